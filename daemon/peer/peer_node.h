// PeerNode: this ckptd's side of peer replication (docs/peer.md), set up
// from the configuration: the replica service it answers its peers with
// (replica_server.h over replica_store.h), and the transport to the peer
// it replicates to (peer_store.h), which the engine's peer tier uses.
// Either may be off; both share this node's TLS identity.
//
// Thread-safety: Start, then the accessors from any thread; Shutdown once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_store.h"
#include "daemon/peer/replica_server.h"
#include "daemon/peer/replica_store.h"

namespace ckpt::peer {

struct PeerConfig {
  std::string listen;   // host:port of the replica service; "" = not a peer
  std::string address;  // host:port of the peer this node replicates to; "" = none
  std::string name;     // the common name the peer's certificate carries
  std::string allow;    // comma-separated names that may keep replicas here; "" = any
  std::string cert_file;
  std::string tls_key_file;
  std::string ca_file;
  uint64_t rate_bytes = 0;  // bytes/s sent to the peer; 0 = no cap
  uint64_t memory_bytes = uint64_t{1} << 30;
  uint64_t max_replica_bytes = uint64_t{64} << 30;
  uint64_t max_bytes_per_peer = uint64_t{32} << 30;
  uint32_t timeout_ms = 30000;              // each call to the peer, plus its bytes at the rate cap
  uint32_t calls_at_once = 4;               // set from peer_upload_threads
  uint64_t min_free_disk_bytes = 64 << 20;  // set from min_free_disk_bytes

  bool enabled() const { return !listen.empty() || !address.empty(); }
  // INVALID_ARGUMENT for a setting that cannot work.
  absl::Status Validate() const;
};

class PeerNode {
 public:
  // Reads the TLS files and starts the replica service (its objects under
  // <data_dir>/replicas). OK with nothing started when `config` is off.
  static absl::StatusOr<std::unique_ptr<PeerNode>> Start(const PeerConfig& config,
                                                         const std::string& data_dir,
                                                         Metrics* metrics);
  ~PeerNode();

  // The transport of the peer tier; null without peer_address.
  remote::RemoteStore* store() const { return store_.get(); }
  // The replica service's port; 0 without peer_listen.
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void CollectMetrics();
  void Shutdown(absl::Time deadline);

 private:
  PeerNode() = default;
  Metrics* metrics_ = nullptr;
  std::unique_ptr<PeerStore> store_;
  std::unique_ptr<ReplicaStore> replicas_;
  std::unique_ptr<ReplicaServer> server_;
};

}  // namespace ckpt::peer
