#include "tests/lib/fault_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace testing {
namespace {

uint64_t AlignDown(uint64_t v) { return v / kSectorBytes * kSectorBytes; }

std::string FdPath(int fd) {
  char link[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  char buf[PATH_MAX + 1];
  ssize_t n = ::readlink(link, buf, PATH_MAX);
  if (n < 0) return "";
  return std::string(buf, static_cast<size_t>(n));
}

std::string Join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string Dirname(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string Basename(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool PwriteAll(int fd, const char* p, uint64_t len, uint64_t off) {
  while (len > 0) {
    ssize_t n = ::pwrite(fd, p, len, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    len -= static_cast<uint64_t>(n);
    off += static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace

const char* FaultClassName(FaultClass c) {
  switch (c) {
    case FaultClass::kWrite:
      return "write";
    case FaultClass::kSync:
      return "fdatasync";
    case FaultClass::kDirSync:
      return "dir fsync";
    case FaultClass::kRename:
      return "rename";
    case FaultClass::kRead:
      return "read";
    case FaultClass::kAllocate:
      return "fallocate";
    case FaultClass::kCreate:
      return "create";
    case FaultClass::kUnlink:
      return "unlink";
    case FaultClass::kNumClasses:
      break;
  }
  return "?";
}

const char* CrashDataName(CrashPolicy::Data d) {
  switch (d) {
    case CrashPolicy::Data::kDropAll:
      return "drop-all-unsynced";
    case CrashPolicy::Data::kKeepAll:
      return "keep-all-unsynced";
    case CrashPolicy::Data::kRandom:
      return "drop-random-sectors";
  }
  return "?";
}

const char* CrashDirsName(CrashPolicy::Dirs d) {
  switch (d) {
    case CrashPolicy::Dirs::kForgetAll:
      return "forget-all-unsynced-entries";
    case CrashPolicy::Dirs::kKeepAll:
      return "keep-all-entries";
    case CrashPolicy::Dirs::kRandomPrefix:
      return "keep-random-prefix";
  }
  return "?";
}

// ---- FaultFileSystem ----

FaultFileSystem::FaultFileSystem(FileSystem* base, std::string graveyard_dir, uint64_t seed)
    : base_(base),
      graveyard_(std::move(graveyard_dir)),
      rng_(seed),
      caller_rng_(seed ^ 0x5bd1e9955bd1e995ULL) {}

FaultFileSystem::~FaultFileSystem() {
  absl::MutexLock lock(&mu_);
  ResetLocked();
}

void FaultFileSystem::FailNth(FaultClass c, uint64_t n, int err) {
  absl::MutexLock lock(&mu_);
  Rule& r = rules_[static_cast<int>(c)];
  r.nth = n;
  r.nth_err = err;
}

void FaultFileSystem::FailOneIn(FaultClass c, uint64_t k, int err) {
  absl::MutexLock lock(&mu_);
  Rule& r = rules_[static_cast<int>(c)];
  r.one_in = k;
  r.odds_err = err;
}

void FaultFileSystem::SetShortWrites(bool on) {
  absl::MutexLock lock(&mu_);
  short_writes_ = on;
}

void FaultFileSystem::SetReadFault(ReadFault kind) {
  absl::MutexLock lock(&mu_);
  read_fault_ = kind;
}

void FaultFileSystem::ClearFaults() {
  absl::MutexLock lock(&mu_);
  for (Rule& r : rules_) r = Rule();
  short_writes_ = false;
  read_fault_ = ReadFault::kError;
}

uint64_t FaultFileSystem::injected(FaultClass c) const {
  absl::MutexLock lock(&mu_);
  return injected_[static_cast<int>(c)];
}

uint64_t FaultFileSystem::read_faults(ReadFault kind) const {
  absl::MutexLock lock(&mu_);
  int i = static_cast<int>(kind);
  return i < 3 ? read_faults_[i] : read_faults_[0] + read_faults_[1] + read_faults_[2];
}

void FaultFileSystem::CrashAfter(uint64_t n, TearMode tear, FaultClass only) {
  absl::MutexLock lock(&mu_);
  crash_countdown_ = n;
  tear_ = tear;
  crash_class_ = only;
}

void FaultFileSystem::FreezeNow() {
  absl::MutexLock lock(&mu_);
  frozen_ = true;
}

bool FaultFileSystem::frozen() const {
  absl::MutexLock lock(&mu_);
  return frozen_;
}

uint64_t FaultFileSystem::mutating_ops() const {
  absl::MutexLock lock(&mu_);
  return mutating_ops_;
}

uint64_t FaultFileSystem::unsynced_dir_ops() const {
  absl::MutexLock lock(&mu_);
  return dir_ops_.size();
}

uint64_t FaultFileSystem::unsynced_files() const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [key, f] : files_) {
    if (!f.unsynced.empty() || f.size_changed || f.poisoned) ++n;
  }
  return n;
}

uint64_t FaultFileSystem::sync_retries_after_failure() const {
  absl::MutexLock lock(&mu_);
  return sync_retries_;
}

void FaultFileSystem::ForgetUnsynced() {
  absl::MutexLock lock(&mu_);
  const bool frozen = frozen_;
  const uint64_t countdown = crash_countdown_;
  const FaultClass crash_class = crash_class_;
  ResetLocked();
  frozen_ = frozen;
  crash_countdown_ = countdown;
  crash_class_ = crash_class;
}

bool FaultFileSystem::Odds(uint64_t k) { return k <= 1 || rng_() % k == 0; }

absl::Status FaultFileSystem::FrozenError(const char* what) const {
  return ErrnoStatus(EIO, absl::StrCat(what, " (file system frozen by a simulated power loss)"));
}

absl::Status FaultFileSystem::Gate(FaultClass c, bool mutating, const char* what, bool* crashed) {
  if (frozen_) return FrozenError(what);
  if (mutating) {
    ++mutating_ops_;
    const bool counts = crash_class_ == FaultClass::kNumClasses || crash_class_ == c;
    if (counts && crash_countdown_ > 0 && --crash_countdown_ == 0) {
      frozen_ = true;
      if (crashed != nullptr) *crashed = true;
      return FrozenError(what);
    }
  }
  Rule& r = rules_[static_cast<int>(c)];
  int err = 0;
  if (r.nth > 0 && --r.nth == 0) {
    err = r.nth_err;
  } else if (r.one_in > 0 && Odds(r.one_in)) {
    err = r.odds_err;
  }
  if (err == 0) return absl::OkStatus();
  ++injected_[static_cast<int>(c)];
  return ErrnoStatus(err, absl::StrCat(what, " (injected fault)"));
}

absl::StatusOr<FaultFileSystem::Key> FaultFileSystem::KeyOfFd(int fd) const {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat");
  return Key(st.st_dev, st.st_ino);
}

absl::StatusOr<FaultFileSystem::Key> FaultFileSystem::KeyOfDirFd(int dir_fd) {
  CKPT_ASSIGN_OR_RETURN(Key key, KeyOfFd(dir_fd));
  if (dirs_.find(key) == dirs_.end()) dirs_[key] = FdPath(dir_fd);
  return key;
}

FaultFileSystem::FileState* FaultFileSystem::FileFor(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return nullptr;
  Key key(st.st_dev, st.st_ino);
  auto it = files_.find(key);
  if (it != files_.end()) return &it->second;
  // A file that predates the record: durable as it is now.
  FileState& f = files_[key];
  f.path = FdPath(fd);
  f.synced_size = static_cast<uint64_t>(st.st_size);
  return &f;
}

void FaultFileSystem::RecordWrite(int fd, uint64_t offset, uint64_t len) {
  FileState* f = FileFor(fd);
  if (f == nullptr || len == 0) return;
  // Keep the durable bytes a write overwrites, so a crash can restore them.
  if (offset < f->synced_size) {
    UniqueFd rfd(::open(FdPath(fd).c_str(), O_RDONLY | O_CLOEXEC));
    const uint64_t end = std::min(offset + len, f->synced_size);
    for (uint64_t s = AlignDown(offset); rfd.valid() && s < end; s += kSectorBytes) {
      if (f->old_bytes.count(s) != 0) continue;
      std::string old(std::min(kSectorBytes, f->synced_size - s), '\0');
      ssize_t n = ::pread(rfd.get(), old.data(), old.size(), static_cast<off_t>(s));
      if (n >= 0) {
        old.resize(static_cast<size_t>(n));
        f->old_bytes[s] = std::move(old);
      }
    }
  }
  f->unsynced.push_back(Extent{offset, len});
  if (offset + len > f->synced_size) f->size_changed = true;
}

uint64_t FaultFileSystem::WritePartial(int fd, const IoSegment& s, bool prefix, TornWrite* torn) {
  const uint64_t sectors = (s.len + kSectorBytes - 1) / kSectorBytes;
  std::vector<bool> write(sectors, false);
  if (prefix) {
    const uint64_t k = sectors == 0 ? 0 : rng_() % sectors;  // at least one sector missing
    for (uint64_t i = 0; i < k; ++i) write[i] = true;
  } else {
    for (uint64_t i = 0; i < sectors; ++i) write[i] = Odds(2);
  }
  uint64_t written = 0;
  for (uint64_t i = 0; i < sectors; ++i) {
    if (!write[i]) continue;
    const uint64_t off = i * kSectorBytes;
    const uint64_t len = std::min(kSectorBytes, s.len - off);
    RecordWrite(fd, s.offset + off, len);
    if (PwriteAll(fd, static_cast<const char*>(s.buf) + off, len, s.offset + off)) ++written;
  }
  if (torn != nullptr) {
    FileState* f = FileFor(fd);
    torn->path = f != nullptr ? f->path : FdPath(fd);
    torn->offset = s.offset;
    torn->len = s.len;
    torn->sectors_total = sectors;
    torn->sectors_written = written;
  }
  return written;
}

std::string FaultFileSystem::NewGravePath() {
  return Join(graveyard_, absl::StrCat("g", ++grave_seq_));
}

absl::StatusOr<UniqueFd> FaultFileSystem::MakeDirs(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("mkdir");
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    const std::string cur = path.substr(0, pos);
    if (cur.empty()) continue;
    struct stat st;
    if (::stat(cur.c_str(), &st) == 0) continue;
    CKPT_RETURN_IF_ERROR(Gate(FaultClass::kCreate, true, "mkdir"));
    const std::string parent = Dirname(cur);
    struct stat pst;
    if (::stat(parent.c_str(), &pst) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", parent));
    if (::mkdir(cur.c_str(), 0750) != 0) {
      if (errno == EEXIST) continue;
      return ErrnoStatus(errno, absl::StrCat("mkdir ", cur));
    }
    const Key pkey(pst.st_dev, pst.st_ino);
    if (dirs_.find(pkey) == dirs_.end()) dirs_[pkey] = parent;
    dir_ops_.push_back(DirOp{pkey, DirOpKind::kMkdir, Basename(cur), "", ""});
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("open dir ", path));
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> FaultFileSystem::OpenSubdir(int dir_fd, const std::string& name,
                                                     bool create) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("open dir");
  struct stat st;
  const bool missing =
      ::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT;
  if (!create || !missing) return base_->OpenSubdir(dir_fd, name, create);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kCreate, true, "mkdir"));
  CKPT_ASSIGN_OR_RETURN(Key key, KeyOfDirFd(dir_fd));
  absl::StatusOr<UniqueFd> fd = base_->OpenSubdir(dir_fd, name, true);
  if (fd.ok()) dir_ops_.push_back(DirOp{key, DirOpKind::kMkdir, name, "", ""});
  return fd;
}

absl::StatusOr<UniqueFd> FaultFileSystem::CreateExclusive(int dir_fd, const std::string& name,
                                                          bool direct, bool* direct_used) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kCreate, true, "create"));
  CKPT_ASSIGN_OR_RETURN(Key dkey, KeyOfDirFd(dir_fd));
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, base_->CreateExclusive(dir_fd, name, direct, direct_used));
  CKPT_ASSIGN_OR_RETURN(Key fkey, KeyOfFd(fd.get()));
  FileState f;
  f.path = Join(dirs_[dkey], name);
  files_[fkey] = std::move(f);  // replaces a stale entry of a reused inode
  dir_ops_.push_back(DirOp{dkey, DirOpKind::kCreate, name, "", ""});
  return fd;
}

absl::StatusOr<UniqueFd> FaultFileSystem::OpenForRead(int dir_fd, const std::string& name,
                                                      bool direct, bool* direct_used) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("open");
  return base_->OpenForRead(dir_fd, name, direct, direct_used);
}

absl::Status FaultFileSystem::Allocate(int fd, uint64_t len) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kAllocate, true, "fallocate"));
  FileState* f = FileFor(fd);
  CKPT_RETURN_IF_ERROR(base_->Allocate(fd, len));
  if (f != nullptr && len > f->synced_size) f->size_changed = true;
  return absl::OkStatus();
}

absl::Status FaultFileSystem::DataSync(int fd) {
  absl::MutexLock lock(&mu_);
  FileState* f = FileFor(fd);
  absl::Status gate = Gate(FaultClass::kSync, true, "fdatasync");
  if (!gate.ok()) {
    // An injected failure poisons the unsynced data (the page cache may have
    // dropped it); the crash point itself just never happened.
    if (!frozen_ && f != nullptr) f->poisoned = true;
    return gate;
  }
  if (f != nullptr && f->poisoned) {
    // Linux reports a writeback error once; the retry "succeeds" without
    // writing anything. Count the retry: the protocol must never do it.
    ++sync_retries_;
    return absl::OkStatus();
  }
  absl::Status s = base_->DataSync(fd);
  if (f == nullptr) return s;
  if (!s.ok()) {
    f->poisoned = true;
    return s;
  }
  struct stat st;
  if (::fstat(fd, &st) == 0) f->synced_size = static_cast<uint64_t>(st.st_size);
  f->unsynced.clear();
  f->old_bytes.clear();
  f->size_changed = false;
  return absl::OkStatus();
}

absl::Status FaultFileSystem::RenameNoReplace(int dir_fd, const std::string& from,
                                              const std::string& to) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kRename, true, "rename"));
  CKPT_ASSIGN_OR_RETURN(Key dkey, KeyOfDirFd(dir_fd));
  struct stat st;
  const bool have = ::fstatat(dir_fd, from.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  CKPT_RETURN_IF_ERROR(base_->RenameNoReplace(dir_fd, from, to));
  dir_ops_.push_back(DirOp{dkey, DirOpKind::kRename, from, to, ""});
  if (have) {
    auto it = files_.find(Key(st.st_dev, st.st_ino));
    if (it != files_.end()) it->second.path = Join(dirs_[dkey], to);
  }
  return absl::OkStatus();
}

// A move between directories is recorded against the source directory: until
// that directory is synced a crash image puts the entry back (a rename is one
// journal transaction, so the entry is never in both places or in neither).
absl::Status FaultFileSystem::MoveNoReplace(int from_dir, const std::string& from, int to_dir,
                                            const std::string& to) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kRename, true, "move"));
  CKPT_ASSIGN_OR_RETURN(Key from_key, KeyOfDirFd(from_dir));
  CKPT_ASSIGN_OR_RETURN(Key to_key, KeyOfDirFd(to_dir));
  struct stat st;
  const bool have = ::fstatat(from_dir, from.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  CKPT_RETURN_IF_ERROR(base_->MoveNoReplace(from_dir, from, to_dir, to));
  const std::string dest = Join(dirs_[to_key], to);
  dir_ops_.push_back(DirOp{from_key, DirOpKind::kMove, from, dest, ""});
  if (have) {
    auto it = files_.find(Key(st.st_dev, st.st_ino));
    if (it != files_.end()) it->second.path = dest;
  }
  return absl::OkStatus();
}

absl::Status FaultFileSystem::SyncDir(int dir_fd) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kDirSync, true, "fsync dir"));
  CKPT_ASSIGN_OR_RETURN(Key dkey, KeyOfDirFd(dir_fd));
  CKPT_RETURN_IF_ERROR(base_->SyncDir(dir_fd));
  std::vector<DirOp> rest;
  for (DirOp& op : dir_ops_) {
    if (!(op.dir == dkey)) {
      rest.push_back(std::move(op));
      continue;
    }
    if (op.kind == DirOpKind::kUnlink && !op.grave.empty()) {
      // The unlink is durable: the file is gone for good.
      struct stat st;
      if (::stat(op.grave.c_str(), &st) == 0) files_.erase(Key(st.st_dev, st.st_ino));
      ::unlink(op.grave.c_str());
    }
  }
  dir_ops_ = std::move(rest);
  return absl::OkStatus();
}

absl::Status FaultFileSystem::Unlink(int dir_fd, const std::string& name) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kUnlink, true, "unlink"));
  CKPT_ASSIGN_OR_RETURN(Key dkey, KeyOfDirFd(dir_fd));
  struct stat st;
  std::string grave;
  if (name.find('/') == std::string::npos &&
      ::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
    grave = NewGravePath();
    if (::linkat(dir_fd, name.c_str(), AT_FDCWD, grave.c_str(), 0) != 0) grave.clear();
  }
  absl::Status s = base_->Unlink(dir_fd, name);
  if (!s.ok()) {
    if (!grave.empty()) ::unlink(grave.c_str());
    return s;
  }
  dir_ops_.push_back(DirOp{dkey, DirOpKind::kUnlink, name, "", grave});
  if (!grave.empty()) {
    auto it = files_.find(Key(st.st_dev, st.st_ino));
    if (it != files_.end()) it->second.path = grave;
  }
  return absl::OkStatus();
}

absl::Status FaultFileSystem::RemoveDir(int dir_fd, const std::string& name) {
  absl::MutexLock lock(&mu_);
  CKPT_RETURN_IF_ERROR(Gate(FaultClass::kUnlink, true, "rmdir"));
  CKPT_ASSIGN_OR_RETURN(Key dkey, KeyOfDirFd(dir_fd));
  CKPT_RETURN_IF_ERROR(base_->RemoveDir(dir_fd, name));
  dir_ops_.push_back(DirOp{dkey, DirOpKind::kRmdir, name, "", ""});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FaultFileSystem::List(int dir_fd,
                                                               std::vector<bool>* is_dir) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("list");
  return base_->List(dir_fd, is_dir);
}

absl::StatusOr<uint64_t> FaultFileSystem::FileSize(int fd) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("fstat");
  return base_->FileSize(fd);
}

absl::StatusOr<uint64_t> FaultFileSystem::FileSizeAt(int dir_fd, const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("stat");
  return base_->FileSizeAt(dir_fd, name);
}

absl::StatusOr<uint64_t> FaultFileSystem::FreeBytes(int fd) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("statvfs");
  if (free_bytes_.has_value()) return *free_bytes_;
  return base_->FreeBytes(fd);
}

absl::StatusOr<uint64_t> FaultFileSystem::TotalBytes(int fd) {
  absl::MutexLock lock(&mu_);
  if (frozen_) return FrozenError("statvfs");
  if (total_bytes_.has_value()) return *total_bytes_;
  return base_->TotalBytes(fd);
}

void FaultFileSystem::SetFreeBytes(std::optional<uint64_t> free_bytes) {
  absl::MutexLock lock(&mu_);
  free_bytes_ = free_bytes;
}

void FaultFileSystem::SetTotalBytes(std::optional<uint64_t> total_bytes) {
  absl::MutexLock lock(&mu_);
  total_bytes_ = total_bytes;
}

// ---- crash images ----

void FaultFileSystem::RevertData(const CrashPolicy& policy, CrashReport* report) {
  for (auto& [key, f] : files_) {
    if (f.unsynced.empty() && !f.size_changed && !f.poisoned) continue;
    const CrashPolicy::Data mode = f.poisoned ? CrashPolicy::Data::kDropAll : policy.data;
    std::set<uint64_t> sectors;
    for (const Extent& e : f.unsynced) {
      for (uint64_t s = AlignDown(e.offset); s < e.offset + e.len; s += kSectorBytes)
        sectors.insert(s);
    }
    if (mode == CrashPolicy::Data::kKeepAll) {
      report->sectors_kept += sectors.size();
      continue;
    }
    UniqueFd fd(::open(f.path.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd.valid()) continue;
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) continue;
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    bool kept_beyond = false;
    const std::string zeros(kSectorBytes, '\0');
    for (uint64_t s : sectors) {
      if (mode == CrashPolicy::Data::kRandom && Odds(2)) {
        ++report->sectors_kept;
        if (s + kSectorBytes > f.synced_size) kept_beyond = true;
        continue;
      }
      ++report->sectors_dropped;
      if (s < f.synced_size) {
        auto old = f.old_bytes.find(s);
        if (old != f.old_bytes.end())
          PwriteAll(fd.get(), old->second.data(), old->second.size(), s);
      }
      const uint64_t zero_from = std::max(s, f.synced_size);
      const uint64_t zero_to = std::min(s + kSectorBytes, size);
      if (zero_from < zero_to) PwriteAll(fd.get(), zeros.data(), zero_to - zero_from, zero_from);
    }
    // The size: back to the synced one, unless kept data lies past it (then
    // the allocated size reached the disk with it).
    if (mode == CrashPolicy::Data::kDropAll || (!kept_beyond && Odds(2))) {
      if (size != f.synced_size && ::ftruncate(fd.get(), static_cast<off_t>(f.synced_size)) != 0) {
        continue;
      }
    }
    ++report->files_reverted;
  }
}

void FaultFileSystem::UndoDirOps(const CrashPolicy& policy, CrashReport* report) {
  std::map<Key, size_t> count;
  for (const DirOp& op : dir_ops_) ++count[op.dir];
  std::map<Key, size_t> keep;
  for (const auto& [dir, n] : count) {
    switch (policy.dirs) {
      case CrashPolicy::Dirs::kForgetAll:
        keep[dir] = 0;
        break;
      case CrashPolicy::Dirs::kKeepAll:
        keep[dir] = n;
        break;
      case CrashPolicy::Dirs::kRandomPrefix:
        keep[dir] = static_cast<size_t>(rng_() % (n + 1));
        break;
    }
  }
  std::vector<bool> undo(dir_ops_.size(), false);
  std::map<Key, size_t> seen;
  for (size_t i = 0; i < dir_ops_.size(); ++i)
    undo[i] = seen[dir_ops_[i].dir]++ >= keep[dir_ops_[i].dir];
  for (size_t j = dir_ops_.size(); j-- > 0;) {
    const DirOp& op = dir_ops_[j];
    if (!undo[j]) {
      ++report->dir_ops_kept;
      continue;
    }
    ++report->dir_ops_forgotten;
    const std::string& dir = dirs_[op.dir];
    switch (op.kind) {
      case DirOpKind::kCreate:
        ::unlink(Join(dir, op.name).c_str());
        break;
      case DirOpKind::kMkdir:
        RemoveTree(Join(dir, op.name));
        break;
      case DirOpKind::kRename:
        ::renameat2(AT_FDCWD, Join(dir, op.name2).c_str(), AT_FDCWD, Join(dir, op.name).c_str(),
                    RENAME_NOREPLACE);
        break;
      case DirOpKind::kMove:
        ::renameat2(AT_FDCWD, op.name2.c_str(), AT_FDCWD, Join(dir, op.name).c_str(),
                    RENAME_NOREPLACE);
        break;
      case DirOpKind::kUnlink:
        if (!op.grave.empty()) ::link(op.grave.c_str(), Join(dir, op.name).c_str());
        break;
      case DirOpKind::kRmdir:
        ::mkdir(Join(dir, op.name).c_str(), 0750);
        break;
    }
  }
}

void FaultFileSystem::ResetLocked() {
  files_.clear();
  dirs_.clear();
  dir_ops_.clear();
  torn_.clear();
  frozen_ = false;
  crash_countdown_ = 0;
  crash_class_ = FaultClass::kNumClasses;
  if (DIR* d = ::opendir(graveyard_.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      if (e->d_name[0] == 'g') ::unlink(Join(graveyard_, e->d_name).c_str());
    }
    ::closedir(d);
  }
}

absl::StatusOr<CrashReport> FaultFileSystem::MakeCrashImage(const CrashPolicy& policy) {
  absl::MutexLock lock(&mu_);
  CrashReport report;
  report.torn = torn_;
  RevertData(policy, &report);
  UndoDirOps(policy, &report);
  ResetLocked();
  return report;
}

// ---- FaultIoBackend ----

FaultIoBackend::FaultIoBackend(FaultFileSystem* fs, std::unique_ptr<IoBackend> base)
    : fs_(fs), base_(std::move(base)), name_(absl::StrCat("fault(", base_->Name(), ")")) {}

void FaultIoBackend::Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) {
  direction_ = direction;
  fd_ = fd;
  segments_.assign(segments.begin(), segments.end());
}

absl::Status FaultIoBackend::Wait() {
  absl::Status s = direction_ == IoDirection::kWrite ? Write(fd_, segments_) : Read(fd_, segments_);
  segments_.clear();
  return s;
}

absl::Status FaultIoBackend::Write(int fd, absl::Span<const IoSegment> segments) {
  absl::MutexLock lock(&fs_->mu_);
  for (const IoSegment& s : segments) {
    bool crashed = false;
    absl::Status gate = fs_->Gate(FaultClass::kWrite, true, "write", &crashed);
    if (crashed) {
      // The crash point: this write is in flight when the power goes.
      bool prefix =
          fs_->tear_ == TearMode::kPrefix || (fs_->tear_ == TearMode::kMixed && fs_->Odds(2));
      TornWrite torn;
      fs_->WritePartial(fd, s, prefix, &torn);
      fs_->torn_.push_back(torn);
      return gate;
    }
    if (!gate.ok()) {
      if (!fs_->frozen_ && fs_->short_writes_) fs_->WritePartial(fd, s, /*prefix=*/true, nullptr);
      return gate;
    }
    fs_->RecordWrite(fd, s.offset, s.len);
    CKPT_RETURN_IF_ERROR(base_->WriteAll(fd, absl::MakeConstSpan(&s, 1)));
  }
  return absl::OkStatus();
}

absl::Status FaultIoBackend::Read(int fd, absl::Span<const IoSegment> segments) {
  absl::MutexLock lock(&fs_->mu_);
  absl::Status gate = fs_->Gate(FaultClass::kRead, false, "read");
  if (gate.ok()) return base_->ReadAll(fd, segments);
  if (fs_->frozen_) return gate;
  ReadFault kind = fs_->read_fault_;
  if (kind == ReadFault::kMixed) kind = static_cast<ReadFault>(fs_->rng_() % 3);
  ++fs_->read_faults_[static_cast<int>(kind)];
  if (kind == ReadFault::kError) return gate;
  CKPT_RETURN_IF_ERROR(base_->ReadAll(fd, segments));
  uint64_t total = 0;
  for (const IoSegment& s : segments) total += s.len;
  if (total == 0) return absl::OkStatus();
  // Byte `pos` of the transfer, across segments.
  auto at = [&segments](uint64_t pos) -> char* {
    for (const IoSegment& s : segments) {
      if (pos < s.len) return static_cast<char*>(s.buf) + pos;
      pos -= s.len;
    }
    return nullptr;
  };
  if (kind == ReadFault::kCorrupt) {
    const int flips = 1 + static_cast<int>(fs_->rng_() % 3);
    for (int i = 0; i < flips; ++i) {
      char* p = at(fs_->rng_() % total);
      *p = static_cast<char>(*p ^ (1 << (fs_->rng_() % 8)));
    }
    return absl::OkStatus();
  }
  // kTruncated: only a prefix arrives.
  const uint64_t cut = fs_->rng_() % total;
  uint64_t pos = 0;
  for (const IoSegment& s : segments) {
    if (pos + s.len > cut) {
      const uint64_t from = cut > pos ? cut - pos : 0;
      std::memset(static_cast<char*>(s.buf) + from, 0, s.len - from);
    }
    pos += s.len;
  }
  if (fs_->Odds(2)) {
    return absl::DataLossError(
        absl::StrCat("file ends at ", cut, "; expected ", total, " (injected truncated read)"));
  }
  return absl::OkStatus();
}

}  // namespace testing
}  // namespace ckpt
