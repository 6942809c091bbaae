// The staging pool's pinned registration in chunks, on fake runtime calls
// (no GPU, and no memory behind the addresses: the fake only records them).
// Regression: the whole pool went to one cudaHostRegister, which fails on
// r580+ drivers at 512 GiB and more.
#include "daemon/gpu/cuda_host.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Records every call; the `fail_at`-th Register (1-based; 0 = none) fails.
class FakeHostRegisterCalls final : public HostRegisterCalls {
 public:
  absl::Status Register(void* ptr, uint64_t bytes) override {
    attempts.emplace_back(Offset(ptr), bytes);
    if (static_cast<int>(attempts.size()) == fail_at) {
      return absl::InternalError("cudaHostRegister: invalid argument");
    }
    registered.push_back(Offset(ptr));
    return absl::OkStatus();
  }
  absl::Status Unregister(void* ptr) override {
    unregistered.push_back(Offset(ptr));
    return absl::OkStatus();
  }

  // Offsets from kBase.
  static uint64_t Offset(void* p) { return reinterpret_cast<uintptr_t>(p) - kBase; }
  static void* At(uint64_t offset) { return reinterpret_cast<void*>(kBase + offset); }
  static constexpr uintptr_t kBase = uintptr_t{1} << 44;

  int fail_at = 0;
  std::vector<std::pair<uint64_t, uint64_t>> attempts;  // (offset, bytes)
  std::vector<uint64_t> registered, unregistered;
};

std::vector<uint64_t> Offsets(uint64_t count, uint64_t chunk) {
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < count; ++i) out.push_back(i * chunk);
  return out;
}

TEST(GpuHostRegistrationTest, A512GiBPoolIsRegisteredInChunksOf64GiB) {
  FakeHostRegisterCalls calls;
  {
    HostRegistration reg(FakeHostRegisterCalls::At(0), 512 * kGiB, &calls);
    EXPECT_TRUE(reg.registered()) << reg.reason();
    EXPECT_EQ(reg.chunks(), 8u);
    ASSERT_EQ(calls.attempts.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(calls.attempts[i], std::make_pair(i * 64 * kGiB, 64 * kGiB)) << "chunk " << i;
    }
    EXPECT_TRUE(calls.unregistered.empty());
  }
  // Every chunk is unregistered on destruction, the last first.
  std::vector<uint64_t> expected = Offsets(8, 64 * kGiB);
  std::reverse(expected.begin(), expected.end());
  EXPECT_EQ(calls.unregistered, expected);
}

TEST(GpuHostRegistrationTest, TheLastChunkTakesWhatIsLeft) {
  FakeHostRegisterCalls calls;
  const uint64_t bytes = 130 * kGiB + 4096;
  HostRegistration reg(FakeHostRegisterCalls::At(0), bytes, &calls);
  EXPECT_TRUE(reg.registered()) << reg.reason();
  const std::vector<std::pair<uint64_t, uint64_t>> expected = {
      {0, 64 * kGiB}, {64 * kGiB, 64 * kGiB}, {128 * kGiB, 2 * kGiB + 4096}};
  EXPECT_EQ(calls.attempts, expected);
}

TEST(GpuHostRegistrationTest, APoolOfOneChunkOrLessIsOneCall) {
  for (uint64_t bytes : {uint64_t{1} << 20, 64 * kGiB}) {
    FakeHostRegisterCalls calls;
    HostRegistration reg(FakeHostRegisterCalls::At(0), bytes, &calls);
    EXPECT_TRUE(reg.registered()) << reg.reason();
    EXPECT_EQ(calls.attempts, (std::vector<std::pair<uint64_t, uint64_t>>{{0, bytes}}));
  }
}

// A failure at the k-th chunk unregisters the k-1 chunks before it (the
// last first), leaves nothing registered and says which chunk failed and
// why; the destructor has nothing left to unregister.
TEST(GpuHostRegistrationTest, AFailedChunkUnregistersTheChunksBeforeIt) {
  for (int k : {1, 2, 5, 8}) {
    FakeHostRegisterCalls calls;
    calls.fail_at = k;
    {
      HostRegistration reg(FakeHostRegisterCalls::At(0), 512 * kGiB, &calls);
      EXPECT_FALSE(reg.registered()) << "k " << k;
      EXPECT_EQ(reg.chunks(), 0u);
      EXPECT_EQ(calls.attempts.size(), static_cast<size_t>(k)) << "no chunk after the failed one";
      std::vector<uint64_t> expected = Offsets(k - 1, 64 * kGiB);
      std::reverse(expected.begin(), expected.end());
      EXPECT_EQ(calls.unregistered, expected) << "k " << k;
      const std::string& why = reg.reason();
      EXPECT_NE(why.find("chunk " + std::to_string(k) + " of 8"), std::string::npos) << why;
      EXPECT_NE(why.find("invalid argument"), std::string::npos) << why;
    }
    EXPECT_EQ(calls.unregistered.size(), static_cast<size_t>(k - 1)) << "nothing twice";
  }
}

TEST(GpuHostRegistrationTest, SmallerChunksForTests) {
  FakeHostRegisterCalls calls;
  HostRegistration reg(FakeHostRegisterCalls::At(0), 10 << 20, &calls, /*chunk_bytes=*/4 << 20);
  EXPECT_EQ(calls.attempts, (std::vector<std::pair<uint64_t, uint64_t>>{
                                {0, 4 << 20}, {4 << 20, 4 << 20}, {8 << 20, 2 << 20}}));
}

// A staging-pool chunk never straddles two registered ranges: every range
// ends on a pool-chunk boundary (a 3 MiB pool chunk: 64 GiB is no multiple).
TEST(GpuHostRegistrationTest, RangesEndOnPoolChunkBoundaries) {
  FakeHostRegisterCalls calls;
  HostRegistration reg(FakeHostRegisterCalls::At(0), 100, &calls, /*chunk_bytes=*/10,
                       /*pool_chunk_bytes=*/4);
  EXPECT_TRUE(reg.registered()) << reg.reason();
  std::vector<std::pair<uint64_t, uint64_t>> expected;
  for (uint64_t off = 0; off < 96; off += 8) expected.emplace_back(off, 8);
  expected.emplace_back(96, 4);
  EXPECT_EQ(calls.attempts, expected);
  // The default size, with a pool chunk that does not divide it.
  FakeHostRegisterCalls big;
  const uint64_t pool_chunk = 3 << 20;
  HostRegistration big_reg(FakeHostRegisterCalls::At(0), 200 * kGiB, &big, 0, pool_chunk);
  ASSERT_GT(big.attempts.size(), 1u);
  for (const auto& [offset, bytes] : big.attempts) {
    EXPECT_EQ(offset % pool_chunk, 0u) << offset;
    EXPECT_LE(bytes, kHostRegisterChunkBytes);
  }
  // A pool chunk larger than the largest range is one range of its own.
  FakeHostRegisterCalls huge;
  HostRegistration huge_reg(FakeHostRegisterCalls::At(0), 30, &huge, /*chunk_bytes=*/4,
                            /*pool_chunk_bytes=*/10);
  EXPECT_EQ(huge.attempts,
            (std::vector<std::pair<uint64_t, uint64_t>>{{0, 10}, {10, 10}, {20, 10}}));
}

}  // namespace
}  // namespace ckpt
