// RankState: one registered rank's state, shared by the engine's stages
// (engine.h), with the mutex that guards it; and the units of work the
// stages pass along (SnapTask, PendingStep, WriteTask). Internal to
// daemon/engine: nothing outside this folder includes it.
//
// A RankState is created by Register and filled before it is published in
// Engine::ranks_. From then on its mutable state is guarded by
// RankState::mu (the compiler checks it: ABSL_GUARDED_BY, clang
// -Wthread-safety); the rest is immutable.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/engine/caller.h"
#include "daemon/engine/leases.h"
#include "daemon/engine/quota.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/step_types.h"
#include "daemon/policy/layercheck.h"
#include "daemon/policy/selection.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/store/layer_store.h"
#include "kernels/drift.h"

namespace ckpt {

// The LayerCheck drift trace: a side file of the rank's directory.
inline constexpr char kDriftTraceFile[] = "drift.jsonl";

inline constexpr size_t kSnapResultsKept = 64;
inline constexpr size_t kOutcomesKept = 64;  // per layer

// One layer's copy recipe: the file header template and where its tensors live.
struct LayerTemplate {
  store::LayerFileHeader header;  // tensors with offsets; checksums filled at commit
  std::vector<char*> src;         // per tensor, inside the rank's memory (RankMemory::base)
};

struct PendingStep {
  uint64_t step = 0;
  uint32_t remaining = 0;  // versions still being written
  // Every selected layer has been staged or skipped. A snapshot larger than
  // the staging pool hands its first versions to the writers before it has
  // copied the rest (Engine::Snapshot), so a step can be pending while its
  // snapshot still runs; its event waits for this.
  bool sealed = false;
  store::EventRecord event;
  absl::Time staged_at;  // for the durability lag
  uint64_t staged_bytes = 0;
  StepCharge charge;  // the step's queue slot and event bytes (quota.h)
};

struct SnapTask {
  enum class Stage { kNew, kAwaitingGlobal, kReady };
  uint64_t step = 0;
  double lr = 0;
  std::vector<uint32_t> layers;  // selected at StepDone time (not for layercheck)
  store::EventRecord event;      // aux, lr
  std::vector<GroupStep> group_steps;
  // LayerCheck only.
  Stage stage = Stage::kNew;
  std::vector<drift::LayerSums> client_drift;  // OPTIMIZER_CLIENT
  std::vector<drift::LayerSums> global;        // the vector the decision uses
  StepCharge charge;  // the step's queue slot and event bytes; moves to PendingStep
  // A GPU step whose event was pending (Engine::PollStep): when a poll first
  // found it so (engine clock), the pause before the next poll, and whether
  // the wait was given up.
  absl::Time pending_since = absl::InfinitePast();
  absl::Duration poll_pause = absl::ZeroDuration();
  bool given_up = false;
};

struct RankState;

struct WriteTask {
  std::shared_ptr<RankState> rank;
  StagedVersion version;
};

// What a snapshot has handed to the writers so far.
struct SpillState {
  bool pending = false;           // the step's PendingStep is in r->pending
  std::vector<uint32_t> layers;   // layers handed over, in order
  uint64_t count = 0, bytes = 0;  // versions and payload bytes handed over
};

// The engine's table of ranks and its write queue (both guarded by
// Engine::mu_).
using RankTable = std::map<RankKey, std::shared_ptr<RankState>>;
using WriteQueue = std::deque<std::unique_ptr<WriteTask>>;

struct RankState {
  // Immutable after registration (set before the rank is published in
  // Engine::ranks_).
  std::string job;
  uint32_t rank = 0;
  uint64_t generation = 0;
  uid_t uid = 0;
  store::RankRecord table;
  PolicyConfig policy;
  std::vector<LayerTemplate> layers;
  std::vector<bool> frozen;  // per layer: LayerDesc::frozen
  uint32_t world_size = 1;
  // LayerCheck decides from this rank's sums alone (LayerCheckConfig::local_drift).
  bool local_drift = false;
  OptimizerKind optimizer = OptimizerKind::kUnspecified;
  // The kernel that reads `memory`: the engine's CPU kernel for host memory,
  // a CUDA kernel on the rank's device (owned here) for GPU memory.
  drift::DriftKernel* drift_kernel = nullptr;
  std::unique_ptr<drift::DriftKernel> own_drift_kernel;
  std::vector<drift::TensorTask> drift_tasks;  // pointers into `memory`
  std::vector<uint32_t> drift_task_groups;     // optimizer group of each task
  std::vector<double> drift_task_lr_scale;
  // drift.jsonl, when recorded. Written by Register before the rank is
  // published and then only by the rank's snapshot worker (one at a time per
  // rank), outside every mutex. Opened and written through the store's
  // FileSystem (never through a symbolic link); closed after a failed write.
  UniqueFd trace;

  // Guards the rank's mutable state below. Lock order: JobOwners ->
  // Engine::mu_ -> RankState::event_mu -> RankState::mu; nothing is taken
  // while mu is held except leaf mutexes (the metrics registry, the staging
  // pool).
  mutable absl::Mutex mu;
  // LayerCheck; the pointer is set at registration (null for the other
  // policies), the policy object is guarded by mu.
  std::unique_ptr<LayerCheckPolicy> layercheck ABSL_PT_GUARDED_BY(mu);
  // The handed-over memory; null once released (trainer exit). A snapshot
  // or restore holds its own reference while it copies.
  std::shared_ptr<RankMemory> memory ABSL_GUARDED_BY(mu);
  std::string memory_released ABSL_GUARDED_BY(mu);  // why memory is null
  UniqueFd trainer_pidfd ABSL_GUARDED_BY(mu);       // the registering process
  bool stopping ABSL_GUARDED_BY(mu) = false;        // ckptd is shutting down
  bool active ABSL_GUARDED_BY(mu) = true;
  bool restoring ABSL_GUARDED_BY(mu) = false;
  uint64_t last_step_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t snapshot_step ABSL_GUARDED_BY(mu) = 0;
  uint64_t durable_step ABSL_GUARDED_BY(mu) = 0;
  // The job's newest step durable on every rank, as its ranks last agreed
  // and reported with a StepDone (world_size > 1); unset: none reported.
  std::optional<uint64_t> global_durable_step ABSL_GUARDED_BY(mu);
  std::deque<SnapTask> snap_queue ABSL_GUARDED_BY(mu);
  // A snapshot worker holds the rank, or it is queued in
  // Engine::snapshot_ready_ or snapshot_waiting_ (changed with Engine::mu_
  // held as well).
  bool snap_busy ABSL_GUARDED_BY(mu) = false;
  std::map<uint64_t, SnapshotTaken> snap_results ABSL_GUARDED_BY(mu);  // recent steps
  std::deque<PendingStep> pending ABSL_GUARDED_BY(mu);
  std::vector<bool> never_persisted ABSL_GUARDED_BY(mu);
  std::vector<bool> retry ABSL_GUARDED_BY(mu);
  // Per layer, the outcome (durable or not) of its recent selected versions by
  // step: WaitDurable(t) checks the newest one at or before t.
  std::vector<std::map<uint64_t, bool>> outcomes ABSL_GUARDED_BY(mu);
  // A WaitSnapshot gave up on this step (or later).
  uint64_t fence_broken_step ABSL_GUARDED_BY(mu) = 0;
  // Per layer: newest committed step (0 = none).
  std::vector<uint64_t> last_committed ABSL_GUARDED_BY(mu);
  // The newest checkpoint events that could not be written (quota, the
  // index's free-space floor, a RocksDB error): up to this step nothing
  // newer is durable, and WaitDurable reports `event_failure`. Later events
  // are tried again; the first that is written makes its step durable.
  uint64_t event_failed_step ABSL_GUARDED_BY(mu) = 0;
  absl::Status event_failure ABSL_GUARDED_BY(mu);
  // LayerCheck: the partial sums of recent steps, the latest decisions.
  std::map<uint64_t, std::vector<drift::LayerSums>> partials ABSL_GUARDED_BY(mu);
  std::vector<LayerDecision> last_decisions ABSL_GUARDED_BY(mu);
  // The front task waits for SetGlobalDrift; no worker holds it.
  bool deferred ABSL_GUARDED_BY(mu) = false;

  // Serializes the event writes of this rank (AdvanceEvents); held across
  // the index write, never with Engine::mu_.
  absl::Mutex event_mu ABSL_ACQUIRED_BEFORE(mu);

  // Takes the rank's memory away; later steps and restores of the rank fail
  // until it registers again. The memory moves to `closing`, which the caller
  // drops after releasing every lock (closing GPU mappings synchronizes a
  // stream); an in-flight snapshot holds its own reference until it is done.
  void ReleaseMemory(const std::string& why, std::vector<std::shared_ptr<RankMemory>>* closing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Drops the steps parked for SetGlobalDrift (their trainer is gone).
  // REQUIRES: Engine::mu_ as well (snap_busy pairs with snapshot_ready_).
  void ReleaseDeferred() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Nothing of the rank is queued, being snapshotted or being written.
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return snap_queue.empty() && !snap_busy && pending.empty();
  }
  // Waits until Idle(). UNAVAILABLE at `deadline`; kShuttingDown when ckptd
  // stops.
  absl::Status Drain(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // FAILED_PRECONDITION when `step` was never reported to this registration
  // (a wait for it could never end).
  absl::Status CheckReported(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Remembers whether the version of `layer` selected at `step` became
  // durable (WaitDurable reads it).
  void RecordOutcome(uint32_t layer, uint64_t step, bool durable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

// Drops `r` from `ranks` once it is unregistered and idle (RankState::Idle):
// nothing else would, and every unregistered job would stay in memory and
// in every walk over the table for good. REQUIRES: Engine::mu_ (it guards
// `ranks`), and a reference to `r` of the caller's own (the table's may be
// the last but one).
void ForgetIfDone(RankTable* ranks, const std::shared_ptr<RankState>& r)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu);

// Queues `staged` on `queue` for the writers as versions of task.step,
// making the step's PendingStep (staged at `now`) the first time; returns
// it. REQUIRES: Engine::mu_ (it guards `queue`).
PendingStep* QueueStaged(WriteQueue* queue, absl::Time now, const std::shared_ptr<RankState>& r,
                         SnapTask& task, std::vector<StagedVersion>& staged, SpillState* spill)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu);

}  // namespace ckpt
