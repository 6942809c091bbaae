// A registration as the engine sees it (the gRPC handler converts
// ckpt.v1.RegisterRequest into it, daemon/rpc/convert.h), and its validation
// before anything is mapped.
//
// Checks, each failing with INVALID_ARGUMENT and a message naming the layer or
// tensor: job id syntax; rank < world_size; 1..max_layers layers numbered
// 0..N-1 with unique names; 1..max_tensors tensors per layer with unique,
// non-empty names; a known dtype; nbytes == prod(shape) * sizeof(dtype) and
// > 0; region index in range; [offset, offset+nbytes) inside the region's real
// size (from fstat, not from the request); no two tensors overlapping; each
// layer's file image no larger than the staging pool.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/common/tensor_types.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/policy/layercheck.h"
#include "daemon/policy/selection.h"
#include "daemon/store/store.pb.h"

namespace ckpt {

// One tensor of a layer: where it lives in the handed-over regions and, for
// LayerCheck's drift accounting, how its optimizer treats it. A state tensor
// (exp_avg, exp_avg_sq, momentum) names its weight tensor in `param`; a
// weight tensor carries its optimizer's hyper-parameters (lr_scale 0 means 1).
// It has the fields of ckpt.v1.TensorSpec and of the stored ckpt.store.TensorSpec
// and is neither, so that the engine, the policies and the GPU code see no API
// type and the API can change without the store: daemon/rpc/convert.cc makes
// it from the request, TableEntryOf below the stored record, and
// engine_layercheck.cc the drift kernels' tasks.
struct TensorDesc {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
  TensorRole role = TensorRole::kUnspecified;
  uint32_t region = 0;
  uint64_t offset = 0;
  uint32_t group = 0;
  std::string param;
  double lr_scale = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
};

struct LayerDesc {
  uint32_t id = 0;  // dense: 0..N-1
  std::string name;
  LayerKind kind = LayerKind::kUnspecified;
  std::vector<TensorDesc> tensors;
  // Never changes while the rank trains: written once, never selected by a
  // policy (ckpt.v1.LayerSpec.frozen).
  bool frozen = false;
};

struct RegistrationPolicy {
  PolicyConfig selection;
  OptimizerKind optimizer = OptimizerKind::kUnspecified;
  LayerCheckConfig layercheck;  // defaults filled in
  bool record_trace = false;    // append per-step drift to the rank's drift trace
};

struct Registration {
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  std::string handover_token;  // names the host regions; empty for GPU memory
  std::vector<LayerDesc> layers;
  RegistrationPolicy policy;
  std::optional<GpuHandover> gpu;  // instead of host regions
  // The node of each rank of the job (its ckptd's node name), in rank
  // order, as the trainer gathered it; empty when it did not. At most
  // world_size names, each a valid node name (ValidateRegistration).
  std::vector<std::string> job_nodes;
  // When the caller stops waiting (its call's deadline): Register gives up
  // with DEADLINE_EXCEEDED between its steps, rather than work on for a
  // caller that has gone.
  absl::Time deadline = absl::InfiniteFuture();
};

// What a successful registration returns.
struct Registered {
  uint64_t generation = 0;
  uint64_t latest_durable_step = 0;  // 0 when the rank has no history
  std::string io_backend;
};

struct RegistrationLimits {
  uint32_t max_layers = 1 << 16;
  uint32_t max_tensors_per_layer = 4096;
  uint32_t max_world_size = 1 << 20;
  uint64_t max_layer_file_bytes = 0;  // the staging pool budget
  // The rank's table as the index stores it (every layer's and tensor's
  // name, shape, role, ...): a bound per registration, whose bytes also
  // count against the owner's index quota.
  uint64_t max_table_bytes = uint64_t{8} << 20;
};

// The layer's entry in the rank's stored table (index: the rank record).
store::LayerSpec TableEntryOf(const LayerDesc& layer);
// What a rank's stored table counts for in its owner's index quota.
uint64_t RankIndexBytes(const store::RankRecord& table);
// The header every version file of the layer starts from (format.h): the
// job, rank, layer and its tensors; step, generation, checksums and
// offsets are filled per version.
store::LayerFileHeader HeaderTemplateOf(const std::string& job, uint32_t rank,
                                        const LayerDesc& layer);

absl::Status ValidateRegistration(const Registration& req,
                                  const std::vector<uint64_t>& region_sizes,
                                  const RegistrationLimits& limits);

}  // namespace ckpt
