#include "daemon/store/retention.h"

#include <algorithm>
#include <set>

namespace ckpt {

RetentionPlan PlanRetention(const RetentionPolicy& policy, const RetentionInput& in) {
  RetentionPlan plan;
  if (in.events.empty()) return plan;  // nothing is durable as a step: touch nothing
  const size_t n = in.events.size();
  const uint64_t latest = in.events.back().first;
  // keep_hours comes from the config unchecked: computed wide and saturated,
  // so a huge value keeps every event instead of overflowing.
  int64_t horizon_ms = INT64_MAX;
  if (policy.keep_hours > 0) {
    const __int128 h =
        static_cast<__int128>(in.now_unix_ms) - static_cast<__int128>(policy.keep_hours) * 3600000;
    horizon_ms = h < INT64_MIN ? INT64_MIN : static_cast<int64_t>(h);
  }
  // The newest event at or below the agreed step (n when none).
  size_t agreed = n;
  for (size_t i = 0; in.agreed_step > 0 && i < n && in.events[i].first <= in.agreed_step; ++i) {
    agreed = i;
  }
  // The oldest `max_pending_events` events above pending_after: the remote
  // tier's uploader still needs them.
  uint64_t pending_left = in.max_pending_events;
  std::vector<bool> keep(n, false);
  for (size_t i = 0; i < n; ++i) {
    const auto& [step, ms] = in.events[i];
    const bool pending = step > in.pending_after && pending_left > 0;
    if (pending) --pending_left;
    keep[i] = i + 1 == n || pending ||
              (policy.keep_last_events > 0 && n - i <= policy.keep_last_events) ||
              (policy.keep_every_steps > 0 && step % policy.keep_every_steps == 0) ||
              ms >= horizon_ms || i == agreed;
    (keep[i] ? plan.retained_targets : plan.delete_events).push_back(step);
  }
  for (const auto& [layer, steps] : in.versions) {
    // Two pointers: for each retained target, the newest version <= it.
    std::set<uint64_t> needed;
    size_t v = 0;
    for (uint64_t target : plan.retained_targets) {
      while (v + 1 < steps.size() && steps[v + 1] <= target) ++v;
      if (!steps.empty() && steps[v] <= target) needed.insert(steps[v]);
    }
    for (uint64_t s : steps) {
      if (s > latest || needed.count(s) > 0) {
        ++plan.versions_kept;
      } else {
        plan.delete_versions.emplace_back(layer, s);
      }
    }
  }
  return plan;
}

}  // namespace ckpt
