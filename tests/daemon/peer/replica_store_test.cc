// ReplicaStore: memory within its budget, disk past it, shares per peer.
#include "daemon/peer/replica_store.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::peer {
namespace {

using ::ckpt::testing::HasCode;
using ::ckpt::testing::RandomBytes;
using ::ckpt::testing::TempDir;

ReplicaStoreOptions Small(const TempDir& dir) {
  ReplicaStoreOptions o;
  o.dir = dir.Join("replicas");
  o.memory_bytes = 1000;
  o.max_bytes = 5000;
  o.max_bytes_per_peer = 3000;
  o.max_object_bytes = 2000;
  return o;
}

TEST(ReplicaStoreTest, EveryReplicaIsOnDiskAndTheFirstOnesInMemoryToo) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string a = RandomBytes(1, 800), b = RandomBytes(2, 800);
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/a", a, false).ok());
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/b", b, false).ok());
  ReplicaTotals t = (*store)->Totals();
  EXPECT_EQ(t.memory_bytes, 800u);  // b did not fit the budget
  EXPECT_EQ(t.disk_bytes, 1600u);
  EXPECT_EQ(*(*store)->Get("jobs/j/a", 1 << 20), a);
  EXPECT_EQ(*(*store)->Get("jobs/j/b", 1 << 20), b);
  EXPECT_TRUE(HasCode((*store)->Get("jobs/j/b", 10), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(HasCode((*store)->Get("jobs/j/c", 10), absl::StatusCode::kNotFound));
  auto listed = (*store)->List("jobs/j/");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[1].key, "jobs/j/b");
  EXPECT_EQ((*listed)[1].size, 800u);

  // Both survive a restart (ckptd killed: nothing acknowledged is lost).
  store->reset();
  auto again = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*(*again)->Get("jobs/j/a", 1 << 20), a);
  EXPECT_EQ(*(*again)->Get("jobs/j/b", 1 << 20), b);
  ASSERT_TRUE((*again)->Delete("jobs/j/b").ok());
  EXPECT_EQ((*again)->Totals().disk_bytes, 800u);
  EXPECT_TRUE(HasCode((*again)->Get("jobs/j/b", 1 << 20), absl::StatusCode::kNotFound));
}

TEST(ReplicaStoreTest, OnePeersFloodLeavesRoomForTheOthers) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        (*store)->Put("flood", "jobs/f/" + std::to_string(i), std::string(1000, 'f'), false).ok());
  }
  absl::Status over = (*store)->Put("flood", "jobs/f/3", std::string(1000, 'f'), false);
  EXPECT_TRUE(HasCode(over, absl::StatusCode::kResourceExhausted)) << over;
  EXPECT_NE(over.message().find("share"), std::string::npos) << over;
  EXPECT_TRUE(
      HasCode((*store)->Hold("flood", "jobs/f/4", 1), absl::StatusCode::kResourceExhausted));
  // Replacing its own object within its share is fine.
  EXPECT_TRUE((*store)->Put("flood", "jobs/f/0", std::string(900, 'g'), false).ok());
  EXPECT_EQ((*store)->PeerBytes("flood"), 2900u);
  // Another peer still gets its room, up to the store's whole bound.
  EXPECT_TRUE((*store)->Put("other", "jobs/o/0", std::string(2000, 'o'), false).ok());
  EXPECT_TRUE(HasCode((*store)->Put("other", "jobs/o/1", std::string(200, 'o'), false),
                      absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(HasCode((*store)->Put("other", "jobs/o/2", std::string(2001, 'o'), false),
                      absl::StatusCode::kInvalidArgument));
  // Deleting gives the room back.
  ASSERT_TRUE((*store)->Delete("jobs/f/1").ok());
  EXPECT_EQ((*store)->PeerBytes("flood"), 1900u);
  // Room held for bytes still arriving counts against the bounds.
  ASSERT_TRUE((*store)->Hold("other", "jobs/o/1", 1000).ok());
  EXPECT_TRUE(HasCode((*store)->Put("other", "jobs/o/3", std::string(200, 'o'), false),
                      absl::StatusCode::kResourceExhausted));
  (*store)->Release("other", 1000);
  EXPECT_TRUE((*store)->Put("other", "jobs/o/1", std::string(200, 'o'), false).ok());
}

TEST(ReplicaStoreTest, IfAbsentRefusesAnExistingKey) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/owner", "one", true).ok());
  EXPECT_TRUE(
      HasCode((*store)->Put("n2", "jobs/j/owner", "two", true), absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(*(*store)->Get("jobs/j/owner", 100), "one");
}

}  // namespace
}  // namespace ckpt::peer
