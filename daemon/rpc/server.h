// RpcServer: the gRPC front of ckptd on a Unix socket.
//
// ckptd accepts connections itself, reads each peer's uid/gid/pid with
// SO_PEERCRED and only then hands the connection to gRPC
// (grpc::AddInsecureChannelFromFd). Handlers find the caller's identity from
// the connection ("fd:N" peer string), never from request fields. The socket
// is created 0660 (main.cc creates its directory 0750).
//
// Handlers are thin: validate, convert, call the Engine, convert the Status
// back (status_convert.h). Messages above max_message_bytes are refused by
// gRPC itself. Also served: the standard health service and reflection.
//
// Thread-safety: Start/Shutdown from one thread; handlers run on gRPC threads.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
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
  int max_message_bytes = 64 << 20;
  std::string config_text;  // the effective config, served by Admin.Config
  // Calls in flight at once: per uid over every method (so a flooding user
  // cannot take every server thread), and node-wide for the heavy admin
  // methods (Verify, Export, Gc), which read whole histories. Beyond them a
  // call fails at once with RESOURCE_EXHAUSTED.
  int max_calls_per_uid = 64;
  int max_heavy_calls = 4;
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

  // Admission of one call of `uid` (see RpcServerOptions); LeaveCall undoes
  // a successful EnterCall.
  absl::Status EnterCall(uid_t uid, bool heavy);
  void LeaveCall(uid_t uid, bool heavy);

 private:
  void AcceptLoop();

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
  std::map<int, PeerCred> peers_ ABSL_GUARDED_BY(mu_);  // by connection fd
  std::map<uid_t, int> calls_by_uid_ ABSL_GUARDED_BY(mu_);
  int heavy_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
