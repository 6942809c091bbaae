// Where the peer tier puts a job's replicas (docs/peer.md, "Placement").
//
// Every node replicates the versions it writes to `copies` (F) other
// nodes, chosen per job from the job's topology: the nodes its ranks run
// on, as the trainer reported them at registration (ckpt.torch gathers
// them over the job's torch.distributed group). The job's nodes form a
// ring in the order of their first rank; this node takes the next nodes
// of that ring that ckptd can reach (those in peer_nodes), then, when the
// job spans fewer nodes than F + 1, the next nodes of the cluster's ring
// (peer_nodes' order). A copy is never placed on this node, nor twice on
// one node. With rack labels, a node whose rack already holds a copy of
// the version (this node's rack included) is taken only when no other is
// left, and never with `require_other_rack`. The same inputs always give
// the same placement, so a restarted ckptd places a job as before.
//
// Thread-safety: a pure function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt {

// A node this node can replicate to.
struct PeerNodeInfo {
  std::string name;  // its certificate's common name
  std::string rack;  // "" = unknown
};

struct PlacementInput {
  std::string self;       // this node's name
  std::string self_rack;  // "" = unknown
  // The node of each rank of the job, in rank order (repeats allowed;
  // empty: the trainer did not say, and the cluster's ring alone counts).
  std::vector<std::string> job_nodes;
  // The nodes in peer_nodes, in the cluster's ring order (this node may be
  // among them).
  std::vector<PeerNodeInfo> cluster;
  uint32_t copies = 1;
  bool require_other_rack = false;
};

// The chosen nodes, as indices into `in.cluster`, at most `in.copies`, in
// the order they were chosen. Fewer when the cluster has fewer nodes to
// offer (the caller warns).
std::vector<size_t> PlacePeers(const PlacementInput& in);

}  // namespace ckpt
