#include "daemon/io/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt {
namespace {

// A single path component that cannot climb out of its directory.
bool IsPlainName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name != "." && name != "..";
}

// InvalidArgument naming `name` unless it is a plain name; `what` is "file"
// or "directory".
absl::Status CheckPlainName(const std::string& name, const char* what) {
  if (IsPlainName(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("bad ", what, " name '", name, "'"));
}

// openat2 confined beneath dir_fd; falls back to openat+O_NOFOLLOW on kernels
// without openat2 (names are single components we built, so that is safe).
int OpenBeneath(int dir_fd, const std::string& name, int flags, mode_t mode) {
  if (!IsPlainName(name)) {
    errno = EINVAL;
    return -1;
  }
  struct open_how how;
  std::memset(&how, 0, sizeof(how));
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  int fd;
  do {
    fd = static_cast<int>(::syscall(SYS_openat2, dir_fd, name.c_str(), &how, sizeof(how)));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == ENOSYS) {
    fd = ::openat(dir_fd, name.c_str(), flags | O_CLOEXEC | O_NOFOLLOW, mode);
  }
  return fd;
}

// The status of a failed open of `name` in `dir_fd`: a symbolic link (ELOOP
// from RESOLVE_NO_SYMLINKS or O_NOFOLLOW, ENOTDIR from O_NOFOLLOW with
// O_DIRECTORY) says so, so start-up can name it.
absl::Status OpenError(int err, int dir_fd, const std::string& what, const std::string& name) {
  struct stat st;
  if (err == ELOOP ||
      (err == ENOTDIR && ::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
       S_ISLNK(st.st_mode))) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", name, ": is a symbolic link, which ckptd does not follow"));
  }
  return ErrnoStatus(err, absl::StrCat(what, " ", name));
}

const char* FileTypeName(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    default:
      return "not a file";
  }
}

absl::Status NotRegular(const char* what, const std::string& name, mode_t mode) {
  return absl::DataLossError(
      absl::StrCat(what, " ", name, ": not a regular file but ", FileTypeName(mode)));
}

// OpenBeneath for a file ckptd reads or appends to but did not just
// create: O_NONBLOCK, so that a FIFO or a device in its place cannot block
// the calling thread in open() (a FIFO planted in quarantine/ hung `ckptctl
// repair` with the index locked), then anything but a regular file refused
// with DATA_LOSS; the descriptor goes back to blocking for the caller.
absl::StatusOr<UniqueFd> OpenRegular(int dir_fd, const std::string& name, int flags, mode_t mode,
                                     const char* what) {
  UniqueFd fd(OpenBeneath(dir_fd, name, flags | O_NONBLOCK, mode));
  struct stat st;
  if (!fd.valid()) {
    // ENXIO: a FIFO without a reader, opened for writing without blocking.
    const int err = errno;
    if (err == ENXIO && ::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISREG(st.st_mode)) {
      return NotRegular(what, name, st.st_mode);
    }
    return OpenError(err, dir_fd, what, name);
  }
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat ", name));
  if (!S_ISREG(st.st_mode)) {
    return NotRegular(what, name, st.st_mode);
  }
  if (::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK & (O_APPEND | O_DIRECT)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("fcntl ", name));
  }
  return fd;
}

}  // namespace

absl::StatusOr<UniqueFd> FileSystem::MakeDirs(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0750) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("mkdir ", cur));
    }
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("open dir ", path));
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> FileSystem::OpenSubdir(int dir_fd, const std::string& name, bool create) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(name, "directory"));
  if (create && ::mkdirat(dir_fd, name.c_str(), 0750) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("mkdir ", name));
  }
  int fd = OpenBeneath(dir_fd, name, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0) return OpenError(errno, dir_fd, "open dir", name);
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> FileSystem::CreateExclusive(int dir_fd, const std::string& name,
                                                     bool direct, bool* direct_used) {
  int flags = O_RDWR | O_CREAT | O_EXCL;
  int fd = OpenBeneath(dir_fd, name, flags | (direct ? O_DIRECT : 0), 0640);
  bool used = direct;
  if (fd < 0 && direct && errno == EINVAL) {
    fd = OpenBeneath(dir_fd, name, flags, 0640);
    used = false;
  }
  if (fd < 0) return OpenError(errno, dir_fd, "create", name);
  if (direct_used) *direct_used = used;
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> FileSystem::OpenForRead(int dir_fd, const std::string& name, bool direct,
                                                 bool* direct_used) {
  absl::StatusOr<UniqueFd> fd =
      OpenRegular(dir_fd, name, O_RDONLY | (direct ? O_DIRECT : 0), 0, "open");
  bool used = direct;
  if (!fd.ok() && direct && absl::IsInvalidArgument(fd.status())) {
    fd = OpenRegular(dir_fd, name, O_RDONLY, 0, "open");
    used = false;
  }
  if (fd.ok() && direct_used) *direct_used = used;
  return fd;
}

absl::Status FileSystem::Allocate(int fd, uint64_t len) {
  if (len == 0) return absl::OkStatus();
  int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(len));
  if (rc == EOPNOTSUPP || rc == EINVAL) return absl::OkStatus();  // fs without fallocate
  if (rc != 0) return ErrnoStatus(rc, "fallocate");
  return absl::OkStatus();
}

absl::Status FileSystem::DataSync(int fd) {
  if (::fdatasync(fd) != 0) return ErrnoStatus(errno, "fdatasync");
  return absl::OkStatus();
}

absl::Status FileSystem::RenameNoReplace(int dir_fd, const std::string& from,
                                         const std::string& to) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(from, "file"));
  CKPT_RETURN_IF_ERROR(CheckPlainName(to, "file"));
  if (::renameat2(dir_fd, from.c_str(), dir_fd, to.c_str(), RENAME_NOREPLACE) != 0) {
    return ErrnoStatus(errno, absl::StrCat("rename ", from, " -> ", to));
  }
  return absl::OkStatus();
}

absl::Status FileSystem::MoveNoReplace(int from_dir, const std::string& from, int to_dir,
                                       const std::string& to) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(from, "file"));
  CKPT_RETURN_IF_ERROR(CheckPlainName(to, "file"));
  if (::renameat2(from_dir, from.c_str(), to_dir, to.c_str(), RENAME_NOREPLACE) != 0) {
    return ErrnoStatus(errno, absl::StrCat("move ", from, " -> ", to));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> FileSystem::OpenForAppend(int dir_fd, const std::string& name) {
  return OpenRegular(dir_fd, name, O_WRONLY | O_CREAT | O_APPEND, 0640, "open");
}

absl::Status FileSystem::Append(int fd, absl::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, "append");
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status FileSystem::SyncDir(int dir_fd) {
  if (::fsync(dir_fd) != 0) return ErrnoStatus(errno, "fsync dir");
  return absl::OkStatus();
}

absl::Status FileSystem::Unlink(int dir_fd, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(name, "file"));
  if (::unlinkat(dir_fd, name.c_str(), 0) != 0) {
    return ErrnoStatus(errno, absl::StrCat("unlink ", name));
  }
  return absl::OkStatus();
}

absl::Status FileSystem::RemoveDir(int dir_fd, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(name, "directory"));
  if (::unlinkat(dir_fd, name.c_str(), AT_REMOVEDIR) != 0) {
    return ErrnoStatus(errno, absl::StrCat("rmdir ", name));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FileSystem::List(int dir_fd, std::vector<bool>* is_dir) {
  int fd = ::dup(dir_fd);
  if (fd < 0) return ErrnoStatus(errno, "dup");
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    ::close(fd);
    return ErrnoStatus(errno, "fdopendir");
  }
  ::rewinddir(d);
  std::vector<std::string> names;
  if (is_dir) is_dir->clear();
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    names.emplace_back(e->d_name);
    if (is_dir) {
      bool dir = e->d_type == DT_DIR;
      if (e->d_type == DT_UNKNOWN) {
        struct stat st;
        dir = ::fstatat(dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
      }
      is_dir->push_back(dir);
    }
  }
  ::closedir(d);
  return names;
}

absl::StatusOr<uint64_t> FileSystem::FileSize(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat");
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<uint64_t> FileSystem::FileSizeAt(int dir_fd, const std::string& name) {
  CKPT_RETURN_IF_ERROR(CheckPlainName(name, "file"));
  struct stat st;
  if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoStatus(errno, absl::StrCat("stat ", name));
  }
  if (S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": is a symbolic link, which ckptd does not follow"));
  }
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(name + " is not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<uint64_t> FileSystem::FreeBytes(int fd) {
  struct statvfs sv;
  if (::fstatvfs(fd, &sv) != 0) return ErrnoStatus(errno, "fstatvfs");
  return static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
}

absl::StatusOr<uint64_t> FileSystem::TotalBytes(int fd) {
  struct statvfs sv;
  if (::fstatvfs(fd, &sv) != 0) return ErrnoStatus(errno, "fstatvfs");
  return static_cast<uint64_t>(sv.f_blocks) * sv.f_frsize;
}

FileSystem* DefaultFileSystem() {
  static FileSystem* fs = new FileSystem();
  return fs;
}

}  // namespace ckpt
