// HandoverServer: the daemon's end of the handover socket (handover_wire.h).
//
// One thread runs a poll loop over the listening socket and every open
// handover connection; each connection is non-blocking and has a deadline,
// so a client that connects and sends nothing delays nobody: other
// connections are served as soon as their message arrives, and the idle one
// is refused with DEADLINE_EXCEEDED when its deadline passes. No thread is
// created per connection.
//
// Received descriptors wait in a bounded table under a random token until a
// Register call from the same uid claims them (Claim) or they expire.
//
// Limits (HandoverOptions), each refused with RESOURCE_EXHAUSTED and a
// message naming the limit, leaving every other uid served:
//   - open connections per uid and node-wide;
//   - unclaimed tokens per uid and node-wide;
//   - descriptors held per uid and node-wide, where "held" is every
//     descriptor the server has received and not yet seen closed: those
//     waiting under a token, those claimed by a Register that is still
//     running, and those of every live registration (each keeps its
//     HandoverClaim until its memory is released). Each is also one mapping
//     of ckptd's, so the node-wide cap, derived unless set, keeps
//     `fd_reserve` descriptors free of RLIMIT_NOFILE for RocksDB, io_uring,
//     gRPC and layer files, and `map_reserve` mappings of vm.max_map_count.
// One message that carries two descriptors of the same file (st_dev,
// st_ino) is INVALID_ARGUMENT; all of its descriptors are closed.
//
// When accept fails for lack of descriptors (EMFILE, ENFILE) or memory, the
// loop stops accepting for a back-off period that doubles up to one second
// (the waiting clients stay in the listen backlog), counts the failure and
// logs it at most once per ten seconds.
//
// Thread-safety: all public methods are thread-safe.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/handover_wire.h"
#include "base/unique_fd.h"
#include "daemon/common/accept_backoff.h"
#include "daemon/common/clock.h"
#include "daemon/common/holding.h"

namespace ckpt {

struct HandoverOptions {
  std::string socket_path;
  // How long one connection may take from accept to its complete message.
  absl::Duration connection_deadline = absl::Seconds(5);
  absl::Duration token_ttl = absl::Seconds(120);
  size_t max_pending = 1024;        // unclaimed tokens, node-wide
  size_t max_pending_per_uid = 64;  // unclaimed tokens of one uid
  size_t max_connections = 256;     // open handover connections, node-wide
  size_t max_connections_per_uid = 8;
  size_t max_fds_per_uid = 4096;  // descriptors held for one uid (see above)
  // Descriptors held node-wide; 0 = derived from RLIMIT_NOFILE at Start()
  // (DefaultMaxFds).
  size_t max_fds = 0;
  size_t fd_reserve = 4096;  // kept free for the rest of ckptd when max_fds is derived
  // Mappings kept free of vm.max_map_count when max_fds is derived (each held
  // descriptor of a live registration is one mapping too).
  size_t map_reserve = 8192;
  // First pause of the accept loop after EMFILE/ENFILE; doubles up to 1 s.
  absl::Duration accept_backoff = absl::Milliseconds(50);
  Clock* clock = nullptr;  // token expiry; null = the real clock. Not owned.
  // CUDA page descriptors are files of the NVIDIA driver's control device
  // (cuMemExportToShareableHandle exports into an open /dev/nvidiactl): a
  // CKG1 handover must carry character devices of this file's major number.
  // Read at Start(); when the file is missing, CUDA page handovers are
  // refused (this node's ckptd could not import them either).
  std::string cuda_device_file = "/dev/nvidiactl";
};

class HandoverServer;

// Descriptors claimed with a token. They count against their uid's and the
// node's descriptor caps until this object is destroyed: a registration that
// took the descriptors over keeps it (as a Holding) for as long as it holds
// them, so a uid's live registrations count against its cap too. Move-only.
class HandoverClaim final : public Holding {
 public:
  HandoverClaim() = default;
  ~HandoverClaim() override { Release(); }
  HandoverClaim(HandoverClaim&& other) noexcept;
  HandoverClaim& operator=(HandoverClaim&& other) noexcept;
  HandoverClaim(const HandoverClaim&) = delete;
  HandoverClaim& operator=(const HandoverClaim&) = delete;

  std::vector<UniqueFd>& fds() { return fds_; }

  // Moves the descriptors out; they stay counted until destruction.
  std::vector<UniqueFd> TakeFds() { return std::move(fds_); }

 private:
  friend class HandoverServer;
  void Release();
  // Appends the descriptors of `other`, a claim of the same uid on the same
  // server, which keep counting until this claim is destroyed.
  void Absorb(HandoverClaim&& other);

  HandoverServer* server_ = nullptr;
  uid_t uid_ = 0;
  size_t counted_ = 0;
  std::vector<UniqueFd> fds_;
};

class HandoverServer {
 public:
  // What the server holds and has refused; for tests and logs.
  struct Stats {
    size_t connections = 0;      // open, not yet answered
    size_t pending = 0;          // unclaimed tokens
    size_t fds_held = 0;         // pending + claimed, not yet released
    size_t max_fds = 0;          // the node-wide cap in force
    uint64_t refused = 0;        // handovers refused for a limit or a bad message
    uint64_t accept_errors = 0;  // accept failures that started a back-off
  };

  explicit HandoverServer(HandoverOptions options);
  ~HandoverServer();
  HandoverServer(const HandoverServer&) = delete;
  HandoverServer& operator=(const HandoverServer&) = delete;

  // Binds the socket (mode 0660; a stale socket file is replaced, anything
  // else at the path is refused) and starts the loop thread.
  absl::Status Start();
  // Stops accepting, refuses nothing more, closes every open connection and
  // every unclaimed descriptor. Idempotent. Outstanding HandoverClaims stay
  // valid (they must not outlive the server).
  void Stop();

  // Returns the descriptors handed over under `token` by a process of `uid`.
  // NOT_FOUND for an unknown, expired or already claimed token;
  // PERMISSION_DENIED when it was handed over by another uid.
  // INVALID_ARGUMENT when the token names descriptors of another kind.
  absl::StatusOr<HandoverClaim> Claim(const std::string& token, uid_t uid,
                                      HandoverKind kind = HandoverKind::kMemfdRegions);
  // The descriptors of several tokens (a GPU registration's page batches)
  // as one claim, in token order; the first refusal releases what was
  // claimed before it.
  absl::StatusOr<HandoverClaim> ClaimAll(absl::Span<const std::string> tokens, uid_t uid,
                                         HandoverKind kind);

  // Closes the descriptors `uid` handed over under `tokens` (of any kind)
  // and forgets the tokens: a call refused before it ran gives back what it
  // carried at once instead of at expiry. Tokens unknown, expired or of
  // another uid are left as they are.
  void Discard(absl::Span<const std::string> tokens, uid_t uid);

  size_t pending() const;
  Stats stats() const;

  // The node-wide descriptor cap derived from a RLIMIT_NOFILE soft limit:
  // nofile - reserve, or nofile / 2 when the reserve is more than half of nofile.
  static size_t DefaultMaxFds(uint64_t nofile, size_t reserve);
  // That cap, also bounded by vm.max_map_count less `map_reserve` (0 =
  // unknown: not bounded by it).
  static size_t DefaultMaxFds(uint64_t nofile, size_t reserve, uint64_t max_map_count,
                              size_t map_reserve);

 private:
  friend class HandoverClaim;

  // One accepted connection; owned by the loop thread.
  struct Conn {
    UniqueFd fd;
    uid_t uid;
    absl::Time deadline;  // real time
  };
  struct Pending {
    uid_t uid;
    absl::Time expires;
    std::vector<UniqueFd> fds;
    HandoverKind kind;
  };
  struct UidUsage {
    size_t pending = 0;  // tokens
    size_t fds = 0;      // pending + claimed descriptors
  };

  void Loop();
  // Accepts what the backlog holds (bounded per round); starts a back-off on
  // EMFILE/ENFILE/ENOBUFS/ENOMEM.
  void AcceptSome(std::vector<Conn>* conns, std::map<uid_t, size_t>* per_uid);
  // Reads and answers one readable connection. False: keep waiting for it.
  bool Serve(Conn& conn);
  // Refuses `conn` with `s` (best effort: the socket is non-blocking).
  void Refuse(int fd, const absl::Status& s);
  // Checks the uid's and the node's limits for `nfds` more descriptors and
  // one more token, then stores them under a new token.
  absl::StatusOr<std::string> AddPending(uid_t uid, std::vector<UniqueFd> fds, HandoverKind kind);
  absl::Status CheckLimitsLocked(uid_t uid, size_t nfds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropPendingLocked(std::map<std::string, Pending>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseFds(uid_t uid, size_t n);
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountRefusal();
  absl::Time Now() const {
    return (options_.clock != nullptr ? options_.clock : Clock::Real())->Now();
  }

  // Immutable after Start().
  const HandoverOptions options_;
  size_t max_fds_ = 0;
  // The major device number of options_.cuda_device_file; -1 when missing.
  int64_t cuda_major_ = -1;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd: Stop() wakes the loop through it
  std::thread thread_;

  // Loop thread only.
  AcceptBackoff backoff_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, UidUsage> usage_ ABSL_GUARDED_BY(mu_);  // uids holding something
  size_t fds_held_ ABSL_GUARDED_BY(mu_) = 0;
  size_t connections_ ABSL_GUARDED_BY(mu_) = 0;  // mirror of the loop's count
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t accept_errors_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
