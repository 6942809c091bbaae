#include "daemon/peer/peer_node.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt::peer {

absl::Status PeerConfig::Validate() const {
  if (!enabled()) return absl::OkStatus();
  if (cert_file.empty() || tls_key_file.empty() || ca_file.empty()) {
    return absl::InvalidArgumentError(
        "peer replication needs peer_cert_file, peer_tls_key_file and peer_ca_file: peers "
        "authenticate each other with mutual TLS");
  }
  if (!address.empty() && name.empty()) {
    return absl::InvalidArgumentError(
        "peer_address needs peer_name: the common name the peer's certificate must carry");
  }
  if (memory_bytes > max_replica_bytes || max_bytes_per_peer > max_replica_bytes) {
    return absl::InvalidArgumentError(
        "peer_memory_bytes and peer_max_bytes_per_peer must be at most peer_max_replica_bytes");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PeerNode>> PeerNode::Start(const PeerConfig& config,
                                                          const std::string& data_dir,
                                                          Metrics* metrics) {
  std::unique_ptr<PeerNode> node(new PeerNode());
  node->metrics_ = metrics;
  if (!config.enabled()) return node;
  CKPT_RETURN_IF_ERROR(config.Validate());
  CKPT_ASSIGN_OR_RETURN(PeerTls tls,
                        PeerTls::FromFiles(config.cert_file, config.tls_key_file, config.ca_file));
  if (!config.listen.empty()) {
    ReplicaStoreOptions so;
    so.dir = absl::StrCat(data_dir, "/replicas");
    so.memory_bytes = config.memory_bytes;
    so.max_bytes = config.max_replica_bytes;
    so.max_bytes_per_peer = config.max_bytes_per_peer;
    so.max_object_bytes = config.max_bytes_per_peer;
    so.min_free_disk_bytes = config.min_free_disk_bytes;
    CKPT_ASSIGN_OR_RETURN(node->replicas_, ReplicaStore::Open(std::move(so)));
    ReplicaServerOptions ro;
    ro.listen = config.listen;
    ro.tls = tls;
    for (absl::string_view n : absl::StrSplit(config.allow, ',', absl::SkipWhitespace())) {
      ro.allowed_peers.insert(std::string(absl::StripAsciiWhitespace(n)));
    }
    CKPT_ASSIGN_OR_RETURN(node->server_,
                          ReplicaServer::Start(std::move(ro), node->replicas_.get(), metrics));
    CKPT_LOG(INFO) << "peer replicas: serving on " << config.listen << " (port "
                   << node->server_->port() << "), "
                   << (config.allow.empty() ? std::string("any peer the CA signed")
                                            : absl::StrCat("peers ", config.allow));
  }
  if (!config.address.empty()) {
    PeerStoreOptions po;
    po.address = config.address;
    po.server_name = config.name;
    po.tls = std::move(tls);
    po.rate_bytes_per_s = config.rate_bytes;
    po.call_timeout = absl::Milliseconds(config.timeout_ms);
    po.calls_at_once = config.calls_at_once;
    po.connections = config.calls_at_once;  // one per upload thread
    node->store_ = std::make_unique<PeerStore>(std::move(po));
    CKPT_LOG(INFO) << "peer tier: " << node->store_->Describe()
                   << (config.rate_bytes > 0 ? absl::StrCat(", at most ", config.rate_bytes, " B/s")
                                             : std::string());
  }
  return node;
}

PeerNode::~PeerNode() { Shutdown(absl::Now()); }

void PeerNode::CollectMetrics() {
  if (metrics_ == nullptr || replicas_ == nullptr) return;
  ReplicaTotals t = replicas_->Totals();
  metrics_->Set(Gauge::kPeerReplicaBytes, "memory", static_cast<double>(t.memory_bytes));
  metrics_->Set(Gauge::kPeerReplicaBytes, "disk", static_cast<double>(t.disk_bytes));
}

void PeerNode::Shutdown(absl::Time deadline) {
  if (server_ != nullptr) server_->Shutdown(deadline);
}

}  // namespace ckpt::peer
