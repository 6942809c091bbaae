// Tests of daemon/store/format: layout planning, header encoding and checks.
#include "daemon/store/format.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/daemon/store/store_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using store_test::ImageBytes;
using store_test::MakeHeader;
using store_test::MakeTestPool;
using store_test::SealImage;
using store_test::Staged;
using store_test::StageVersion;

const VersionKey kKey{"job-fmt", 3, 7, 1234};

TEST(PlanLayoutTest, OffsetsAreAlignedOrderedAndTight) {
  const std::vector<uint64_t> sizes = {1, 3, 100, 64, 4097, 63, 65, 1};
  store::LayerFileHeader h = MakeHeader(kKey, 9, sizes);
  CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout layout, PlanLayout(&h));
  uint64_t prev_end = 0;
  for (int i = 0; i < h.tensors_size(); ++i) {
    const store::TensorEntry& t = h.tensors(i);
    EXPECT_EQ(t.offset() % kTensorAlignment, 0u) << i;
    EXPECT_GE(t.offset(), prev_end) << i;
    EXPECT_LT(t.offset() - prev_end, kTensorAlignment) << i;
    prev_end = t.offset() + t.nbytes();
  }
  EXPECT_EQ(h.tensors(0).offset(), 0u);
  EXPECT_EQ(layout.payload_bytes, prev_end);
  EXPECT_EQ(layout.header_bytes % 4096, 0u);
  EXPECT_GE(layout.header_bytes, kPrefixBytes + h.ByteSizeLong());
  EXPECT_EQ(layout.file_bytes % 4096, 0u);
  EXPECT_EQ(layout.file_bytes, layout.header_bytes + AlignUp(layout.payload_bytes, 4096));
}

// The format needs no staging pool: a file image in one plain buffer encodes,
// decodes and verifies like one spread over staging chunks.
TEST(BufferImageFormatTest, RoundTripsThroughAPlainBuffer) {
  store::LayerFileHeader h = MakeHeader(kKey, 7, {5, 4096, 70});
  CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout layout, PlanLayout(&h));
  std::vector<char> file(layout.file_bytes, '\x5a');  // stale bytes that must be zeroed
  BufferImage image(file.data(), file.size());
  for (store::TensorEntry& t : *h.mutable_tensors()) {
    std::string bytes(t.nbytes(), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + t.offset());
    image.CopyIn(layout.header_bytes + t.offset(), bytes.data(), bytes.size());
    t.set_xxh3(HashImage(image, layout.header_bytes + t.offset(), t.nbytes()));
  }
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t body_hash, EncodeHeader(h, layout, &image));
  CKPT_ASSERT_OK_AND_ASSIGN(DecodedHeader d, DecodeHeader(image, file.size()));
  EXPECT_EQ(d.body_xxh3, body_hash);
  EXPECT_EQ(d.header.tensors_size(), 3);
  CKPT_EXPECT_OK(VerifyPayload(d, image));
  // The gap after the first tensor was zeroed; a flipped payload byte fails.
  EXPECT_EQ(file[layout.header_bytes + 5], 0);
  file[layout.header_bytes + h.tensors(1).offset() + 100] ^= 1;
  CKPT_EXPECT_CODE(VerifyPayload(d, image), kDataLoss);
}

TEST(PlanLayoutTest, HeaderGrowsWithTheBody) {
  store::LayerFileHeader h = MakeHeader(kKey, 1, {10});
  h.set_layer_name(std::string(10000, 'n'));
  CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout layout, PlanLayout(&h));
  EXPECT_EQ(layout.header_bytes, 3u * 4096);
  EXPECT_EQ(layout.file_bytes, 4u * 4096);
}

TEST(PlanLayoutTest, EmptyLayerHasNoPayload) {
  store::LayerFileHeader h = MakeHeader(kKey, 1, {});
  CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout layout, PlanLayout(&h));
  EXPECT_EQ(layout.payload_bytes, 0u);
  EXPECT_EQ(layout.header_bytes, 4096u);
  EXPECT_EQ(layout.file_bytes, 4096u);
}

TEST(PlanLayoutTest, RejectsOversizedHeader) {
  store::LayerFileHeader h = MakeHeader(kKey, 1, {10});
  h.set_layer_name(std::string(kMaxHeaderBytes, 'n'));
  CKPT_EXPECT_CODE(PlanLayout(&h), kInvalidArgument);
}

class FormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = MakeTestPool(4096, 64);
    ASSERT_NE(pool_, nullptr);
    ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), kKey, 42, {5000, 1, 333, 4096}, 1, &s_));
    // Garbage everywhere except the tensors, to see that Encode zeroes the padding.
    StagedVersion& v = s_.version;
    std::string junk(v.layout.file_bytes, '\xEE');
    uint64_t prev_end = 0;
    for (const store::TensorEntry& t : v.header.tensors()) {
      v.lease.CopyIn(v.layout.header_bytes + prev_end, junk.data(), t.offset() - prev_end);
      prev_end = t.offset() + t.nbytes();
    }
    v.lease.CopyIn(0, junk.data(), v.layout.header_bytes);
    v.lease.CopyIn(v.layout.header_bytes + prev_end, junk.data(),
                   v.layout.file_bytes - v.layout.header_bytes - prev_end);
    CKPT_ASSERT_OK_AND_ASSIGN(body_hash_, SealImage(&v));
  }

  uint64_t BodyLen() const {
    uint32_t len;
    s_.version.lease.CopyOut(16, &len, 4);
    return len;
  }

  void Flip(uint64_t offset, char mask) {
    char c;
    s_.version.lease.CopyOut(offset, &c, 1);
    c = static_cast<char>(c ^ mask);
    s_.version.lease.CopyIn(offset, &c, 1);
  }

  std::unique_ptr<StagingPool> pool_;
  Staged s_;
  uint64_t body_hash_ = 0;
};

TEST_F(FormatTest, EncodeDecodeRoundTrip) {
  const StagedVersion& v = s_.version;
  CKPT_ASSERT_OK_AND_ASSIGN(DecodedHeader d,
                            DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes));
  EXPECT_EQ(d.header.SerializeAsString(), v.header.SerializeAsString());
  EXPECT_EQ(d.layout.header_bytes, v.layout.header_bytes);
  EXPECT_EQ(d.layout.payload_bytes, v.layout.payload_bytes);
  EXPECT_EQ(d.layout.file_bytes, v.layout.file_bytes);
  EXPECT_EQ(d.body_xxh3, body_hash_);
  EXPECT_EQ(body_hash_, HashBytes(v.header.SerializeAsString().data(), BodyLen()));
  CKPT_EXPECT_OK(VerifyPayload(d, LeaseImage(v.lease)));
  for (int i = 0; i < d.header.tensors_size(); ++i) {
    const store::TensorEntry& t = d.header.tensors(i);
    EXPECT_EQ(ImageBytes(v.lease, d.layout.header_bytes + t.offset(), t.nbytes()),
              s_.data[static_cast<size_t>(i)]);
    EXPECT_EQ(t.xxh3(), HashBytes(s_.data[static_cast<size_t>(i)].data(), t.nbytes()));
  }
}

TEST_F(FormatTest, PrefixFieldsAreLittleEndianAsDocumented) {
  const StagedVersion& v = s_.version;
  const std::string prefix = ImageBytes(v.lease, 0, kPrefixBytes);
  EXPECT_EQ(prefix.substr(0, 8), std::string(kFormatMagic, 8));
  uint32_t u32;
  uint64_t u64;
  std::memcpy(&u32, prefix.data() + 8, 4);
  EXPECT_EQ(u32, kFormatVersion);
  std::memcpy(&u32, prefix.data() + 12, 4);
  EXPECT_EQ(u32, v.layout.header_bytes);
  std::memcpy(&u64, prefix.data() + 24, 8);
  EXPECT_EQ(u64, v.layout.payload_bytes);
  std::memcpy(&u64, prefix.data() + 32, 8);
  EXPECT_EQ(u64, body_hash_);
  std::memcpy(&u64, prefix.data() + 40, 8);
  EXPECT_EQ(u64, HashBytes(prefix.data(), 40));
  EXPECT_EQ(prefix.substr(20, 4), std::string(4, '\0'));
  EXPECT_EQ(prefix.substr(48, 16), std::string(16, '\0'));
}

TEST_F(FormatTest, EncodeZeroesAllPadding) {
  const StagedVersion& v = s_.version;
  const uint64_t body_end = kPrefixBytes + BodyLen();
  EXPECT_EQ(ImageBytes(v.lease, body_end, v.layout.header_bytes - body_end),
            std::string(v.layout.header_bytes - body_end, '\0'));
  uint64_t prev_end = 0;
  for (const store::TensorEntry& t : v.header.tensors()) {
    EXPECT_EQ(ImageBytes(v.lease, v.layout.header_bytes + prev_end, t.offset() - prev_end),
              std::string(t.offset() - prev_end, '\0'));
    prev_end = t.offset() + t.nbytes();
  }
  const uint64_t tail = v.layout.file_bytes - v.layout.header_bytes - prev_end;
  EXPECT_GT(tail, 0u);
  EXPECT_EQ(ImageBytes(v.lease, v.layout.header_bytes + prev_end, tail), std::string(tail, '\0'));
}

TEST_F(FormatTest, AnyFlippedCheckedPrefixOrBodyByteIsDataLoss) {
  const StagedVersion& v = s_.version;
  std::vector<uint64_t> offsets;
  for (uint64_t i = 0; i < 48; ++i) offsets.push_back(i);  // magic .. prefix checksum
  for (uint64_t i = kPrefixBytes; i < kPrefixBytes + BodyLen(); ++i) offsets.push_back(i);
  ASSERT_GT(BodyLen(), 20u);
  for (uint64_t off : offsets) {
    for (char mask : {'\x01', '\x80', '\xFF'}) {
      Flip(off, mask);
      CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes), kDataLoss)
          << "byte " << off << " mask " << static_cast<int>(mask);
      Flip(off, mask);
    }
  }
  CKPT_EXPECT_OK(DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes));
}

// Regression: the reserved prefix bytes are outside the prefix checksum; DecodeHeader must
// reject any that is not zero rather than accept a flipped byte silently.
TEST_F(FormatTest, FlippedReservedPrefixByteIsDataLoss) {
  const StagedVersion& v = s_.version;
  std::vector<uint64_t> accepted;
  for (uint64_t off = 48; off < kPrefixBytes; ++off) {
    Flip(off, '\x01');
    if (!absl::IsDataLoss(DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes).status())) {
      accepted.push_back(off);
    }
    Flip(off, '\x01');
  }
  EXPECT_TRUE(accepted.empty()) << accepted.size() << " of 16 flipped reserved bytes accepted, "
                                << "first at offset " << accepted.front();
}

TEST_F(FormatTest, WrongFileSizeIsDataLoss) {
  const StagedVersion& v = s_.version;
  CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes - 4096), kDataLoss);
  CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), 100), kDataLoss);
  CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), 0), kDataLoss);
  // More than the lease holds.
  CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), v.lease.capacity() + 4096), kDataLoss);
}

// Regression (found by tests/fuzz/format_fuzzer.cc): a payload size within
// 4095 of 2^64 rounded up to 0, so a file cut after its header, with resealed
// checksums, decoded with every tensor "inside" a payload past the file's end
// and VerifyPayload then read beyond the file.
TEST_F(FormatTest, PayloadSizeThatWrapsWhenRoundedUpIsDataLoss) {
  StagedVersion& v = s_.version;
  ASSERT_GT(v.header.tensors_size(), 0);
  for (uint64_t payload : {~uint64_t{0}, ~uint64_t{0} - 4094}) {
    std::string prefix = ImageBytes(v.lease, 0, kPrefixBytes);
    std::memcpy(prefix.data() + 24, &payload, 8);
    const uint64_t prefix_hash = HashBytes(prefix.data(), 40);
    std::memcpy(prefix.data() + 40, &prefix_hash, 8);
    v.lease.CopyIn(0, prefix.data(), kPrefixBytes);
    CKPT_EXPECT_CODE(DecodeHeader(LeaseImage(v.lease), v.layout.header_bytes), kDataLoss)
        << payload;
  }
}

TEST_F(FormatTest, VerifyPayloadNamesTheCorruptTensor) {
  const StagedVersion& v = s_.version;
  CKPT_ASSERT_OK_AND_ASSIGN(DecodedHeader d,
                            DecodeHeader(LeaseImage(v.lease), v.layout.file_bytes));
  std::mt19937_64 rng(77);
  for (int i = 0; i < d.header.tensors_size(); ++i) {
    const store::TensorEntry& t = d.header.tensors(i);
    for (uint64_t pos : {uint64_t{0}, t.nbytes() - 1, rng() % t.nbytes()}) {
      const uint64_t off = v.layout.header_bytes + t.offset() + pos;
      Flip(off, '\x10');
      absl::Status s = VerifyPayload(d, LeaseImage(v.lease));
      CKPT_EXPECT_CODE(s, kDataLoss) << t.name() << " byte " << pos;
      EXPECT_NE(s.message().find("'" + t.name() + "'"), absl::string_view::npos) << s;
      Flip(off, '\x10');
    }
  }
  CKPT_EXPECT_OK(VerifyPayload(d, LeaseImage(v.lease)));
}

TEST(FormatHashTest, HashImageMatchesHashBytesAcrossChunks) {
  std::unique_ptr<StagingPool> pool = MakeTestPool(4096, 4);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease, pool->Acquire(4 * 4096, absl::InfiniteFuture()));
  const std::string data = ::ckpt::testing::RandomBytes(5, 4 * 4096);
  lease.CopyIn(0, data.data(), data.size());
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 0}, {0, 4096}, {4000, 200}, {1, 3 * 4096 + 5}, {0, 4 * 4096}}) {
    EXPECT_EQ(HashImage(LeaseImage(lease), off, len), HashBytes(data.data() + off, len))
        << off << "+" << len;
  }
}

// HashImageThrough is HashImage whatever the piece size, and hands on every
// byte once, in order, in pieces no larger than asked (0: a lease chunk); it
// stops handing on at the first failure and returns it.
TEST(FormatHashTest, HashImageThroughIsHashImageInAnyPieces) {
  std::unique_ptr<StagingPool> pool = MakeTestPool(4096, 4);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease, pool->Acquire(4 * 4096, absl::InfiniteFuture()));
  const std::string data = ::ckpt::testing::RandomBytes(6, 4 * 4096);
  lease.CopyIn(0, data.data(), data.size());
  for (uint64_t piece : {0, 1, 7, 64, 1000, 4096, 1 << 20}) {
    for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
             {0, 0}, {4000, 200}, {1, 3 * 4096 + 5}, {0, 4 * 4096}}) {
      std::string seen;
      uint64_t largest = 0, hash = 0;
      CKPT_ASSERT_OK(HashImageThrough(
          LeaseImage(lease), off, len, piece,
          [&](const char* p, uint64_t n) {
            seen.append(p, n);
            largest = std::max(largest, n);
            return absl::OkStatus();
          },
          &hash));
      EXPECT_EQ(hash, HashImage(LeaseImage(lease), off, len)) << piece << ": " << off << "+" << len;
      EXPECT_TRUE(seen == data.substr(off, len)) << piece << ": " << off << "+" << len;
      EXPECT_LE(largest, piece == 0 ? 4096 : piece);
    }
  }
  int calls = 0;
  uint64_t hash = 0;
  EXPECT_TRUE(absl::IsUnavailable(HashImageThrough(
      LeaseImage(lease), 0, 4 * 4096, 1000,
      [&](const char*, uint64_t) {
        return ++calls == 3 ? absl::UnavailableError("copy failed") : absl::OkStatus();
      },
      &hash)));
  EXPECT_EQ(calls, 3);
}

// The layer files' checksum is XXH3-64 whichever build of it runs: the AVX2
// one (xxh3_avx2.h, where the CPU has it) gives the library's value for
// every length its code paths distinguish (0, 1-3, 4-8, 9-16, 17-128,
// 129-240, longer, several stripes and blocks), at every alignment, and
// the same across the pieces of a lease.
TEST(FormatHashTest, HashIsTheLibrarysXxh3) {
  const std::string data = ::ckpt::testing::RandomBytes(11, (1 << 20) + 64);
  std::vector<uint64_t> lengths;
  for (uint64_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (uint64_t n : {1023, 1024, 1025, 4095, 4096, 65536, 100003, 1 << 20}) lengths.push_back(n);
  for (uint64_t n : lengths) {
    for (uint64_t off : {0, 1, 7, 32, 63}) {
      ASSERT_EQ(HashBytes(data.data() + off, n), XXH3_64bits(data.data() + off, n))
          << off << "+" << n;
    }
  }
  std::unique_ptr<StagingPool> pool = MakeTestPool(64 << 10, 32);
  ASSERT_NE(pool, nullptr);
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease lease, pool->Acquire(1 << 20, absl::InfiniteFuture()));
  lease.CopyIn(0, data.data(), 1 << 20);
  for (auto [off, len] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 1 << 20}, {3, (1 << 20) - 3}, {65535, 2}, {100, 200000}}) {
    EXPECT_EQ(HashImage(LeaseImage(lease), off, len), XXH3_64bits(data.data() + off, len))
        << off << "+" << len;
  }
}

}  // namespace
}  // namespace ckpt
