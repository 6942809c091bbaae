// The remote tier's retention of its own copies: the manifests and objects
// the retention policy no longer keeps are deleted, manifests first.
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/remote/remote_layout.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/retention.h"

namespace ckpt {

absl::Status RemoteTier::RemoteGc(const RankKey& key) {
  const auto& [job, rank] = key;
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(deps_.clock->Now());
  std::map<uint64_t, std::vector<std::string>> manifest_files;
  std::vector<std::string> objects;
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    if (rc == nullptr || !rc->blocked.empty() || rc->discard_above.has_value()) {
      return absl::OkStatus();
    }
    for (const auto& [step, m] : rc->manifests) {
      in.events.emplace_back(step, m.unix_ms);
      manifest_files[step] = m.files;
    }
    if (!rc->manifests.empty()) in.agreed_step = rc->manifests.rbegin()->second.agreed_step;
    for (const auto& [file, bytes] : rc->objects) objects.push_back(file);
    objects.insert(objects.end(), rc->stray.begin(), rc->stray.end());
  }
  if (in.events.empty()) return absl::OkStatus();
  const uint64_t newest = in.events.back().first;
  const RetentionPlan plan = PlanRetention(options_.retention, in);
  // What the kept manifests name, exactly (not recomputed from the listing:
  // objects of two histories may share the prefix).
  std::set<std::string> needed;
  for (uint64_t step : plan.retained_targets) {
    for (const std::string& f : manifest_files[step]) needed.insert(f);
  }
  // Deletes `object`, then `forget` drops it from the rank's copy; false
  // when the rank's copy has gone meanwhile.
  auto remove = [&](const std::string& object,
                    const std::function<void(RankCopy*)>& forget) -> absl::StatusOr<bool> {
    CKPT_RETURN_IF_ERROR(store_->Delete(object));
    if (Metrics* m = deps_.metrics) m->Inc(options_.metric_ids.gc_deleted);
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return false;
    forget(rc);
    return true;
  };
  // Manifests first, so no manifest ever names a deleted object.
  for (uint64_t step : plan.delete_events) {
    CKPT_ASSIGN_OR_RETURN(const bool here,
                          remove(remote::ManifestKey(job, rank, step),
                                 [step](RankCopy* rc) { rc->manifests.erase(step); }));
    if (!here) return absl::OkStatus();
  }
  for (const std::string& file : objects) {
    uint32_t layer = 0;
    uint64_t step = 0;
    // Objects above the newest manifest belong to a step being uploaded.
    if (needed.count(file) > 0 || !ParseFileName(file, &layer, &step) || step > newest) continue;
    CKPT_ASSIGN_OR_RETURN(const bool here,
                          remove(remote::VersionObjectKey(job, rank, file), [&file](RankCopy* rc) {
                            rc->objects.erase(file);
                            rc->stray.erase(file);
                          }));
    if (!here) return absl::OkStatus();
  }
  CKPT_SYNC_POINT("remote.after_gc");
  return absl::OkStatus();
}

}  // namespace ckpt
