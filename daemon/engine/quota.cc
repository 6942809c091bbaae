#include "daemon/engine/quota.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt {
namespace {

absl::Status QuotaError(std::string message) {
  return WithReason(absl::ResourceExhaustedError(std::move(message)), ErrorReason::kQuota);
}

uint64_t Sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }

}  // namespace

const char* QuotaKindName(QuotaKind kind) {
  switch (kind) {
    case QuotaKind::kDisk:
      return "disk";
    case QuotaKind::kIndex:
      return "index";
    case QuotaKind::kQueuedSteps:
      return "queued_steps";
  }
  return "disk";
}

StepCharge& StepCharge::operator=(StepCharge&& other) noexcept {
  if (this != &other) {
    Release();
    table_ = std::exchange(other.table_, nullptr);
    uid_ = other.uid_;
    job_ = std::move(other.job_);
    rank_ = other.rank_;
    index_bytes_ = other.index_bytes_;
    keep_ = other.keep_;
  }
  return *this;
}

void StepCharge::Release() {
  if (table_ == nullptr) return;
  std::exchange(table_, nullptr)->ReleaseStep(QuotaOwner{uid_, job_, rank_}, index_bytes_, keep_);
}

void QuotaTable::SetLimits(const QuotaLimits& limits) {
  absl::MutexLock lock(&mu_);
  limits_ = limits;
}

QuotaLimits QuotaTable::limits() const {
  absl::MutexLock lock(&mu_);
  return limits_;
}

absl::Status QuotaTable::CheckBytesLocked(const QuotaOwner& owner, uint64_t files, uint64_t index,
                                          QuotaKind* refused) {
  const Usage& u = usage_[owner.uid];
  if (limits_.index_bytes > 0 && u.index_bytes + index > limits_.index_bytes) {
    return RefuseLocked(
        QuotaKind::kIndex, refused,
        absl::StrCat("uid ", owner.uid, " holds ", u.index_bytes,
                     " bytes of index records (rank tables, aux blobs, events, versions); ", index,
                     " more would pass max_index_bytes_per_uid = ", limits_.index_bytes,
                     " (run `ckptctl gc JOB` or `ckptctl delete JOB` on its jobs, send smaller "
                     "aux blobs, or raise the option)"));
  }
  const uint64_t held = u.file_bytes + u.index_bytes + u.replica_bytes;
  if (limits_.disk_bytes > 0 && held + files + index > limits_.disk_bytes) {
    return RefuseLocked(
        QuotaKind::kDisk, refused,
        absl::StrCat("uid ", owner.uid, " holds ", held,
                     " bytes of layer files, index records and replicas for its jobs on other "
                     "nodes; ",
                     files + index,
                     " more would pass max_disk_bytes_per_uid = ", limits_.disk_bytes,
                     " (run `ckptctl gc JOB` or `ckptctl delete JOB` on its jobs, or raise the "
                     "option)"));
  }
  if (limits_.job_disk_bytes > 0 && !owner.job.empty()) {
    auto it = jobs_.find(owner.job);
    const uint64_t job_held =
        it == jobs_.end() ? 0 : it->second.file_bytes + it->second.index_bytes;
    if (job_held + files + index > limits_.job_disk_bytes) {
      return RefuseLocked(
          QuotaKind::kDisk, refused,
          absl::StrCat("job ", std::string(owner.job), " holds ", job_held,
                       " bytes of layer files and index records; ", files + index,
                       " more would pass max_disk_bytes_per_job = ", limits_.job_disk_bytes,
                       " (run `ckptctl gc ", std::string(owner.job), "` or raise the option)"));
    }
  }
  return absl::OkStatus();
}

absl::Status QuotaTable::RefuseLocked(QuotaKind kind, QuotaKind* refused, std::string message) {
  ++refused_[static_cast<int>(kind)];
  if (refused != nullptr) *refused = kind;
  return QuotaError(std::move(message));
}

void QuotaTable::ChargeLocked(const QuotaOwner& owner, int sign, uint64_t files, uint64_t index) {
  auto apply = [&](Usage& u) {
    if (sign > 0) {
      u.file_bytes += files;
      u.index_bytes += index;
    } else {
      u.file_bytes = Sub(u.file_bytes, files);
      u.index_bytes = Sub(u.index_bytes, index);
    }
  };
  apply(usage_[owner.uid]);
  auto it = jobs_.find(owner.job);
  if (it == jobs_.end()) {
    if (sign < 0) return;
    it = jobs_.emplace(std::string(owner.job), Usage{}).first;
  }
  apply(it->second);
  if (it->second.file_bytes == 0 && it->second.index_bytes == 0) jobs_.erase(it);
}

absl::StatusOr<StepCharge> QuotaTable::AdmitStep(const QuotaOwner& owner, uint64_t event_bytes,
                                                 QuotaKind* refused) {
  absl::MutexLock lock(&mu_);
  Usage& u = usage_[owner.uid];
  RankKey key(owner.uid, std::string(owner.job), owner.rank);
  auto mine = rank_steps_.find(key);
  const uint64_t held = mine == rank_steps_.end() ? 0 : mine->second;
  auto registered = ranks_.find(owner.uid);
  const uint64_t ranks = registered == ranks_.end() ? 1 : std::max<uint32_t>(1, registered->second);
  const uint64_t share = std::max<uint64_t>(1, limits_.queued_steps / ranks);
  if (limits_.queued_steps > 0 && held >= share) {
    ++refused_[static_cast<int>(QuotaKind::kQueuedSteps)];
    if (refused != nullptr) *refused = QuotaKind::kQueuedSteps;
    return QuotaError(absl::StrCat(
        "job ", std::string(owner.job), " rank ", owner.rank, " has ", held,
        " steps queued, being snapshotted or written: its share of max_queued_steps_per_uid = ",
        limits_.queued_steps, " among the ", ranks, " ranks uid ", owner.uid,
        " has registered (wait for snapshots with WaitSnapshot, or raise the option)"));
  }
  if (limits_.queued_steps > 0 && u.queued_steps >= limits_.queued_steps) {
    ++refused_[static_cast<int>(QuotaKind::kQueuedSteps)];
    if (refused != nullptr) *refused = QuotaKind::kQueuedSteps;
    return QuotaError(absl::StrCat("uid ", owner.uid, " has ", u.queued_steps,
                                   " steps queued, being snapshotted or written, "
                                   "max_queued_steps_per_uid = ",
                                   limits_.queued_steps,
                                   " (wait for snapshots with WaitSnapshot, or raise the option)"));
  }
  CKPT_RETURN_IF_ERROR(CheckBytesLocked(owner, 0, event_bytes, refused));
  ChargeLocked(owner, +1, 0, event_bytes);
  ++u.queued_steps;
  ++rank_steps_[key];
  StepCharge charge;
  charge.table_ = this;
  charge.uid_ = owner.uid;
  charge.job_ = std::string(owner.job);
  charge.rank_ = owner.rank;
  charge.index_bytes_ = event_bytes;
  return charge;
}

void QuotaTable::ReleaseStep(const QuotaOwner& owner, uint64_t index_bytes, bool keep) {
  absl::MutexLock lock(&mu_);
  Usage& u = usage_[owner.uid];
  u.queued_steps = Sub(u.queued_steps, 1);
  auto mine = rank_steps_.find(RankKey(owner.uid, std::string(owner.job), owner.rank));
  if (mine != rank_steps_.end() && --mine->second == 0) rank_steps_.erase(mine);
  if (!keep) ChargeLocked(owner, -1, 0, index_bytes);
}

void QuotaTable::AddRank(uid_t uid) {
  absl::MutexLock lock(&mu_);
  ++ranks_[uid];
}

void QuotaTable::RemoveRank(uid_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(uid);
  if (it != ranks_.end() && --it->second == 0) ranks_.erase(it);
}

absl::Status QuotaTable::ReserveVersion(const QuotaOwner& owner, uint64_t file_bytes,
                                        QuotaKind* refused) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(CheckBytesLocked(owner, file_bytes, kVersionIndexBytes, refused));
  ChargeLocked(owner, +1, file_bytes, kVersionIndexBytes);
  return absl::OkStatus();
}

void QuotaTable::ReleaseVersion(const QuotaOwner& owner, uint64_t file_bytes) {
  absl::MutexLock lock(&mu_);
  ChargeLocked(owner, -1, file_bytes, kVersionIndexBytes);
}

absl::Status QuotaTable::ReserveIndex(const QuotaOwner& owner, uint64_t index_bytes,
                                      QuotaKind* refused) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(CheckBytesLocked(owner, 0, index_bytes, refused));
  ChargeLocked(owner, +1, 0, index_bytes);
  return absl::OkStatus();
}

void QuotaTable::ReleaseIndex(const QuotaOwner& owner, uint64_t index_bytes) {
  absl::MutexLock lock(&mu_);
  ChargeLocked(owner, -1, 0, index_bytes);
}

void QuotaTable::ReleaseEvent(const QuotaOwner& owner, uint64_t event_bytes) {
  absl::MutexLock lock(&mu_);
  ChargeLocked(owner, -1, 0, event_bytes);
}

void QuotaTable::Seed(const QuotaOwner& owner, uint64_t file_bytes, uint64_t index_bytes) {
  absl::MutexLock lock(&mu_);
  ChargeLocked(owner, +1, file_bytes, index_bytes);
}

absl::Status QuotaTable::ReserveReplica(uid_t uid, uint64_t bytes, uint64_t replaced,
                                        QuotaKind* refused) {
  absl::MutexLock lock(&mu_);
  // Replicas are charged to the uid alone: the job's own quota is about
  // this node's checkpoints of it.
  CKPT_RETURN_IF_ERROR(CheckBytesLocked(QuotaOwner{uid, {}}, Sub(bytes, replaced), 0, refused));
  usage_[uid].replica_bytes += bytes;
  return absl::OkStatus();
}

void QuotaTable::ReleaseReplica(uid_t uid, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  Usage& u = usage_[uid];
  u.replica_bytes = Sub(u.replica_bytes, bytes);
}

void QuotaTable::SeedReplica(uid_t uid, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  usage_[uid].replica_bytes += bytes;
}

QuotaTable::Usage QuotaTable::Get(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  return it == usage_.end() ? Usage() : it->second;
}

QuotaTable::Usage QuotaTable::GetJob(std::string_view job) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? Usage() : it->second;
}

std::map<uid_t, QuotaTable::Usage> QuotaTable::All() const {
  absl::MutexLock lock(&mu_);
  return usage_;
}

uint64_t QuotaTable::refused(QuotaKind kind) const {
  absl::MutexLock lock(&mu_);
  return refused_[static_cast<int>(kind)];
}

}  // namespace ckpt
