// Snapshotter: StepDone, the snapshot workers, WaitSnapshot (the fence).
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"

namespace ckpt {
namespace {

// A GPU step whose event is pending is asked again after 200 us, then after
// pauses that double up to 5 ms: a step that is nearly done costs little
// latency, a hung one little CPU.
constexpr absl::Duration kFirstStepPoll = absl::Microseconds(200);
constexpr absl::Duration kLongestStepPoll = absl::Milliseconds(5);

}  // namespace

absl::Status Engine::StepDone(StepReport req, const Caller& caller) {
  if (req.aux.size() > options_.max_aux_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("aux blob of ", req.aux.size(), " bytes exceeds ", options_.max_aux_bytes));
  }
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, FindLocked(req.rank, caller));
  absl::MutexLock rank_lock(&r->mu);
  if (r->restoring) return absl::FailedPreconditionError("a restore of this rank is in progress");
  if (r->memory == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", r->job, " rank ", r->rank,
                                                      ": memory released (", r->memory_released,
                                                      "); register again"));
  }
  if (req.step <= r->last_step_seen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", req.step, " is not above the last step ", r->last_step_seen, " of job ", r->job,
        " rank ", r->rank, " (restore the job, or use a new job id to start over)"));
  }
  if (req.global_durable_step.value_or(0) > req.step) {
    return absl::InvalidArgumentError(absl::StrCat("global_durable_step ", *req.global_durable_step,
                                                   " is above the step ", req.step));
  }
  SnapTask task;
  task.step = req.step;
  task.lr = req.lr;
  if (r->layercheck != nullptr) {
    if (!req.layers.empty()) {
      return absl::InvalidArgumentError(
          "a layer list was given but the rank's policy is layercheck");
    }
    const bool client = r->optimizer == OptimizerKind::kClient;
    if (client != !req.client_drift.empty() ||
        (client && req.client_drift.size() != r->layers.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(client ? "optimizer client needs client_drift with one entry per layer ("
                              : "client_drift is only for optimizer client (",
                       r->layers.size(), " layers)"));
    }
    for (const drift::LayerSums& d : req.client_drift) {
      if (!(d.dw2 >= 0) || !(d.w2 >= 0)) {
        return absl::InvalidArgumentError("client_drift sums must be finite and >= 0");
      }
    }
    task.client_drift = std::move(req.client_drift);
  } else {
    // Validate the layer list now so that the caller sees the error.
    CKPT_ASSIGN_OR_RETURN(task.layers,
                          SelectLayers(r->policy, req.step, static_cast<uint32_t>(r->layers.size()),
                                       req.layers, r->never_persisted, r->retry, r->frozen));
  }
  // Bounded memory and index per rank and per uid: the step is admitted only
  // within the rank's StepDone queue bound and the owner's quotas (quota.h:
  // steps in flight until their event, and their aux blobs, which count
  // against the index quota from here on).
  if (options_.max_queued_steps_per_rank > 0 &&
      r->snap_queue.size() >= options_.max_queued_steps_per_rank) {
    if (Metrics* m = options_.metrics) {
      m->Inc(Counter::kQuotaRefused, QuotaKindName(QuotaKind::kQueuedSteps), 1);
    }
    return WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "job ", r->job, " rank ", r->rank, " has ", r->snap_queue.size(),
            " steps queued for a snapshot, max_queued_steps_per_rank = ",
            options_.max_queued_steps_per_rank, " (wait for snapshots with WaitSnapshot)")),
        ErrorReason::kQuota);
  }
  QuotaKind refused = QuotaKind::kDisk;
  absl::StatusOr<StepCharge> charge = quota_.AdmitStep(QuotaOwner{r->uid, r->job, r->rank},
                                                       EventIndexBytes(req.aux.size()), &refused);
  if (!charge.ok()) {
    if (Metrics* m = options_.metrics) m->Inc(Counter::kQuotaRefused, QuotaKindName(refused), 1);
    return charge.status();
  }
  task.charge = std::move(*charge);
  task.event.set_aux(std::move(req.aux));  // up to max_aux_bytes: moved, not copied
  task.event.set_lr(req.lr);
  task.event.set_agreed_step(req.global_durable_step.value_or(0));
  task.group_steps = std::move(req.group_steps);
  r->last_step_seen = req.step;
  if (req.global_durable_step.has_value()) r->global_durable_step = req.global_durable_step;
  r->snap_queue.push_back(std::move(task));
  if (!r->snap_busy) {
    r->snap_busy = true;
    snapshot_ready_.push_back(r);
  }
  return absl::OkStatus();
}

void Engine::SnapshotLoop() {
  for (;;) {
    std::shared_ptr<RankState> r;
    SnapTask task;
    std::shared_ptr<RankMemory> memory;
    {
      absl::MutexLock lock(&mu_);
      if (!NextRankLocked(&r)) return;
      absl::MutexLock rank_lock(&r->mu);
      task = std::move(r->snap_queue.front());
      r->snap_queue.pop_front();
      memory = r->memory;
    }
    std::optional<absl::Status> ready = PollStep(r, task, memory.get());
    if (!ready.has_value()) {
      // Its device has not finished the step: the other ranks' steps go
      // first, and this one is asked again after a pause.
      memory.reset();  // a release meanwhile closes the mappings here
      ParkForPoll(r, std::move(task));
      CKPT_SYNC_POINT("snapshot.step_pending");
      continue;
    }
    // A step refused because its device is poisoned releases its rank here,
    // whether or not a poisoning was newly seen (the rank may have been
    // published after the others on the device were released).
    const bool refused = !ready->ok();
    const bool done = Snapshot(r, task, memory.get(), *std::move(ready));
    memory.reset();  // the last reference of a released rank closes its mappings here
    ReleaseRanksOnPoisonedGpus(refused ? r.get() : nullptr);
    CKPT_SYNC_POINT("snapshot.after_publish");
    absl::MutexLock lock(&mu_);
    absl::MutexLock rank_lock(&r->mu);
    if (!done) {
      // Parked until SetGlobalDrift. Publishing the partial sums and parking
      // happen under one lock, so a SetGlobalDrift that follows the partials
      // always finds the step waiting.
      if (r->active && !stopping_) {
        r->partials[task.step] = task.global;
        while (r->partials.size() > kSnapResultsKept) r->partials.erase(r->partials.begin());
        r->snap_queue.push_front(std::move(task));
        r->deferred = true;
      } else {
        r->snap_queue.clear();  // nobody will send the global vectors
        r->snap_busy = false;
        ForgetIfDone(&ranks_, r);
      }
      continue;
    }
    if (!r->snap_queue.empty() && !stopping_) {
      snapshot_ready_.push_back(r);
    } else {
      r->snap_busy = false;
      ForgetIfDone(&ranks_, r);  // unregistered meanwhile, and nothing was staged
    }
  }
}

bool Engine::NextRankLocked(std::shared_ptr<RankState>* r) {
  for (;;) {
    // Ranks whose poll is due join the end of the queue, behind the ranks
    // that were ready before them.
    const absl::Time now = absl::Now();
    while (!snapshot_waiting_.empty() && snapshot_waiting_.begin()->first <= now) {
      snapshot_ready_.push_back(std::move(snapshot_waiting_.begin()->second));
      snapshot_waiting_.erase(snapshot_waiting_.begin());
    }
    if (stopping_) {
      // Their steps stay queued; nobody waits on a device any more.
      for (auto& q : snapshot_ready_) {
        absl::MutexLock rank_lock(&q->mu);
        q->snap_busy = false;
      }
      for (auto& [when, q] : snapshot_waiting_) {
        absl::MutexLock rank_lock(&q->mu);
        q->snap_busy = false;
      }
      snapshot_ready_.clear();
      snapshot_waiting_.clear();
      return false;
    }
    if (!snapshot_ready_.empty()) {
      *r = std::move(snapshot_ready_.front());
      snapshot_ready_.pop_front();
      return true;
    }
    CKPT_SYNC_POINT("snapshot.idle");  // under mu_: a test counts it, never blocks it
    // A rank parked meanwhile (by another snapshot thread) may be due before
    // this deadline: its epoch ends the wait, and the deadline is computed
    // again.
    const uint64_t epoch = waiting_epoch_;
    auto ready = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || !snapshot_ready_.empty() || waiting_epoch_ != epoch;
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), snapshot_waiting_.empty()
                                                       ? absl::InfiniteFuture()
                                                       : snapshot_waiting_.begin()->first);
  }
}

std::optional<absl::Status> Engine::PollStep(const std::shared_ptr<RankState>& r, SnapTask& task,
                                             RankMemory* memory) {
  if (memory != nullptr) {
    absl::StatusOr<bool> ready = memory->StepReady();
    if (!ready.ok()) return ready.status();
    if (*ready) return absl::OkStatus();
  } else if (task.pending_since == absl::InfinitePast()) {
    return absl::OkStatus();  // Snapshot says the memory was released
  }
  // The step's deadline runs from the first poll that found it pending.
  const absl::Time now = clock_->Now();
  if (task.pending_since == absl::InfinitePast()) task.pending_since = now;
  const char* reason = nullptr;
  std::string why;
  {
    absl::MutexLock rank_lock(&r->mu);
    if (r->stopping || shutting_down_.load(std::memory_order_relaxed)) {
      reason = "stopping";
      why = "ckptd is stopping";
    } else if (!r->active || r->memory == nullptr) {
      reason = "released";
      why = "the rank was released";
    } else if (r->fence_broken_step >= task.step) {
      reason = "fence";
      why = "the trainer's fence (WaitSnapshot) gave up";
    } else if (now - task.pending_since >= options_.gpu_wait_timeout) {
      reason = "deadline";
      why = absl::StrCat("gpu_wait_timeout (", absl::FormatDuration(options_.gpu_wait_timeout),
                         ") has passed");
    }
  }
  if (reason == nullptr) return std::nullopt;
  task.given_up = true;
  if (Metrics* m = options_.metrics) m->Inc(Counter::kGpuWaitsAbandoned, reason, 1);
  CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank << " step " << task.step
                    << ": the trainer's step event on its GPU has not completed (a kernel hung, "
                    << "or the trainer died with work queued) and " << why
                    << "; the step is given up and its layers are retried";
  return absl::DeadlineExceededError(
      absl::StrCat("the trainer's step event did not complete: ", why));
}

void Engine::ParkForPoll(const std::shared_ptr<RankState>& r, SnapTask task) {
  task.poll_pause = task.poll_pause == absl::ZeroDuration()
                        ? kFirstStepPoll
                        : std::min(task.poll_pause * 2, kLongestStepPoll);
  const absl::Time next = absl::Now() + task.poll_pause;  // a wait: real time
  absl::MutexLock lock(&mu_);
  absl::MutexLock rank_lock(&r->mu);
  r->snap_queue.push_front(std::move(task));
  snapshot_waiting_.emplace(next, r);  // still snap_busy
  ++waiting_epoch_;                    // wakes the idle snapshot threads
}

bool Engine::Snapshot(const std::shared_ptr<RankState>& r, SnapTask& task, RankMemory* memory,
                      absl::Status ready) {
  // The reported step is complete in the trainer's memory (PollStep). When
  // it was given up, without memory, or when BeginSnapshot fails, nothing is
  // copied and every selected layer is retried. A test holds a real ckptd
  // here to copy a step only after the trainer went on (python.torch_swaps).
  CKPT_DELAY_POINT("snapshot.before_copy");
  absl::Status copy_status = !ready.ok() ? std::move(ready)
                             : memory == nullptr
                                 ? absl::FailedPreconditionError("the rank's memory was released")
                                 : memory->BeginSnapshot();
  // Layers selected at StepDone time may since have become retry candidates;
  // the retry set is folded in at the next StepDone, not here (LayerCheck
  // decides here, with the current retry set).
  if (copy_status.ok() && r->layercheck != nullptr && !DecideLayerCheck(r, task, memory)) {
    return false;
  }
  if (!copy_status.ok() && r->layercheck != nullptr) {
    // Nothing was decided: every layer counts as skipped, so the step is not
    // reported durable and every layer is retried.
    task.layers.resize(r->layers.size());
    for (uint32_t l = 0; l < task.layers.size(); ++l) task.layers[l] = l;
  }
  const absl::Time copy_start = absl::Now();
  std::vector<StagedVersion> staged;  // copied, not yet handed to the writers
  std::vector<uint32_t> skipped;
  SpillState spill;
  if (copy_status.ok()) {
    copy_status = CopyLayers(r, task, memory, &staged, &skipped, &spill);
  } else {
    skipped = task.layers;
  }
  if (!copy_status.ok()) {
    // No torn version: whatever was staged and not yet handed over is
    // dropped and retried (versions already handed over were copied whole).
    // A step given up by PollStep was logged and counted there.
    if (!task.given_up) {
      CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << " step " << task.step
                      << ": snapshot copy failed: " << copy_status;
      if (options_.metrics != nullptr) {
        options_.metrics->Inc(Counter::kErrors, ReasonName(ErrorReason::kSnapshotCopy), 1);
      }
    }
    if (memory != nullptr && memory->CopiesInFlight()) WithholdStaging(r, task, memory, staged);
    for (const StagedVersion& v : staged) skipped.push_back(v.key.layer);
    staged.clear();
  }
  CKPT_KILL_POINT("snapshot.copied");
  CKPT_DELAY_POINT("snapshot.before_publish");
  const bool advance = FinishSnapshot(r, task, staged, skipped, &spill);
  if (Metrics* m = options_.metrics) {
    m->Observe(Histogram::kSnapshotCopySeconds, absl::ToDoubleSeconds(absl::Now() - copy_start));
    m->Inc(Counter::kVersionsStaged, static_cast<double>(spill.count));
    m->Inc(Counter::kStagedBytes, static_cast<double>(spill.bytes));
    if (!skipped.empty()) {
      m->Inc(Counter::kSnapshotsSkipped, "pool_full", static_cast<double>(skipped.size()));
    }
  }
  if (advance) AdvanceEvents(r);
  return true;
}

absl::Status Engine::CopyLayers(const std::shared_ptr<RankState>& r, SnapTask& task,
                                RankMemory* memory, std::vector<StagedVersion>* staged,
                                std::vector<uint32_t>* skipped, SpillState* spill) {
  // A step larger than the free room of the pool is written as it is copied:
  // when a version finds no free room, the versions staged before it go to
  // the writers (SpillStaged) and their chunks come back as they are
  // committed. Holding them until the whole step was copied would make a
  // step larger than the pool wait for room only its own writes could free,
  // and skip its last layers at every step.
  absl::Status copy_status;
  bool abandoned = false;      // a spill found the fence abandoned: copy no more
  bool finish_failed = false;  // a wait for the copies ended without them
  for (uint32_t l : task.layers) {
    if (!copy_status.ok() || abandoned) {
      skipped->push_back(l);
      continue;
    }
    const LayerTemplate& lt = r->layers[l];
    StagedVersion v;
    v.key = VersionKey{r->job, r->rank, l, task.step};
    v.generation = r->generation;
    v.header = lt.header;
    v.header.set_step(task.step);
    v.header.set_generation(r->generation);
    for (const GroupStep& g : task.group_steps) {
      for (const store::TensorEntry& t : lt.header.tensors()) {
        if (t.group() == g.group) {
          store::GroupStep* gs = v.header.add_group_steps();
          gs->set_group(g.group);
          gs->set_step(g.step);
          break;
        }
      }
    }
    // Step, generation and group counters change the header's size, so each
    // version gets its own layout.
    absl::StatusOr<VersionLayout> layout = PlanLayout(&v.header);
    if (!layout.ok()) {
      skipped->push_back(l);
      continue;
    }
    // Free room, or room the memory tier gives back, without waiting.
    absl::StatusOr<StagingLease> lease = pool_->Acquire(layout->file_bytes, absl::InfinitePast());
    if (!lease.ok() && !staged->empty()) {
      // The copies so far must have landed before a writer reads them.
      copy_status = memory->FinishSnapshot();
      finish_failed = !copy_status.ok();
      if (copy_status.ok()) abandoned = !SpillStaged(r, task, *staged, skipped, spill);
    }
    if (!lease.ok() && copy_status.ok() && !abandoned) {
      lease = pool_->Acquire(layout->file_bytes, absl::Now() + options_.admission_timeout);
    }
    if (!lease.ok() || !copy_status.ok() || abandoned) {
      skipped->push_back(l);
      continue;
    }
    v.layout = *layout;
    v.lease = std::move(*lease);
    for (int i = 0; i < lt.header.tensors_size() && copy_status.ok(); ++i) {
      const store::TensorEntry& t = lt.header.tensors(i);
      const char* src = lt.src[static_cast<size_t>(i)];
      v.lease.ForEachPiece(v.layout.header_bytes + t.offset(), t.nbytes(),
                           [&](char* piece, uint64_t n) {
                             if (copy_status.ok()) copy_status = memory->CopyOut(piece, src, n);
                             src += n;
                           });
    }
    staged->push_back(std::move(v));
  }
  // After a failed copy too, what was enqueued before it must land (or the
  // wait for it end) before its staging memory is given back.
  if (!finish_failed) {
    absl::Status finished = memory->FinishSnapshot();
    if (copy_status.ok()) copy_status = std::move(finished);
  }
  return copy_status;
}

void Engine::WithholdStaging(const std::shared_ptr<RankState>& r, const SnapTask& task,
                             RankMemory* memory, std::vector<StagedVersion>& staged) {
  // A step refused while earlier copies may still land staged nothing:
  // nothing is withheld, and the deadline was counted once already.
  if (staged.empty()) return;
  uint64_t bytes = 0;
  for (StagedVersion& v : staged) {
    bytes += v.lease.capacity();
    memory->HoldUntilCopiesLand(std::make_shared<StagingLease>(std::move(v.lease)));
  }
  if (Metrics* m = options_.metrics) m->Inc(Counter::kGpuWaitsAbandoned, "copies", 1);
  CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << " step " << task.step
                  << ": the GPU did not finish ckptd's copies; " << bytes
                  << " bytes of staging memory they write into stay out of the pool until the "
                  << "device is seen to have finished them (until ckptd restarts if it never is)";
}

bool Engine::FinishSnapshot(const std::shared_ptr<RankState>& r, SnapTask& task,
                            std::vector<StagedVersion>& staged, std::vector<uint32_t>& skipped,
                            SpillState* spill) {
  absl::MutexLock lock(&mu_);  // write_queue_
  absl::MutexLock rank_lock(&r->mu);
  if (stopping_ || !r->active || r->fence_broken_step >= task.step) {
    // Nobody waited for this copy to finish: the trainer may have changed
    // the buffers meanwhile, so the staged bytes cannot be trusted. Drop
    // them (the layers are retried) rather than make them durable.
    for (const StagedVersion& v : staged) {
      skipped.push_back(v.key.layer);
      r->retry[v.key.layer] = true;
      r->RecordOutcome(v.key.layer, task.step, false);
    }
    CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank << " step " << task.step
                      << ": snapshot finished after its fence was abandoned; discarded";
    staged.clear();
  }
  PendingStep* p = QueueStaged(&write_queue_, clock_->Now(), r, task, staged, spill);
  p->sealed = true;
  p->event.set_skipped(static_cast<uint32_t>(skipped.size()));
  SnapshotTaken result;
  result.layers = std::move(spill->layers);
  for (uint32_t l : skipped) {
    r->retry[l] = true;
    r->RecordOutcome(l, task.step, false);
  }
  result.skipped = static_cast<uint32_t>(skipped.size());
  if (!skipped.empty()) {
    snapshots_skipped_.fetch_add(skipped.size(), std::memory_order_relaxed);
    CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank << " step " << task.step << ": "
                      << skipped.size() << " layer versions skipped, staging pool full";
  }
  r->snap_results[task.step] = std::move(result);
  while (r->snap_results.size() > kSnapResultsKept) r->snap_results.erase(r->snap_results.begin());
  r->snapshot_step = task.step;
  return p->remaining == 0;
}

bool Engine::SpillStaged(const std::shared_ptr<RankState>& r, SnapTask& task,
                         std::vector<StagedVersion>& staged, std::vector<uint32_t>* skipped,
                         SpillState* spill) {
  absl::MutexLock lock(&mu_);  // write_queue_
  absl::MutexLock rank_lock(&r->mu);
  if (stopping_ || !r->active || r->fence_broken_step >= task.step) {
    // As at the end of a snapshot: copies made after the trainer went on are
    // not trusted (the outcome is recorded there, with the other skips).
    for (const StagedVersion& v : staged) skipped->push_back(v.key.layer);
    staged.clear();
    return false;
  }
  QueueStaged(&write_queue_, clock_->Now(), r, task, staged, spill);
  return true;
}

absl::StatusOr<SnapshotTaken> Engine::WaitSnapshot(const RankRef& rank, uint64_t step,
                                                   const Caller& caller, absl::Time deadline) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, Find(rank, caller));
  absl::MutexLock rank_lock(&r->mu);
  CKPT_RETURN_IF_ERROR(r->CheckReported(step));
  auto taken = [&r, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
    return r->snapshot_step >= step || !r->active || r->stopping;
  };
  const absl::Time wait_start = absl::Now();
  r->mu.AwaitWithDeadline(absl::Condition(&taken), deadline);
  if (options_.metrics != nullptr) {
    options_.metrics->Observe(Histogram::kFenceWaitSeconds,
                              absl::ToDoubleSeconds(absl::Now() - wait_start));
  }
  if (r->snapshot_step < step) {
    // The caller will go on without the fence: a copy still running for this
    // step (or an earlier one) must not become durable.
    r->fence_broken_step = std::max(r->fence_broken_step, step);
    if (!r->active || r->stopping) {
      return RegistrationEndedError(r->stopping, "the registration ended before the snapshot");
    }
    return absl::DeadlineExceededError(
        absl::StrCat("snapshot of step ", step, " not taken in time"));
  }
  auto it = r->snap_results.find(step);
  if (it == r->snap_results.end()) return SnapshotTaken();  // an old step: taken long ago
  return it->second;
}

}  // namespace ckpt
