// MemoryTier over a real staging pool: replacement, eviction order, budget,
// Shrink, DropJob and Drop, and that evicted images return their chunks.
#include "daemon/engine/memory_tier.h"

#include "gtest/gtest.h"
#include "tests/lib/io_test_util.h"

namespace ckpt {
namespace {

constexpr uint64_t kChunk = 64 << 10;
constexpr uint32_t kUid = 1000;

StagingLease Take(StagingPool* pool, uint64_t chunks) {
  absl::StatusOr<StagingLease> l = pool->Acquire(chunks * kChunk, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(l.ok()) << l.status();
  return std::move(*l);
}

TEST(MemoryTier, KeepsTheNewestVersionOfEachLayerWithinItsBudget) {
  std::unique_ptr<StagingPool> pool = testing::MakeTestPool(kChunk, 16);
  MemoryTier tier(4 * kChunk);
  const RankKey r("j", 0);
  tier.Put(r, 0, 1, "a1", kUid, Take(pool.get(), 1));
  tier.Put(r, 1, 1, "b1", kUid, Take(pool.get(), 2));
  EXPECT_EQ(tier.bytes(), 3 * kChunk);
  // A newer version of layer 0 replaces the older one (its chunk returns).
  tier.Put(r, 0, 2, "a2", kUid, Take(pool.get(), 1));
  EXPECT_EQ(tier.bytes(), 3 * kChunk);
  EXPECT_EQ(pool->bytes_in_use(), 3 * kChunk);
  EXPECT_EQ(tier.Find(r, 0, 1, "a1"), nullptr);
  EXPECT_NE(tier.Find(r, 0, 2, "a2"), nullptr);
  EXPECT_EQ(tier.Find(r, 0, 2, "other-file"), nullptr);
  // The newest commit wins, even of an older step (the rank went back).
  tier.Put(r, 0, 1, "a1", kUid, Take(pool.get(), 1));
  EXPECT_EQ(tier.Find(r, 0, 2, "a2"), nullptr);
  EXPECT_NE(tier.Find(r, 0, 1, "a1"), nullptr);
  // Over the budget, the oldest entry (layer 1) goes.
  tier.Put(r, 2, 1, "c1", kUid, Take(pool.get(), 2));
  EXPECT_EQ(tier.Find(r, 1, 1, "b1"), nullptr);
  EXPECT_EQ(tier.bytes(), 3 * kChunk);
  // Larger than the whole budget: not kept, and the layer's older entry
  // goes with it.
  tier.Put(r, 2, 2, "c2", kUid, Take(pool.get(), 5));
  EXPECT_EQ(tier.Find(r, 2, 2, "c2"), nullptr);
  EXPECT_EQ(tier.Find(r, 2, 1, "c1"), nullptr);
  EXPECT_EQ(pool->bytes_in_use(), 1 * kChunk);
}

// A restore that found an image damaged drops it: only that version's
// entry goes (not a newer one put since), and its chunks return.
TEST(MemoryTier, DropRemovesOnlyTheVersionARestoreFoundDamaged) {
  std::unique_ptr<StagingPool> pool = testing::MakeTestPool(kChunk, 8);
  MemoryTier tier(8 * kChunk);
  const RankKey r("j", 0);
  tier.Put(r, 0, 1, "a1", kUid, Take(pool.get(), 2));
  tier.Put(r, 1, 1, "b1", kUid, Take(pool.get(), 1));
  store::VersionRecord rec;
  rec.set_file("a1");
  tier.Drop(VersionKey{"j", 0, 0, 2}, rec);  // another step: kept
  EXPECT_NE(tier.Find(r, 0, 1, "a1"), nullptr);
  tier.Drop(VersionKey{"j", 0, 0, 1}, rec);
  EXPECT_EQ(tier.Find(r, 0, 1, "a1"), nullptr);
  EXPECT_NE(tier.Find(r, 1, 1, "b1"), nullptr);
  EXPECT_EQ(tier.bytes(), 1 * kChunk);
  EXPECT_EQ(pool->bytes_in_use(), 1 * kChunk);
}

// Regression: another uid's snapshots evicted every entry of the victim
// (4 MiB of it in memory before the flood, 0 after). Entries go from the uid
// holding the most first, so a uid's flood evicts its own entries once it
// holds more than the other, and the other keeps what it stored.
TEST(MemoryTier, OneUidsFloodEvictsItsOwnEntriesBeforeAnothersLayers) {
  constexpr uint32_t kVictim = 4242, kHog = 4243;
  std::unique_ptr<StagingPool> pool = testing::MakeTestPool(kChunk, 32);
  MemoryTier tier(8 * kChunk);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    tier.Put(RankKey("victim", 0), layer, 1, "v", kVictim, Take(pool.get(), 1));
  }
  for (uint64_t step = 1; step <= 20; ++step) {  // oldest first would take the victim's
    tier.Put(RankKey("hog", 0), static_cast<uint32_t>(step), step, "h", kHog, Take(pool.get(), 1));
  }
  EXPECT_EQ(tier.bytes_of(kVictim), 2 * kChunk);
  EXPECT_EQ(tier.bytes_of(kHog), 6 * kChunk);
  EXPECT_NE(tier.Find(RankKey("victim", 0), 0, 1, "v"), nullptr);
  EXPECT_NE(tier.Find(RankKey("victim", 0), 1, 1, "v"), nullptr);
  EXPECT_NE(tier.Find(RankKey("hog", 0), 20, 20, "h"), nullptr) << "the hog's newest stays";
  EXPECT_EQ(tier.Find(RankKey("hog", 0), 14, 14, "h"), nullptr) << "its oldest went";
  // The victim may grow up to an equal share, taking the hog's room.
  for (uint32_t layer = 2; layer < 6; ++layer) {
    tier.Put(RankKey("victim", 0), layer, 1, "v", kVictim, Take(pool.get(), 1));
  }
  EXPECT_EQ(tier.bytes_of(kVictim), 4 * kChunk);
  EXPECT_EQ(tier.bytes_of(kHog), 4 * kChunk);
  // A reclaim for the pool takes from the larger holder first too.
  tier.Put(RankKey("hog", 0), 30, 30, "h", kHog, Take(pool.get(), 1));
  tier.Shrink(kChunk);
  EXPECT_EQ(tier.bytes_of(kVictim), 4 * kChunk);
  EXPECT_EQ(tier.bytes_of(kHog), 3 * kChunk);
  EXPECT_EQ(pool->bytes_in_use(), 7 * kChunk);
}

TEST(MemoryTier, ShrinkAndDropJobReturnChunksOnceReadersAreDone) {
  std::unique_ptr<StagingPool> pool = testing::MakeTestPool(kChunk, 16);
  MemoryTier tier(8 * kChunk);
  tier.Put(RankKey("j", 0), 0, 1, "a", kUid, Take(pool.get(), 2));
  tier.Put(RankKey("j", 1), 0, 1, "b", kUid, Take(pool.get(), 2));
  tier.Put(RankKey("k", 0), 0, 1, "c", kUid, Take(pool.get(), 2));
  std::shared_ptr<const StagingLease> reading = tier.Find(RankKey("j", 0), 0, 1, "a");
  ASSERT_NE(reading, nullptr);
  tier.Shrink(kChunk);  // the oldest entry ("a") goes
  EXPECT_EQ(tier.bytes(), 4 * kChunk);
  EXPECT_EQ(pool->bytes_in_use(), 6 * kChunk) << "a reader still holds the evicted image";
  reading.reset();
  EXPECT_EQ(pool->bytes_in_use(), 4 * kChunk);
  tier.DropJob("j");
  EXPECT_EQ(tier.bytes(), 2 * kChunk);
  EXPECT_NE(tier.Find(RankKey("k", 0), 0, 1, "c"), nullptr);
  MemoryTier off(0);
  EXPECT_FALSE(off.enabled());
}

}  // namespace
}  // namespace ckpt
