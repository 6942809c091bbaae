#include "daemon/shm/handover.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/handover_wire.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/common/unix_socket.h"

namespace ckpt {
namespace {

// Why a handed-over descriptor is not what its kind carries, or "" when it
// is: a memfd region is a regular file; a CUDA page descriptor is a file of
// the NVIDIA driver's device (major `cuda_major`, -1 when this node has
// none). Anything else -- a socket, a pipe, a directory, a tty, an
// anonymous inode such as an io_uring or eventfd, an O_PATH handle -- is
// refused before ckptd holds it: holding it would keep the trainer's other
// ends (or the files an io_uring has registered) open until the token
// expired.
std::string NotWhatItsKindCarries(HandoverKind kind, int fd, const struct stat& st,
                                  int64_t cuda_major) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_PATH) != 0) return "an O_PATH handle";
  const char* what = "neither a regular file nor a device";
  switch (st.st_mode & S_IFMT) {
    case S_IFREG:
      if (kind == HandoverKind::kMemfdRegions) return "";
      what = "a regular file";
      break;
    case S_IFCHR:
      if (kind == HandoverKind::kCudaPages && cuda_major >= 0 &&
          static_cast<int64_t>(major(st.st_rdev)) == cuda_major) {
        return "";
      }
      what = kind == HandoverKind::kMemfdRegions ? "a character device"
             : cuda_major < 0 ? "a character device, and ckptd sees no NVIDIA driver device "
                                "(handover_cuda_device_file)"
                              : "a character device that is not the NVIDIA driver's";
      break;
    case S_IFSOCK:
      what = "a socket";
      break;
    case S_IFIFO:
      what = "a pipe";
      break;
    case S_IFDIR:
      what = "a directory";
      break;
    case S_IFBLK:
      what = "a block device";
      break;
    case 0:
      what = "an anonymous inode (an io_uring, eventfd, epoll, ...)";
      break;
    default:
      break;
  }
  return kind == HandoverKind::kMemfdRegions
             ? absl::StrCat(what, "; host regions are handed over as memfds")
             : absl::StrCat(what,
                            "; CUDA pages are handed over as the descriptors "
                            "cuMemExportToShareableHandle returns");
}

// Connections accepted per loop round, so a flood of connects cannot starve
// the connections already open.
constexpr int kAcceptsPerRound = 32;

int PollTimeoutMs(absl::Time now, absl::Time until) {
  if (until == absl::InfiniteFuture()) return 1000;  // only Stop() ends this wait
  absl::Duration d = until - now;
  if (d <= absl::ZeroDuration()) return 0;
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(d + absl::Milliseconds(1)), 1000));
}

}  // namespace

// ---- HandoverClaim ----

HandoverClaim::HandoverClaim(HandoverClaim&& other) noexcept
    : server_(std::exchange(other.server_, nullptr)),
      uid_(other.uid_),
      counted_(std::exchange(other.counted_, 0)),
      fds_(std::move(other.fds_)) {}

HandoverClaim& HandoverClaim::operator=(HandoverClaim&& other) noexcept {
  if (this != &other) {
    Release();
    server_ = std::exchange(other.server_, nullptr);
    uid_ = other.uid_;
    counted_ = std::exchange(other.counted_, 0);
    fds_ = std::move(other.fds_);
  }
  return *this;
}

void HandoverClaim::Absorb(HandoverClaim&& other) {
  if (server_ == nullptr) {
    *this = std::move(other);
    return;
  }
  // Same server and uid: one Release gives back both counts.
  counted_ += std::exchange(other.counted_, 0);
  other.server_ = nullptr;
  for (UniqueFd& fd : other.fds_) fds_.push_back(std::move(fd));
  other.fds_.clear();
}

void HandoverClaim::Release() {
  fds_.clear();  // closes what the caller did not take
  if (server_ != nullptr && counted_ > 0) server_->ReleaseFds(uid_, counted_);
  server_ = nullptr;
  counted_ = 0;
}

// ---- HandoverServer ----

size_t HandoverServer::DefaultMaxFds(uint64_t nofile, size_t reserve) {
  const uint64_t half = nofile / 2;
  if (nofile > reserve && nofile - reserve >= half) return static_cast<size_t>(nofile - reserve);
  return static_cast<size_t>(half);
}

size_t HandoverServer::DefaultMaxFds(uint64_t nofile, size_t reserve, uint64_t max_map_count,
                                     size_t map_reserve) {
  size_t cap = DefaultMaxFds(nofile, reserve);
  if (max_map_count > 0) cap = std::min(cap, DefaultMaxFds(max_map_count, map_reserve));
  return cap;
}

namespace {

// vm.max_map_count, or 0 when it cannot be read.
uint64_t MaxMapCount() {
  std::ifstream in("/proc/sys/vm/max_map_count");
  uint64_t n = 0;
  return in >> n ? n : 0;
}

}  // namespace

HandoverServer::HandoverServer(HandoverOptions options)
    : options_(std::move(options)),
      backoff_(options_.accept_backoff, "HandoverServer::AcceptBackoff") {}

HandoverServer::~HandoverServer() { Stop(); }

absl::Status HandoverServer::Start() {
  max_fds_ = options_.max_fds;
  if (max_fds_ == 0) {
    struct rlimit rl;
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return ErrnoStatus(errno, "getrlimit(RLIMIT_NOFILE)");
    max_fds_ = DefaultMaxFds(rl.rlim_cur, options_.fd_reserve, MaxMapCount(), options_.map_reserve);
  }
  if (struct stat st; ::stat(options_.cuda_device_file.c_str(), &st) == 0 && S_ISCHR(st.st_mode)) {
    cuda_major_ = major(st.st_rdev);
  }
  wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) return ErrnoStatus(errno, "eventfd");
  CKPT_ASSIGN_OR_RETURN(listen_fd_, ListenUnixSocket(options_.socket_path, 0660));
  // Non-blocking: the loop accepts until EAGAIN and must never block there.
  const int flags = ::fcntl(listen_fd_.get(), F_GETFL);
  if (flags < 0 || ::fcntl(listen_fd_.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, "fcntl O_NONBLOCK on the handover socket");
  }
  CKPT_LOG(INFO) << "handover: at most " << max_fds_ << " descriptors node-wide, "
                 << options_.max_fds_per_uid << " per uid; " << options_.max_connections_per_uid
                 << " connections and " << options_.max_pending_per_uid << " tokens per uid";
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void HandoverServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto it = pending_.begin(); it != pending_.end();) DropPendingLocked(it++);
  }
  if (wake_fd_.valid()) {
    uint64_t one = 1;
    IgnoreError(::write(wake_fd_.get(), &one, sizeof(one)) == sizeof(one)
                    ? absl::OkStatus()
                    : ErrnoStatus(errno, "eventfd write"),
                "the loop also wakes within a second on its own");
  }
  if (thread_.joinable()) thread_.join();
  IgnoreError(listen_fd_.Close(), "shutdown: nothing to do about a close error");
  IgnoreError(wake_fd_.Close(), "shutdown: nothing to do about a close error");
}

void HandoverServer::Loop() {
  std::vector<Conn> conns;
  std::map<uid_t, size_t> per_uid;  // open connections by uid
  std::vector<struct pollfd> pfds;
  auto close_conn = [&](size_t i) {
    if (--per_uid[conns[i].uid] == 0) per_uid.erase(conns[i].uid);
    conns.erase(conns.begin() + static_cast<ptrdiff_t>(i));
    {
      absl::MutexLock lock(&mu_);
      connections_ = conns.size();
    }
    CKPT_SYNC_POINT("HandoverServer::ConnectionClosed");
  };
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
    }
    absl::Time now = absl::Now();
    // Deadlines first: an idle connection is refused and closed.
    for (size_t i = conns.size(); i-- > 0;) {
      if (conns[i].deadline <= now) {
        Refuse(conns[i].fd.get(), absl::DeadlineExceededError(absl::StrCat(
                                      "no complete handover message within ",
                                      absl::FormatDuration(options_.connection_deadline))));
        close_conn(i);
      }
    }
    absl::Time wake_at = absl::InfiniteFuture();
    pfds.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    const bool accepting = backoff_.Accepting(now);
    if (accepting) {
      pfds.push_back({listen_fd_.get(), POLLIN, 0});
    } else {
      wake_at = backoff_.resume_at();
    }
    const size_t first_conn = pfds.size();
    for (const Conn& c : conns) {
      pfds.push_back({c.fd.get(), POLLIN, 0});
      wake_at = std::min(wake_at, c.deadline);
    }
    int rc = ::poll(pfds.data(), pfds.size(), PollTimeoutMs(now, wake_at));
    if (rc < 0) {
      if (errno == EINTR) continue;
      CKPT_LOG(ERROR) << "handover poll: " << std::strerror(errno) << "; the loop stops";
      break;
    }
    if (rc == 0) continue;
    if (pfds[0].revents != 0) continue;  // Stop(): re-checked at the top
    // Serve the readable connections, newest index first so erasing is safe.
    for (size_t i = conns.size(); i-- > 0;) {
      if (pfds[first_conn + i].revents == 0) continue;
      if (Serve(conns[i])) close_conn(i);
    }
    if (accepting && (pfds[1].revents & POLLIN) != 0) AcceptSome(&conns, &per_uid);
  }
  conns.clear();
  absl::MutexLock lock(&mu_);
  connections_ = 0;
}

void HandoverServer::AcceptSome(std::vector<Conn>* conns, std::map<uid_t, size_t>* per_uid) {
  for (int n = 0; n < kAcceptsPerRound; ++n) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (!AcceptBackoff::OutOfResources(err)) {
        if (err != EAGAIN && err != EWOULDBLOCK) {
          CKPT_LOG(WARNING) << "handover accept: " << std::strerror(err);
        }
        return;
      }
      // No descriptor (or memory) for the connection: pause accepting.
      {
        absl::MutexLock lock(&mu_);
        ++accept_errors_;
      }
      const AcceptBackoff::Pause pause = backoff_.Fail(absl::Now());
      if (pause.log) {
        CKPT_LOG(WARNING) << "handover accept: " << std::strerror(err) << " (and " << pause.unlogged
                          << " failures since the last report); not accepting for "
                          << absl::FormatDuration(pause.length) << "; " << stats().fds_held
                          << " handed-over descriptors held";
      }
      return;
    }
    backoff_.Reset();
    UniqueFd conn(fd);
    absl::StatusOr<PeerCred> cred = GetPeerCred(conn.get());
    if (!cred.ok()) {
      Refuse(conn.get(), cred.status());
      continue;
    }
    const uid_t uid = cred->uid;
    size_t& open = (*per_uid)[uid];
    if (open >= options_.max_connections_per_uid || conns->size() >= options_.max_connections) {
      if (open == 0) per_uid->erase(uid);
      const bool mine = open >= options_.max_connections_per_uid;
      Refuse(
          conn.get(),
          absl::ResourceExhaustedError(
              mine ? absl::StrCat("uid ", uid, " has ", open, " handover connections open (limit ",
                                  options_.max_connections_per_uid,
                                  ", handover_max_connections_per_uid)")
                   : absl::StrCat("ckptd has ", conns->size(), " handover connections open (limit ",
                                  options_.max_connections, ", handover_max_connections); retry")));
      continue;
    }
    ++open;
    conns->push_back(Conn{std::move(conn), uid, absl::Now() + options_.connection_deadline});
    {
      absl::MutexLock lock(&mu_);
      connections_ = conns->size();
    }
    CKPT_SYNC_POINT("HandoverServer::Accepted");
  }
}

void HandoverServer::CountRefusal() {
  absl::MutexLock lock(&mu_);
  ++refused_;
}

void HandoverServer::Refuse(int fd, const absl::Status& s) {
  CountRefusal();
  HandoverReply reply;
  std::memset(&reply, 0, sizeof(reply));
  reply.magic = kHandoverMagic;
  reply.code = static_cast<uint32_t>(s.code());
  std::snprintf(reply.message, sizeof(reply.message), "%s", std::string(s.message()).c_str());
  IgnoreError(SendWithFds(fd, &reply, sizeof(reply), {}), "peer gone; nothing to report");
}

bool HandoverServer::Serve(Conn& conn) {
  // A uid already at a cap is refused before its message is read: closing
  // the connection discards the descriptors still queued in the kernel, so
  // they never enter ckptd's table.
  absl::Status over;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked();
    over = CheckLimitsLocked(conn.uid, 1);
  }
  if (!over.ok()) {
    Refuse(conn.fd.get(), over);
    return true;
  }
  HandoverHeader h;
  std::vector<UniqueFd> fds;
  absl::Status s = RecvWithFds(conn.fd.get(), &h, sizeof(h), &fds, kMaxHandoverFds);
  if (absl::IsDeadlineExceeded(s)) return false;  // EAGAIN: nothing there yet
  if (!s.ok()) {
    Refuse(conn.fd.get(), s);
    return true;
  }
  if (h.magic != kHandoverMagic && h.magic != kHandoverMagicCudaPages) {
    fds.clear();
    Refuse(conn.fd.get(), absl::InvalidArgumentError("bad handover magic"));
    return true;
  }
  if (h.nfds == 0 || h.nfds != fds.size()) {
    const size_t got = fds.size();
    fds.clear();
    Refuse(conn.fd.get(), absl::InvalidArgumentError(absl::StrCat(
                              "header announces ", h.nfds, " descriptors, message carried ", got)));
    return true;
  }
  // Each region once: two descriptors of one file in a message are refused,
  // so one region cannot be multiplied into many table slots. (CUDA page
  // descriptors are all files of the driver's one device; a page handed
  // over twice costs only its own import, counted against the region
  // limits.)
  const HandoverKind kind =
      h.magic == kHandoverMagic ? HandoverKind::kMemfdRegions : HandoverKind::kCudaPages;
  std::set<std::pair<dev_t, ino_t>> files;
  for (size_t i = 0; i < fds.size(); ++i) {
    struct stat st;
    absl::Status bad;
    if (::fstat(fds[i].get(), &st) != 0) {
      bad = ErrnoStatus(errno, "fstat of a handed-over descriptor");
    } else if (std::string why = NotWhatItsKindCarries(kind, fds[i].get(), st, cuda_major_);
               !why.empty()) {
      bad = absl::InvalidArgumentError(absl::StrCat("descriptor ", i, " is ", why));
    } else if (kind == HandoverKind::kMemfdRegions &&
               !files.insert({st.st_dev, st.st_ino}).second) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("descriptor ", i,
                       " is a second descriptor of a region already in this "
                       "handover; hand over each region once"));
    }
    if (!bad.ok()) {
      fds.clear();  // closed before the reply goes out
      Refuse(conn.fd.get(), bad);
      return true;
    }
  }
  absl::StatusOr<std::string> token = AddPending(conn.uid, std::move(fds), kind);
  if (!token.ok()) {
    Refuse(conn.fd.get(), token.status());
    return true;
  }
  HandoverReply reply;
  std::memset(&reply, 0, sizeof(reply));
  reply.magic = kHandoverMagic;
  std::memcpy(reply.token, token->data(), kHandoverTokenBytes);
  if (!SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok()) {
    // The client never learns the token: release its descriptors now rather
    // than at expiry.
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(*token);
    if (it != pending_.end()) DropPendingLocked(it);
  }
  return true;
}

absl::Status HandoverServer::CheckLimitsLocked(uid_t uid, size_t nfds) {
  auto it = usage_.find(uid);
  const UidUsage u = it == usage_.end() ? UidUsage{} : it->second;
  if (u.pending >= options_.max_pending_per_uid) {
    return absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " has ", u.pending, " unclaimed handovers (limit ",
                     options_.max_pending_per_uid,
                     ", handover_max_pending_per_uid); register or let them "
                     "expire"));
  }
  if (u.fds + nfds > options_.max_fds_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " holds ", u.fds, " handed-over descriptors in ckptd; ", nfds,
        " more exceed the limit of ", options_.max_fds_per_uid, " (handover_max_fds_per_uid)"));
  }
  if (pending_.size() >= options_.max_pending) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ckptd holds ", pending_.size(), " unclaimed handovers (limit ",
                     options_.max_pending, ", handover_max_pending); retry"));
  }
  if (fds_held_ + nfds > max_fds_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ckptd holds ", fds_held_, " handed-over descriptors; ", nfds,
        " more exceed its node-wide limit of ", max_fds_, " (handover_max_fds); retry"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> HandoverServer::AddPending(uid_t uid, std::vector<UniqueFd> fds,
                                                       HandoverKind kind) {
  std::string token(kHandoverTokenBytes, '\0');
  if (::getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    return ErrnoStatus(errno, "getrandom");
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("ckptd is stopping");
  ExpireLocked();
  CKPT_RETURN_IF_ERROR(CheckLimitsLocked(uid, fds.size()));
  UidUsage& u = usage_[uid];
  u.pending += 1;
  u.fds += fds.size();
  fds_held_ += fds.size();
  pending_[token] = Pending{uid, Now() + options_.token_ttl, std::move(fds), kind};
  return token;
}

void HandoverServer::DropPendingLocked(std::map<std::string, Pending>::iterator it) {
  UidUsage& u = usage_[it->second.uid];
  const size_t n = it->second.fds.size();
  u.pending -= 1;
  u.fds -= n;
  fds_held_ -= n;
  if (u.pending == 0 && u.fds == 0) usage_.erase(it->second.uid);
  pending_.erase(it);
}

void HandoverServer::ReleaseFds(uid_t uid, size_t n) {
  absl::MutexLock lock(&mu_);
  UidUsage& u = usage_[uid];
  u.fds -= n;
  fds_held_ -= n;
  if (u.pending == 0 && u.fds == 0) usage_.erase(uid);
}

void HandoverServer::ExpireLocked() {
  absl::Time now = Now();
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires < now) {
      DropPendingLocked(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<HandoverClaim> HandoverServer::Claim(const std::string& token, uid_t uid,
                                                    HandoverKind kind) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    return absl::NotFoundError("unknown or expired handover token");
  }
  if (it->second.uid != uid) {
    return absl::PermissionDeniedError("handover token belongs to another uid");
  }
  if (it->second.kind != kind) {
    return absl::InvalidArgumentError(
        kind == HandoverKind::kCudaPages
            ? "a GPU page token names memfd regions, not CUDA page descriptors"
            : "the handover token names CUDA page descriptors, not memfd regions");
  }
  HandoverClaim claim;
  claim.server_ = this;
  claim.uid_ = uid;
  claim.counted_ = it->second.fds.size();
  claim.fds_ = std::move(it->second.fds);
  // The token goes; its descriptors stay counted until the claim is destroyed.
  usage_[uid].pending -= 1;
  pending_.erase(it);
  return claim;
}

absl::StatusOr<HandoverClaim> HandoverServer::ClaimAll(absl::Span<const std::string> tokens,
                                                       uid_t uid, HandoverKind kind) {
  HandoverClaim all;
  for (const std::string& token : tokens) {
    CKPT_ASSIGN_OR_RETURN(HandoverClaim one, Claim(token, uid, kind));
    all.Absorb(std::move(one));
  }
  return all;
}

void HandoverServer::Discard(absl::Span<const std::string> tokens, uid_t uid) {
  absl::MutexLock lock(&mu_);
  for (const std::string& token : tokens) {
    auto it = pending_.find(token);
    if (it != pending_.end() && it->second.uid == uid) DropPendingLocked(it);
  }
}

size_t HandoverServer::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}

HandoverServer::Stats HandoverServer::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.connections = connections_;
  s.pending = pending_.size();
  s.fds_held = fds_held_;
  s.max_fds = max_fds_;
  s.refused = refused_;
  s.accept_errors = accept_errors_;
  return s;
}

}  // namespace ckpt
