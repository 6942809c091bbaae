// PeerNode: this ckptd's side of peer replication (docs/peer.md), set up
// from the configuration: the replica service it answers its peers with
// (replica_server.h over replica_store.h), and a transport to each node it
// may replicate to (peer_store.h, one per entry of peer_nodes, sharing one
// rate cap), which the engine's peer tier places jobs on. Either may be
// off; both share this node's TLS identity, whose certificate names the
// node.
//
// Thread-safety: Start, then the accessors from any thread; Shutdown once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_store.h"
#include "daemon/peer/replica_server.h"
#include "daemon/peer/replica_store.h"

namespace ckpt::peer {

// One node of peer_nodes.
struct PeerNodeEntry {
  std::string name;     // the common name its certificate carries
  std::string address;  // host:port of its replica service
  std::string rack;     // "" = unknown
};

struct PeerConfig {
  std::string listen;  // host:port of the replica service; "" = not a peer
  // The nodes this node may replicate to, in the cluster's ring order:
  // "name=host:port[@rack], ..." (this node may be among them; it is left
  // out). peer_address/peer_name add one more entry.
  std::string nodes;
  std::string address;              // host:port of a peer this node replicates to; "" = none
  std::string name;                 // the common name the peer's certificate carries
  uint32_t copies = 1;              // copies of each version on other nodes (F)
  std::string rack;                 // this node's rack; "" = its entry's in nodes, if any
  bool require_other_rack = false;  // a copy never in a rack that holds one
  std::string allow;                // comma-separated names that may keep replicas here; "" = any
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

  bool enabled() const { return !listen.empty() || !address.empty() || !nodes.empty(); }
  // INVALID_ARGUMENT for a setting that cannot work.
  absl::Status Validate() const;
  // peer_nodes parsed, then peer_address/peer_name; INVALID_ARGUMENT for
  // an entry that is not name=host:port[@rack] or a name given twice.
  absl::StatusOr<std::vector<PeerNodeEntry>> Nodes() const;
};

// A node this ckptd may replicate to, and the transport to it.
struct PeerLink {
  PeerNodeEntry node;
  remote::RemoteStore* store = nullptr;  // owned by the PeerNode
};

class PeerNode {
 public:
  // Reads the TLS files, makes the transports to the peer nodes and opens
  // the replica store (its objects under <data_dir>/replicas, charged to
  // their owners through `charges`); Serve starts its service. OK with
  // nothing made when `config` is off. `key` (the cluster key) is REQUIRED
  // with peer_listen; `key` and `charges` are not owned and outlive the node.
  static absl::StatusOr<std::unique_ptr<PeerNode>> Start(const PeerConfig& config,
                                                         const std::string& data_dir,
                                                         Metrics* metrics,
                                                         const remote::RemoteKey* key,
                                                         ReplicaCharges* charges);
  // Starts the replica service (with peer_listen; else OK, nothing done).
  absl::Status Serve();
  ~PeerNode();

  // This node's name (its certificate's common name; the host name without
  // a certificate) and rack.
  const std::string& self() const { return self_; }
  const std::string& rack() const { return rack_; }
  // The nodes this node may replicate to (this node left out), in ring
  // order; empty without peer_nodes or peer_address.
  const std::vector<PeerLink>& links() const { return links_; }
  // The replica service's port; 0 without peer_listen.
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void CollectMetrics();
  void Shutdown(absl::Time deadline);

 private:
  PeerNode() = default;
  Metrics* metrics_ = nullptr;
  std::string self_, rack_;
  std::vector<std::unique_ptr<PeerStore>> stores_;
  std::vector<PeerLink> links_;
  std::unique_ptr<ReplicaStore> replicas_;
  std::unique_ptr<ReplicaServer> server_;
  std::optional<ReplicaServerOptions> serve_;  // until Serve
};

}  // namespace ckpt::peer
