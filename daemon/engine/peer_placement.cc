#include "daemon/engine/peer_placement.h"

#include <algorithm>
#include <map>
#include <set>

namespace ckpt {
namespace {

// `ring` rotated to start after `self` (unchanged when self is not in it).
std::vector<std::string> After(const std::vector<std::string>& ring, const std::string& self) {
  auto it = std::find(ring.begin(), ring.end(), self);
  if (it == ring.end()) return ring;
  std::vector<std::string> out(it + 1, ring.end());
  out.insert(out.end(), ring.begin(), it);
  return out;
}

}  // namespace

std::vector<size_t> PlacePeers(const PlacementInput& in) {
  std::map<std::string, size_t> index;  // cluster name -> its entry
  for (size_t i = 0; i < in.cluster.size(); ++i) index.emplace(in.cluster[i].name, i);

  // The job's distinct nodes, by first rank; then the cluster's ring.
  std::vector<std::string> job_ring;
  std::set<std::string> seen;
  for (const std::string& n : in.job_nodes) {
    if (seen.insert(n).second) job_ring.push_back(n);
  }
  std::vector<std::string> cluster_ring;
  for (const PeerNodeInfo& n : in.cluster) cluster_ring.push_back(n.name);

  std::vector<size_t> candidates;
  std::set<size_t> taken;
  for (const std::vector<std::string>& ring :
       {After(job_ring, in.self), After(cluster_ring, in.self)}) {
    for (const std::string& n : ring) {
      auto it = index.find(n);
      if (n == in.self || it == index.end() || !taken.insert(it->second).second) continue;
      candidates.push_back(it->second);
    }
  }

  std::vector<size_t> chosen;
  std::set<std::string> racks;  // racks that hold a copy of the version
  if (!in.self_rack.empty()) racks.insert(in.self_rack);
  std::vector<bool> used(candidates.size(), false);
  // First the nodes in racks without a copy (or of unknown rack), then,
  // unless racks are required to differ, the others in ring order.
  for (int pass = 0; pass < 2 && chosen.size() < in.copies; ++pass) {
    if (pass == 1 && in.require_other_rack) break;
    for (size_t c = 0; c < candidates.size() && chosen.size() < in.copies; ++c) {
      if (used[c]) continue;
      const std::string& rack = in.cluster[candidates[c]].rack;
      if (pass == 0 && !rack.empty() && racks.count(rack) > 0) continue;
      used[c] = true;
      chosen.push_back(candidates[c]);
      if (!rack.empty()) racks.insert(rack);
    }
  }
  return chosen;
}

}  // namespace ckpt
