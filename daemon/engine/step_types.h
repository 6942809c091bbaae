// The engine's own types for the per-step calls (StepDone, WaitSnapshot,
// WaitDurable, the multi-rank drift exchange, Unregister). The gRPC handlers
// convert the ckpt.v1 messages into these in one place
// (daemon/rpc/convert.h); the engine never sees a generated request on its
// per-step path.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "daemon/common/tensor_types.h"
#include "kernels/drift.h"

namespace ckpt {

// One registration of a rank, as every per-step call names it.
struct RankRef {
  std::string job;
  uint32_t rank = 0;
  uint64_t generation = 0;
};

// StepDone: the trainer finished optimizer step `step`.
struct StepReport {
  RankRef rank;
  uint64_t step = 0;
  double lr = 0;
  std::string aux;               // stored with the step, opaque
  std::vector<uint32_t> layers;  // policy explicit: the layers to persist
  std::vector<GroupStep> group_steps;
  std::vector<drift::LayerSums> client_drift;   // optimizer client: one per layer
  std::optional<uint64_t> global_durable_step;  // agreed by the job's ranks; unset: not agreed
};

// What WaitSnapshot reports once snapshot `step` is in staging.
struct SnapshotTaken {
  std::vector<uint32_t> layers;  // copied into staging at this step
  uint32_t skipped = 0;          // selected but skipped (pool full, abandoned fence)
};

}  // namespace ckpt
