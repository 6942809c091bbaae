// PlacePeers: the job's ring first, then the cluster's; never this node or
// one node twice; racks spread the copies.
#include "daemon/engine/peer_placement.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ckpt {
namespace {

std::vector<std::string> Names(const PlacementInput& in) {
  std::vector<std::string> out;
  for (size_t i : PlacePeers(in)) out.push_back(in.cluster[i].name);
  return out;
}

PlacementInput Cluster(const std::string& self, uint32_t copies, std::vector<PeerNodeInfo> nodes) {
  PlacementInput in;
  in.self = self;
  in.copies = copies;
  in.cluster = std::move(nodes);
  for (const PeerNodeInfo& n : in.cluster) {
    if (n.name == self) in.self_rack = n.rack;
  }
  return in;
}

using V = std::vector<std::string>;

TEST(PeerPlacement, TheJobsRingFromThisNodeOn) {
  PlacementInput in = Cluster("b", 2, {{"a", ""}, {"b", ""}, {"c", ""}, {"d", ""}, {"e", ""}});
  // Ranks on d, b, b, e, a: the ring d -> b -> e -> a; after b come e, a.
  in.job_nodes = {"d", "b", "b", "e", "a"};
  EXPECT_EQ(Names(in), (V{"e", "a"}));
  in.copies = 4;  // the job has 3 other nodes; the cluster gives c
  EXPECT_EQ(Names(in), (V{"e", "a", "d", "c"}));
  in.copies = 9;  // no more than there are, never b itself
  EXPECT_EQ(Names(in), (V{"e", "a", "d", "c"}));
}

TEST(PeerPlacement, WithoutTopologyTheClustersRing) {
  PlacementInput in = Cluster("c", 2, {{"a", ""}, {"b", ""}, {"c", ""}, {"d", ""}});
  EXPECT_EQ(Names(in), (V{"d", "a"}));
  // A node not in peer_nodes starts at the list's head.
  in.self = "z";
  EXPECT_EQ(Names(in), (V{"a", "b"}));
  // A job node ckptd cannot reach (not in peer_nodes) is passed over.
  in.self = "c";
  in.job_nodes = {"c", "x", "a"};
  EXPECT_EQ(Names(in), (V{"a", "d"}));
}

TEST(PeerPlacement, RacksSpreadTheCopies) {
  PlacementInput in =
      Cluster("a1", 2, {{"a1", "r1"}, {"a2", "r1"}, {"b1", "r2"}, {"b2", "r2"}, {"c1", "r3"}});
  // The ring after a1: a2 (r1, this node's rack), b1 (r2), b2 (r2 again),
  // c1 (r3): other racks first, each once.
  EXPECT_EQ(Names(in), (V{"b1", "c1"}));
  in.copies = 4;  // then the rest in ring order
  EXPECT_EQ(Names(in), (V{"b1", "c1", "a2", "b2"}));
  in.require_other_rack = true;  // fewer copies rather than two in a rack
  EXPECT_EQ(Names(in), (V{"b1", "c1"}));
  // A node of unknown rack counts as a rack of its own.
  in.cluster.push_back({"u", ""});
  EXPECT_EQ(Names(in), (V{"b1", "c1", "u"}));
}

TEST(PeerPlacement, NothingToPlaceOn) {
  PlacementInput in = Cluster("a", 1, {{"a", ""}});
  EXPECT_TRUE(PlacePeers(in).empty());
  in.cluster.clear();
  EXPECT_TRUE(PlacePeers(in).empty());
}

}  // namespace
}  // namespace ckpt
