// libFuzzer target: the layer-version file decoder (daemon/store/format.h)
// on raw bytes (parser fuzzing in docs/reliability.md).
//
// Input: byte 0 holds flags, the rest is the start of a file image.
//   bit 0  reseal: recompute the body and prefix checksums before decoding, so
//          that the checks behind them (sizes, body parse, tensor bounds,
//          payload checksums) are fuzzed too, not only the checksum compare;
//   bit 1  exact: the file is exactly the image (otherwise it is padded with
//          zeros to the next multiple of 4096, as files on disk are);
//   bit 2  magic: write the magic and format version before resealing;
//   bit 3  truncate: cut the image after the header it claims (a file cut
//          short after its header, the common torn-write shape).
// The image is copied into a staging lease of 4096-byte chunks (so every
// piece boundary is exercised); every byte of the pool outside the file is
// ASan-poisoned, so a read past the end of the file is reported even where
// it would stay inside the pool's mapping.
//
// Oracles: DecodeHeader and VerifyPayload fail only with DATA_LOSS; a decoded
// header's sizes agree with the file and every tensor lies inside the
// payload; VerifyPayload accepts only tensors whose bytes hash to their
// recorded XXH3 (checked independently on a copy of the image).
#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/format.h"
#include "daemon/store/layer_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace ckpt {
namespace {

constexpr uint64_t kChunk = 4096;
constexpr size_t kChunks = 24;
constexpr uint64_t kMaxImage = 20 * kChunk;  // leaves room for the padding

StagingPool* Pool() {
  static StagingPool* pool = [] {
    StagingPoolOptions o;
    o.budget_bytes = kChunk * kChunks;
    o.chunk_bytes = kChunk;
    o.lock_memory = false;
    absl::StatusOr<std::unique_ptr<StagingPool>> p = StagingPool::Create(o);
    CKPT_FUZZ_CHECK(p.ok(), p.status().ToString());
    ASAN_POISON_MEMORY_REGION((*p)->base(), o.budget_bytes);
    return p->release();
  }();
  return pool;
}

uint32_t GetU32(const std::string& s, size_t off) {
  uint32_t v;
  std::memcpy(&v, s.data() + off, 4);
  return v;
}
uint64_t GetU64(const std::string& s, size_t off) {
  uint64_t v;
  std::memcpy(&v, s.data() + off, 8);
  return v;
}
void PutU32(std::string* s, size_t off, uint32_t v) { std::memcpy(s->data() + off, &v, 4); }
void PutU64(std::string* s, size_t off, uint64_t v) { std::memcpy(s->data() + off, &v, 8); }

// The leased chunks covering [0, len) are made addressable for the call.
void Unpoison(const StagingLease& lease, uint64_t len) {
  for (uint64_t off = 0; off < len; off += kChunk) {
    ASAN_UNPOISON_MEMORY_REGION(lease.chunk(off / kChunk), std::min(kChunk, len - off));
  }
}
void Repoison(const StagingLease& lease) {
  for (size_t i = 0; i < lease.chunk_count(); ++i)
    ASAN_POISON_MEMORY_REGION(lease.chunk(i), kChunk);
}

// A valid file image written the way LayerStore::Commit writes one: layout
// planned, tensor bytes staged, tensor checksums filled in, header encoded.
std::string ValidImage(const std::vector<uint64_t>& sizes, uint64_t step, int groups) {
  store::LayerFileHeader h;
  h.set_job_id("fuzz-job");
  h.set_rank(1);
  h.set_layer(2);
  h.set_layer_name("layers.2");
  h.set_step(step);
  h.set_generation(7);
  for (size_t i = 0; i < sizes.size(); ++i) {
    store::TensorEntry* t = h.add_tensors();
    t->set_name("t" + std::to_string(i));
    t->set_dtype(store::DTYPE_U8);
    t->add_shape(sizes[i]);
    t->set_role(store::ROLE_PARAM);
    t->set_nbytes(sizes[i]);
  }
  for (int g = 0; g < groups; ++g) {
    store::GroupStep* gs = h.add_group_steps();
    gs->set_group(static_cast<uint32_t>(g));
    gs->set_step(step - static_cast<uint64_t>(g));
  }
  absl::StatusOr<VersionLayout> layout = PlanLayout(&h);
  CKPT_FUZZ_CHECK(layout.ok(), layout.status().ToString());
  absl::StatusOr<StagingLease> lease = Pool()->Acquire(layout->file_bytes, absl::InfiniteFuture());
  CKPT_FUZZ_CHECK(lease.ok(), lease.status().ToString());
  Unpoison(*lease, layout->file_bytes);
  for (store::TensorEntry& t : *h.mutable_tensors()) {
    std::string bytes(t.nbytes(), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + t.offset());
    lease->CopyIn(layout->header_bytes + t.offset(), bytes.data(), bytes.size());
    t.set_xxh3(HashBytes(bytes.data(), bytes.size()));
  }
  h.set_created_unix_ms(1700000000000);
  LeaseImage lease_image(*lease);
  absl::StatusOr<uint64_t> body = EncodeHeader(h, *layout, &lease_image);
  CKPT_FUZZ_CHECK(body.ok(), body.status().ToString());
  std::string image(layout->file_bytes, '\0');
  lease->CopyOut(0, image.data(), image.size());
  Repoison(*lease);
  return image;
}

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  auto add = [&](char flags, const std::string& image) {
    seeds.push_back(std::string(1, flags) + image);
  };
  add(0, ValidImage({100}, 5, 0));
  add(1, ValidImage({5000, 1, 333}, 1234, 2));
  add(3, ValidImage({}, 1, 0));
  add(1, ValidImage({64, 64, 63, 65}, ~uint64_t{0}, 1));
  add(0, ValidImage({4096 * 3 + 17}, 99, 3));
  add(7, std::string(kPrefixBytes, '\0'));
  return seeds;
}

void CheckCode(const absl::Status& s, const char* what) {
  CKPT_FUZZ_CHECK(s.ok() || absl::IsDataLoss(s), std::string(what) + " returned " + s.ToString());
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const uint8_t flags = data[0];
  std::string image(reinterpret_cast<const char*>(data + 1),
                    std::min<uint64_t>(size - 1, kMaxImage));
  if ((flags & 8) != 0 && image.size() >= kPrefixBytes) {
    image.resize(std::min<uint64_t>(image.size(), GetU32(image, 12)));
  }
  const bool exact = (flags & 2) != 0;
  const uint64_t file_bytes =
      exact ? image.size() : AlignUp(std::max<uint64_t>(image.size(), 1), kChunk);
  std::string file = image;
  file.resize(file_bytes, '\0');
  if ((flags & 4) != 0 && file.size() >= kPrefixBytes) {
    std::memcpy(file.data(), kFormatMagic, 8);
    PutU32(&file, 8, kFormatVersion);
  }
  if ((flags & 1) != 0 && file.size() >= kPrefixBytes) {
    const uint64_t body_len = GetU32(file, 16);
    if (kPrefixBytes + body_len <= file.size()) {
      PutU64(&file, 32, HashBytes(file.data() + kPrefixBytes, body_len));
    }
    PutU64(&file, 40, HashBytes(file.data(), 40));
  }

  absl::StatusOr<StagingLease> lease =
      Pool()->Acquire(std::max<uint64_t>(file_bytes, 1), absl::InfiniteFuture());
  CKPT_FUZZ_CHECK(lease.ok(), lease.status().ToString());
  Unpoison(*lease, file_bytes);
  lease->CopyIn(0, file.data(), file.size());

  absl::StatusOr<DecodedHeader> d = DecodeHeader(LeaseImage(*lease), file_bytes);
  CheckCode(d.status(), "DecodeHeader");
  if (d.ok()) {
    const VersionLayout& l = d->layout;
    CKPT_FUZZ_CHECK(l.file_bytes == file_bytes, "decoded file size differs from the file");
    CKPT_FUZZ_CHECK(l.header_bytes % kDirectAlignment == 0 && l.header_bytes >= kPrefixBytes &&
                        l.header_bytes <= file_bytes,
                    "header size out of range");
    CKPT_FUZZ_CHECK(l.payload_bytes <= file_bytes - l.header_bytes, "payload larger than the file");
    CKPT_FUZZ_CHECK(d->body_xxh3 == GetU64(file, 32), "body checksum not the one in the prefix");
    bool all_match = true;
    for (const store::TensorEntry& t : d->header.tensors()) {
      CKPT_FUZZ_CHECK(t.offset() <= l.payload_bytes && t.nbytes() <= l.payload_bytes - t.offset(),
                      "tensor '" + t.name() + "' outside the payload");
      all_match &= HashBytes(file.data() + l.header_bytes + t.offset(), t.nbytes()) == t.xxh3();
    }
    absl::Status v = VerifyPayload(*d, LeaseImage(*lease));
    CheckCode(v, "VerifyPayload");
    CKPT_FUZZ_CHECK(v.ok() == all_match, "VerifyPayload disagrees with the tensor checksums");
  }
  Repoison(*lease);
}

}  // namespace
}  // namespace ckpt

CKPT_FUZZ_ENTRY_POINTS()
