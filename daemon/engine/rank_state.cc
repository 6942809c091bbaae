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

}  // namespace ckpt
