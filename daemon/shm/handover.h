// HandoverServer: the daemon's end of the handover socket (handover_wire.h).
//
// One accept thread; each connection is served inline with a short socket
// timeout, so a slow client delays only other handovers, never the gRPC path.
// Received descriptors wait in a bounded table under a random token until a
// Register call from the same uid claims them (Claim) or they expire.
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
#include "base/unique_fd.h"
#include "daemon/common/clock.h"

namespace ckpt {

struct HandoverOptions {
  std::string socket_path;
  absl::Duration io_timeout = absl::Seconds(5);
  absl::Duration token_ttl = absl::Seconds(120);
  size_t max_pending = 1024;  // tokens waiting to be claimed, node-wide
  Clock* clock = nullptr;     // token expiry; null = the real clock. Not owned.
};

class HandoverServer {
 public:
  explicit HandoverServer(HandoverOptions options);
  ~HandoverServer();
  HandoverServer(const HandoverServer&) = delete;
  HandoverServer& operator=(const HandoverServer&) = delete;

  // Binds the socket (mode 0660; a stale socket file is replaced, anything
  // else at the path is refused) and starts the accept thread.
  absl::Status Start();
  // Stops accepting and closes every unclaimed descriptor. Idempotent.
  void Stop();

  // Returns the descriptors handed over under `token` by a process of `uid`.
  // NOT_FOUND for an unknown, expired or already claimed token;
  // PERMISSION_DENIED when it was handed over by another uid.
  absl::StatusOr<std::vector<UniqueFd>> Claim(const std::string& token, uid_t uid);

  size_t pending() const;

 private:
  struct Pending {
    uid_t uid;
    absl::Time expires;
    std::vector<UniqueFd> fds;
  };

  void AcceptLoop();
  void Serve(UniqueFd conn);
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Time Now() const { return (options_.clock != nullptr ? options_.clock : Clock::Real())->Now(); }

  const HandoverOptions options_;
  UniqueFd listen_fd_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt
