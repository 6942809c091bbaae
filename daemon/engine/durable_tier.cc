#include "daemon/engine/durable_tier.h"

#include <algorithm>
#include <utility>

#include "base/logging.h"
#include "base/status.h"

namespace ckpt {

absl::Status PullFromNewest(const std::vector<DurableTier*>& tiers, const std::string& job,
                            uint32_t rank, const Caller& caller, bool must_know,
                            const std::function<absl::StatusOr<bool>()>& arrived, bool any_answer) {
  std::vector<std::pair<uint64_t, DurableTier*>> order;
  for (DurableTier* tier : tiers) {
    absl::StatusOr<uint64_t> newest = tier->NewestListedStep(job, rank, must_know);
    order.emplace_back(newest.ok() ? *newest : 0, tier);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  absl::Status failed;
  bool answered = false;
  for (const auto& [listed, tier] : order) {
    absl::Status s = tier->Pull(job, rank, caller, must_know);
    if (absl::IsPermissionDenied(s)) return s;
    if (!s.ok()) {
      CKPT_LOG(WARNING) << "could not pull job " << job << " rank " << rank << " from the "
                        << tier->name() << " tier (" << s << "); trying the next tier";
      if (failed.ok()) failed = s;
      continue;
    }
    answered = true;
    CKPT_ASSIGN_OR_RETURN(const bool here, arrived());
    if (here) return absl::OkStatus();
  }
  return any_answer && answered ? absl::OkStatus() : failed;
}

void ForEachNewestRankEvent(Index* index, const std::string& job,
                            const std::function<void(uint32_t, uid_t, uint64_t)>& fn) {
  absl::StatusOr<std::optional<store::JobRecord>> rec = index->GetJob(job);
  absl::StatusOr<std::vector<uint32_t>> ranks = index->ListRanks(job);
  if (!rec.ok() || !rec->has_value() || !ranks.ok()) return;
  for (uint32_t rank : *ranks) {
    absl::StatusOr<std::optional<std::pair<uint64_t, store::EventRecord>>> e =
        index->EventAtOrBefore(job, rank, ~uint64_t{0});
    if (e.ok() && e->has_value()) fn(rank, (*rec)->owner_uid(), (*e)->first);
  }
}

}  // namespace ckpt
