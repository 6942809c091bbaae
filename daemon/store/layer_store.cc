#include "daemon/store/layer_store.h"

#include <sys/mman.h>
#include <sys/random.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/common/kill_point.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/validate.h"

namespace ckpt {

static_assert(kChunkAlignment % kDirectAlignment == 0,
              "staging chunks are written with O_DIRECT");

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

namespace {

// The I/O segments of [begin, end) of a lease's image, one per chunk piece
// (4096-aligned wherever begin and end are).
std::vector<IoSegment> LeaseSegments(const StagingLease& lease, uint64_t begin, uint64_t end) {
  std::vector<IoSegment> segments;
  const uint64_t chunk = lease.chunk_bytes();
  for (uint64_t off = begin; off < end;) {
    const uint64_t in = off % chunk;
    const uint64_t n = std::min(chunk - in, end - off);
    segments.push_back(IoSegment{lease.chunk(off / chunk) + in, n, off});
    off += n;
  }
  return segments;
}

// `s` with `path` in front of its message (same code), so a start-up
// failure names where in the data directory it happened.
absl::Status AtPath(const absl::Status& s, const std::string& path) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

}  // namespace

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
  if (fs_->RemoveDir(jobs_dir_.get(), job).ok()) CKPT_RETURN_IF_ERROR(fs_->SyncDir(jobs_dir_.get()));
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
  CKPT_ASSIGN_OR_RETURN(UniqueFd rank_dir, fs_->OpenSubdir(job_dir.get(), RankDirName(rank), create));
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

namespace {

// A failed commit step's status, tagged with what failed (metric labels,
// logs); a full file system is a full disk whatever step met it.
absl::Status CommitFailure(absl::Status s, ErrorReason reason) {
  if (absl::IsResourceExhausted(s)) reason = ErrorReason::kDiskFull;
  return WithReason(std::move(s), reason);
}

}  // namespace

void LayerStore::DropTemp(int dir, UniqueFd* fd, const std::string& tmp_name) {
  IgnoreError(fd->Close(), "the version already failed");
  IgnoreError(fs_->Unlink(dir, tmp_name), "a leftover temp file is removed at the next start");
}

absl::StatusOr<store::VersionRecord> LayerStore::Commit(StagedVersion* v, IoBackend* io,
                                                        CommitTimings* timings) {
  std::vector<WrittenVersion> group;
  CKPT_ASSIGN_OR_RETURN(WrittenVersion w, Write(v, io));
  group.push_back(std::move(w));
  std::vector<absl::StatusOr<store::VersionRecord>> rec = Publish(&group);
  if (timings != nullptr) *timings = group[0].timings;
  return std::move(rec[0]);
}

absl::StatusOr<WrittenVersion> LayerStore::Write(StagedVersion* v, IoBackend* io) {
  WrittenVersion w;
  w.key = v->key;
  w.start = absl::Now();
  CKPT_ASSIGN_OR_RETURN(w.dir, RankDir(v->key.job, v->key.rank, /*create=*/true));
  const int dir = w.dir->get();

  // The payload's padding is final before a byte of it is written; its
  // checksums go into the header, written last (below).
  LeaseImage image(v->lease);
  ZeroPayloadGaps(v->header, v->layout, &image);

  uint64_t nonce = 0;
  if (::getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) nonce = absl::ToUnixNanos(absl::Now());
  const std::string final_name = FileName(v->key, v->generation);
  w.tmp_name = absl::StrFormat("tmp.%s.%016x", final_name, nonce);

  bool direct_used = false;
  CKPT_ASSIGN_OR_RETURN(w.fd, fs_->CreateExclusive(dir, w.tmp_name, use_direct_io_, &direct_used));
  auto fail = [&](absl::Status s, ErrorReason reason = ErrorReason::kWrite) {
    DropTemp(dir, &w.fd, w.tmp_name);
    return CommitFailure(std::move(s), reason);
  };
  if (absl::Status s = fs_->Allocate(w.fd.get(), v->layout.file_bytes); !s.ok()) return fail(s);
  CKPT_KILL_POINT("commit.before_write");

  // Checksums come from the staged bytes: exactly what is written. They are
  // computed while the payload is on its way to the disk (reading the bytes
  // the kernel is writing), so the disk does not wait for the CPU; the
  // header that holds them follows. Before, hashing came first and took
  // about 14 % of a commit's time on the development VM.
  const absl::Time write_start = absl::Now();
  absl::StatusOr<uint64_t> body_hash = absl::UnknownError("not encoded");
  auto hash = [&] {
    const absl::Time hash_start = absl::Now();
    for (store::TensorEntry& t : *v->header.mutable_tensors()) {
      t.set_xxh3(HashImage(image, v->layout.header_bytes + t.offset(), t.nbytes()));
    }
    v->header.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
    body_hash = EncodeHeaderRegion(v->header, v->layout, &image);
    w.timings.hash_seconds = absl::ToDoubleSeconds(absl::Now() - hash_start);
  };
  io->Submit(IoDirection::kWrite, w.fd.get(),
             LeaseSegments(v->lease, v->layout.header_bytes, v->layout.file_bytes));
  hash();
  if (absl::Status s = io->Wait(); !s.ok()) return fail(s);
  if (!body_hash.ok()) return fail(body_hash.status());
  if (absl::Status s = io->WriteAll(w.fd.get(), LeaseSegments(v->lease, 0, v->layout.header_bytes));
      !s.ok()) {
    return fail(s);
  }
  const absl::Time sync_start = absl::Now();
  w.timings.write_seconds = absl::ToDoubleSeconds(sync_start - write_start);
  CKPT_KILL_POINT("commit.after_write");
  // A failed fdatasync is final for this data: fail the version, never retry.
  if (absl::Status s = fs_->DataSync(w.fd.get()); !s.ok()) return fail(s, ErrorReason::kFsync);
  w.timings.sync_seconds = absl::ToDoubleSeconds(absl::Now() - sync_start);
  CKPT_KILL_POINT("commit.after_datasync");

  store::VersionRecord& rec = w.record;
  rec.set_file(final_name);
  rec.set_file_bytes(v->layout.file_bytes);
  rec.set_payload_bytes(v->layout.payload_bytes);
  rec.set_header_xxh3(*body_hash);
  rec.set_generation(v->generation);
  *rec.mutable_group_steps() = v->header.group_steps();
  return w;
}

std::vector<absl::StatusOr<store::VersionRecord>> LayerStore::Publish(
    std::vector<WrittenVersion>* group) {
  std::vector<absl::StatusOr<store::VersionRecord>> out;
  out.reserve(group->size());
  // Each version's data is durable (Write): its file gets its final name.
  for (WrittenVersion& w : *group) {
    const int dir = w.dir->get();
    auto fail = [&](absl::Status s) {
      DropTemp(dir, &w.fd, w.tmp_name);
      out.push_back(CommitFailure(std::move(s), ErrorReason::kWrite));
    };
    if (absl::Status s = w.fd.Close(); !s.ok()) {
      fail(s);
      continue;
    }
    if (absl::Status s = fs_->RenameNoReplace(dir, w.tmp_name, w.record.file()); !s.ok()) {
      fail(s);
      continue;
    }
    CKPT_KILL_POINT("commit.after_rename");
    out.push_back(w.record);
  }
  auto fail_renamed = [&](size_t i, const absl::Status& s, ErrorReason reason) {
    const WrittenVersion& w = (*group)[i];
    IgnoreError(fs_->Unlink(w.dir->get(), w.record.file()),
                "an orphan file is removed at the next start");
    out[i] = CommitFailure(s, reason);
  };
  // Then the names are durable: one fsync per rank directory of the group.
  std::map<int, absl::Status> dir_synced;
  for (size_t i = 0; i < group->size(); ++i) {
    if (!out[i].ok()) continue;
    auto [it, first] = dir_synced.try_emplace((*group)[i].dir->get());
    if (first) {
      it->second = fs_->SyncDir(it->first);
      CKPT_KILL_POINT("commit.after_dirsync");
    }
    if (!it->second.ok()) fail_renamed(i, it->second, ErrorReason::kFsync);
  }
  // Then the records, in one synchronous batch: the versions are visible.
  std::vector<VersionKey> keys;
  std::vector<store::VersionRecord> records;
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (size_t i = 0; i < group->size(); ++i) {
    if (!out[i].ok()) continue;
    out[i]->set_committed_unix_ms(now_ms);
    keys.push_back((*group)[i].key);
    records.push_back(*out[i]);
  }
  if (!keys.empty()) {
    if (absl::Status s = index_->PutVersions(keys, records); !s.ok()) {
      for (size_t i = 0; i < group->size(); ++i) {
        if (out[i].ok()) fail_renamed(i, s, ErrorReason::kIndex);
      }
    } else {
      CKPT_KILL_POINT("commit.after_index");
    }
  }
  const absl::Time end = absl::Now();
  for (WrittenVersion& w : *group) w.timings.total_seconds = absl::ToDoubleSeconds(end - w.start);
  return out;
}

absl::StatusOr<LoadedVersion> LayerStore::Read(const VersionKey& key,
                                               const store::VersionRecord& rec, IoBackend* io,
                                               StagingPool* pool, absl::Time deadline) {
  LoadedVersion out;
  CKPT_ASSIGN_OR_RETURN(out.lease, pool->Acquire(rec.file_bytes(), deadline));
  CKPT_RETURN_IF_ERROR(ReadUnchecked(key, rec, io, out.lease));
  CKPT_ASSIGN_OR_RETURN(out.decoded, CheckImage(key, rec, LeaseImage(out.lease)));
  return out;
}

absl::Status LayerStore::ReadUnchecked(const VersionKey& key, const store::VersionRecord& rec,
                                       IoBackend* io, const StagingLease& lease) {
  CKPT_ASSIGN_OR_RETURN(VersionRead read, PrepareRead(key, rec, lease));
  return io->ReadAll(read.fd.get(), read.segments);
}

absl::StatusOr<VersionRead> LayerStore::PrepareRead(const VersionKey& key,
                                                    const store::VersionRecord& rec,
                                                    const StagingLease& lease) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  bool direct_used = false;
  absl::StatusOr<UniqueFd> fd = fs_->OpenForRead(dir, rec.file(), use_direct_io_, &direct_used);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) {
      return absl::DataLossError(absl::StrCat("file ", rec.file(), " of a committed version is missing"));
    }
    return fd.status();
  }
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(fd->get()));
  if (size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", size, " bytes; the index says ",
                                            rec.file_bytes()));
  }
  if (lease.capacity() < size) {
    return absl::InvalidArgumentError(absl::StrCat("a lease of ", lease.capacity(),
                                                   " bytes cannot hold ", rec.file(), " (", size, ")"));
  }
  return VersionRead{*std::move(fd), LeaseSegments(lease, 0, size)};
}

absl::StatusOr<DecodedHeader> CheckImageHeader(const VersionKey& key,
                                               const store::VersionRecord& rec,
                                               const ByteImage& image) {
  CKPT_ASSIGN_OR_RETURN(DecodedHeader decoded, DecodeHeader(image, rec.file_bytes()));
  const store::LayerFileHeader& h = decoded.header;
  if (decoded.body_xxh3 != rec.header_xxh3() || h.job_id() != key.job || h.rank() != key.rank ||
      h.layer() != key.layer || h.step() != key.step) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " does not match its index record"));
  }
  return decoded;
}

absl::StatusOr<DecodedHeader> CheckImage(const VersionKey& key, const store::VersionRecord& rec,
                                         const ByteImage& image) {
  CKPT_ASSIGN_OR_RETURN(DecodedHeader decoded, CheckImageHeader(key, rec, image));
  CKPT_RETURN_IF_ERROR(VerifyPayload(decoded, image));
  return decoded;
}

absl::StatusOr<UniqueFd> LayerStore::OpenCommitted(const VersionKey& key,
                                                   const store::VersionRecord& rec) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  bool direct_used = false;
  absl::StatusOr<UniqueFd> fd = fs_->OpenForRead(dir, rec.file(), /*direct=*/false, &direct_used);
  if (absl::IsNotFound(fd.status())) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " of a committed version is missing"));
  }
  if (!fd.ok()) return fd.status();
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(fd->get()));
  if (size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", size,
                                            " bytes; the index says ", rec.file_bytes()));
  }
  return fd;
}

namespace {

// A file mapped read-only, as a ByteImage for the format's checks.
class MappedFile final : public ByteImage {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Map(int fd, uint64_t size) {
    if (size == 0) return absl::DataLossError("empty file");
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap");
    return std::unique_ptr<MappedFile>(new MappedFile(static_cast<char*>(p), size));
  }
  ~MappedFile() override { munmap(data_, size_); }
  uint64_t size() const override { return size_; }
  void ForEachPiece(uint64_t offset, uint64_t len,
                    const std::function<void(char*, uint64_t)>& fn) const override {
    if (len > 0) fn(data_ + offset, len);
  }

 private:
  MappedFile(char* data, uint64_t size) : data_(data), size_(size) {}
  char* const data_;
  const uint64_t size_;
};

}  // namespace

absl::Status LayerStore::Adopt(const VersionKey& key, const store::VersionRecord& rec,
                               const std::function<absl::StatusOr<uint64_t>(int fd)>& fill) {
  uint32_t layer = 0;
  uint64_t step = 0;
  if (!ParseFileName(rec.file(), &layer, &step) || layer != key.layer || step != key.step) {
    return absl::DataLossError(absl::StrCat("version file name \"", rec.file(),
                                            "\" does not name layer ", key.layer, " step ", key.step));
  }
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/true));
  const int dir = dir_ref->get();
  uint64_t nonce = 0;
  if (::getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) nonce = absl::ToUnixNanos(absl::Now());
  const std::string tmp_name = absl::StrFormat("tmp.%s.%016x", rec.file(), nonce);
  bool direct_used = false;
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->CreateExclusive(dir, tmp_name, /*direct=*/false, &direct_used));
  auto fail = [&](absl::Status s) {
    DropTemp(dir, &fd, tmp_name);
    return s;
  };
  if (absl::Status s = fs_->Allocate(fd.get(), rec.file_bytes()); !s.ok()) return fail(s);
  absl::StatusOr<uint64_t> wrote = fill(fd.get());
  if (!wrote.ok()) return fail(wrote.status());
  if (*wrote != rec.file_bytes()) {
    return fail(absl::DataLossError(absl::StrCat("version ", rec.file(), " arrived with ", *wrote,
                                                 " bytes; its record says ", rec.file_bytes())));
  }
  if (absl::Status s = fs_->DataSync(fd.get()); !s.ok()) return fail(s);
  {
    // Checked through a read-only descriptor (the temp file is write-only).
    bool direct = false;
    absl::StatusOr<UniqueFd> rd = fs_->OpenForRead(dir, tmp_name, /*direct=*/false, &direct);
    if (!rd.ok()) return fail(rd.status());
    absl::StatusOr<std::unique_ptr<MappedFile>> image = MappedFile::Map(rd->get(), rec.file_bytes());
    if (!image.ok()) return fail(image.status());
    if (absl::StatusOr<DecodedHeader> d = CheckImage(key, rec, **image); !d.ok()) {
      return fail(d.status());
    }
  }
  if (absl::Status s = fd.Close(); !s.ok()) return fail(s);
  if (absl::Status s = fs_->RenameNoReplace(dir, tmp_name, rec.file()); !s.ok()) return fail(s);
  auto fail_renamed = [&](absl::Status s) {
    IgnoreError(fs_->Unlink(dir, rec.file()), "an orphan file is quarantined at the next start");
    return s;
  };
  if (absl::Status s = fs_->SyncDir(dir); !s.ok()) return fail_renamed(s);
  if (absl::Status s = index_->PutVersion(key, rec); !s.ok()) return fail_renamed(s);
  return absl::OkStatus();
}

absl::Status LayerStore::CheckFile(const VersionKey& key, const store::VersionRecord& rec) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  absl::StatusOr<uint64_t> size = fs_->FileSizeAt(dir, rec.file());
  if (!size.ok()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), ": ", size.status().message()));
  }
  if (*size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", *size,
                                            " bytes; the index says ", rec.file_bytes()));
  }
  return absl::OkStatus();
}

absl::Status LayerStore::Remove(const VersionKey& key, const store::VersionRecord& rec) {
  CKPT_RETURN_IF_ERROR(index_->DeleteVersion(key));
  absl::StatusOr<DirRef> dir = RankDir(key.job, key.rank, /*create=*/false);
  if (!dir.ok()) return absl::IsNotFound(dir.status()) ? absl::OkStatus() : dir.status();
  absl::Status s = fs_->Unlink((*dir)->get(), rec.file());
  if (!s.ok() && !absl::IsNotFound(s)) return s;
  return fs_->SyncDir((*dir)->get());
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
  std::vector<bool> is_dir;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> job_dirs, fs_->List(jobs_dir_.get(), &is_dir));
  for (size_t i = 0; i < job_dirs.size(); ++i) {
    if (!is_dir[i] || !ValidateJobId(job_dirs[i]).ok()) {
      CKPT_LOG(WARNING) << "reconcile: ignoring unexpected entry jobs/" << job_dirs[i];
      continue;
    }
    const std::string job_path = absl::StrCat(data_dir_, "/jobs/", job_dirs[i]);
    absl::StatusOr<UniqueFd> jd = fs_->OpenSubdir(jobs_dir_.get(), job_dirs[i], false);
    if (!jd.ok()) return AtPath(jd.status(), job_path);
    std::vector<bool> rank_is_dir;
    absl::StatusOr<std::vector<std::string>> rank_dirs = fs_->List(jd->get(), &rank_is_dir);
    if (!rank_dirs.ok()) return AtPath(rank_dirs.status(), job_path);
    for (size_t j = 0; j < rank_dirs->size(); ++j) {
      uint32_t r;
      if (rank_is_dir[j] && ParseRankDirName((*rank_dirs)[j], &r)) ranks.emplace(job_dirs[i], r);
    }
  }
  for (const auto& [job, rank] : ranks) {
    absl::StatusOr<DirRef> dir = RankDir(job, rank, /*create=*/true);
    if (!dir.ok()) return AtPath(dir.status(), RankDirPath(job, rank));
    CKPT_RETURN_IF_ERROR(ReconcileRank(job, rank, (*dir)->get(), check, &report));
    // Start-up visits every rank ever written; only the ranks that write
    // again keep a descriptor.
    ForgetRankDir(job, rank);
  }
  return report;
}

absl::Status LayerStore::ReconcileRank(const std::string& job, uint32_t rank, int dir,
                                       ReconcileCheck check, ReconcileReport* report) {
  CKPT_ASSIGN_OR_RETURN(auto last_event, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  const uint64_t last_step = last_event.has_value() ? last_event->first : 0;
  // After a clean stop a recorded file is looked up by name in the listing
  // (which the file side below uses too: one listing, no stat).
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
                    << ") but the file is missing or has the wrong size; dropping the record so "
                       "plans fall back to the previous version";
    CKPT_RETURN_IF_ERROR(Remove(k, rec));
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
                                    const std::string& name, const char* why) {
  const std::string qpath = absl::StrCat(data_dir_, "/", kQuarantineDir, "/", job, "/",
                                         RankDirName(rank));
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
  CKPT_LOG(WARNING) << "reconcile: quarantined " << RankDirPath(job, rank) << "/" << name
                    << " -> " << qpath << "/" << target << " (" << why
                    << "); `ckptctl repair` restores it to the index";
  return absl::OkStatus();
}

}  // namespace ckpt
