// LayerStore (layer_store.h): the directory layout -- the names of rank
// directories and layer files, the data directory's set-up, the kept
// descriptors of rank directories -- and each rank's side files. The commit
// protocol is in layer_store_commit.cc, reads and Adopt in
// layer_store_read.cc, start-up reconciliation in layer_store_reconcile.cc.
#include "daemon/store/layer_store.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/validate.h"
#include "daemon/store/layer_store_internal.h"

namespace ckpt {

using layer_store_internal::AtPath;

std::string RankDirName(uint32_t rank) { return absl::StrFormat("rank-%08x", rank); }

bool ParseRankDirName(const std::string& name, uint32_t* rank) {
  return name.size() == 13 && absl::StartsWith(name, "rank-") &&
         absl::SimpleHexAtoi(absl::string_view(name).substr(5), rank);
}

// L<layer:8>-S<step:16>-G<gen:16>.ckv
bool ParseFileName(const std::string& name, uint32_t* layer, uint64_t* step) {
  if (name.size() != 1 + 8 + 2 + 16 + 2 + 16 + 4 || name[0] != 'L' || name.substr(9, 2) != "-S" ||
      name.substr(27, 2) != "-G" || !absl::EndsWith(name, ".ckv")) {
    return false;
  }
  absl::string_view n(name);
  return absl::SimpleHexAtoi(n.substr(1, 8), layer) && absl::SimpleHexAtoi(n.substr(11, 16), step);
}

LayerStore::LayerStore(std::string data_dir, FileSystem* fs, Index* index, bool use_direct_io)
    : data_dir_(std::move(data_dir)), fs_(fs), index_(index), use_direct_io_(use_direct_io) {}

absl::StatusOr<uint64_t> LayerStore::FreeBytes() { return fs_->FreeBytes(jobs_dir_.get()); }
absl::StatusOr<uint64_t> LayerStore::TotalBytes() { return fs_->TotalBytes(jobs_dir_.get()); }

absl::Status LayerStore::Init() {
  CKPT_ASSIGN_OR_RETURN(data_dir_fd_, fs_->MakeDirs(data_dir_));
  absl::StatusOr<UniqueFd> jobs = fs_->OpenSubdir(data_dir_fd_.get(), "jobs", /*create=*/true);
  if (!jobs.ok()) return AtPath(jobs.status(), data_dir_ + "/jobs");
  jobs_dir_ = std::move(jobs).value();
  // An fsync inside jobs/ does not make jobs/ itself durable: without this a
  // power loss can take the whole tree (and the index directory, created
  // before Init) away from under records that name its files.
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(data_dir_fd_.get()));
  return absl::OkStatus();
}

std::string LayerStore::FileName(const VersionKey& key, uint64_t generation) {
  return absl::StrFormat("L%08x-S%016x-G%016x.ckv", key.layer, key.step, generation);
}

std::string LayerStore::RankDirPath(const std::string& job, uint32_t rank) const {
  return absl::StrCat(data_dir_, "/jobs/", job, "/", RankDirName(rank));
}

absl::StatusOr<UniqueFd> LayerStore::OpenSideFile(const std::string& job, uint32_t rank,
                                                  const std::string& name) {
  absl::StatusOr<DirRef> dir = RankDir(job, rank, /*create=*/true);
  if (!dir.ok()) return AtPath(dir.status(), RankDirPath(job, rank));
  absl::StatusOr<UniqueFd> fd = fs_->OpenForAppend((*dir)->get(), name);
  if (!fd.ok()) return AtPath(fd.status(), RankDirPath(job, rank));
  return fd;
}

absl::Status LayerStore::RemoveRankDir(const std::string& job, uint32_t rank,
                                       const std::vector<std::string>& side_files) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  absl::MutexLock dir_lock(&dir_mu_);
  ForgetRankDir(job, rank);
  absl::StatusOr<UniqueFd> job_dir = fs_->OpenSubdir(jobs_dir_.get(), job, /*create=*/false);
  if (absl::IsNotFound(job_dir.status())) return absl::OkStatus();
  if (!job_dir.ok()) return AtPath(job_dir.status(), RankDirPath(job, rank));
  absl::StatusOr<UniqueFd> rank_dir = fs_->OpenSubdir(job_dir->get(), RankDirName(rank), false);
  if (rank_dir.ok()) {
    for (const std::string& name : side_files) {
      absl::Status s = fs_->Unlink(rank_dir->get(), name);
      if (!s.ok() && !absl::IsNotFound(s)) return AtPath(s, RankDirPath(job, rank));
    }
    *rank_dir = UniqueFd();
    if (absl::Status s = fs_->RemoveDir(job_dir->get(), RankDirName(rank)); !s.ok()) {
      CKPT_LOG(WARNING) << "kept " << RankDirPath(job, rank) << ": " << s;
      return absl::OkStatus();
    }
  } else if (!absl::IsNotFound(rank_dir.status())) {
    return AtPath(rank_dir.status(), RankDirPath(job, rank));
  }
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(job_dir->get()));
  *job_dir = UniqueFd();
  // The job's directory goes once its last rank's has.
  if (fs_->RemoveDir(jobs_dir_.get(), job).ok())
    CKPT_RETURN_IF_ERROR(fs_->SyncDir(jobs_dir_.get()));
  return absl::OkStatus();
}

absl::Status LayerStore::AppendSideFile(int fd, absl::string_view data) {
  return fs_->Append(fd, data);
}

absl::StatusOr<LayerStore::DirRef> LayerStore::RankDir(const std::string& job, uint32_t rank,
                                                       bool create) {
  auto key = std::make_pair(job, rank);
  {
    absl::MutexLock lock(&mu_);
    auto it = rank_dirs_.find(key);
    if (it != rank_dirs_.end()) return it->second;
  }
  // Opened (and made durable) under dir_mu_ alone: ForgetRankDir, which the
  // engine calls under its own locks, takes mu_ only and never waits behind
  // these fsyncs; RemoveRankDir takes dir_mu_ too, so a directory is never
  // removed while it is being opened.
  absl::MutexLock dir_lock(&dir_mu_);
  {
    absl::MutexLock lock(&mu_);
    auto it = rank_dirs_.find(key);
    if (it != rank_dirs_.end()) return it->second;
  }
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  CKPT_ASSIGN_OR_RETURN(UniqueFd job_dir, fs_->OpenSubdir(jobs_dir_.get(), job, create));
  CKPT_ASSIGN_OR_RETURN(UniqueFd rank_dir,
                        fs_->OpenSubdir(job_dir.get(), RankDirName(rank), create));
  if (create) {
    // Make the new entries themselves durable before any file inside them.
    CKPT_RETURN_IF_ERROR(fs_->SyncDir(job_dir.get()));
    CKPT_RETURN_IF_ERROR(fs_->SyncDir(jobs_dir_.get()));
  }
  DirRef ref = std::make_shared<const UniqueFd>(std::move(rank_dir));
  absl::MutexLock lock(&mu_);
  // A bound on the descriptors kept: past it one kept entry goes (whoever
  // still uses it holds its own reference) and is opened again when needed.
  if (rank_dirs_.size() >= kMaxOpenRankDirs) rank_dirs_.erase(rank_dirs_.begin());
  rank_dirs_.emplace(key, ref);
  return ref;
}

void LayerStore::ForgetRankDir(const std::string& job, uint32_t rank) {
  absl::MutexLock lock(&mu_);
  rank_dirs_.erase(std::make_pair(job, rank));
}

size_t LayerStore::open_rank_dirs() const {
  absl::MutexLock lock(&mu_);
  return rank_dirs_.size();
}

}  // namespace ckpt
