#include "daemon/engine/rank_state.h"

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace ckpt {

void RankState::ReleaseMemory(const std::string& why,
                              std::vector<std::shared_ptr<RankMemory>>* closing) {
  if (memory == nullptr) return;
  if (std::string(memory->kind()) == "cuda") {
    CKPT_LOG(INFO) << "job " << job << " rank " << rank << ": closing GPU mappings (" << why << ")";
  }
  closing->push_back(std::move(memory));
  memory.reset();
  memory_released = why;
  trainer_pidfd = UniqueFd();
}

void RankState::ReleaseDeferred() {
  if (!deferred) return;
  // The trainer that would have sent the global vector is gone: the parked
  // steps cannot be decided; drop them.
  snap_queue.clear();
  deferred = false;
  snap_busy = false;
}

absl::Status RankState::Drain(absl::Time deadline) {
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return Idle() || stopping; };
  if (!mu.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::UnavailableError(
        absl::StrCat("job ", job, " rank ", rank, " is still writing earlier steps; retry"));
  }
  if (stopping) return ShuttingDownError();
  return absl::OkStatus();
}

absl::Status RankState::CheckReported(uint64_t step) const {
  if (step <= last_step_seen) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("step ", step, " was never reported"));
}

void RankState::RecordOutcome(uint32_t layer, uint64_t step, bool durable) {
  std::map<uint64_t, bool>& o = outcomes[layer];
  o[step] = durable;
  while (o.size() > kOutcomesKept) o.erase(o.begin());
}

void ForgetIfDone(RankTable* ranks, const std::shared_ptr<RankState>& r) {
  if (r->active || !r->Idle()) return;
  auto it = ranks->find(RankKey(r->job, r->rank));
  if (it != ranks->end() && it->second == r) ranks->erase(it);
}

PendingStep* QueueStaged(WriteQueue* queue, absl::Time now, const std::shared_ptr<RankState>& r,
                         SnapTask& task, std::vector<StagedVersion>& staged, SpillState* spill) {
  if (!spill->pending) {
    // The step's place in the event order, taken by its first versions. The
    // rank's snapshots run one at a time, in step order, so it is the newest.
    PendingStep p;
    p.step = task.step;
    p.event = std::move(task.event);
    p.staged_at = now;
    p.charge = std::move(task.charge);
    r->pending.push_back(std::move(p));
    spill->pending = true;
  }
  PendingStep& p = r->pending.back();
  for (StagedVersion& v : staged) {
    spill->layers.push_back(v.key.layer);
    r->never_persisted[v.key.layer] = false;
    r->retry[v.key.layer] = false;
    spill->bytes += v.layout.payload_bytes;
    ++spill->count;
    p.staged_bytes += v.layout.payload_bytes;
    ++p.remaining;
    auto w = std::make_unique<WriteTask>();
    w->rank = r;
    w->version = std::move(v);
    queue->push_back(std::move(w));
  }
  staged.clear();
  return &p;
}

}  // namespace ckpt
