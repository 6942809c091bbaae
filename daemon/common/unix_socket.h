// Unix-socket helpers: listening sockets with safe permissions, and the
// identity of the peer (SO_PEERCRED). Identity always comes from the kernel,
// never from request fields.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "base/unique_fd.h"

namespace ckpt {

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
};

absl::StatusOr<PeerCred> GetPeerCred(int sock_fd);

// Binds and listens on a Unix stream socket at `path` with `mode` (the socket
// never exists with looser permissions). A stale socket file is replaced;
// anything else at the path (a file, a symlink) is FAILED_PRECONDITION.
absl::StatusOr<UniqueFd> ListenUnixSocket(const std::string& path, mode_t mode);

// A directory that holds ckptd's sockets must be a directory owned by this
// process's user or root and writable by nobody else; otherwise another user
// could replace the socket between bind and use, or plant one ckptd would
// then serve through. FAILED_PRECONDITION naming `path` and the problem.
absl::Status CheckSocketDirectory(int dir_fd, const std::string& path);

}  // namespace ckpt
