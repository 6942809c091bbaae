#include "daemon/remote/posix_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt::remote {
namespace {

constexpr char kTempPrefix[] = ".tmp.";
constexpr size_t kCopyBuffer = 1 << 20;
// Below this many directories no key reaches (remote_layout.h's keys are
// four deep).
constexpr int kMaxKeyDepth = 16;

// Why another uid could change what `st` describes ("" = nobody can):
// owned by someone other than ckptd (root may own directories above the
// store), or writable by its group or by everyone.
std::string OthersCanWrite(const struct stat& st, bool root_may_own) {
  const uid_t me = geteuid();
  if (st.st_uid != me && !(root_may_own && st.st_uid == 0)) {
    return absl::StrCat("it belongs to uid ", st.st_uid, ", not ckptd's uid ", me);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::StrCat("its group or everyone may write it (mode ",
                        absl::StrFormat("%04o", st.st_mode & 07777), ")");
  }
  return "";
}

// `fd` is a directory (or a file) only ckptd may change. A directory that
// is not is FAILED_PRECONDITION (the store is not ckptd's alone); a file that
// is not is DATA_LOSS: whatever it holds, it is not an object ckptd wrote.
absl::Status CheckTrusted(int fd, const std::string& what, bool directory) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", what));
  auto refuse = [directory](std::string message) {
    return directory ? absl::FailedPreconditionError(message) : absl::DataLossError(message);
  };
  if (directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) {
    return refuse(
        absl::StrCat(what, " in the remote directory is not a ", directory ? "directory" : "file"));
  }
  const std::string why = OthersCanWrite(st, /*root_may_own=*/false);
  if (!why.empty()) {
    return refuse(absl::StrCat(what, " in the remote directory could be changed by another user (",
                               why, "); ckptd reads nothing there that only it did not write"));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> OpenDir(int parent, const std::string& name, bool create) {
  if (create) {
    if (mkdirat(parent, name.c_str(), 0750) == 0) {
      // The new entry itself must survive a crash before anything in it.
      if (fsync(parent) != 0) return ErrnoStatus(errno, absl::StrCat("fsync the parent of ", name));
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("mkdir ", name));
    }
  }
  int fd = openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return absl::FailedPreconditionError(absl::StrCat(
          name, " in the remote directory is not a directory (or is a symbolic link)"));
    }
    return ErrnoStatus(errno, absl::StrCat("open directory ", name));
  }
  UniqueFd dir(fd);
  CKPT_RETURN_IF_ERROR(CheckTrusted(dir.get(), name, /*directory=*/true));
  return dir;
}

// The root and every directory above it: none another uid could replace or
// rename (a sticky directory of root's, such as /tmp, lets nobody move what
// is not theirs).
absl::Status CheckRootTrusted(const std::string& root, int root_fd) {
  struct stat st;
  if (fstat(root_fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", root));
  if (std::string why = OthersCanWrite(st, /*root_may_own=*/false); !why.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the remote directory ", root, " could be written by another user (", why,
        "): a manifest they put there could be restored by every node. Give it to ckptd's user "
        "and chmod 750 it"));
  }
  std::string path = root;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  for (size_t slash = path.rfind('/'); slash != std::string::npos && slash > 0;
       slash = path.rfind('/', slash - 1)) {
    const std::string above = path.substr(0, slash);
    if (stat(above.c_str(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", above));
    const bool sticky_roots = st.st_uid == 0 && (st.st_mode & S_ISVTX) != 0;
    if (std::string why = OthersCanWrite(st, /*root_may_own=*/true);
        !why.empty() && !sticky_roots) {
      return absl::FailedPreconditionError(
          absl::StrCat("the remote directory ", root, " is under ", above,
                       ", which another user could change (", why, "); move it, or fix ", above));
    }
  }
  return absl::OkStatus();
}

// A stream over the entries of the directory `fd`, from its first one;
// closedir releases it (`fd` stays open).
absl::StatusOr<DIR*> ReadDir(int fd) {
  UniqueFd copy(dup(fd));
  if (!copy.valid()) return ErrnoStatus(errno, "dup");
  DIR* d = fdopendir(copy.get());
  if (d == nullptr) return ErrnoStatus(errno, "opendir");
  copy.release();
  // A dup shares its position with the descriptor it copies, which an
  // earlier walk left at the end.
  rewinddir(d);
  return d;
}

absl::Status WriteAll(int fd, const char* p, size_t n, off_t off) {
  while (n > 0) {
    ssize_t w = pwrite(fd, p, n, off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write");
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += w;
  }
  return absl::OkStatus();
}

// Copies `size` bytes from `in` to `out`, both from offset 0. With `limit`,
// INVALID_ARGUMENT once more than `limit` bytes would be copied.
absl::StatusOr<uint64_t> Copy(int in, int out, uint64_t size) {
  std::string buf(kCopyBuffer, '\0');
  uint64_t done = 0;
  while (done < size) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(kCopyBuffer, size - done));
    ssize_t r = pread(in, buf.data(), want, static_cast<off_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read");
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat("short read: ", done, " of ", size, " bytes"));
    }
    CKPT_RETURN_IF_ERROR(
        WriteAll(out, buf.data(), static_cast<size_t>(r), static_cast<off_t>(done)));
    done += static_cast<uint64_t>(r);
  }
  return done;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PosixStore>> PosixStore::Open(const std::string& root) {
  if (root.empty()) return absl::InvalidArgumentError("the remote directory is not set");
  if (mkdir(root.c_str(), 0750) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("mkdir ", root));
  }
  int fd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOTDIR) {
      return absl::FailedPreconditionError(absl::StrCat(root, " is not a directory"));
    }
    return ErrnoStatus(errno, absl::StrCat("open ", root));
  }
  UniqueFd root_fd(fd);
  CKPT_RETURN_IF_ERROR(CheckRootTrusted(root, root_fd.get()));
  return std::unique_ptr<PosixStore>(new PosixStore(root, std::move(root_fd)));
}

std::string PosixStore::Describe() const { return absl::StrCat("posix ", root_); }

absl::StatusOr<UniqueFd> PosixStore::OpenParent(const std::string& key, bool create,
                                                std::string* name) const {
  CKPT_RETURN_IF_ERROR(CheckObjectKey(key));
  std::vector<std::string> parts = absl::StrSplit(key, '/');
  *name = parts.back();
  parts.pop_back();
  UniqueFd dir(dup(root_fd_.get()));
  if (!dir.valid()) return ErrnoStatus(errno, "dup");
  for (const std::string& part : parts) {
    CKPT_ASSIGN_OR_RETURN(dir, OpenDir(dir.get(), part, create));
  }
  return dir;
}

absl::Status PosixStore::Publish(int dir, const std::string& name, bool if_absent, bool direct,
                                 const std::function<absl::Status(int fd)>& write) const {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(kTempPrefix, name, ".", getpid(), ".",
                                       counter.fetch_add(1, std::memory_order_relaxed));
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = openat(dir, tmp.c_str(), flags | (direct ? O_DIRECT : 0), 0640);
  // tmpfs and some network file systems refuse O_DIRECT.
  if (fd < 0 && direct && errno == EINVAL) fd = openat(dir, tmp.c_str(), flags, 0640);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("create ", tmp));
  UniqueFd out(fd);
  absl::Status s = write(out.get());
  if (s.ok() && fsync(out.get()) != 0) s = ErrnoStatus(errno, absl::StrCat("fsync ", tmp));
  if (s.ok()) {
    if (if_absent) {
      // link() fails on an existing name, so a second writer never replaces
      // the first one's object.
      if (linkat(dir, tmp.c_str(), dir, name.c_str(), 0) != 0) {
        s = errno == EEXIST ? absl::AlreadyExistsError(absl::StrCat(name, " exists"))
                            : ErrnoStatus(errno, absl::StrCat("link ", name));
      }
      unlinkat(dir, tmp.c_str(), 0);
    } else if (renameat(dir, tmp.c_str(), dir, name.c_str()) != 0) {
      s = ErrnoStatus(errno, absl::StrCat("rename ", name));
    }
  }
  if (!s.ok()) {
    unlinkat(dir, tmp.c_str(), 0);
    return s;
  }
  if (fsync(dir) != 0) return ErrnoStatus(errno, absl::StrCat("fsync the directory of ", name));
  return absl::OkStatus();
}

absl::Status PosixStore::PutFile(const std::string& key, int fd, uint64_t size) {
  std::string name;
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(key, /*create=*/true, &name));
  return Publish(dir.get(), name, /*if_absent=*/false, /*direct=*/false,
                 [&](int out) -> absl::Status {
                   CKPT_ASSIGN_OR_RETURN(uint64_t copied, Copy(fd, out, size));
                   (void)copied;
                   return absl::OkStatus();
                 });
}

absl::Status PosixStore::PutBytes(const std::string& key, std::string_view data, bool if_absent) {
  std::string name;
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(key, /*create=*/true, &name));
  return Publish(dir.get(), name, if_absent, /*direct=*/false,
                 [&](int out) { return WriteAll(out, data.data(), data.size(), 0); });
}

absl::Status PosixStore::PutWith(const std::string& key, bool if_absent, bool direct,
                                 const std::function<absl::Status(int fd)>& write) {
  std::string name;
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(key, /*create=*/true, &name));
  return Publish(dir.get(), name, if_absent, direct, write);
}

absl::StatusOr<UniqueFd> PosixStore::OpenObject(const std::string& key, uint64_t max_bytes,
                                                uint64_t* size) const {
  std::string name;
  CKPT_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(key, /*create=*/false, &name));
  // O_NONBLOCK: a FIFO in an object's place must not block this thread in
  // open(); it is refused below, never read.
  int in = openat(dir.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (in < 0) {
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(absl::StrCat(key, " is a symbolic link, not an object"));
    }
    return ErrnoStatus(errno, absl::StrCat("open ", key));
  }
  UniqueFd src(in);
  CKPT_RETURN_IF_ERROR(CheckTrusted(in, key, /*directory=*/false));
  struct stat st;
  if (fstat(in, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", key));
  *size = static_cast<uint64_t>(st.st_size);
  if (*size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, " holds ", *size, " bytes, more than the ", max_bytes, " expected"));
  }
  return src;
}

absl::StatusOr<uint64_t> PosixStore::GetToFile(const std::string& key, int fd, uint64_t max_bytes) {
  uint64_t size = 0;
  CKPT_ASSIGN_OR_RETURN(UniqueFd src, OpenObject(key, max_bytes, &size));
  return Copy(src.get(), fd, size);
}

absl::StatusOr<std::string> PosixStore::GetBytes(const std::string& key, uint64_t max_bytes) {
  uint64_t size = 0;
  CKPT_ASSIGN_OR_RETURN(UniqueFd src, OpenObject(key, max_bytes, &size));
  std::string out(static_cast<size_t>(size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t r = pread(src.get(), out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(errno, absl::StrCat("read ", key));
    if (r == 0) return absl::DataLossError(absl::StrCat(key, " shrank while being read"));
    done += static_cast<size_t>(r);
  }
  return out;
}

absl::StatusOr<std::vector<ObjectInfo>> PosixStore::List(const std::string& prefix) {
  std::vector<ObjectInfo> out;
  // Walks the directories the prefix can reach: the prefix's directory part
  // fixes where to start.
  const size_t slash = prefix.rfind('/');
  const std::string start = slash == std::string::npos ? "" : prefix.substr(0, slash);
  UniqueFd dir(dup(root_fd_.get()));
  if (!dir.valid()) return ErrnoStatus(errno, "dup");
  if (!start.empty()) {
    for (absl::string_view part : absl::StrSplit(start, '/')) {
      if (part.empty() || part == "." || part == "..") return out;
      absl::StatusOr<UniqueFd> sub = OpenDir(dir.get(), std::string(part), /*create=*/false);
      if (absl::IsNotFound(sub.status())) return out;
      if (!sub.ok()) return sub.status();
      dir = std::move(*sub);
    }
  }
  std::function<absl::Status(int, const std::string&)> walk = [&](int fd, const std::string& base) {
    CKPT_ASSIGN_OR_RETURN(DIR * d, ReadDir(fd));
    // A listing must be whole: a caller takes a missing manifest for "no
    // checkpoint". Errors are returned, never read as the end.
    std::vector<std::string> names;
    for (;;) {
      errno = 0;
      dirent* e = readdir(d);
      if (e == nullptr) break;
      std::string n = e->d_name;
      if (n == "." || n == ".." || absl::StartsWith(n, kTempPrefix)) continue;
      names.push_back(std::move(n));
    }
    const int err = errno;
    closedir(d);
    if (err != 0) return ErrnoStatus(err, absl::StrCat("readdir ", base.empty() ? "." : base));
    for (const std::string& n : names) {
      const std::string key = base.empty() ? n : absl::StrCat(base, "/", n);
      // d_type may be DT_UNKNOWN (NFS, XFS without ftype): stat every entry.
      struct stat st;
      if (fstatat(fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // went away meanwhile
        return ErrnoStatus(errno, absl::StrCat("stat ", key));
      }
      if (S_ISDIR(st.st_mode)) {
        if (!absl::StartsWith(key, prefix.substr(0, std::min(prefix.size(), key.size())))) continue;
        absl::StatusOr<UniqueFd> sub = OpenDir(fd, n, /*create=*/false);
        if (absl::IsNotFound(sub.status())) continue;
        if (!sub.ok()) return sub.status();
        CKPT_RETURN_IF_ERROR(walk(sub->get(), key));
      } else if (S_ISREG(st.st_mode) && absl::StartsWith(key, prefix)) {
        out.push_back({key, static_cast<uint64_t>(st.st_size)});
      }
      // Anything else (a symbolic link, a device) is not an object.
    }
    return absl::OkStatus();
  };
  CKPT_RETURN_IF_ERROR(walk(dir.get(), start));
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return out;
}

absl::Status PosixStore::RemoveTempFiles() {
  std::function<absl::Status(int, int)> sweep = [&](int fd, int depth) -> absl::Status {
    if (depth > kMaxKeyDepth) return absl::OkStatus();
    CKPT_ASSIGN_OR_RETURN(DIR * d, ReadDir(fd));
    std::vector<std::string> temps, dirs;
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      struct stat st;
      if (n == "." || n == ".." || fstatat(fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (S_ISDIR(st.st_mode)) dirs.push_back(n);
      if (S_ISREG(st.st_mode) && absl::StartsWith(n, kTempPrefix)) temps.push_back(n);
    }
    closedir(d);
    for (const std::string& n : temps) {
      if (unlinkat(fd, n.c_str(), 0) != 0 && errno != ENOENT) {
        return ErrnoStatus(errno, absl::StrCat("remove the temp file ", n));
      }
    }
    for (const std::string& n : dirs) {
      absl::StatusOr<UniqueFd> sub = OpenDir(fd, n, /*create=*/false);
      if (!sub.ok()) continue;  // not ours to sweep (refused by the trust rules)
      CKPT_RETURN_IF_ERROR(sweep(sub->get(), depth + 1));
    }
    return absl::OkStatus();
  };
  return sweep(root_fd_.get(), 0);
}

absl::Status PosixStore::Delete(const std::string& key) {
  std::string name;
  absl::StatusOr<UniqueFd> dir = OpenParent(key, /*create=*/false, &name);
  if (absl::IsNotFound(dir.status())) return absl::OkStatus();
  if (!dir.ok()) return dir.status();
  if (unlinkat(dir->get(), name.c_str(), 0) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("unlink ", key));
  }
  if (fsync(dir->get()) != 0)
    return ErrnoStatus(errno, absl::StrCat("fsync the directory of ", key));
  return absl::OkStatus();
}

}  // namespace ckpt::remote
