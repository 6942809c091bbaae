// Tests of daemon/staging: the StagingPool and its leases.
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/staging/staging_pool.h"
#include "gtest/gtest.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::RandomBytes;

constexpr uint64_t kChunk = 8192;
constexpr size_t kChunks = 8;

std::unique_ptr<StagingPool> MakePool(uint64_t chunk = kChunk, size_t chunks = kChunks) {
  return ::ckpt::testing::MakeTestPool(chunk, chunks);
}

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

TEST(StagingPoolTest, CreateRejectsBadChunkAndBudget) {
  StagingPoolOptions o;
  o.lock_memory = false;
  o.budget_bytes = 1 << 20;
  for (uint64_t chunk : {uint64_t{0}, uint64_t{1000}, uint64_t{4097}, uint64_t{6144}}) {
    o.chunk_bytes = chunk;
    CKPT_EXPECT_CODE(StagingPool::Create(o), kInvalidArgument) << "chunk " << chunk;
  }
  o.chunk_bytes = 8192;
  o.budget_bytes = 4096;
  CKPT_EXPECT_CODE(StagingPool::Create(o), kInvalidArgument);
  o.budget_bytes = 0;
  CKPT_EXPECT_CODE(StagingPool::Create(o), kInvalidArgument);
}

TEST(StagingPoolTest, BudgetIsWholeChunks) {
  StagingPoolOptions o;
  o.lock_memory = false;
  o.chunk_bytes = 4096;
  o.budget_bytes = 3 * 4096 + 100;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StagingPool> pool, StagingPool::Create(o));
  EXPECT_EQ(pool->budget_bytes(), 3u * 4096);
  EXPECT_EQ(pool->chunk_bytes(), 4096u);
  EXPECT_EQ(pool->bytes_in_use(), 0u);
}

TEST(StagingPoolTest, LockedPoolCanBeCreated) {
  StagingPoolOptions o;
  o.lock_memory = true;  // failure to lock is only a warning
  o.chunk_bytes = 4096;
  o.budget_bytes = 4 * 4096;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StagingPool> pool, StagingPool::Create(o));
  CKPT_EXPECT_OK(pool->Acquire(4 * 4096, Soon()));
}

TEST(StagingPoolTest, AcquireRoundsUpAndAccounts) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  {
    CKPT_ASSERT_OK_AND_ASSIGN(StagingLease a, pool->Acquire(1, Soon()));
    EXPECT_EQ(a.chunk_count(), 1u);
    EXPECT_EQ(a.chunk_bytes(), kChunk);
    EXPECT_EQ(a.capacity(), kChunk);
    EXPECT_EQ(pool->bytes_in_use(), kChunk);
    CKPT_ASSERT_OK_AND_ASSIGN(StagingLease b, pool->Acquire(kChunk + 1, Soon()));
    EXPECT_EQ(b.chunk_count(), 2u);
    EXPECT_EQ(pool->bytes_in_use(), 3 * kChunk);
    CKPT_ASSERT_OK_AND_ASSIGN(StagingLease c, pool->Acquire(2 * kChunk, Soon()));
    EXPECT_EQ(c.chunk_count(), 2u);
    EXPECT_EQ(pool->bytes_in_use(), 5 * kChunk);
    CKPT_ASSERT_OK_AND_ASSIGN(StagingLease zero, pool->Acquire(0, Soon()));
    EXPECT_EQ(zero.chunk_count(), 1u);
    EXPECT_EQ(pool->bytes_in_use(), 6 * kChunk);
  }
  EXPECT_EQ(pool->bytes_in_use(), 0u);
}

TEST(StagingPoolTest, WholePoolCanBeLent) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease all, pool->Acquire(kChunks * kChunk, Soon()));
  EXPECT_EQ(all.chunk_count(), kChunks);
  EXPECT_EQ(pool->bytes_in_use(), pool->budget_bytes());
}

TEST(StagingPoolTest, AcquireIsAllOrNothing) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease held, pool->Acquire(6 * kChunk, Soon()));
  // 3 chunks wanted, 2 free: nothing is taken, the call times out.
  CKPT_EXPECT_CODE(pool->Acquire(3 * kChunk, absl::Now() + absl::Milliseconds(50)),
                   kDeadlineExceeded);
  EXPECT_EQ(pool->bytes_in_use(), 6 * kChunk);
  // The 2 free chunks are still all there.
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease two, pool->Acquire(2 * kChunk, absl::Now()));
  EXPECT_EQ(two.chunk_count(), 2u);
  EXPECT_EQ(pool->bytes_in_use(), 8 * kChunk);
  CKPT_EXPECT_CODE(pool->Acquire(1, absl::Now()), kDeadlineExceeded);
  CKPT_EXPECT_CODE(pool->Acquire(1, absl::InfinitePast()), kDeadlineExceeded);
}

// TryAcquire takes free chunks only: it neither waits nor asks the
// reclaimer, which Acquire does when chunks are missing.
TEST(StagingPoolTest, TryAcquireTakesFreeRoomOnly) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  int reclaims = 0;
  pool->SetReclaimer([&reclaims](uint64_t) { ++reclaims; });
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease held, pool->Acquire(6 * kChunk, Soon()));
  EXPECT_FALSE(pool->TryAcquire(3 * kChunk).has_value());
  EXPECT_FALSE(pool->TryAcquire(UINT64_MAX).has_value());
  EXPECT_EQ(reclaims, 0);
  EXPECT_EQ(pool->bytes_in_use(), 6 * kChunk);
  std::optional<StagingLease> two = pool->TryAcquire(2 * kChunk - 1);
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->chunk_count(), 2u);
  EXPECT_EQ(pool->bytes_in_use(), 8 * kChunk);
  two.reset();
  EXPECT_EQ(pool->bytes_in_use(), 6 * kChunk);
  // Acquire asks the reclaimer for what is missing.
  CKPT_EXPECT_CODE(pool->Acquire(3 * kChunk, absl::Now()), kDeadlineExceeded);
  EXPECT_EQ(reclaims, 1);
}

// Regression: Acquire asked the reclaimer for room once, when its wait
// began. What a reclaimer holds can grow while a caller waits (the memory
// tier keeps every version a writer finishes), so that room stayed out of
// reach until the deadline, and a snapshot larger than the pool skipped
// layers. Acquire asks again while it waits: here the reclaimer has nothing
// to give at its first call and gives the whole pool back at its second.
TEST(StagingPoolTest, AcquireAsksTheReclaimerAgainWhileItWaits) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease whole, pool->Acquire(kChunks * kChunk, Soon()));
  std::optional<StagingLease> held(std::move(whole));
  int calls = 0;  // the reclaimer runs on the thread that calls Acquire
  pool->SetReclaimer([&calls, &held](uint64_t) {
    if (++calls == 2) held.reset();
  });
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease,
                            pool->Acquire(kChunk, absl::Now() + absl::Seconds(60)));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(lease.chunk_count(), 1u);
}

TEST(StagingPoolTest, LargerThanPoolIsResourceExhaustedAtOnce) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  // With a far deadline a wait would end in DEADLINE_EXCEEDED much later; the
  // contract is RESOURCE_EXHAUSTED without waiting.
  CKPT_EXPECT_CODE(pool->Acquire(kChunks * kChunk + 1, absl::InfiniteFuture()), kResourceExhausted);
  CKPT_EXPECT_CODE(pool->Acquire(~uint64_t{0} - kChunk, absl::InfiniteFuture()),
                   kResourceExhausted);
  EXPECT_EQ(pool->bytes_in_use(), 0u);
}

// Regression: rounding bytes up to chunks wrapped around near UINT64_MAX, so
// Acquire(UINT64_MAX) succeeded with one chunk instead of RESOURCE_EXHAUSTED.
TEST(StagingPoolTest, HugeRequestDoesNotWrapAround) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_EXPECT_CODE(pool->Acquire(~uint64_t{0}, absl::Now()), kResourceExhausted);
  CKPT_EXPECT_CODE(pool->Acquire(~uint64_t{0} - kChunk + 2, absl::Now()), kResourceExhausted);
}

TEST(StagingPoolTest, ReleaseFromAnotherThreadUnblocksWaiter) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease all, pool->Acquire(kChunks * kChunk, Soon()));
  std::atomic<pid_t> waiter_tid{0};
  absl::Status waiter_status;
  size_t waiter_chunks = 0;
  std::thread waiter([&] {
    waiter_tid = ::ckpt::testing::ThreadId();
    // From here the only blocking call is Acquire's wait for free chunks.
    absl::StatusOr<StagingLease> lease = pool->Acquire(3 * kChunk, Soon());
    waiter_status = lease.status();
    if (lease.ok()) waiter_chunks = lease->chunk_count();
  });
  while (waiter_tid == 0) std::this_thread::yield();
  // The release must find the waiter blocked, so that it is the release
  // that wakes it up.
  const bool blocked =
      ::ckpt::testing::WaitUntilThreadSleeps(waiter_tid, absl::Now() + absl::Seconds(20));
  EXPECT_TRUE(blocked) << "the waiter never blocked in Acquire";
  std::thread releaser(
      [lease = std::move(all)]() mutable { StagingLease gone = std::move(lease); });
  releaser.join();
  waiter.join();
  CKPT_EXPECT_OK(waiter_status);
  EXPECT_EQ(waiter_chunks, 3u);
  EXPECT_EQ(pool->bytes_in_use(), 0u);
}

TEST(StagingPoolTest, ChunksAreAlignedDistinctAndInsideThePool) {
  std::unique_ptr<StagingPool> pool = MakePool(4096, 16);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease a, pool->Acquire(5 * 4096, Soon()));
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease b, pool->Acquire(11 * 4096, Soon()));
  std::set<char*> seen;
  const char* base = static_cast<const char*>(pool->base());
  for (const StagingLease* l : {&a, &b}) {
    for (size_t i = 0; i < l->chunk_count(); ++i) {
      char* c = l->chunk(i);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(c) % 4096, 0u);
      EXPECT_GE(c, base);
      EXPECT_LE(c + 4096, base + pool->budget_bytes());
      EXPECT_EQ(static_cast<uint64_t>(c - base) % 4096, 0u);
      EXPECT_TRUE(seen.insert(c).second) << "chunk lent twice";
    }
  }
  EXPECT_EQ(seen.size(), 16u);
}

TEST(StagingLeaseTest, CopyRoundTripsAcrossChunkBoundaries) {
  std::unique_ptr<StagingPool> pool = MakePool(4096, 8);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease, pool->Acquire(5 * 4096, Soon()));
  ASSERT_EQ(lease.capacity(), 5u * 4096);
  std::mt19937_64 rng(0x57a9e);
  for (int round = 0; round < 200; ++round) {
    const uint64_t offset = rng() % lease.capacity();
    const uint64_t len = rng() % (lease.capacity() - offset + 1);
    const std::string data = RandomBytes(rng(), len);
    lease.CopyIn(offset, data.data(), len);
    // Byte by byte through the chunk pointers.
    for (uint64_t i = 0; i < len; i += 97) {
      const uint64_t o = offset + i;
      ASSERT_EQ(lease.chunk(o / 4096)[o % 4096], data[i]) << "offset " << o;
    }
    std::string out(len, '\0');
    lease.CopyOut(offset, out.data(), len);
    ASSERT_TRUE(out == data) << "round " << round << " offset " << offset << " len " << len;
    // ForEachPiece covers the range in order, never crossing a chunk.
    std::string pieces;
    lease.ForEachPiece(offset, len, [&](char* p, uint64_t n) {
      ASSERT_GT(n, 0u);
      bool inside = false;
      for (size_t c = 0; c < lease.chunk_count(); ++c) {
        if (p >= lease.chunk(c) && p + n <= lease.chunk(c) + 4096) inside = true;
      }
      EXPECT_TRUE(inside) << "piece crosses a chunk boundary";
      pieces.append(p, n);
    });
    ASSERT_TRUE(pieces == data) << "round " << round;
  }
}

TEST(StagingLeaseTest, OddOffsetsStraddlingChunks) {
  std::unique_ptr<StagingPool> pool = MakePool(4096, 4);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease, pool->Acquire(4 * 4096, Soon()));
  const std::string data = RandomBytes(7, 8201);
  lease.CopyIn(4093, data.data(), data.size());  // touches chunks 0..3
  int pieces = 0;
  uint64_t total = 0;
  lease.ForEachPiece(4093, data.size(), [&](char*, uint64_t n) {
    ++pieces;
    total += n;
  });
  EXPECT_EQ(pieces, 4);
  EXPECT_EQ(total, data.size());
  std::string out(data.size(), '\0');
  lease.CopyOut(4093, out.data(), out.size());
  EXPECT_TRUE(out == data);
  lease.Zero(4095, 2);
  char two[2];
  lease.CopyOut(4095, two, 2);
  EXPECT_EQ(two[0], 0);
  EXPECT_EQ(two[1], 0);
  char neighbours[2];
  lease.CopyOut(4094, neighbours, 1);
  lease.CopyOut(4097, neighbours + 1, 1);
  EXPECT_EQ(neighbours[0], data[1]);
  EXPECT_EQ(neighbours[1], data[4]);
}

TEST(StagingLeaseTest, MoveReturnsChunksExactlyOnce) {
  std::unique_ptr<StagingPool> pool = MakePool();
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease a, pool->Acquire(2 * kChunk, Soon()));
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease b, pool->Acquire(3 * kChunk, Soon()));
  EXPECT_EQ(pool->bytes_in_use(), 5 * kChunk);
  StagingLease c(std::move(a));
  EXPECT_EQ(c.chunk_count(), 2u);
  EXPECT_EQ(pool->bytes_in_use(), 5 * kChunk);
  c = std::move(b);  // c's two chunks go back
  EXPECT_EQ(c.chunk_count(), 3u);
  EXPECT_EQ(pool->bytes_in_use(), 3 * kChunk);
  { StagingLease d = std::move(c); }
  EXPECT_EQ(pool->bytes_in_use(), 0u);
  CKPT_EXPECT_OK(pool->Acquire(kChunks * kChunk, absl::Now()));
}

TEST(StagingPoolTest, StressNeverExceedsBudgetNorDoubleLends) {
  constexpr size_t kPoolChunks = 8;
  std::unique_ptr<StagingPool> pool = MakePool(4096, kPoolChunks);
  ASSERT_NE(pool, nullptr);
  std::atomic<bool> over_budget{false};
  std::atomic<bool> clobbered{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      for (int i = 0; i < 400; ++i) {
        const uint64_t want = 1 + rng() % (3 * 4096);
        absl::StatusOr<StagingLease> lease = pool->Acquire(want, Soon());
        if (!lease.ok()) {
          ++failures;
          continue;
        }
        if (pool->bytes_in_use() > pool->budget_bytes()) over_budget = true;
        // Stamp every byte with (thread, iteration); another holder would overwrite it.
        const char tag = static_cast<char>(t * 64 + i % 64);
        for (size_t c = 0; c < lease->chunk_count(); ++c) std::memset(lease->chunk(c), tag, 4096);
        std::this_thread::yield();
        for (size_t c = 0; c < lease->chunk_count(); ++c) {
          for (size_t k = 0; k < 4096; k += 511) {
            if (lease->chunk(c)[k] != tag) clobbered = true;
          }
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_FALSE(over_budget);
  EXPECT_FALSE(clobbered) << "a chunk was lent to two leases at once";
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(pool->bytes_in_use(), 0u);
  CKPT_EXPECT_OK(pool->Acquire(kPoolChunks * 4096, absl::Now()));
}

}  // namespace
}  // namespace ckpt
