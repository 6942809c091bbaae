#include "daemon/store/repair.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/validate.h"
#include "daemon/io/io_backend.h"
#include "daemon/store/byte_image.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {
namespace {

constexpr size_t kFileNameLength = 1 + 8 + 2 + 16 + 2 + 16 + 4;

// A layer file found by the scan, verified.
struct Found {
  std::string job;
  uint32_t rank = 0;
  std::string name;   // canonical name (quarantine suffix stripped)
  std::string entry;  // name in its directory
  bool quarantined = false;
  store::LayerFileHeader header;
  store::VersionRecord record;
};

// Reads the whole file `entry` of `dir` and checks it: prefix, header body
// and every tensor checksum, and that the header names `job`, `rank` and the
// version `name` says. DATA_LOSS (or the I/O error) otherwise.
absl::StatusOr<Found> ReadAndCheck(FileSystem* fs, IoBackend* io, int dir, const std::string& job,
                                   uint32_t rank, const std::string& entry,
                                   const std::string& name) {
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs->OpenForRead(dir, entry, /*direct=*/false, nullptr));
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs->FileSize(fd.get()));
  if (size < kPrefixBytes) return absl::DataLossError(absl::StrCat("only ", size, " bytes"));
  std::string bytes(size, '\0');
  IoSegment seg{bytes.data(), size, 0};
  CKPT_RETURN_IF_ERROR(io->ReadAll(fd.get(), absl::MakeConstSpan(&seg, 1)));
  BufferImage image(bytes.data(), size);
  CKPT_ASSIGN_OR_RETURN(DecodedHeader decoded, DecodeHeader(image, size));
  CKPT_RETURN_IF_ERROR(VerifyPayload(decoded, image));
  const store::LayerFileHeader& h = decoded.header;
  const VersionKey key{h.job_id(), h.rank(), h.layer(), h.step()};
  if (h.job_id() != job || h.rank() != rank || LayerStore::FileName(key, h.generation()) != name) {
    return absl::DataLossError(absl::StrCat("its header names job ", h.job_id(), " rank ", h.rank(),
                                            " file ", LayerStore::FileName(key, h.generation())));
  }
  Found f;
  f.job = job;
  f.rank = rank;
  f.name = name;
  f.entry = entry;
  f.header = h;
  f.record.set_file(name);
  f.record.set_file_bytes(size);
  f.record.set_payload_bytes(decoded.layout.payload_bytes);
  f.record.set_header_xxh3(decoded.body_xxh3);
  f.record.set_generation(h.generation());
  *f.record.mutable_group_steps() = h.group_steps();
  f.record.set_committed_unix_ms(h.created_unix_ms());
  return f;
}

// Opens the index; when it cannot be opened for any reason but a lock or a
// newer schema, moves it aside (under its lock) and creates a new one.
absl::StatusOr<std::unique_ptr<Index>> OpenOrRebuild(const std::string& data_dir, int data_fd,
                                                     FileSystem* fs, RepairReport* report) {
  const std::string path = data_dir + "/index";
  absl::StatusOr<std::unique_ptr<Index>> index = Index::Open(path);
  if (index.ok() || absl::IsFailedPrecondition(index.status())) return index;
  report->index_rebuilt = true;
  report->open_error = std::string(index.status().message());
  {
    // Index::Open let go of the lock when RocksDB failed; hold it while the
    // directory is renamed so no ckptd starts on it meanwhile.
    const std::string lock_path = path + "/ckptd.lock";
    UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock.valid()) return ErrnoStatus(errno, absl::StrCat("open ", lock_path));
    if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("the index ", path, " is in use (", lock_path, " is locked); stop ckptd"));
    }
    const std::string aside = absl::StrCat("index.damaged-", absl::ToUnixSeconds(absl::Now()));
    CKPT_RETURN_IF_ERROR(fs->RenameNoReplace(data_fd, "index", aside));
    CKPT_RETURN_IF_ERROR(fs->SyncDir(data_fd));
    report->damaged_index = absl::StrCat(data_dir, "/", aside);
  }
  CKPT_LOG(WARNING) << "repair: the index did not open (" << report->open_error << "); moved to "
                    << report->damaged_index << ", building a new one";
  return Index::Open(path);
}

// Lists the (job, rank) directories under `root_fd` (jobs/ or quarantine/).
absl::StatusOr<std::vector<std::pair<std::string, uint32_t>>> ListRankDirs(FileSystem* fs,
                                                                           int root_fd) {
  std::vector<std::pair<std::string, uint32_t>> out;
  std::vector<bool> is_dir;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, fs->List(root_fd, &is_dir));
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!is_dir[i] || !ValidateJobId(jobs[i]).ok()) continue;
    CKPT_ASSIGN_OR_RETURN(UniqueFd jd, fs->OpenSubdir(root_fd, jobs[i], false));
    std::vector<bool> rank_is_dir;
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> ranks, fs->List(jd.get(), &rank_is_dir));
    for (size_t j = 0; j < ranks.size(); ++j) {
      uint32_t r;
      if (rank_is_dir[j] && ParseRankDirName(ranks[j], &r)) out.emplace_back(jobs[i], r);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The canonical layer-file name of a directory entry: the name itself, or
// for quarantine/ also "<name>.<n>" (a second file of the same name).
std::optional<std::string> CanonicalName(const std::string& entry, bool quarantine) {
  uint32_t layer;
  uint64_t step;
  if (ParseFileName(entry, &layer, &step)) return entry;
  if (!quarantine || entry.size() <= kFileNameLength + 1 || entry[kFileNameLength] != '.') {
    return std::nullopt;
  }
  std::string base = entry.substr(0, kFileNameLength);
  if (!ParseFileName(base, &layer, &step)) return std::nullopt;
  return base;
}

// A rank record from the newest version of each layer found.
store::RankRecord SynthesizeRank(const std::map<uint32_t, const store::LayerFileHeader*>& newest,
                                 uint32_t world_size) {
  store::RankRecord rank;
  rank.set_world_size(world_size);
  uint64_t generation = 0;
  for (const auto& [layer, h] : newest) {
    store::LayerSpec* spec = rank.add_layers();
    spec->set_id(layer);
    spec->set_name(h->layer_name());
    spec->set_kind(store::LAYER_OTHER);
    for (const store::TensorEntry& t : h->tensors()) {
      store::TensorSpec* ts = spec->add_tensors();
      ts->set_name(t.name());
      ts->set_dtype(t.dtype());
      *ts->mutable_shape() = t.shape();
      ts->set_nbytes(t.nbytes());
      ts->set_role(t.role());
      ts->set_group(t.group());
    }
    generation = std::max(generation, h->generation());
  }
  rank.set_generation(generation);
  return rank;
}

// The steps of one repair (RepairDataDir), in order: Scan each of jobs/ and
// quarantine/, PlaceRecords, RestoreRanks. Holds what a step finds for the
// next one.
class Repair {
 public:
  Repair(const std::string& data_dir, FileSystem* fs, Index* index, int jobs_fd,
         RepairReport* report)
      : data_dir_(data_dir),
        fs_(fs),
        index_(index),
        jobs_fd_(jobs_fd),
        report_(report),
        io_(MakePwriteBackend()) {}

  // 1. Reads and verifies every layer file of the rank directories under
  //    `root_fd` (jobs/, or quarantine/ when `quarantine`); what does not
  //    verify is listed as skipped.
  absl::Status Scan(int root_fd, const std::string& root_name, bool quarantine);
  // 2. Keeps the records the index has of intact files and adds one for
  //    every other file found, moving a quarantined one back into its rank
  //    directory (`quarantine_fd`: quarantine/, -1 when there is none).
  absl::Status PlaceRecords(int quarantine_fd);
  // 3. The job and rank records the index lacks for the files placed, and
  //    the events of the steps after each rank's newest surviving one.
  absl::Status RestoreRanks(const RepairOptions& options);
  // The newest generation a placed file names (0: none).
  uint64_t max_generation() const { return max_generation_; }

 private:
  // Step 2 for one file.
  absl::Status Place(const Found& f, int quarantine_fd);
  // Whether the index's record `existing` of f's version names a file of
  // the scan that matches it, in the rank directory.
  bool RecordIntact(const Found& f, const store::VersionRecord& existing) const;
  // Moves the quarantined file `f` back into its rank directory (created
  // when missing), durably. False (and listed as skipped) when a file of its
  // name is there already.
  absl::StatusOr<bool> Unquarantine(const Found& f, int quarantine_fd, const std::string& where);
  // Events for the steps of (job, rank) after its newest surviving event
  // (every step when none survives) that have versions.
  absl::Status SynthesizeEvents(const std::string& job, uint32_t rank);

  const std::string data_dir_;
  FileSystem* const fs_;
  Index* const index_;
  const int jobs_fd_;
  RepairReport* const report_;
  const std::unique_ptr<IoBackend> io_;

  std::vector<Found> found_;  // step 1: every file that verified
  // Step 2: (job, rank) -> layer -> the newest header placed (in found_),
  // the files placed (job/rank-dir/name) and the newest generation.
  std::map<std::pair<std::string, uint32_t>, std::map<uint32_t, const store::LayerFileHeader*>>
      newest_;
  std::set<std::string> placed_;
  uint64_t max_generation_ = 0;
};

absl::Status Repair::Scan(int root_fd, const std::string& root_name, bool quarantine) {
  CKPT_ASSIGN_OR_RETURN(auto rank_dirs, ListRankDirs(fs_, root_fd));
  for (const auto& [job, rank] : rank_dirs) {
    const std::string dir_path =
        absl::StrCat(data_dir_, "/", root_name, "/", job, "/", RankDirName(rank));
    CKPT_ASSIGN_OR_RETURN(UniqueFd jd, fs_->OpenSubdir(root_fd, job, false));
    CKPT_ASSIGN_OR_RETURN(UniqueFd rd, fs_->OpenSubdir(jd.get(), RankDirName(rank), false));
    std::vector<bool> is_dir;
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> entries, fs_->List(rd.get(), &is_dir));
    std::sort(entries.begin(), entries.end());
    for (const std::string& entry : entries) {
      std::optional<std::string> name = CanonicalName(entry, quarantine);
      if (!name.has_value()) continue;
      ++report_->files_checked;
      absl::StatusOr<Found> f = ReadAndCheck(fs_, io_.get(), rd.get(), job, rank, entry, *name);
      if (!f.ok()) {
        report_->skipped.push_back(absl::StrCat(dir_path, "/", entry, ": ", f.status().ToString()));
        continue;
      }
      f->quarantined = quarantine;
      found_.push_back(std::move(f).value());
    }
  }
  return absl::OkStatus();
}

absl::Status Repair::PlaceRecords(int quarantine_fd) {
  for (const Found& f : found_) CKPT_RETURN_IF_ERROR(Place(f, quarantine_fd));
  return absl::OkStatus();
}

bool Repair::RecordIntact(const Found& f, const store::VersionRecord& existing) const {
  bool intact = false;
  for (const Found& g : found_) {
    intact |= !g.quarantined && g.job == f.job && g.rank == f.rank && g.name == existing.file() &&
              g.record.header_xxh3() == existing.header_xxh3();
  }
  return intact;
}

absl::Status Repair::Place(const Found& f, int quarantine_fd) {
  const VersionKey key{f.job, f.rank, f.header.layer(), f.header.step()};
  const std::string id = absl::StrCat(f.job, "/", RankDirName(f.rank), "/", f.name);
  const std::string where =
      absl::StrCat(data_dir_, "/", f.quarantined ? LayerStore::kQuarantineDir : "jobs", "/", f.job,
                   "/", RankDirName(f.rank), "/", f.entry);
  CKPT_ASSIGN_OR_RETURN(auto existing,
                        index_->VersionAtOrBefore(f.job, f.rank, key.layer, key.step));
  const bool has_record = existing.has_value() && existing->first == key.step;
  // The file the record names, verified and matching it, in the rank dir.
  const bool record_intact = has_record && RecordIntact(f, existing->second);
  if (record_intact && !f.quarantined && existing->second.file() == f.name) {
    ++report_->records_kept;
    placed_.insert(id);
  } else if (placed_.count(id) != 0) {
    report_->skipped.push_back(where + ": its version is already in the index");
    return absl::OkStatus();
  } else if (record_intact) {
    report_->skipped.push_back(where + ": the index names another intact file for its version");
    return absl::OkStatus();
  } else {
    if (f.quarantined) {
      CKPT_ASSIGN_OR_RETURN(const bool moved, Unquarantine(f, quarantine_fd, where));
      if (!moved) return absl::OkStatus();
    }
    CKPT_RETURN_IF_ERROR(index_->PutVersion(key, f.record));
    // Found again: plans that refused for its loss take it once more.
    CKPT_RETURN_IF_ERROR(index_->DeleteLost(key));
    ++report_->records_added;
    placed_.insert(id);
  }
  max_generation_ = std::max(max_generation_, f.header.generation());
  auto& layers = newest_[{f.job, f.rank}];
  const store::LayerFileHeader*& slot = layers[key.layer];
  if (slot == nullptr || slot->step() < key.step) slot = &f.header;
  return absl::OkStatus();
}

absl::StatusOr<bool> Repair::Unquarantine(const Found& f, int quarantine_fd,
                                          const std::string& where) {
  // Back into the rank directory (created when missing), then durable.
  CKPT_ASSIGN_OR_RETURN(UniqueFd jd, fs_->OpenSubdir(jobs_fd_, f.job, true));
  CKPT_ASSIGN_OR_RETURN(UniqueFd rd, fs_->OpenSubdir(jd.get(), RankDirName(f.rank), true));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(jd.get()));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(jobs_fd_));
  CKPT_ASSIGN_OR_RETURN(UniqueFd qj, fs_->OpenSubdir(quarantine_fd, f.job, false));
  CKPT_ASSIGN_OR_RETURN(UniqueFd qr, fs_->OpenSubdir(qj.get(), RankDirName(f.rank), false));
  absl::Status moved = fs_->MoveNoReplace(qr.get(), f.entry, rd.get(), f.name);
  if (absl::IsAlreadyExists(moved)) {
    report_->skipped.push_back(where + ": a file of that name is in the rank directory");
    return false;
  }
  CKPT_RETURN_IF_ERROR(moved);
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(rd.get()));
  CKPT_RETURN_IF_ERROR(fs_->SyncDir(qr.get()));
  ++report_->files_unquarantined;
  return true;
}

absl::Status Repair::RestoreRanks(const RepairOptions& options) {
  std::map<std::string, uint32_t> world;
  for (const auto& [jr, layers] : newest_) {
    world[jr.first] = std::max(world[jr.first], jr.second + 1);
  }
  for (const auto& [jr, layers] : newest_) {
    const auto& [job, rank] = jr;
    CKPT_ASSIGN_OR_RETURN(auto job_rec, index_->GetJob(job));
    if (!job_rec.has_value()) {
      store::JobRecord rec;
      rec.set_owner_uid(options.owner_uid);
      rec.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
      CKPT_RETURN_IF_ERROR(index_->PutJob(job, rec));
      ++report_->jobs_added;
    }
    CKPT_ASSIGN_OR_RETURN(auto rank_rec, index_->GetRank(job, rank));
    if (!rank_rec.has_value()) {
      CKPT_RETURN_IF_ERROR(index_->PutRank(job, rank, SynthesizeRank(layers, world[job])));
      ++report_->ranks_added;
    }
    CKPT_RETURN_IF_ERROR(SynthesizeEvents(job, rank));
  }
  return absl::OkStatus();
}

absl::Status Repair::SynthesizeEvents(const std::string& job, uint32_t rank) {
  CKPT_ASSIGN_OR_RETURN(auto last_event, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  const uint64_t after = last_event.has_value() ? last_event->first : 0;
  std::map<uint64_t, store::EventRecord> events;
  CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
      job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
        if (k.step > after || (!last_event.has_value() && k.step == 0)) {
          store::EventRecord& ev = events[k.step];
          ev.add_layers(k.layer);
          ev.set_bytes(ev.bytes() + rec.payload_bytes());
          ev.set_unix_ms(std::max(ev.unix_ms(), rec.committed_unix_ms()));
        }
        return true;
      }));
  if (events.empty()) return absl::OkStatus();
  std::vector<std::pair<uint64_t, store::EventRecord>> batch(events.begin(), events.end());
  for (auto& [step, ev] : batch) {
    std::sort(ev.mutable_layers()->begin(), ev.mutable_layers()->end());
  }
  CKPT_RETURN_IF_ERROR(index_->PutEvents(job, rank, batch));
  report_->events_added += batch.size();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RepairReport> RepairDataDir(const std::string& data_dir, FileSystem* fs,
                                           const RepairOptions& options) {
  RepairReport report;
  struct stat st;
  if (::stat((data_dir + "/jobs").c_str(), &st) != 0 &&
      ::stat((data_dir + "/index").c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(data_dir, " holds neither jobs/ nor index/"));
  }
  CKPT_ASSIGN_OR_RETURN(UniqueFd data_fd, fs->MakeDirs(data_dir));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<Index> index,
                        OpenOrRebuild(data_dir, data_fd.get(), fs, &report));
  CKPT_ASSIGN_OR_RETURN(UniqueFd jobs_fd, fs->OpenSubdir(data_fd.get(), "jobs", true));
  Repair repair(data_dir, fs, index.get(), jobs_fd.get(), &report);

  // 1. Scan: rank directories first, so a file in both places counts where
  //    the index expects it.
  CKPT_RETURN_IF_ERROR(repair.Scan(jobs_fd.get(), "jobs", /*quarantine=*/false));
  absl::StatusOr<UniqueFd> q_fd =
      fs->OpenSubdir(data_fd.get(), LayerStore::kQuarantineDir, /*create=*/false);
  if (q_fd.ok()) {
    CKPT_RETURN_IF_ERROR(repair.Scan(q_fd->get(), LayerStore::kQuarantineDir, /*quarantine=*/true));
  } else if (!absl::IsNotFound(q_fd.status())) {
    return q_fd.status();
  }
  // 2. Records: keep what the index names intact, add the rest.
  CKPT_RETURN_IF_ERROR(repair.PlaceRecords(q_fd.ok() ? q_fd->get() : -1));
  // 3. Jobs, ranks, events and the generation counter.
  CKPT_RETURN_IF_ERROR(repair.RestoreRanks(options));
  if (repair.max_generation() > 0) {
    CKPT_RETURN_IF_ERROR(index->RaiseGeneration(repair.max_generation()));
  }
  for (const std::string& s : report.skipped) CKPT_LOG(WARNING) << "repair: left in place: " << s;
  return report;
}

}  // namespace ckpt
