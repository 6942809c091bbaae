#include "daemon/engine/history.h"

#include <algorithm>

#include "base/status.h"

namespace ckpt {

absl::StatusOr<RankHistory> LocalHistory::Read(const std::string& job, uint32_t rank,
                                               std::optional<uint64_t> after) {
  RankHistory h;
  CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> job_rec, index_->GetJob(job));
  if (job_rec.has_value()) h.owner = job_rec->owner_uid();
  const bool newest_first = after.has_value();
  CKPT_RETURN_IF_ERROR(index_->ForEachEvent(
      job, rank, newest_first, [&](uint64_t step, const store::EventRecord& e) {
        if (after.has_value() && step <= *after) return false;
        h.events.push_back({step, e.unix_ms(), EventIndexBytes(e.aux().size()), e.agreed_step()});
        return true;
      }));
  if (newest_first) std::reverse(h.events.begin(), h.events.end());  // in step order
  auto add = [&h](const VersionKey& k, const store::VersionRecord& v) {
    h.versions[{k.layer, k.step}] = v;
    return true;
  };
  if (after.has_value()) {
    CKPT_RETURN_IF_ERROR(index_->ForEachVersionAfter(job, rank, *after, add));
  } else {
    CKPT_RETURN_IF_ERROR(index_->ForEachVersion(job, rank, -1, add));
  }
  return h;
}

absl::Status LocalHistory::DeleteEvent(uid_t owner, const std::string& job, uint32_t rank,
                                       const RankHistory::Event& event) {
  CKPT_RETURN_IF_ERROR(index_->DeleteEvent(job, rank, event.step));
  quota_->ReleaseEvent(QuotaOwner{owner, job}, event.index_bytes);
  return absl::OkStatus();
}

absl::Status LocalHistory::RemoveVersion(uid_t owner, const VersionKey& key,
                                         const store::VersionRecord& rec) {
  CKPT_RETURN_IF_ERROR(store_->Remove(key, rec));
  disk_->Release(rec.file_bytes());
  quota_->ReleaseVersion(QuotaOwner{owner, key.job}, rec.file_bytes());
  if (metrics_ != nullptr) {
    metrics_->Inc(Counter::kGcVersionsDeleted);
    metrics_->Inc(Counter::kGcDeletedBytes, static_cast<double>(rec.file_bytes()));
  }
  return absl::OkStatus();
}

absl::Status LocalHistory::QuarantineVersion(uid_t owner, const VersionKey& key,
                                             const store::VersionRecord& rec,
                                             const std::string& why) {
  CKPT_RETURN_IF_ERROR(store_->QuarantineVersion(key, rec, why));
  disk_->Release(rec.file_bytes());
  quota_->ReleaseVersion(QuotaOwner{owner, key.job}, rec.file_bytes());
  if (metrics_ != nullptr) metrics_->Inc(Counter::kVersionsQuarantined);
  return absl::OkStatus();
}

absl::Status LocalHistory::ForgetLost(const std::string& job, uint32_t rank, uint64_t from) {
  return store_->ForgetLost(job, rank, from);
}

}  // namespace ckpt
