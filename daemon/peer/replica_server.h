// ReplicaServer: the replica service (replica.proto) that keeps a peer's
// copies in this node's ReplicaStore (docs/peer.md).
//
// gRPC over TCP with mutual TLS: a client must present a certificate the
// cluster CA signed, and its common name must be in `allowed_peers` (when
// that is not empty). Every call is authenticated before it touches the
// store; a refused peer is told PERMISSION_DENIED and counted. A Put is
// bounded before its bytes arrive (its declared size against the peer's
// share and the store's bound), and its bytes must be exactly that size.
// gRPC's own threads serve the calls (at most `max_threads`); one thread of
// the server's cancels a Put or Get that moved nothing for `idle_timeout`.
//
// Thread-safety: Start once, Shutdown once; the calls are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_tls.h"
#include "daemon/peer/replica_store.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace ckpt::peer {

struct ReplicaServerOptions {
  std::string listen;  // host:port; port 0 picks one (port() says which)
  PeerTls tls;
  std::set<std::string> allowed_peers;  // common names; empty: any the CA signed
  int max_threads = 16;
  uint32_t chunk_bytes = 1 << 20;  // Get's chunks
  // A Put or Get that moves no message for this long is cancelled, so a
  // peer that stops sending or reading mid-call cannot hold a server
  // thread (whatever deadline it set).
  absl::Duration idle_timeout = absl::Seconds(30);
  size_t list_page = 10000;  // keys in one List reply (each at most 1 KiB)
};

class ReplicaServer {
 public:
  // `store` and `metrics` (may be null) outlive the server.
  static absl::StatusOr<std::unique_ptr<ReplicaServer>> Start(ReplicaServerOptions options,
                                                              ReplicaStore* store,
                                                              Metrics* metrics);
  ~ReplicaServer();
  ReplicaServer(const ReplicaServer&) = delete;
  ReplicaServer& operator=(const ReplicaServer&) = delete;

  int port() const { return port_; }
  // Refuses new calls, lets running ones finish until `deadline`, then
  // cancels them.
  void Shutdown(absl::Time deadline);

 private:
  class Service;
  ReplicaServer() = default;

  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace ckpt::peer
