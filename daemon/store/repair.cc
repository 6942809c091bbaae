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
  std::string name;        // canonical name (quarantine suffix stripped)
  std::string entry;       // name in its directory
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
  std::unique_ptr<IoBackend> io = MakePwriteBackend();

  // 1. Scan: rank directories first, so a file in both places counts where
  //    the index expects it.
  std::vector<Found> found;
  auto scan = [&](int root_fd, const std::string& root_name, bool quarantine) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto rank_dirs, ListRankDirs(fs, root_fd));
    for (const auto& [job, rank] : rank_dirs) {
      const std::string dir_path = absl::StrCat(data_dir, "/", root_name, "/", job, "/",
                                                RankDirName(rank));
      CKPT_ASSIGN_OR_RETURN(UniqueFd jd, fs->OpenSubdir(root_fd, job, false));
      CKPT_ASSIGN_OR_RETURN(UniqueFd rd, fs->OpenSubdir(jd.get(), RankDirName(rank), false));
      std::vector<bool> is_dir;
      CKPT_ASSIGN_OR_RETURN(std::vector<std::string> entries, fs->List(rd.get(), &is_dir));
      std::sort(entries.begin(), entries.end());
      for (const std::string& entry : entries) {
        std::optional<std::string> name = CanonicalName(entry, quarantine);
        if (!name.has_value()) continue;
        ++report.files_checked;
        absl::StatusOr<Found> f = ReadAndCheck(fs, io.get(), rd.get(), job, rank, entry, *name);
        if (!f.ok()) {
          report.skipped.push_back(absl::StrCat(dir_path, "/", entry, ": ", f.status().ToString()));
          continue;
        }
        f->quarantined = quarantine;
        found.push_back(std::move(f).value());
      }
    }
    return absl::OkStatus();
  };
  CKPT_RETURN_IF_ERROR(scan(jobs_fd.get(), "jobs", false));
  absl::StatusOr<UniqueFd> q_fd =
      fs->OpenSubdir(data_fd.get(), LayerStore::kQuarantineDir, /*create=*/false);
  if (q_fd.ok()) {
    CKPT_RETURN_IF_ERROR(scan(q_fd->get(), LayerStore::kQuarantineDir, true));
  } else if (!absl::IsNotFound(q_fd.status())) {
    return q_fd.status();
  }

  // 2. Records: keep what the index names intact, add the rest.
  std::map<std::pair<std::string, uint32_t>, std::map<uint32_t, const store::LayerFileHeader*>>
      newest;  // (job, rank) -> layer -> newest header
  std::set<std::string> placed;  // job/rank-dir/name already in the index
  uint64_t max_generation = 0;
  for (const Found& f : found) {
    const VersionKey key{f.job, f.rank, f.header.layer(), f.header.step()};
    const std::string id = absl::StrCat(f.job, "/", RankDirName(f.rank), "/", f.name);
    const std::string where = absl::StrCat(data_dir, "/",
                                           f.quarantined ? LayerStore::kQuarantineDir : "jobs",
                                           "/", f.job, "/", RankDirName(f.rank), "/", f.entry);
    CKPT_ASSIGN_OR_RETURN(auto existing,
                          index->VersionAtOrBefore(f.job, f.rank, key.layer, key.step));
    const bool has_record = existing.has_value() && existing->first == key.step;
    // The file the record names, verified and matching it, in the rank dir.
    bool record_intact = false;
    for (const Found& g : found) {
      record_intact |= has_record && !g.quarantined && g.job == f.job && g.rank == f.rank &&
                       g.name == existing->second.file() &&
                       g.record.header_xxh3() == existing->second.header_xxh3();
    }
    if (record_intact && !f.quarantined && existing->second.file() == f.name) {
      ++report.records_kept;
      placed.insert(id);
    } else if (placed.count(id) != 0) {
      report.skipped.push_back(where + ": its version is already in the index");
      continue;
    } else if (record_intact) {
      report.skipped.push_back(where + ": the index names another intact file for its version");
      continue;
    } else {
      if (f.quarantined) {
        // Back into the rank directory (created when missing), then durable.
        CKPT_ASSIGN_OR_RETURN(UniqueFd jd, fs->OpenSubdir(jobs_fd.get(), f.job, true));
        CKPT_ASSIGN_OR_RETURN(UniqueFd rd, fs->OpenSubdir(jd.get(), RankDirName(f.rank), true));
        CKPT_RETURN_IF_ERROR(fs->SyncDir(jd.get()));
        CKPT_RETURN_IF_ERROR(fs->SyncDir(jobs_fd.get()));
        CKPT_ASSIGN_OR_RETURN(UniqueFd qj, fs->OpenSubdir(q_fd->get(), f.job, false));
        CKPT_ASSIGN_OR_RETURN(UniqueFd qr, fs->OpenSubdir(qj.get(), RankDirName(f.rank), false));
        absl::Status moved = fs->MoveNoReplace(qr.get(), f.entry, rd.get(), f.name);
        if (absl::IsAlreadyExists(moved)) {
          report.skipped.push_back(where + ": a file of that name is in the rank directory");
          continue;
        }
        CKPT_RETURN_IF_ERROR(moved);
        CKPT_RETURN_IF_ERROR(fs->SyncDir(rd.get()));
        CKPT_RETURN_IF_ERROR(fs->SyncDir(qr.get()));
        ++report.files_unquarantined;
      }
      CKPT_RETURN_IF_ERROR(index->PutVersion(key, f.record));
      ++report.records_added;
      placed.insert(id);
    }
    max_generation = std::max(max_generation, f.header.generation());
    auto& layers = newest[{f.job, f.rank}];
    const store::LayerFileHeader*& slot = layers[key.layer];
    if (slot == nullptr || slot->step() < key.step) slot = &f.header;
  }

  // 3. Jobs, ranks, events and the generation counter.
  std::map<std::string, uint32_t> world;
  for (const auto& [jr, layers] : newest) world[jr.first] = std::max(world[jr.first], jr.second + 1);
  for (const auto& [jr, layers] : newest) {
    const auto& [job, rank] = jr;
    CKPT_ASSIGN_OR_RETURN(auto job_rec, index->GetJob(job));
    if (!job_rec.has_value()) {
      store::JobRecord rec;
      rec.set_owner_uid(options.owner_uid);
      rec.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
      CKPT_RETURN_IF_ERROR(index->PutJob(job, rec));
      ++report.jobs_added;
    }
    CKPT_ASSIGN_OR_RETURN(auto rank_rec, index->GetRank(job, rank));
    if (!rank_rec.has_value()) {
      CKPT_RETURN_IF_ERROR(index->PutRank(job, rank, SynthesizeRank(layers, world[job])));
      ++report.ranks_added;
    }
    // Steps after the newest surviving event that have versions.
    CKPT_ASSIGN_OR_RETURN(auto last_event, index->EventAtOrBefore(job, rank, ~uint64_t{0}));
    const uint64_t after = last_event.has_value() ? last_event->first : 0;
    std::map<uint64_t, store::EventRecord> events;
    CKPT_RETURN_IF_ERROR(index->ForEachVersion(
        job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
          if (k.step > after || (!last_event.has_value() && k.step == 0)) {
            store::EventRecord& ev = events[k.step];
            ev.add_layers(k.layer);
            ev.set_bytes(ev.bytes() + rec.payload_bytes());
            ev.set_unix_ms(std::max(ev.unix_ms(), rec.committed_unix_ms()));
          }
          return true;
        }));
    if (!events.empty()) {
      std::vector<std::pair<uint64_t, store::EventRecord>> batch(events.begin(), events.end());
      for (auto& [step, ev] : batch) std::sort(ev.mutable_layers()->begin(), ev.mutable_layers()->end());
      CKPT_RETURN_IF_ERROR(index->PutEvents(job, rank, batch));
      report.events_added += batch.size();
    }
  }
  if (max_generation > 0) CKPT_RETURN_IF_ERROR(index->RaiseGeneration(max_generation));
  for (const std::string& s : report.skipped) CKPT_LOG(WARNING) << "repair: left in place: " << s;
  return report;
}

}  // namespace ckpt
