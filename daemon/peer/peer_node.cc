#include "daemon/peer/peer_node.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/validate.h"

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
  if (copies == 0) return absl::InvalidArgumentError("peer_copies must be at least 1");
  CKPT_RETURN_IF_ERROR(Nodes().status());
  if (memory_bytes > max_replica_bytes || max_bytes_per_peer > max_replica_bytes) {
    return absl::InvalidArgumentError(
        "peer_memory_bytes and peer_max_bytes_per_peer must be at most peer_max_replica_bytes");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PeerNodeEntry>> PeerConfig::Nodes() const {
  std::vector<PeerNodeEntry> out;
  std::set<std::string> names;
  auto add = [&](PeerNodeEntry e) -> absl::Status {
    if (absl::Status s = ValidateNodeName(e.name); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("peer_nodes: ", s.message()));
    }
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("peer_nodes names ", e.name, " twice"));
    }
    if (e.address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer_nodes: node ", e.name, " has no host:port (", e.address, ")"));
    }
    out.push_back(std::move(e));
    return absl::OkStatus();
  };
  for (absl::string_view entry : absl::StrSplit(nodes, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer_nodes entry '", entry, "' is not name=host:port[@rack]"));
    }
    PeerNodeEntry e;
    e.name = std::string(absl::StripAsciiWhitespace(entry.substr(0, eq)));
    absl::string_view where = absl::StripAsciiWhitespace(entry.substr(eq + 1));
    if (const size_t at = where.rfind('@'); at != absl::string_view::npos) {
      e.rack = std::string(where.substr(at + 1));
      where = where.substr(0, at);
    }
    e.address = std::string(where);
    CKPT_RETURN_IF_ERROR(add(std::move(e)));
  }
  if (!address.empty()) CKPT_RETURN_IF_ERROR(add(PeerNodeEntry{name, address, ""}));
  return out;
}

absl::StatusOr<std::unique_ptr<PeerNode>> PeerNode::Start(const PeerConfig& config,
                                                          const std::string& data_dir,
                                                          Metrics* metrics,
                                                          const remote::RemoteKey* key,
                                                          ReplicaCharges* charges) {
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
    so.key = key;
    so.charges = charges;
    CKPT_ASSIGN_OR_RETURN(node->replicas_, ReplicaStore::Open(std::move(so)));
    ReplicaServerOptions ro;
    ro.listen = config.listen;
    ro.tls = tls;
    ro.idle_timeout = absl::Milliseconds(config.timeout_ms);
    for (absl::string_view n : absl::StrSplit(config.allow, ',', absl::SkipWhitespace())) {
      ro.allowed_peers.insert(std::string(absl::StripAsciiWhitespace(n)));
    }
    node->serve_ = std::move(ro);
  }
  // This node: its certificate's common name, its rack.
  node->self_ = tls.CommonName();
  // Trainers report it for placement, and ckptd checks what they report.
  if (absl::Status s = ValidateNodeName(node->self_); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer_cert_file ", config.cert_file,
                     ": its common name names this node among its peers: ", s.message()));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<PeerNodeEntry> nodes, config.Nodes());
  node->rack_ = config.rack;
  std::vector<PeerNodeEntry> others;
  for (PeerNodeEntry& e : nodes) {
    if (e.name == node->self_) {
      if (node->rack_.empty()) node->rack_ = e.rack;
      continue;
    }
    others.push_back(std::move(e));
  }
  // One rate cap for every peer: F copies share what training leaves.
  auto cap = std::make_shared<RateCap>(config.rate_bytes);
  for (PeerNodeEntry& e : others) {
    PeerStoreOptions po;
    po.address = e.address;
    po.server_name = e.name;
    po.tls = tls;
    po.cap = cap;
    po.call_timeout = absl::Milliseconds(config.timeout_ms);
    // Every peer node's uploader runs its threads under the one cap.
    po.calls_at_once =
        config.calls_at_once * static_cast<uint32_t>(std::max<size_t>(1, others.size()));
    po.connections = config.calls_at_once;  // one per upload thread
    node->stores_.push_back(std::make_unique<PeerStore>(std::move(po)));
    node->links_.push_back(PeerLink{std::move(e), node->stores_.back().get()});
  }
  if (!node->links_.empty()) {
    std::vector<std::string> names;
    for (const PeerLink& l : node->links_) names.push_back(l.store->Describe());
    CKPT_LOG(INFO) << "peer tier: node " << node->self_
                   << (node->rack_.empty() ? "" : absl::StrCat(" in rack ", node->rack_)) << ", "
                   << config.copies << (config.copies == 1 ? " copy" : " copies")
                   << " of each version on " << absl::StrJoin(names, ", ")
                   << (config.rate_bytes > 0 ? absl::StrCat(", at most ", config.rate_bytes, " B/s")
                                             : std::string());
  }
  return node;
}

absl::Status PeerNode::Serve() {
  if (!serve_.has_value()) return absl::OkStatus();
  const std::string listen = serve_->listen;
  const bool any = serve_->allowed_peers.empty();
  CKPT_ASSIGN_OR_RETURN(server_,
                        ReplicaServer::Start(*std::move(serve_), replicas_.get(), metrics_));
  serve_.reset();
  CKPT_LOG(INFO) << "peer replicas: serving on " << listen << " (port " << server_->port() << "), "
                 << (any ? "any peer the CA signed" : "the peers of peer_allow");
  return absl::OkStatus();
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
