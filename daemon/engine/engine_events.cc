// Event sequencer: version outcomes, ordered checkpoint events, WaitDurable.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"

namespace ckpt {

void Engine::FinishVersion(const std::shared_ptr<RankState>& r, uint64_t step, uint32_t layer,
                           const absl::StatusOr<store::VersionRecord>& rec, uint64_t bytes) {
  if (rec.ok()) {
    versions_committed_.fetch_add(1, std::memory_order_relaxed);
    bytes_committed_.fetch_add(bytes, std::memory_order_relaxed);
    if (Metrics* m = options_.metrics) {
      m->Inc(Counter::kVersionsCommitted);
      m->Inc(Counter::kCommittedBytes, static_cast<double>(bytes));
    }
  } else {
    write_errors_.fetch_add(1, std::memory_order_relaxed);
    if (Metrics* m = options_.metrics) {
      // What failed, as the commit pipeline tagged it; a write by default.
      ErrorReason reason = ReasonOf(rec.status());
      if (reason == ErrorReason::kUnspecified) {
        reason =
            absl::IsResourceExhausted(rec.status()) ? ErrorReason::kDiskFull : ErrorReason::kWrite;
      }
      const char* kind = ReasonName(reason);
      m->Inc(Counter::kVersionsFailed);
      m->Inc(Counter::kErrors, kind, 1);
    }
    CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << " layer " << layer << " step "
                    << step << ": version failed, previous version stays: " << rec.status();
  }
  absl::MutexLock rank_lock(&r->mu);
  for (PendingStep& p : r->pending) {
    if (p.step != step) continue;
    if (rec.ok()) {
      p.event.add_layers(layer);
      p.event.set_bytes(p.event.bytes() + bytes);
      r->last_committed[layer] = std::max(r->last_committed[layer], step);
      r->RecordOutcome(layer, step, true);
    } else {
      p.event.set_failed(p.event.failed() + 1);
      r->retry[layer] = true;
      r->RecordOutcome(layer, step, false);
    }
    --p.remaining;
    return;
  }
}

void Engine::AdvanceEvents(const std::shared_ptr<RankState>& r) {
  absl::MutexLock order(&r->event_mu);
  std::vector<std::pair<uint64_t, store::EventRecord>> batch;
  uint64_t batch_bytes = 0;  // what the events add to the index (quota.h)
  {
    absl::MutexLock rank_lock(&r->mu);
    for (const PendingStep& p : r->pending) {
      if (p.remaining != 0 || !p.sealed) break;
      store::EventRecord e = p.event;
      std::sort(e.mutable_layers()->begin(), e.mutable_layers()->end());
      e.set_unix_ms(absl::ToUnixMillis(clock_->Now()));
      batch_bytes += EventIndexBytes(e.aux().size());
      batch.emplace_back(p.step, std::move(e));
    }
  }
  if (batch.empty()) return;
  // The free-space floor of the index first: a refusal writes nothing, so
  // RocksDB's WAL never meets a full file system through these records.
  absl::Status s = disk_.CheckIndexRoom(batch_bytes);
  if (s.ok()) {
    CKPT_KILL_POINT("event.before_put");
    s = index_->PutEvents(r->job, r->rank, batch);
    CKPT_KILL_POINT("event.after_put");
  }
  CKPT_SYNC_POINT("event.after_write");
  absl::MutexLock rank_lock(&r->mu);
  if (!s.ok()) {
    // These steps are not durable; their versions stay (a later event covers
    // them) and later steps are tried again: no step of the rank is given up
    // for good, and the index recovers when there is room again (index.h).
    if (r->event_failure.ok()) {  // once per run of failures
      CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << ": checkpoint events of steps "
                      << batch.front().first << ".." << batch.back().first
                      << " not recorded; they are not durable: " << s;
    }
    r->event_failure = s;
    r->event_failed_step = batch.back().first;
    if (Metrics* m = options_.metrics) {
      ErrorReason reason = ReasonOf(s);
      if (reason == ErrorReason::kUnspecified) reason = ErrorReason::kIndex;
      m->Inc(Counter::kErrors, ReasonName(reason), 1);
      m->Inc(Counter::kEventsFailed, static_cast<double>(batch.size()));
    }
  } else {
    if (!r->event_failure.ok()) {
      CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank
                        << ": checkpoint events recorded again from step " << batch.front().first;
    }
    r->event_failure = absl::OkStatus();
    for (size_t i = 0; i < batch.size(); ++i) r->pending[i].charge.Keep();
  }
  // A refused step gives its queue slot and its reserved bytes back here.
  for (size_t i = 0; i < batch.size(); ++i) r->pending.pop_front();
  if (!s.ok()) return;
  r->durable_step = batch.back().first;
  // The tiers copy it behind (their locks are leaves: taken under r->mu).
  std::vector<LocalEvent> events;
  for (const auto& [step, e] : batch) events.push_back(LocalEvent{step, e.bytes()});
  for (const std::unique_ptr<DurableTier>& tier : tiers_) {
    tier->OnLocalEvents(RankKey(r->job, r->rank), r->uid, events);
  }
}

absl::StatusOr<uint64_t> Engine::WaitDurable(const RankRef& rank, uint64_t step,
                                             const Caller& caller, absl::Time deadline,
                                             std::string_view tier) {
  DurableTier* copy = nullptr;
  if (!tier.empty()) {
    copy = TierNamed(tier);
    if (copy == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("ckptd has no ", std::string(tier), " tier configured",
                       tier == "remote" ? " (remote_kind)" : "", "; wait for local durability"));
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, Find(rank, caller));
  // Locally durable first (its errors are the same), then the tier's copy.
  CKPT_ASSIGN_OR_RETURN(uint64_t durable, WaitLocallyDurable(r, step, deadline));
  if (copy == nullptr) return durable;
  return copy->WaitDurable(RankKey(rank.job, rank.rank), step, deadline);
}

absl::StatusOr<uint64_t> Engine::WaitLocallyDurable(const std::shared_ptr<RankState>& r,
                                                    uint64_t step, absl::Time deadline) {
  absl::MutexLock rank_lock(&r->mu);
  CKPT_RETURN_IF_ERROR(r->CheckReported(step));
  auto durable = [&r, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
    return r->durable_step >= step || r->event_failed_step >= step || !r->active || r->stopping;
  };
  r->mu.AwaitWithDeadline(absl::Condition(&durable), deadline);
  if (r->durable_step < step && r->event_failed_step >= step) {
    // The event of this step (or of one after it) could not be written.
    return r->event_failure.ok() ? absl::AbortedError(absl::StrCat("the checkpoint event of step ",
                                                                   step, " was not recorded"))
                                 : r->event_failure;
  }
  if (r->durable_step < step) {
    if (!r->active || r->stopping) {
      return RegistrationEndedError(r->stopping,
                                    "the registration ended before step became durable");
    }
    return absl::DeadlineExceededError(absl::StrCat("step ", step, " not durable in time"));
  }
  std::vector<uint32_t> failed;
  for (uint32_t l = 0; l < r->outcomes.size(); ++l) {
    const std::map<uint64_t, bool>& o = r->outcomes[l];
    auto it = o.upper_bound(step);  // the newest selection at or before the step
    if (it != o.begin() && !std::prev(it)->second) failed.push_back(l);
  }
  if (!failed.empty()) {
    return absl::AbortedError(absl::StrCat("layer versions of layers [", absl::StrJoin(failed, ","),
                                           "] at or before step ", step,
                                           " failed or were skipped; they are retried next step"));
  }
  return r->durable_step;
}

}  // namespace ckpt
