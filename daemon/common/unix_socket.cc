#include "daemon/common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"

namespace ckpt {

absl::StatusOr<PeerCred> GetPeerCred(int sock_fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus(errno, "SO_PEERCRED");
  }
  PeerCred p;
  p.pid = cred.pid;
  p.uid = cred.uid;
  p.gid = cred.gid;
  return p;
}

absl::StatusOr<UniqueFd> ListenUnixSocket(const std::string& path, mode_t mode) {
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is empty or too long"));
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, absl::StrCat("unlink ", path));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "socket");
  // Bind under a restrictive umask so the socket is never reachable with
  // looser permissions than `mode`, not even between bind and chmod.
  mode_t old = ::umask(0177);
  int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old);
  if (rc != 0) return ErrnoStatus(bind_errno, absl::StrCat("bind ", path));
  if (::chmod(path.c_str(), mode) != 0) return ErrnoStatus(errno, absl::StrCat("chmod ", path));
  // The longest queue the kernel allows (net.core.somaxconn): while one user
  // connects faster than ckptd accepts (and closes what is over its caps),
  // the queue is what keeps room for everyone else's connections.
  if (::listen(fd.get(), SOMAXCONN) != 0) return ErrnoStatus(errno, "listen");
  return fd;
}

absl::Status CheckSocketDirectory(int dir_fd, const std::string& path) {
  struct stat st;
  if (::fstat(dir_fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory ", path, " is not a directory"));
  }
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", path, " belongs to uid ", st.st_uid, ", not to ckptd's user (",
        ::geteuid(), ") or root; refusing to serve from it"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", path, " is writable by group or others (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777), "); use a directory of mode 0750"));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
