#include "base/handover_wire.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt {

absl::Status SetSocketTimeout(int sock, absl::Duration timeout) {
  struct timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return ErrnoStatus(errno, "setsockopt timeout");
  }
  return absl::OkStatus();
}

absl::Status SendWithFds(int sock, const void* data, size_t len, absl::Span<const int> fds) {
  if (fds.size() > kMaxHandoverFds) {
    return absl::InvalidArgumentError(
        absl::StrCat(fds.size(), " descriptors; at most ", kMaxHandoverFds, " per handover"));
  }
  struct iovec iov = {const_cast<void*>(data), len};
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return absl::DeadlineExceededError("sendmsg timed out");
    return ErrnoStatus(errno, "sendmsg");
  }
  if (static_cast<size_t>(n) != len) return absl::UnavailableError("short sendmsg");
  return absl::OkStatus();
}

absl::Status RecvWithFds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds,
                         size_t max_fds) {
  struct iovec iov = {data, len};
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (max_fds + 1)));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return absl::DeadlineExceededError("recvmsg timed out");
    return ErrnoStatus(errno, "recvmsg");
  }
  // Collect every descriptor first so that none leaks on an error below.
  std::vector<UniqueFd> got;
  for (struct cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        got.emplace_back(fd);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return absl::InvalidArgumentError("too many descriptors");
  if (static_cast<size_t>(n) != len) return absl::InvalidArgumentError("short handover message");
  if (got.size() > max_fds) return absl::InvalidArgumentError("too many descriptors");
  if (fds != nullptr) *fds = std::move(got);
  return absl::OkStatus();
}

absl::Status ConnectUnix(int sock, const std::string& path) {
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> HandOverFds(const std::string& socket_path, absl::Span<const int> fds,
                                        absl::Duration timeout, HandoverKind kind) {
  if (fds.empty() || fds.size() > kMaxHandoverFds) {
    return absl::InvalidArgumentError(
        absl::StrCat("handover takes 1..", kMaxHandoverFds, " regions, got ", fds.size()));
  }
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return ErrnoStatus(errno, "socket");
  CKPT_RETURN_IF_ERROR(SetSocketTimeout(sock.get(), timeout));
  if (absl::Status s = ConnectUnix(sock.get(), socket_path); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("ckptd handover socket ", s.message()));
  }
  HandoverHeader h{kind == HandoverKind::kCudaPages ? kHandoverMagicCudaPages : kHandoverMagic,
                   static_cast<uint32_t>(fds.size())};
  if (absl::Status s = SendWithFds(sock.get(), &h, sizeof(h), fds); !s.ok()) {
    // The daemon went away mid-handover (EPIPE, ECONNRESET) or stalled.
    return absl::UnavailableError(absl::StrCat("handover to ckptd: ", s.message()));
  }
  HandoverReply reply;
  absl::Status s = RecvWithFds(sock.get(), &reply, sizeof(reply), nullptr, 0);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("handover reply: ", s.message()));
  if (reply.magic != kHandoverMagic) return absl::UnavailableError("bad handover reply");
  if (reply.code != 0) {
    // The daemon's message names the limit or the fault (for example
    // "uid 1000 has 64 unclaimed handovers (limit 64,
    // handover_max_pending_per_uid)"); the code says what to do about it:
    // RESOURCE_EXHAUSTED is a limit, INVALID_ARGUMENT a malformed handover.
    reply.message[sizeof(reply.message) - 1] = '\0';
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        absl::StrCat("ckptd refused the handover: ", reply.message));
  }
  return std::string(reinterpret_cast<const char*>(reply.token), kHandoverTokenBytes);
}

}  // namespace ckpt
