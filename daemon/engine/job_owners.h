// JobOwners: which uid each job of this node belongs to (the job record in
// the index), and the one step that checks and records it.
//
// A job belongs to the uid that created it. To every other uid except root
// it does not exist: CheckVisible answers NOT_FOUND, so no uid learns which
// job ids others use.
//
// Root may evict a job (its squatting trainers re-register at once after a
// plain release): the record then refuses every registration of the job
// until the job is deleted, across restarts.
//
// Used by registration, recovery, retention and admin queries, and by the
// remote tier when a pull creates the job on a replacement node.
// Thread-safety: thread-safe. mu_ makes check-and-create one step (two uids
// racing for a new id: the second is refused); it is taken before any other
// engine lock and held across the index read and write.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/clock.h"
#include "daemon/engine/caller.h"
#include "daemon/store/index.h"

namespace ckpt {

class JobOwners {
 public:
  // Neither owned.
  JobOwners(Index* index, Clock* clock) : index_(index), clock_(clock) {}
  JobOwners(const JobOwners&) = delete;
  JobOwners& operator=(const JobOwners&) = delete;

  // OK when the job exists and belongs to `caller` (root: any job).
  // INVALID_ARGUMENT for a malformed id; NOT_FOUND for a missing job and for
  // another user's.
  absl::Status CheckVisible(const std::string& job, const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);
  // The job's owner; nullopt when this node has no record of the job.
  absl::StatusOr<std::optional<uid_t>> OwnerOf(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);
  // Records the job as `owner`'s unless it exists. PERMISSION_DENIED when it
  // belongs to another uid; index errors as is.
  absl::Status Claim(const std::string& job, uid_t owner) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks an existing job evicted (durably): CheckAdmits refuses it from
  // then on, until the job record is deleted with the job.
  absl::Status Evict(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);
  // OK unless the job exists and was evicted: FAILED_PRECONDITION naming
  // what frees it.
  absl::Status CheckAdmits(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Index* const index_;
  Clock* const clock_;
  absl::Mutex mu_;
};

}  // namespace ckpt
