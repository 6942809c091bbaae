// LayerStore (layer_store.h): start-up reconciliation. The index and the
// rank directories are brought back into agreement after a crash: temp
// files go, records without a whole file go (a bug alarm), and layer files
// no record names -- or of steps after the rank's last event -- are moved
// to quarantine/, never deleted.
#include <algorithm>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/validate.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/layer_store_internal.h"

namespace ckpt {

using layer_store_internal::AtPath;

store::LostVersion LostRecord(const store::VersionRecord& rec, const std::string& why) {
  store::LostVersion lost;
  lost.set_reason(why);
  lost.set_lost_unix_ms(absl::ToUnixMillis(absl::Now()));
  lost.set_payload_bytes(rec.payload_bytes());
  lost.set_file(rec.file());
  return lost;
}

absl::StatusOr<ReconcileReport> LayerStore::Reconcile(ReconcileCheck check) {
  ReconcileReport report;
  // Ranks known to the index or present on disk.
  std::set<std::pair<std::string, uint32_t>> ranks;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> rs, index_->ListRanks(job));
    for (uint32_t r : rs) ranks.emplace(job, r);
  }
  // What an operator must fix (a link, a FIFO, an unreadable directory) is
  // gathered over the whole data directory and reported at once; the ranks
  // without a problem are reconciled meanwhile.
  std::vector<absl::Status> problems;
  std::vector<bool> is_dir;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> job_dirs, fs_->List(jobs_dir_.get(), &is_dir));
  for (size_t i = 0; i < job_dirs.size(); ++i) {
    if (!is_dir[i] || !ValidateJobId(job_dirs[i]).ok()) {
      CKPT_LOG(WARNING) << "reconcile: ignoring unexpected entry jobs/" << job_dirs[i];
      continue;
    }
    const std::string job_path = absl::StrCat(data_dir_, "/jobs/", job_dirs[i]);
    absl::StatusOr<UniqueFd> jd = fs_->OpenSubdir(jobs_dir_.get(), job_dirs[i], false);
    std::vector<bool> rank_is_dir;
    absl::StatusOr<std::vector<std::string>> rank_dirs =
        jd.ok() ? fs_->List(jd->get(), &rank_is_dir) : jd.status();
    if (!rank_dirs.ok()) {
      problems.push_back(AtPath(rank_dirs.status(), job_path));
      for (auto it = ranks.begin(); it != ranks.end();) {  // none of its ranks is looked at
        it = it->first == job_dirs[i] ? ranks.erase(it) : std::next(it);
      }
      continue;
    }
    for (size_t j = 0; j < rank_dirs->size(); ++j) {
      uint32_t r;
      if (rank_is_dir[j] && ParseRankDirName((*rank_dirs)[j], &r)) ranks.emplace(job_dirs[i], r);
    }
  }
  for (const auto& [job, rank] : ranks) {
    absl::StatusOr<DirRef> dir = RankDir(job, rank, /*create=*/true);
    absl::Status s = dir.ok() ? ReconcileRank(job, rank, (*dir)->get(), check, &report)
                              : AtPath(dir.status(), RankDirPath(job, rank));
    // Start-up visits every rank ever written; only the ranks that write
    // again keep a descriptor.
    ForgetRankDir(job, rank);
    if (!s.ok()) problems.push_back(std::move(s));
  }
  return problems.empty() ? absl::StatusOr<ReconcileReport>(report) : AllProblems(problems);
}

absl::Status LayerStore::AllProblems(const std::vector<absl::Status>& problems) {
  constexpr size_t kListed = 32;
  std::string listed;
  for (size_t i = 0; i < problems.size() && i < kListed; ++i) {
    CKPT_LOG(ERROR) << "reconcile: " << problems[i];
    absl::StrAppend(&listed, "\n  ", problems[i].message());
  }
  if (problems.size() > kListed) {
    absl::StrAppend(&listed, "\n  and ", problems.size() - kListed, " more");
  }
  // One that needs an operator makes the whole start need one.
  absl::StatusCode code = problems.front().code();
  for (const absl::Status& p : problems) {
    if (absl::IsFailedPrecondition(p)) code = absl::StatusCode::kFailedPrecondition;
  }
  return absl::Status(code, absl::StrCat(problems.size(), " entries of the data directory ",
                                         data_dir_, " cannot be used:", listed));
}

absl::Status LayerStore::ReconcileRank(const std::string& job, uint32_t rank, int dir,
                                       ReconcileCheck check, ReconcileReport* report) {
  CKPT_ASSIGN_OR_RETURN(auto last_event, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  const uint64_t last_step = last_event.has_value() ? last_event->first : 0;
  CKPT_RETURN_IF_ERROR(ForgetLost(job, rank, last_step + 1));  // left by a crash in a discard
  // After a clean stop, files are looked up by name in one listing (no stat).
  std::vector<std::string> names;
  if (check == ReconcileCheck::kNames) {
    absl::StatusOr<std::vector<std::string>> listed = fs_->List(dir);
    if (!listed.ok()) return AtPath(listed.status(), RankDirPath(job, rank));
    names = *std::move(listed);
    std::sort(names.begin(), names.end());
  }

  // 1. Index side: versions after the last event were never acknowledged;
  //    records whose file is missing or short are bug alarms.
  std::vector<std::pair<VersionKey, store::VersionRecord>> drop_uncommitted, drop_dangling;
  absl::flat_hash_set<std::string> named;
  absl::Status stat_error;
  CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
      job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
        if (k.step > last_step) {
          drop_uncommitted.emplace_back(k, rec);
          return true;
        }
        if (check == ReconcileCheck::kNames) {
          if (std::binary_search(names.begin(), names.end(), rec.file())) {
            named.insert(rec.file());
          } else {
            drop_dangling.emplace_back(k, rec);
          }
          return true;
        }
        absl::StatusOr<uint64_t> size = fs_->FileSizeAt(dir, rec.file());
        if ((!size.ok() && absl::IsNotFound(size.status())) ||
            (size.ok() && *size != rec.file_bytes())) {
          drop_dangling.emplace_back(k, rec);
        } else if (!size.ok()) {
          // Anything but "missing" (EIO, ENOMEM...) is not a verdict on the
          // file: stop rather than delete acknowledged data.
          stat_error = size.status();
          return false;
        } else {
          named.insert(rec.file());
        }
        return true;
      }));
  CKPT_RETURN_IF_ERROR(AtPath(stat_error, RankDirPath(job, rank)));
  absl::flat_hash_set<std::string> moved;  // to quarantine
  for (auto& [k, rec] : drop_uncommitted) {
    // Record first: a crash before the move leaves an orphan, which the next
    // start quarantines in turn.
    CKPT_RETURN_IF_ERROR(index_->DeleteVersion(k));
    ++report->uncommitted_versions_removed;
    absl::StatusOr<uint64_t> size = fs_->FileSizeAt(dir, rec.file());
    if (size.ok()) {
      CKPT_RETURN_IF_ERROR(Quarantine(job, rank, dir, rec.file(),
                                      "its step is after the rank's last checkpoint event"));
      moved.insert(rec.file());
      ++report->files_quarantined;
    } else if (!absl::IsNotFound(size.status())) {
      return AtPath(size.status(), RankDirPath(job, rank));
    }
  }
  for (auto& [k, rec] : drop_dangling) {
    CKPT_LOG(ERROR) << "reconcile: BUG ALARM: index names " << rec.file() << " (job " << job
                    << " rank " << rank << " layer " << k.layer << " step " << k.step
                    << ") but the file is missing or has the wrong size; marking it lost";
    CKPT_RETURN_IF_ERROR(index_->MarkLost(k, LostRecord(rec, "missing or short at start-up")));
    CKPT_RETURN_IF_ERROR(Remove(k, rec));  // its record went with MarkLost: the file
    ++report->dangling_records_removed;
  }
  // 2. File side: temp files and files no record names. (The first listing,
  // after a clean stop, still holds what step 1 moved to quarantine.)
  if (check == ReconcileCheck::kSizes) {
    absl::StatusOr<std::vector<std::string>> listed = fs_->List(dir);
    if (!listed.ok()) return AtPath(listed.status(), RankDirPath(job, rank));
    names = *std::move(listed);
  }
  bool changed = false;
  for (const std::string& name : names) {
    if (moved.count(name) > 0) continue;
    uint32_t layer;
    uint64_t step;
    if (absl::StartsWith(name, "tmp.")) {
      CKPT_RETURN_IF_ERROR(fs_->Unlink(dir, name));
      ++report->temp_files_removed;
      changed = true;
    } else if (ParseFileName(name, &layer, &step) && named.count(name) == 0) {
      // No record names it: a version whose commit died between rename and
      // index write -- or an acknowledged one whose record a damaged index
      // lost. Only `ckptctl repair` can tell; never delete it here.
      CKPT_RETURN_IF_ERROR(Quarantine(job, rank, dir, name, "no index record names it"));
      ++report->orphan_files_quarantined;
      ++report->files_quarantined;
    }
  }
  if (changed) CKPT_RETURN_IF_ERROR(fs_->SyncDir(dir));
  return absl::OkStatus();
}

absl::Status LayerStore::Quarantine(const std::string& job, uint32_t rank, int dir,
                                    const std::string& name, std::string_view why) {
  const std::string qpath =
      absl::StrCat(data_dir_, "/", kQuarantineDir, "/", job, "/", RankDirName(rank));
  absl::StatusOr<UniqueFd> q = fs_->OpenSubdir(data_dir_fd_.get(), kQuarantineDir, true);
  if (!q.ok()) return AtPath(q.status(), absl::StrCat(data_dir_, "/", kQuarantineDir));
  absl::StatusOr<UniqueFd> qjob = fs_->OpenSubdir(q->get(), job, true);
  if (!qjob.ok()) return AtPath(qjob.status(), qpath);
  absl::StatusOr<UniqueFd> qrank = fs_->OpenSubdir(qjob->get(), RankDirName(rank), true);
  if (!qrank.ok()) return AtPath(qrank.status(), qpath);
  // The new directories' entries first, so the moved file cannot vanish
  // with a directory a power loss forgets.
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(qjob->get()));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(q->get()));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(data_dir_fd_.get()));
  std::string target = name;
  for (int n = 1;; ++n) {
    absl::Status s = fs_->MoveNoReplace(dir, name, qrank->get(), target);
    if (s.ok()) break;
    if (!absl::IsAlreadyExists(s) || n > 1000) return AtPath(s, RankDirPath(job, rank));
    target = absl::StrCat(name, ".", n);
  }
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(qrank->get()));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(dir));
  CKPT_LOG(WARNING) << "quarantined " << RankDirPath(job, rank) << "/" << name << " -> " << qpath
                    << "/" << target << " (" << why
                    << "); with ckptd stopped, `ckptctl repair --data-dir=" << data_dir_
                    << "` puts it back in the index if it verifies";
  return absl::OkStatus();
}

absl::Status LayerStore::ForgetLost(const std::string& job, uint32_t rank, uint64_t from) {
  CKPT_ASSIGN_OR_RETURN(const Index::LostMap lost, index_->LostVersions(job, rank));
  for (const auto& [layer_step, rec] : lost) {
    if (layer_step.second >= from) {
      CKPT_RETURN_IF_ERROR(
          index_->DeleteLost(VersionKey{job, rank, layer_step.first, layer_step.second}));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerStore::QuarantineVersion(const VersionKey& key, const store::VersionRecord& rec,
                                           const std::string& why) {
  CKPT_RETURN_IF_ERROR(index_->MarkLost(key, LostRecord(rec, why)));
  absl::StatusOr<DirRef> dir = RankDir(key.job, key.rank, /*create=*/false);
  if (!dir.ok()) return absl::IsNotFound(dir.status()) ? absl::OkStatus() : dir.status();
  absl::StatusOr<uint64_t> size = fs_->FileSizeAt((*dir)->get(), rec.file());
  if (absl::IsNotFound(size.status())) return absl::OkStatus();  // nothing to keep
  if (!size.ok()) return AtPath(size.status(), RankDirPath(key.job, key.rank));
  return Quarantine(key.job, key.rank, (*dir)->get(), rec.file(), why);
}

}  // namespace ckpt
