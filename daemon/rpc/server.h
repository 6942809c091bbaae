// RpcServer: the gRPC front of ckptd on a Unix socket.
//
// ckptd accepts connections itself, reads each peer's uid/gid/pid with
// SO_PEERCRED and only then hands the connection to gRPC
// (grpc::AddInsecureChannelFromFd). Handlers find the caller's identity from
// the connection ("fd:N" peer string), never from request fields. The socket
// is created 0660 (main.cc creates its directory 0750).
//
// Handlers are thin: validate, convert, call the Engine, convert the Status
// back (status_convert.h). Also served: the standard health service and
// reflection.
//
// Request sizes (RpcServerOptions): gRPC refuses any message above
// max_message_bytes, the Register cap, once it has received it (gRPC 1.51's
// server applies one receive limit to every method and checks it on the
// reassembled message; per-method limits of a service config apply only to
// clients). Every other method's request is refused above max_request_bytes
// with RESOURCE_EXHAUSTED naming the option, before it is looked at; Register
// calls above max_request_bytes ("large") run at most max_large_calls at once
// node-wide. After a call whose request was above max_request_bytes has freed
// its request, and no other such call is in flight, the server returns free
// heap memory to the kernel (malloc_trim) before the reply goes out, so the
// memory of a burst of large requests does not stay resident.
//
// Connections (RpcServerOptions): one uid may hold at most
// max_connections_per_uid connections and ckptd at most max_connections;
// a connection beyond either is closed as soon as it is accepted. gRPC closes
// a connection's descriptor without telling us, so each accept first forgets
// the connections whose descriptor no longer refers to the socket accepted
// (fstat: device and inode). When accept fails for lack of descriptors or
// memory the loop pauses (AcceptBackoff, sync point
// "RpcServer::AcceptBackoff") instead of spinning on the readable socket.
//
// Thread-safety: Start/Shutdown from one thread; handlers run on gRPC threads.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/common/unix_socket.h"
#include "daemon/engine/engine.h"
#include "daemon/shm/handover.h"

namespace grpc {
class Server;
class ServerContext;
class Service;
}  // namespace grpc

namespace ckpt {

struct RpcServerOptions {
  std::string socket_path;  // DaemonConfig::socket
  // The largest message gRPC accepts in either direction: the cap of a
  // Register request, whose tensor table grows with the model.
  int max_message_bytes = 64 << 20;
  // The cap of every other request (StepDone: aux of at most max_aux_bytes
  // plus per-layer lists; waits, plans, admin calls: tiny).
  int max_request_bytes = 4 << 20;
  // Register calls with a request above max_request_bytes in their handler
  // at once, node-wide; more fail at once with RESOURCE_EXHAUSTED.
  int max_large_calls = 4;
  std::string config_text;  // the effective config, served by Admin.Config
  // Calls in flight at once: per uid over every method (so a flooding user
  // cannot take every server thread), and node-wide for the heavy admin
  // methods (Verify, Export, Gc), which read whole histories. Beyond them a
  // call fails at once with RESOURCE_EXHAUSTED.
  int max_calls_per_uid = 64;
  int max_heavy_calls = 4;
  // Connections open at once, per uid and node-wide; one more is closed as
  // soon as it is accepted (the client sees its connection closed).
  int max_connections_per_uid = 64;
  int max_connections = 1024;
  // First pause of the accept loop after EMFILE/ENFILE; doubles up to 1 s.
  absl::Duration accept_backoff = absl::Milliseconds(50);
};

class RpcServer {
 public:
  RpcServer(RpcServerOptions options, Engine* engine, HandoverServer* handover);
  ~RpcServer();
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  absl::Status Start();
  // Stops accepting, cancels calls still running after `grace`.
  void Shutdown(absl::Duration grace);

  // The identity of the connection a call arrived on. UNAUTHENTICATED when
  // the connection is unknown (it did not come through our accept loop).
  absl::StatusOr<Caller> CallerOf(const grpc::ServerContext& ctx) const;
  Engine* engine() const { return engine_; }
  HandoverServer* handover() const { return handover_; }
  const RpcServerOptions& options() const { return options_; }

  // Admission of one call of `uid` (see RpcServerOptions): `heavy` for
  // Verify/Export/Gc, `large` for a Register above max_request_bytes.
  // RESOURCE_EXHAUSTED naming the option when a cap is reached. LeaveCall
  // undoes a successful EnterCall with the same arguments.
  absl::Status EnterCall(uid_t uid, bool heavy, bool large = false);
  void LeaveCall(uid_t uid, bool heavy, bool large = false);

  // Release of memory after large requests. A handler calls NoteLargeRequest
  // for a call whose request is above max_request_bytes; the server calls
  // FinishCall for every call once the request is freed and before the
  // status is sent. FinishCall returns free heap memory to the kernel when
  // the call was noted and no other noted call is still unfinished, and
  // returns whether it did. `call` only identifies the call.
  void NoteLargeRequest(const void* call);
  bool FinishCall(const void* call);
  // How many times FinishCall released memory.
  uint64_t memory_releases() const;

  struct ConnectionStats {
    size_t open = 0;             // connections still open
    uint64_t refused = 0;        // closed at once: a connection cap was reached
    uint64_t accept_errors = 0;  // accept failures that started a back-off
  };
  // Forgets the connections gRPC has closed first, so `open` is current.
  ConnectionStats connection_stats() const;

 private:
  // A connection accepted by AcceptLoop and handed to gRPC.
  struct Peer {
    PeerCred cred;
    ino_t ino = 0;  // the socket's inode, to tell a reused fd number
  };

  void AcceptLoop();
  // Drops the peers whose fd gRPC has closed (or reused for another file).
  void PrunePeers() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RpcServerOptions options_;
  Engine* const engine_;
  HandoverServer* const handover_;
  std::unique_ptr<grpc::Service> trainer_service_;
  std::unique_ptr<grpc::Service> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  UniqueFd listen_fd_;
  std::thread accept_thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  mutable std::map<int, Peer> peers_ ABSL_GUARDED_BY(mu_);  // by connection fd
  uint64_t connections_refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t accept_errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uid_t, int> calls_by_uid_ ABSL_GUARDED_BY(mu_);
  int heavy_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int large_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<const void*> large_requests_ ABSL_GUARDED_BY(mu_);  // noted, not finished
  uint64_t memory_releases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
