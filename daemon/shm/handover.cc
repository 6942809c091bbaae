#include "daemon/shm/handover.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "daemon/common/unix_socket.h"
#include "base/status.h"
#include "base/handover_wire.h"

namespace ckpt {

HandoverServer::HandoverServer(HandoverOptions options) : options_(std::move(options)) {}

HandoverServer::~HandoverServer() { Stop(); }

absl::Status HandoverServer::Start() {
  CKPT_ASSIGN_OR_RETURN(listen_fd_, ListenUnixSocket(options_.socket_path, 0660));
  thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void HandoverServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    pending_.clear();
  }
  if (listen_fd_.valid()) ::shutdown(listen_fd_.get(), SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  IgnoreError(listen_fd_.Close(), "shutdown: nothing to do about a close error");
}

void HandoverServer::AcceptLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    struct pollfd pfd = {listen_fd_.get(), POLLIN, 0};
    int rc = ::poll(&pfd, 1, 200);
    if (rc <= 0) continue;
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(UniqueFd(fd));
  }
}

void HandoverServer::Serve(UniqueFd conn) {
  HandoverReply reply;
  std::memset(&reply, 0, sizeof(reply));
  reply.magic = kHandoverMagic;
  auto fail = [&](const absl::Status& s) {
    reply.code = static_cast<uint32_t>(s.code());
    std::snprintf(reply.message, sizeof(reply.message), "%s", std::string(s.message()).c_str());
    IgnoreError(SendWithFds(conn.get(), &reply, sizeof(reply), {}), "peer gone; nothing to report");
  };
  absl::StatusOr<PeerCred> cred = GetPeerCred(conn.get());
  if (!cred.ok()) return fail(cred.status());
  if (!SetSocketTimeout(conn.get(), options_.io_timeout).ok()) return;
  HandoverHeader h;
  std::vector<UniqueFd> fds;
  absl::Status s = RecvWithFds(conn.get(), &h, sizeof(h), &fds, kMaxHandoverFds);
  if (!s.ok()) return fail(s);
  if (h.magic != kHandoverMagic) return fail(absl::InvalidArgumentError("bad handover magic"));
  if (h.nfds == 0 || h.nfds != fds.size()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("header announces ", h.nfds, " descriptors, message carried ", fds.size())));
  }
  std::string token(kHandoverTokenBytes, '\0');
  if (::getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    return fail(ErrnoStatus(errno, "getrandom"));
  }
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked();
    if (pending_.size() >= options_.max_pending) {
      return fail(absl::ResourceExhaustedError("too many unclaimed handovers"));
    }
    pending_[token] = Pending{cred->uid, Now() + options_.token_ttl, std::move(fds)};
  }
  std::memcpy(reply.token, token.data(), kHandoverTokenBytes);
  IgnoreError(SendWithFds(conn.get(), &reply, sizeof(reply), {}),
              "client gone: the token expires unclaimed");
}

void HandoverServer::ExpireLocked() {
  absl::Time now = Now();
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires < now) {
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<std::vector<UniqueFd>> HandoverServer::Claim(const std::string& token, uid_t uid) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    return absl::NotFoundError("unknown or expired handover token");
  }
  if (it->second.uid != uid) {
    return absl::PermissionDeniedError("handover token belongs to another uid");
  }
  std::vector<UniqueFd> fds = std::move(it->second.fds);
  pending_.erase(it);
  return fds;
}

size_t HandoverServer::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}

}  // namespace ckpt
