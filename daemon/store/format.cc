#include "daemon/store/format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/io/io_backend.h"
#include "daemon/store/xxh3_avx2.h"

namespace ckpt {
namespace {

void PutU32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void PutU64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint64_t HeaderBytesFor(uint64_t body_len) {
  return AlignUp(kPrefixBytes + body_len, kDirectAlignment);
}

}  // namespace

// The AVX2 build of XXH3 where the CPU has it (xxh3_avx2.h): the same hash.
const bool kXxh3Avx2 = xxh3_avx2::Available();

uint64_t HashBytes(const void* data, uint64_t len) {
  return kXxh3Avx2 ? xxh3_avx2::Hash(data, len) : XXH3_64bits(data, len);
}

absl::Status HashImageThrough(const ByteImage& image, uint64_t offset, uint64_t len, uint64_t piece,
                              const std::function<absl::Status(const char*, uint64_t)>& then,
                              uint64_t* hash) {
  std::optional<xxh3_avx2::Stream> avx2;  // built only where the CPU has AVX2
  XXH3_state_t state;
  if (kXxh3Avx2) {
    avx2.emplace();
  } else {
    XXH3_64bits_reset(&state);
  }
  absl::Status s;
  image.ForEachPiece(offset, len, [&](const char* p, uint64_t n) {
    for (uint64_t done = 0; done < n && s.ok();) {
      const uint64_t m = piece == 0 ? n - done : std::min(piece, n - done);
      if (kXxh3Avx2) {
        avx2->Update(p + done, m);
      } else {
        XXH3_64bits_update(&state, p + done, m);
      }
      if (then) s = then(p + done, m);
      done += m;
    }
  });
  CKPT_RETURN_IF_ERROR(s);
  *hash = kXxh3Avx2 ? avx2->Digest() : XXH3_64bits_digest(&state);
  return absl::OkStatus();
}

uint64_t HashImage(const ByteImage& image, uint64_t offset, uint64_t len) {
  uint64_t hash = 0;
  (void)HashImageThrough(image, offset, len, /*piece=*/0, nullptr, &hash);
  return hash;
}

absl::StatusOr<VersionLayout> PlanLayout(store::LayerFileHeader* header) {
  uint64_t off = 0;
  for (store::TensorEntry& t : *header->mutable_tensors()) {
    off = AlignUp(off, kTensorAlignment);
    t.set_offset(off);
    off += t.nbytes();
  }
  VersionLayout layout;
  layout.payload_bytes = off;
  // Checksums and the creation time are filled in at commit: size the body
  // with full-width placeholders so the real values always fit.
  store::LayerFileHeader sizing = *header;
  for (store::TensorEntry& t : *sizing.mutable_tensors()) t.set_xxh3(~uint64_t{0});
  sizing.set_created_unix_ms(std::numeric_limits<int64_t>::max());
  uint64_t body = sizing.ByteSizeLong();
  layout.header_bytes = HeaderBytesFor(body);
  if (layout.header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer header of ", body, " bytes exceeds ", kMaxHeaderBytes));
  }
  layout.file_bytes = layout.header_bytes + AlignUp(layout.payload_bytes, kDirectAlignment);
  return layout;
}

absl::StatusOr<uint64_t> EncodeHeader(const store::LayerFileHeader& header,
                                      const VersionLayout& layout, ByteImage* image) {
  absl::StatusOr<uint64_t> body_hash = EncodeHeaderRegion(header, layout, image);
  if (body_hash.ok()) ZeroPayloadGaps(header, layout, image);
  return body_hash;
}

absl::StatusOr<uint64_t> EncodeHeaderRegion(const store::LayerFileHeader& header,
                                            const VersionLayout& layout, ByteImage* image) {
  std::string body;
  if (!header.SerializeToString(&body)) return absl::InternalError("header serialization failed");
  if (kPrefixBytes + body.size() > layout.header_bytes) {
    return absl::InternalError("header body outgrew its planned size");
  }
  char prefix[kPrefixBytes];
  std::memset(prefix, 0, sizeof(prefix));
  std::memcpy(prefix, kFormatMagic, 8);
  PutU32(prefix + 8, kFormatVersion);
  PutU32(prefix + 12, static_cast<uint32_t>(layout.header_bytes));
  PutU32(prefix + 16, static_cast<uint32_t>(body.size()));
  PutU64(prefix + 24, layout.payload_bytes);
  const uint64_t body_hash = HashBytes(body.data(), body.size());
  PutU64(prefix + 32, body_hash);
  PutU64(prefix + 40, HashBytes(prefix, 40));
  image->CopyIn(0, prefix, kPrefixBytes);
  image->CopyIn(kPrefixBytes, body.data(), body.size());
  image->Zero(kPrefixBytes + body.size(), layout.header_bytes - kPrefixBytes - body.size());
  return body_hash;
}

void ZeroPayloadGaps(const store::LayerFileHeader& header, const VersionLayout& layout,
                     ByteImage* image) {
  // Alignment gaps between tensors and the tail up to the 4096 boundary.
  uint64_t prev_end = 0;
  for (const store::TensorEntry& t : header.tensors()) {
    if (t.offset() > prev_end) image->Zero(layout.header_bytes + prev_end, t.offset() - prev_end);
    prev_end = t.offset() + t.nbytes();
  }
  image->Zero(layout.header_bytes + prev_end, layout.file_bytes - layout.header_bytes - prev_end);
}

absl::StatusOr<DecodedHeader> DecodeHeader(const ByteImage& image, uint64_t file_bytes) {
  if (file_bytes < kDirectAlignment || image.size() < file_bytes) {
    return absl::DataLossError(absl::StrCat("file of ", file_bytes, " bytes is too short"));
  }
  char prefix[kPrefixBytes];
  image.CopyOut(0, prefix, kPrefixBytes);
  if (std::memcmp(prefix, kFormatMagic, 8) != 0) return absl::DataLossError("bad file magic");
  if (HashBytes(prefix, 40) != GetU64(prefix + 40))
    return absl::DataLossError("file prefix checksum mismatch");
  if (GetU32(prefix + 20) != 0 ||
      std::any_of(prefix + 48, prefix + 64, [](char c) { return c != 0; })) {
    return absl::DataLossError("file prefix reserved bytes are not zero");
  }
  if (GetU32(prefix + 8) != kFormatVersion) {
    return absl::DataLossError(absl::StrCat("unsupported format version ", GetU32(prefix + 8)));
  }
  DecodedHeader d;
  d.layout.header_bytes = GetU32(prefix + 12);
  const uint64_t body_len = GetU32(prefix + 16);
  d.layout.payload_bytes = GetU64(prefix + 24);
  // Bounded before rounding up: a payload size within 4095 of 2^64 would wrap
  // to a small file size and let tensors point far past the file.
  if (d.layout.header_bytes > file_bytes ||
      d.layout.payload_bytes > file_bytes - d.layout.header_bytes) {
    return absl::DataLossError(absl::StrCat("file sizes disagree: header says ",
                                            d.layout.header_bytes, " + ", d.layout.payload_bytes,
                                            " bytes, file has ", file_bytes));
  }
  d.layout.file_bytes = d.layout.header_bytes + AlignUp(d.layout.payload_bytes, kDirectAlignment);
  if (d.layout.header_bytes % kDirectAlignment != 0 ||
      kPrefixBytes + body_len > d.layout.header_bytes || d.layout.file_bytes != file_bytes) {
    return absl::DataLossError(absl::StrCat("file sizes disagree: header says ",
                                            d.layout.file_bytes, ", file has ", file_bytes));
  }
  std::string body(body_len, '\0');
  image.CopyOut(kPrefixBytes, body.data(), body_len);
  d.body_xxh3 = HashBytes(body.data(), body.size());
  if (d.body_xxh3 != GetU64(prefix + 32))
    return absl::DataLossError("file header checksum mismatch");
  if (!d.header.ParseFromString(body)) return absl::DataLossError("file header does not parse");
  for (const store::TensorEntry& t : d.header.tensors()) {
    if (t.offset() > d.layout.payload_bytes || t.nbytes() > d.layout.payload_bytes - t.offset()) {
      return absl::DataLossError(absl::StrCat("tensor ", t.name(), " lies outside the payload"));
    }
  }
  return d;
}

absl::Status VerifyTensor(const DecodedHeader& d, const store::TensorEntry& t,
                          const ByteImage& image, uint64_t piece,
                          const std::function<absl::Status(const char*, uint64_t)>& then) {
  uint64_t hash = 0;
  CKPT_RETURN_IF_ERROR(
      HashImageThrough(image, d.layout.header_bytes + t.offset(), t.nbytes(), piece, then, &hash));
  if (hash != t.xxh3()) {
    return absl::DataLossError(absl::StrCat("checksum mismatch in tensor '", t.name(),
                                            "' of layer ", d.header.layer(), " step ",
                                            d.header.step()));
  }
  return absl::OkStatus();
}

absl::Status VerifyPayload(const DecodedHeader& d, const ByteImage& image) {
  for (const store::TensorEntry& t : d.header.tensors()) {
    CKPT_RETURN_IF_ERROR(VerifyTensor(d, t, image, /*piece=*/0, nullptr));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
