// ckpt::Client — the trainer side of ckptd (C++).
//
// One Client per trainer rank. Typical use:
//
//   ckpt::ClientOptions opts;                       // socket, deadlines
//   auto client = ckpt::Client::Connect(opts).value();
//   size_t r = client->AllocateRegion(bytes).value();   // tensors live here
//   float* w = static_cast<float*>(client->RegionData(r));
//   ckpt::RankSpec spec{...layers with tensors at (region, offset)...};
//   client->Register(spec);                          // hands the memfds over
//   for (t = 1..) {
//     if (t > 1) client->WaitSnapshot(t - 1);        // fence before mutating
//     optimizer_step();                              // mutate the buffers
//     client->StepDone(t, lr, aux);                  // returns at once
//   }
//   client->WaitDurable(last);
//
// After a crash, a new process registers the same spec and calls Restore(),
// which writes the composite checkpoint into the registered buffers.
//
// Every call carries a deadline (ClientOptions). When the daemon is gone
// (UNAVAILABLE), the client re-registers automatically once it is back; with
// OnDaemonLoss::kContinueUnprotected the calls succeed as no-ops meanwhile and
// unprotected() reports it, so a dead daemon never stops training.
//
// Thread-safety: a Client is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

enum class OnDaemonLoss {
  kError,                // calls fail with UNAVAILABLE while the daemon is gone
  kContinueUnprotected,  // calls succeed as no-ops; training continues unprotected
};

struct ClientOptions {
  std::string socket_path = "/run/ckptd/ckptd.sock";
  std::string handover_socket_path;                  // empty: socket_path + ".fds"
  absl::Duration call_timeout = absl::Seconds(10);   // unary calls
  absl::Duration wait_timeout = absl::Seconds(120);  // WaitSnapshot / WaitDurable
  absl::Duration restore_timeout = absl::Minutes(30);
  absl::Duration reconnect_interval = absl::Seconds(2);  // between re-registration attempts
  OnDaemonLoss on_daemon_loss = OnDaemonLoss::kError;
};

// Bytes per element of `dtype` (4 for DTYPE_F32); 0 for DTYPE_UNSPECIFIED and
// for a value this library does not know.
uint64_t DTypeBytes(v1::DType dtype);

// One tensor as the trainer describes it to this library. It is not the API's
// ckpt.v1.TensorSpec because the library fills in what the caller should not
// have to (nbytes, from the shape and DTypeBytes) and gives the defaults a
// trainer means (DTYPE_F32 and ROLE_PARAM; LayerDesc: LAYER_BLOCK, and its
// index as the layer's id), where the protos' defaults are UNSPECIFIED.
// Register() converts it into a ckpt.v1.TensorSpec in one place
// (client/src/client.cc, TensorSpecOf).
struct TensorDesc {
  std::string name;
  v1::DType dtype = v1::DTYPE_F32;
  std::vector<uint64_t> shape;
  v1::TensorRole role = v1::ROLE_PARAM;
  uint32_t group = 0;
  uint32_t region = 0;  // from AllocateRegion
  uint64_t offset = 0;  // bytes into the region
  // LayerCheck drift accounting: a state tensor names its weight tensor in
  // `param`; a weight tensor carries its optimizer's hyper-parameters
  // (0 = the optimizer's default; lr_scale 0 = 1).
  std::string param;
  double lr_scale = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
};

struct LayerDesc {
  std::string name;
  v1::LayerKind kind = v1::LAYER_BLOCK;
  std::vector<TensorDesc> tensors;
  // Never changes while training (frozen weights): written once, never
  // selected by the policy (ckpt.v1.LayerSpec.frozen).
  bool frozen = false;
};

struct RankSpec {
  std::string job_id;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::vector<LayerDesc> layers;  // layer i gets id i
  v1::PolicySpec policy;          // default: all
  // The node of each rank of the job (each rank's Client::Node()), in rank
  // order, gathered over the job's process group; ckptd places the job's
  // peer copies from it (docs/peer.md). Empty: not known.
  std::vector<std::string> job_nodes;
};

struct LayerSums {
  double dw2 = 0;  // Σ‖ΔW‖²
  double w2 = 0;   // Σ‖W‖²
};

struct SnapshotInfo {
  std::vector<uint32_t> layers;  // copied at this step
  uint32_t skipped = 0;          // selected but skipped (pool full)
  bool lost = false;             // the daemon restarted; nothing was taken
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // A zero-filled shared-memory region of at least `bytes`; returns its index.
  // REQUIRES: before Register.
  absl::StatusOr<size_t> AllocateRegion(uint64_t bytes);
  void* RegionData(size_t region) const;
  uint64_t RegionSize(size_t region) const;

  // GPU memory (CUDA builds; UNIMPLEMENTED otherwise). Adds the CUDA
  // allocation that holds [ptr, ptr + bytes) as a region (one IPC handle per
  // distinct allocation, shared by every tensor inside it) and returns where
  // the tensor lies, for TensorDesc.region / offset. `name` is used in errors.
  // INVALID_ARGUMENT, naming the tensor, when ptr is not device memory, the
  // range leaves its allocation, the allocation is on another device than the
  // earlier ones, or it cannot be exported with legacy CUDA IPC (for example
  // PyTorch's expandable segments). A rank registers host regions or GPU
  // regions, not both. REQUIRES: before Register.
  struct GpuPlace {
    uint32_t region = 0;
    uint64_t offset = 0;
  };
  absl::StatusOr<GpuPlace> AddGpuTensor(const void* ptr, uint64_t bytes, const std::string& name);
  // The CUDA stream (a cudaStream_t; nullptr = the legacy default stream) the
  // optimizer step runs on. With GPU regions, every StepDone first records the
  // rank's interprocess step event on it, so the daemon's copies wait for the
  // step on the GPU, not on the host.
  void SetCudaStream(void* stream) { cuda_stream_ = stream; }

  // Hands the regions over and registers the rank. INVALID_ARGUMENT (from the
  // daemon) names a bad tensor; the spec is kept for automatic re-registration.
  absl::Status Register(const RankSpec& spec);
  // This node's name as ckptd's peer placement knows it (its certificate's
  // common name, else the host name): what each rank reports for
  // RankSpec::job_nodes. Asks ckptd (its Status call).
  absl::StatusOr<std::string> Node();

  // Reports that the optimizer step `step` finished. Returns at once.
  // `layers` is the layer list for POLICY_EXPLICIT.
  absl::Status StepDone(uint64_t step, double lr, const std::string& aux = "",
                        const std::vector<uint32_t>& layers = {},
                        const std::vector<v1::GroupStep>& group_steps = {});
  // The same with every field, including OPTIMIZER_CLIENT's per-layer drift.
  struct StepInfo {
    uint64_t step = 0;
    double lr = 0;
    std::string aux;
    std::vector<uint32_t> layers;
    std::vector<v1::GroupStep> group_steps;
    std::vector<LayerSums> client_drift;  // one per layer (Σ‖ΔW‖², Σ‖W‖²)
    std::optional<uint64_t>
        global_durable_step;  // as the job's ranks last agreed; unset: not agreed
  };
  absl::Status StepDone(const StepInfo& info);

  // Multi-rank LayerCheck (world_size > 1): after StepDone(t) and before
  // WaitSnapshot(t), hand the daemon the all-reduced per-layer drift so every
  // rank decides alike. `allreduce_sum` sums the vector in place over the
  // trainer's process group (2 doubles per layer).
  absl::Status ExchangeDrift(
      uint64_t step, const std::function<absl::Status(std::vector<double>*)>& allreduce_sum);
  // A lost daemon makes both fail (and unprotected() true with
  // on_daemon_loss = continue): a rank that cannot exchange still takes part
  // in the all-reduce (with zeros), so that the other ranks do not wait.
  absl::StatusOr<std::vector<LayerSums>> DriftPartials(uint64_t step);
  absl::Status SetGlobalDrift(uint64_t step, const std::vector<LayerSums>& global);
  // The fence: returns when the snapshot of `step` is in staging.
  absl::StatusOr<SnapshotInfo> WaitSnapshot(uint64_t step);
  // Returns the durable step (>= step) once every layer's newest version
  // selected at or before `step` is durable. With a `tier`, once the step is
  // in that tier too: kRemote, ckptd's remote tier (its manifest written;
  // docs/remote.md); kPeer, a peer node's ckptd (docs/peer.md).
  // FAILED_PRECONDITION when ckptd has no such tier, DEADLINE_EXCEEDED
  // while the copy lags behind.
  enum class Tier { kLocal, kRemote, kPeer };
  absl::StatusOr<uint64_t> WaitDurable(uint64_t step, Tier tier = Tier::kLocal);
  // The composite plan for `target_step` (0 = latest durable) of the
  // registered rank, or of `job` rank `rank` (also before Register: whether
  // there is anything to restore). NOT_FOUND when there is no checkpoint.
  absl::StatusOr<v1::Plan> Plan(uint64_t target_step = 0, uint64_t older_within_steps = 0);
  // `older_within_steps`: as in RestoreRequest (a lost version's layer).
  absl::StatusOr<v1::Plan> Plan(const std::string& job, uint32_t rank, uint64_t target_step,
                                uint64_t older_within_steps = 0);
  // Reads the composite checkpoint of `job` rank `rank` at `target_step` (0 =
  // latest durable) without registering, through ckptd's Export stream
  // (owner or root; every layer verified before it is sent): `header` gets
  // the plan and the tensors in the order their bytes follow, then `data`
  // gets each tensor's bytes in pieces, in order (`offset` within the
  // tensor). A callback's error cancels the stream and is returned. Another
  // world size restores this way: ckpt.torch reads each old rank's layers
  // on the node that holds them and hands them to the new ranks.
  // With `region_bytes` > 0, the bytes come through a shared window of that
  // size (a memfd handed over like Register's, base/export_region.h) rather
  // than in the stream's messages: two copies fewer. `data` is called the
  // same way, its pieces pointing into the window, valid during the call.
  // A checkpoint with a layer larger than the window is streamed as without.
  struct ExportSink {
    std::function<absl::Status(const v1::ExportHeader&)> header;
    std::function<absl::Status(const v1::ExportTensor&, uint64_t offset, std::string_view piece)>
        data;
    uint64_t region_bytes = 0;
  };
  absl::Status Export(const std::string& job, uint32_t rank, uint64_t target_step,
                      const ExportSink& sink, uint64_t older_within_steps = 0);
  // Restores the composite checkpoint into the registered buffers.
  // With `discard_later`, ckptd then deletes the rank's later steps, so that
  // training goes on from the target (RestoreRequest.discard_later).
  absl::StatusOr<v1::RestoreReply> Restore(uint64_t target_step = 0, bool discard_later = false,
                                           uint64_t older_within_steps = 0);
  // Ends the registration (after the staged steps are durable when `drain`).
  // When ckptd was lost (gone, stopping or restarted without this
  // registration): OK with kContinueUnprotected, UNAVAILABLE with kError.
  absl::Status Unregister(bool drain = true);

  uint64_t generation() const { return generation_; }
  uint64_t latest_durable_step_at_register() const { return latest_durable_at_register_; }
  bool unprotected() const { return unprotected_; }
  const std::string& io_backend() const { return io_backend_; }

 private:
  struct Impl;
  explicit Client(const ClientOptions& options);
  absl::Status DoRegister(absl::Duration wait_for_daemon);
  // Handles a failed call: UNAVAILABLE / stale registration -> try to
  // re-register (rate-limited). Returns the status the caller should see.
  absl::Status OnCallError(const absl::Status& s, bool* reregistered);
  // DriftPartials / SetGlobalDrift failed: OnCallError's bookkeeping, then `s`.
  absl::Status NoteDriftError(const absl::Status& s);

  ClientOptions options_;
  std::unique_ptr<Impl> impl_;
  RankSpec spec_;
  bool registered_ = false;
  uint64_t generation_ = 0;
  uint64_t latest_durable_at_register_ = 0;
  uint64_t registered_after_step_ = 0;  // steps <= this were before the last (re)registration
  uint64_t last_step_ = 0;
  bool unprotected_ = false;
  absl::Time next_reconnect_ = absl::InfinitePast();
  std::string io_backend_;
  void* cuda_stream_ = nullptr;
};

}  // namespace ckpt
