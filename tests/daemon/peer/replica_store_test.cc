// ReplicaStore: every replica on disk, the newest in memory within its
// budget, shares per peer.
#include "daemon/peer/replica_store.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/remote/remote_layout.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::peer {
namespace {

using ::ckpt::testing::HasCode;
using ::ckpt::testing::RandomBytes;
using ::ckpt::testing::TempDir;

const remote::RemoteKey& ClusterKey() {
  static const remote::RemoteKey key = *remote::RemoteKey::FromSecret(std::string(32, 'k'));
  return key;
}

ReplicaStoreOptions Small(const TempDir& dir) {
  ReplicaStoreOptions o;
  o.key = &ClusterKey();
  o.dir = dir.Join("replicas");
  o.memory_bytes = 4096;  // one piece
  o.memory_piece_bytes = 4096;
  o.populate_memory = false;
  o.max_bytes = 5000;
  o.max_bytes_per_peer = 3000;
  o.max_object_bytes = 2000;
  return o;
}

TEST(ReplicaStoreTest, EveryReplicaIsOnDiskAndTheNewestInMemoryToo) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string a = RandomBytes(1, 800), b = RandomBytes(2, 800);
  absl::Status pa = (*store)->Put("n1", "jobs/j/rank-00000000/a", a, false);
  ASSERT_TRUE(pa.ok()) << pa;
  EXPECT_TRUE((*store)->InMemory("jobs/j/rank-00000000/a"));
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/b", b, false).ok());
  ReplicaTotals t = (*store)->Totals();
  EXPECT_EQ(t.memory_bytes, 800u);  // the budget holds one: b took a's place
  EXPECT_EQ(t.disk_bytes, 1600u);
  EXPECT_FALSE((*store)->InMemory("jobs/j/rank-00000000/a"));
  EXPECT_TRUE((*store)->InMemory("jobs/j/rank-00000000/b"));
  EXPECT_EQ(*(*store)->Get("jobs/j/rank-00000000/a", 1 << 20), a);
  EXPECT_EQ(*(*store)->Get("jobs/j/rank-00000000/b", 1 << 20), b);
  EXPECT_TRUE(
      HasCode((*store)->Get("jobs/j/rank-00000000/b", 10), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(HasCode((*store)->Get("jobs/j/rank-00000000/c", 10), absl::StatusCode::kNotFound));
  auto listed = (*store)->List("jobs/j/");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[1].key, "jobs/j/rank-00000000/b");
  EXPECT_EQ((*listed)[1].size, 800u);

  // Both survive a restart (ckptd killed: nothing acknowledged is lost).
  store->reset();
  auto again = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*(*again)->Get("jobs/j/rank-00000000/a", 1 << 20), a);
  EXPECT_EQ(*(*again)->Get("jobs/j/rank-00000000/b", 1 << 20), b);
  ASSERT_TRUE((*again)->Delete("jobs/j/rank-00000000/b").ok());
  EXPECT_EQ((*again)->Totals().disk_bytes, 800u);
  EXPECT_TRUE(
      HasCode((*again)->Get("jobs/j/rank-00000000/b", 1 << 20), absl::StatusCode::kNotFound));
}

TEST(ReplicaStoreTest, OnePeersFloodLeavesRoomForTheOthers) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*store)
                    ->Put("flood", "jobs/f/rank-00000000/" + std::to_string(i),
                          std::string(1000, 'f'), false)
                    .ok());
  }
  absl::Status over =
      (*store)->Put("flood", "jobs/f/rank-00000000/3", std::string(1000, 'f'), false);
  EXPECT_TRUE(HasCode(over, absl::StatusCode::kResourceExhausted)) << over;
  EXPECT_NE(over.message().find("share"), std::string::npos) << over;
  EXPECT_TRUE(HasCode((*store)->Put("flood", "jobs/f/rank-00000000/4", "x", false),
                      absl::StatusCode::kResourceExhausted));
  // Replacing its own object within its share is fine.
  EXPECT_TRUE((*store)->Put("flood", "jobs/f/rank-00000000/0", std::string(900, 'g'), false).ok());
  EXPECT_EQ((*store)->PeerBytes("flood"), 2900u);
  // Another peer still gets its room, up to the store's whole bound.
  EXPECT_TRUE((*store)->Put("other", "jobs/o/rank-00000000/0", std::string(2000, 'o'), false).ok());
  EXPECT_TRUE(
      HasCode((*store)->Put("other", "jobs/o/rank-00000000/1", std::string(200, 'o'), false),
              absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(
      HasCode((*store)->Put("other", "jobs/o/rank-00000000/2", std::string(2001, 'o'), false),
              absl::StatusCode::kInvalidArgument));
  // Deleting gives the room back.
  ASSERT_TRUE((*store)->Delete("jobs/f/rank-00000000/1").ok());
  EXPECT_EQ((*store)->PeerBytes("flood"), 1900u);
  // Room held for bytes still arriving counts against the bounds: a put
  // made while they arrive is refused.
  const std::string late(1000, 'l');
  int calls = 0;
  absl::Status during;
  ASSERT_TRUE((*store)
                  ->Receive("other", "jobs/o/rank-00000000/1", late.size(), false,
                            [&](std::string_view* piece) {
                              if (calls++ > 0) return false;
                              during = (*store)->Put("other", "jobs/o/rank-00000000/3",
                                                     std::string(200, 'o'), false);
                              *piece = late;
                              return true;
                            })
                  .ok());
  EXPECT_TRUE(HasCode(during, absl::StatusCode::kResourceExhausted)) << during;
  // A second receipt of one key while the first runs is refused, so memory
  // and disk always hold one writer's bytes.
  calls = 0;
  ASSERT_TRUE((*store)
                  ->Receive("other", "jobs/o/rank-00000000/1", 3, false,
                            [&](std::string_view* piece) {
                              if (calls++ > 0) return false;
                              during =
                                  (*store)->Put("other", "jobs/o/rank-00000000/1", "two", false);
                              *piece = "one";
                              return true;
                            })
                  .ok());
  EXPECT_TRUE(HasCode(during, absl::StatusCode::kAborted)) << during;
  EXPECT_EQ(*(*store)->Get("jobs/o/rank-00000000/1", 10), "one");
  EXPECT_TRUE((*store)->Put("other", "jobs/o/rank-00000000/1", std::string(200, 'o'), false).ok());
}

// A read from memory keeps the pieces it reads: a replica that needs them
// meanwhile goes to disk only, and they come back to the pool afterwards.
TEST(ReplicaStoreTest, AReadInFlightKeepsItsPieces) {
  TempDir dir;
  ReplicaStoreOptions o = Small(dir);
  o.memory_bytes = 2 * 4096;
  o.max_bytes = o.max_bytes_per_peer = o.max_object_bytes = 1 << 20;
  auto store = ReplicaStore::Open(o);
  ASSERT_TRUE(store.ok());
  const std::string a = RandomBytes(3, 4000), b = RandomBytes(4, 4096 + 10);
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/a", a, false).ok());
  std::string read;
  ASSERT_TRUE((*store)
                  ->Read("jobs/j/rank-00000000/a", 1 << 20, 1 << 20,
                         [&](uint64_t, std::string_view piece) {
                           read.append(piece);
                           // b needs both pieces: a leaves memory, but this
                           // read still holds its piece.
                           EXPECT_TRUE(
                               (*store)->Put("n1", "jobs/j/rank-00000000/b", b, false).ok());
                           return absl::OkStatus();
                         })
                  .ok());
  EXPECT_EQ(read, a);
  EXPECT_FALSE((*store)->InMemory("jobs/j/rank-00000000/a"));
  EXPECT_FALSE((*store)->InMemory("jobs/j/rank-00000000/b"));
  EXPECT_EQ((*store)->Totals().memory_bytes, 0u);
  EXPECT_EQ(*(*store)->Get("jobs/j/rank-00000000/b", 1 << 20), b);
  // The pieces are back: the next replica is kept.
  ASSERT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/b", b, false).ok());
  EXPECT_TRUE((*store)->InMemory("jobs/j/rank-00000000/b"));
  EXPECT_EQ(*(*store)->Get("jobs/j/rank-00000000/b", 1 << 20), b);
}

// Replicas never take the free space this node's own checkpoints need.
TEST(ReplicaStoreTest, ReplicasLeaveTheReservedFreeSpace) {
  TempDir dir;
  ReplicaStoreOptions o = Small(dir);
  struct statvfs fs;
  ASSERT_EQ(statvfs(dir.path().c_str(), &fs), 0);
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  o.min_free_disk_bytes = free_bytes + (1 << 20);  // more than is free
  auto store = ReplicaStore::Open(o);
  ASSERT_TRUE(store.ok());
  absl::Status full = (*store)->Put("n1", "jobs/j/rank-00000000/a", "abc", false);
  EXPECT_TRUE(HasCode(full, absl::StatusCode::kResourceExhausted)) << full;
  EXPECT_NE(full.message().find("min_free_disk_bytes"), std::string::npos) << full;
  EXPECT_EQ((*store)->Totals().objects, 0u);
  o.min_free_disk_bytes = free_bytes / 2;  // what every test machine has
  store->reset();
  store = ReplicaStore::Open(o);
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/a", "abc", false).ok());
}

TEST(ReplicaStoreTest, IfAbsentRefusesAnExistingKey) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok());
  const std::string m = "jobs/j/rank-00000000/m/S0000000000000001";
  ASSERT_TRUE((*store)->Put("n1", m, "one", true).ok());
  EXPECT_TRUE(HasCode((*store)->Put("n2", m, "two", true), absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(*(*store)->Get(m, 100), "one");
}

// Pieces of any size, an object not a multiple of the disk's block, read
// back from disk (past the memory budget) after a restart.
class ReplicaPiecesTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(ReplicaPiecesTest, PiecesOfAnySizeComeBackWhole) {
  TempDir dir;
  ReplicaStoreOptions o = Small(dir);
  o.memory_bytes = GetParam();  // none, or memory pieces that cut the pieces anywhere
  o.memory_piece_bytes = 3 * 4096;
  o.max_bytes = o.max_bytes_per_peer = o.max_object_bytes = 8 << 20;
  auto store = ReplicaStore::Open(o);
  ASSERT_TRUE(store.ok());
  const std::string big = RandomBytes(7, (3 << 20) + 4097);
  size_t off = 0, cut = 1;
  ASSERT_TRUE((*store)
                  ->Receive("n1", "jobs/j/rank-00000000/big", big.size(), false,
                            [&](std::string_view* piece) {
                              if (off == big.size()) return false;
                              cut = cut * 7 % 1000003 + 1;  // 1 byte to about 1 MiB
                              *piece = std::string_view(big).substr(off, cut);
                              off += piece->size();
                              return true;
                            })
                  .ok());
  EXPECT_EQ((*store)->Totals().memory_bytes, o.memory_bytes > 0 ? big.size() : 0u);
  auto first = (*store)->Get("jobs/j/rank-00000000/big", 8 << 20);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(*first == big);
  store->reset();
  auto again = ReplicaStore::Open(o);
  ASSERT_TRUE(again.ok());
  auto got = (*again)->Get("jobs/j/rank-00000000/big", 8 << 20);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == big);
  // A read holds one piece at a time, from disk as from memory.
  ASSERT_TRUE((*again)->Put("n1", "jobs/j/rank-00000000/empty", "", false).ok());
  for (const char* key : {"jobs/j/rank-00000000/big", "jobs/j/rank-00000000/empty"}) {
    std::string joined;
    size_t largest = 0, pieces = 0;
    ASSERT_TRUE((*again)
                    ->Read(key, 8 << 20, 64 << 10,
                           [&](uint64_t size, std::string_view piece) {
                             EXPECT_EQ(size, std::string_view(key) == "jobs/j/rank-00000000/big"
                                                 ? big.size()
                                                 : 0);
                             largest = std::max(largest, piece.size());
                             ++pieces;
                             joined.append(piece);
                             return absl::OkStatus();
                           })
                    .ok());
    EXPECT_LE(largest, size_t{64} << 10);
    EXPECT_GE(pieces, 1u);
    EXPECT_TRUE(joined ==
                (std::string_view(key) == "jobs/j/rank-00000000/big" ? big : std::string()));
  }
  // A sink's error stops the read.
  int calls = 0;
  absl::Status stopped =
      (*again)->Read("jobs/j/rank-00000000/big", 8 << 20, 64 << 10, [&](uint64_t, auto) {
        ++calls;
        return absl::CancelledError("the peer left");
      });
  EXPECT_TRUE(HasCode(stopped, absl::StatusCode::kCancelled));
  EXPECT_EQ(calls, 1);
}
INSTANTIATE_TEST_SUITE_P(MemoryOrNot, ReplicaPiecesTest,
                         ::testing::Values(uint64_t{0}, uint64_t{8} << 20));

// A receipt that yields more or fewer bytes than announced, or fails, stores
// nothing and leaves no room taken; a temp file a crash left is removed at
// the next start.
TEST(ReplicaStoreTest, ACutShortReceiptStoresNothing) {
  TempDir dir;
  auto store = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(store.ok());
  auto yielding = [](std::vector<std::string> pieces, absl::Status end) {
    return [pieces, end, i = size_t{0}](std::string_view* piece) mutable -> absl::StatusOr<bool> {
      if (i == pieces.size()) {
        if (!end.ok()) return end;
        return false;
      }
      *piece = pieces[i++];
      return true;
    };
  };
  EXPECT_TRUE(HasCode((*store)->Receive("n1", "jobs/j/rank-00000000/a", 10, false,
                                        yielding({"01234", "567890"}, absl::OkStatus())),
                      absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(HasCode((*store)->Receive("n1", "jobs/j/rank-00000000/a", 10, false,
                                        yielding({"01234"}, absl::OkStatus())),
                      absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(HasCode((*store)->Receive("n1", "jobs/j/rank-00000000/a", 10, false,
                                        yielding({"01234"}, absl::CancelledError("peer left"))),
                      absl::StatusCode::kCancelled));
  EXPECT_TRUE(HasCode((*store)->Get("jobs/j/rank-00000000/a", 100), absl::StatusCode::kNotFound));
  EXPECT_EQ((*store)->PeerBytes("n1"), 0u);
  // All of the share is free again.
  EXPECT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/b", std::string(2000, 'b'), false).ok());
  EXPECT_TRUE((*store)->Put("n1", "jobs/j/rank-00000000/c", std::string(1000, 'c'), false).ok());

  const std::string left = dir.Join("replicas/jobs/j/.tmp.d.1.1");
  ::ckpt::testing::WriteFile(left, "half");
  store->reset();
  auto again = ReplicaStore::Open(Small(dir));
  ASSERT_TRUE(again.ok());
  EXPECT_NE(::access(left.c_str(), F_OK), 0);
  EXPECT_EQ(*(*again)->Get("jobs/j/rank-00000000/c", 1000), std::string(1000, 'c'));
}

// The per-uid quota a test gives replicas (the engine's QuotaTable in ckptd).
class TestCharges final : public ReplicaCharges {
 public:
  explicit TestCharges(uint64_t per_uid) : per_uid_(per_uid) {}
  absl::Status Reserve(uid_t uid, uint64_t bytes, uint64_t replaced) override {
    absl::MutexLock lock(&mu_);
    if (held_[uid] - std::min(held_[uid], replaced) + bytes > per_uid_) {
      return absl::ResourceExhaustedError(absl::StrCat("uid ", uid, "'s quota"));
    }
    held_[uid] += bytes;
    return absl::OkStatus();
  }
  void Release(uid_t uid, uint64_t bytes) override {
    absl::MutexLock lock(&mu_);
    held_[uid] -= bytes;
  }
  void Seed(uid_t uid, uint64_t bytes) override {
    absl::MutexLock lock(&mu_);
    held_[uid] += bytes;
  }
  uint64_t held(uid_t uid) {
    absl::MutexLock lock(&mu_);
    return held_[uid];
  }

 private:
  const uint64_t per_uid_;
  absl::Mutex mu_;
  std::map<uid_t, uint64_t> held_ ABSL_GUARDED_BY(mu_);
};

std::string OwnerRecord(const std::string& job, uid_t uid,
                        const remote::RemoteKey& key = ClusterKey()) {
  store::RemoteJob rec;
  rec.set_job_id(job);
  rec.set_owner_uid(uid);
  return remote::EncodeOwner(rec, key);
}

// Replicas count against the quota of the uid that owns their job, named
// by the job's owner record; a record the cluster key does not vouch for
// is refused, a replica of a job with no owner record too, and a restart
// charges the owners again from the records on disk.
TEST(ReplicaStoreTest, ReplicasAreChargedToTheirJobsOwner) {
  TempDir dir;
  TestCharges charges(/*per_uid=*/2500);
  ReplicaStoreOptions o = Small(dir);
  o.charges = &charges;
  o.max_bytes = o.max_bytes_per_peer = 1 << 20;
  auto store = ReplicaStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string v = remote::RankPrefix("j", 0) + "v/";
  EXPECT_TRUE(HasCode((*store)->Put("n1", v + "a", std::string(100, 'a'), false),
                      absl::StatusCode::kFailedPrecondition));
  // Forged: another key's MAC, or bytes that are no record at all.
  const absl::Status forged = (*store)->Put(
      "n1", remote::OwnerKey("j"),
      OwnerRecord("j", 0, *remote::RemoteKey::FromSecret(std::string(32, 'x'))), true);
  EXPECT_TRUE(HasCode(forged, absl::StatusCode::kDataLoss)) << forged;
  EXPECT_TRUE(HasCode((*store)->Put("n1", remote::OwnerKey("j"), "mine", true),
                      absl::StatusCode::kDataLoss));
  EXPECT_TRUE(HasCode((*store)->Get(remote::OwnerKey("j"), 1 << 20), absl::StatusCode::kNotFound));
  // A record of another job at this job's key.
  EXPECT_TRUE(HasCode((*store)->Put("n1", remote::OwnerKey("j"), OwnerRecord("k", 1001), true),
                      absl::StatusCode::kDataLoss));
  const std::string owner = OwnerRecord("j", 1001);
  ASSERT_TRUE((*store)->Put("n1", remote::OwnerKey("j"), owner, true).ok());
  // A forged record never takes the place of the good one.
  EXPECT_TRUE(HasCode((*store)->Put("n1", remote::OwnerKey("j"), "forged", false),
                      absl::StatusCode::kDataLoss));
  EXPECT_EQ(*(*store)->Get(remote::OwnerKey("j"), 1 << 20), owner);
  ASSERT_TRUE((*store)->Put("n1", v + "a", std::string(1000, 'a'), false).ok());
  ASSERT_TRUE((*store)->Put("n2", v + "b", std::string(1000, 'b'), false).ok());
  EXPECT_EQ(charges.held(1001), owner.size() + 2000);
  const absl::Status over = (*store)->Put("n1", v + "c", std::string(1000, 'c'), false);
  EXPECT_TRUE(HasCode(over, absl::StatusCode::kResourceExhausted)) << over;
  EXPECT_EQ(charges.held(1001), owner.size() + 2000);
  // Replaced by as many bytes near the quota (the old bytes go once the
  // new are stored), then by fewer, deleted: the charge follows.
  const absl::Status same = (*store)->Put("n1", v + "a", std::string(1000, 'A'), false);
  EXPECT_TRUE(same.ok()) << same;
  EXPECT_EQ(charges.held(1001), owner.size() + 2000);
  ASSERT_TRUE((*store)->Put("n1", v + "a", std::string(300, 'a'), false).ok());
  ASSERT_TRUE((*store)->Delete(v + "b").ok());
  EXPECT_EQ(charges.held(1001), owner.size() + 300);
  EXPECT_EQ(charges.held(0), 0u);
  // Keys outside ckptd's layout are refused.
  EXPECT_TRUE(
      HasCode((*store)->Put("n1", "elsewhere/x", "x", false), absl::StatusCode::kInvalidArgument));
  // After a restart the owner record on disk charges its job's replicas.
  store->reset();
  TestCharges again(2500);
  o.charges = &again;
  auto reopened = ReplicaStore::Open(o);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ(again.held(1001), owner.size() + 300);
  ASSERT_TRUE((*reopened)->Delete(v + "a").ok());
  EXPECT_EQ(again.held(1001), owner.size());
}

}  // namespace
}  // namespace ckpt::peer
