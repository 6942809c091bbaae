// Per-rank state shared by the engine's stages (engine.h). Internal to
// daemon/engine: nothing outside this folder includes it.
//
// A Rank is created by Register and filled before it is published in
// Engine::ranks_; from then on the fields marked "guarded by Engine::mu_" are
// read and written only with Engine::mu_ held. The rest is immutable after
// registration, except `trace`, which only the rank's snapshot worker (one
// at a time per rank) writes, outside Engine::mu_.
#pragma once

#include <cstdint>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/engine/engine.h"
#include "daemon/policy/layercheck.h"
#include "daemon/policy/selection.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/store/layer_store.h"
#include "kernels/drift.h"

namespace ckpt {


// One layer's copy recipe: the file header template and where its tensors live.
struct LayerTemplate {
  store::LayerFileHeader header;  // tensors with offsets; checksums filled at commit
  std::vector<char*> src;         // per tensor, inside the rank's memory (RankMemory::base)
};

struct PendingStep {
  uint64_t step = 0;
  uint32_t remaining = 0;  // versions still being written
  store::EventRecord event;
  absl::Time staged_at;    // for the durability lag
  uint64_t staged_bytes = 0;
};

struct Engine::SnapTask {
  enum class Stage { kNew, kAwaitingGlobal, kReady };
  uint64_t step = 0;
  double lr = 0;
  std::vector<uint32_t> layers;  // selected at StepDone time (not for layercheck)
  store::EventRecord event;      // aux, lr
  std::vector<v1::GroupStep> group_steps;
  // LayerCheck only.
  Stage stage = Stage::kNew;
  std::vector<drift::LayerSums> client_drift;  // OPTIMIZER_CLIENT
  std::vector<drift::LayerSums> global;        // the vector the decision uses
};

struct Engine::WriteTask {
  std::shared_ptr<Rank> rank;
  StagedVersion version;
};

struct Engine::Rank {
  // Immutable after registration.
  std::string job;
  uint32_t rank = 0;
  uint64_t generation = 0;
  uid_t uid = 0;
  store::RankRecord table;
  PolicyConfig policy;
  // The handed-over memory; null once released (trainer exit). A snapshot
  // or restore holds its own reference while it copies.
  std::shared_ptr<RankMemory> memory;           // guarded by Engine::mu_
  std::string memory_released;                  // why memory is null
  UniqueFd trainer_pidfd;                       // GPU ranks: the registering process
  std::vector<LayerTemplate> layers;
  uint32_t world_size = 1;
  // LayerCheck (null for the other policies).
  std::unique_ptr<LayerCheckPolicy> layercheck;  // guarded by Engine::mu_
  v1::OptimizerKind optimizer = v1::OPTIMIZER_UNSPECIFIED;
  // The kernel that reads `memory`: the engine's CPU kernel for host memory,
  // a CUDA kernel on the rank's device (owned here) for GPU memory.
  drift::DriftKernel* drift_kernel = nullptr;
  std::unique_ptr<drift::DriftKernel> own_drift_kernel;
  std::vector<drift::TensorTask> drift_tasks;    // pointers into `memory`
  std::vector<uint32_t> drift_task_groups;       // optimizer group of each task
  std::vector<double> drift_task_lr_scale;
  std::unique_ptr<std::ofstream> trace;          // drift.jsonl, when recorded

  // Guarded by Engine::mu_.
  bool active = true;
  bool restoring = false;
  uint64_t last_step_seen = 0;
  uint64_t snapshot_step = 0;
  uint64_t durable_step = 0;
  std::deque<SnapTask> snap_queue;
  bool snap_busy = false;
  std::map<uint64_t, v1::WaitSnapshotReply> snap_results;  // the most recent steps
  std::deque<PendingStep> pending;
  std::vector<bool> never_persisted;
  std::vector<bool> retry;
  // Per layer, the outcome (durable or not) of its recent selected versions by
  // step: WaitDurable(t) checks the newest one at or before t.
  std::vector<std::map<uint64_t, bool>> outcomes;
  uint64_t fence_broken_step = 0;  // a WaitSnapshot gave up on this step (or later)
  std::vector<uint64_t> last_committed;  // per layer: newest committed step (0 = none)
  absl::Status fatal;
  std::map<uint64_t, std::vector<drift::LayerSums>> partials;  // recent steps (layercheck)
  std::vector<LayerDecision> last_decisions;
  bool deferred = false;  // the front task waits for SetGlobalDrift; no worker holds it

  // Serializes event writes of this rank (held without Engine::mu_).
  absl::Mutex event_mu;
};



inline constexpr size_t kSnapResultsKept = 64;
inline constexpr size_t kOutcomesKept = 64;  // per layer

inline bool IsRoot(const Caller& c) { return c.uid == 0; }

// Every call refused because ckptd is stopping carries kShuttingDown, which
// the client treats as the loss of the daemon.
inline absl::Status ShuttingDownError() {
  return WithReason(absl::UnavailableError("ckptd is shutting down"), ErrorReason::kShuttingDown);
}
// A wait that ended because its registration ended: ABORTED, and
// kShuttingDown when ckptd is stopping.
inline absl::Status RegistrationEndedError(bool stopping, absl::string_view what) {
  absl::Status s = absl::AbortedError(what);
  return stopping ? WithReason(std::move(s), ErrorReason::kShuttingDown) : s;
}



}  // namespace ckpt
