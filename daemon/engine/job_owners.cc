#include "daemon/engine/job_owners.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/common/validate.h"

namespace ckpt {

absl::Status JobOwners::CheckVisible(const std::string& job, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  CKPT_ASSIGN_OR_RETURN(std::optional<uid_t> owner, OwnerOf(job));
  // Another user's job reads exactly like a missing one.
  if (!owner.has_value() || (*owner != caller.uid && !IsRoot(caller))) {
    return absl::NotFoundError(absl::StrCat("job ", job, " does not exist"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<uid_t>> JobOwners::OwnerOf(const std::string& job) {
  CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> rec, index_->GetJob(job));
  if (!rec.has_value()) return std::optional<uid_t>();
  return std::optional<uid_t>(rec->owner_uid());
}

absl::Status JobOwners::Claim(const std::string& job, uid_t owner) {
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> now, index_->GetJob(job));
  if (now.has_value()) {
    if (now->owner_uid() == owner) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
  }
  store::JobRecord jr;
  jr.set_owner_uid(owner);
  jr.set_created_unix_ms(absl::ToUnixMillis(clock_->Now()));
  return index_->PutJob(job, jr);
}

absl::Status JobOwners::Evict(const std::string& job) {
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> now, index_->GetJob(job));
  if (!now.has_value()) return absl::NotFoundError(absl::StrCat("job ", job, " does not exist"));
  if (now->evicted_unix_ms() != 0) return absl::OkStatus();
  now->set_evicted_unix_ms(std::max<int64_t>(1, absl::ToUnixMillis(clock_->Now())));
  return index_->PutJob(job, *now);
}

absl::Status JobOwners::CheckAdmits(const std::string& job) {
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> now, index_->GetJob(job));
  if (!now.has_value() || now->evicted_unix_ms() == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("job ", job,
                   " was evicted by root: none of its ranks may register until it is deleted "
                   "(ckptctl delete ",
                   job, ")"));
}

}  // namespace ckpt
