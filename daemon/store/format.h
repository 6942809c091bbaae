// The layer-version file format (version 1).
//
// One file holds one layer version: every tensor of one layer of one rank at
// one step. Layout (all integers little-endian):
//
//   offset  size  field
//   0       8     magic "CKPTLV\0\1"
//   8       4     format version (kFormatVersion)
//   12      4     header_bytes: where the payload starts; a multiple of 4096
//   16      4     body_len: length of the serialized LayerFileHeader
//   20      4     reserved, must be 0
//   24      8     payload_bytes
//   32      8     XXH3-64 of the body
//   40      8     XXH3-64 of bytes [0, 40)
//   48      16    reserved, must be 0 (checked on read)
//   64      body_len  LayerFileHeader (store.proto), then zeros to header_bytes
//   header_bytes  payload: each tensor at its entry's offset (64-byte aligned),
//                 then zeros up to the next multiple of 4096 (O_DIRECT).
//
// Each tensor carries its own XXH3-64; the index record carries the body's
// XXH3-64, so a file is only accepted for the record that names it.
// Nothing in the file is trusted before its checksum is verified.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/store/byte_image.h"
#include "daemon/store/store.pb.h"

namespace ckpt {

inline constexpr char kFormatMagic[8] = {'C', 'K', 'P', 'T', 'L', 'V', '\0', '\1'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kPrefixBytes = 64;
inline constexpr uint64_t kTensorAlignment = 64;
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{16} << 20;

// Sizes of one layer version's file image.
struct VersionLayout {
  uint64_t header_bytes = 0;   // multiple of 4096
  uint64_t payload_bytes = 0;  // tensors with alignment gaps
  uint64_t file_bytes = 0;     // header_bytes + payload rounded up to 4096
};

// Assigns each tensor's payload offset (64-byte aligned, in order) and
// returns the layout. `header` must have every field set except the tensor
// checksums and created_unix_ms, which Commit fills in (the layout leaves room
// for their largest encodings).
// INVALID_ARGUMENT when the header would exceed kMaxHeaderBytes.
absl::StatusOr<VersionLayout> PlanLayout(store::LayerFileHeader* header);

// XXH3-64 of `len` bytes of the image at `offset`.
uint64_t HashImage(const ByteImage& image, uint64_t offset, uint64_t len);
// HashImage that also hands the bytes on: `then(p, n)` is called for each
// piece of at most `piece` bytes (0: no limit) right after the piece is hashed, while it is
// still in the CPU's cache, so a caller that checksums and copies reads the
// memory once (an empty `then`: only the hash). Stops handing on after
// `then` fails and returns that status; else *hash is the XXH3-64.
absl::Status HashImageThrough(const ByteImage& image, uint64_t offset, uint64_t len, uint64_t piece,
                              const std::function<absl::Status(const char*, uint64_t)>& then,
                              uint64_t* hash);
uint64_t HashBytes(const void* data, uint64_t len);

// Writes the prefix and body of `header` into the image at offset 0 and
// zeroes the padding (header and payload tail). Returns the body's XXH3-64.
// REQUIRES: tensors' data already copied; layout from PlanLayout(header).
absl::StatusOr<uint64_t> EncodeHeader(const store::LayerFileHeader& header,
                                      const VersionLayout& layout, ByteImage* image);
// EncodeHeader in two halves, for a writer that sends the payload while the
// checksums the header holds are being computed: ZeroPayloadGaps touches
// only the payload region (the alignment gaps between tensors and the tail;
// it needs the tensors' offsets and sizes, not their checksums),
// EncodeHeaderRegion only [0, layout.header_bytes).
void ZeroPayloadGaps(const store::LayerFileHeader& header, const VersionLayout& layout,
                     ByteImage* image);
absl::StatusOr<uint64_t> EncodeHeaderRegion(const store::LayerFileHeader& header,
                                            const VersionLayout& layout, ByteImage* image);

// Parses and checks the prefix and body at the start of a file image.
// DATA_LOSS on a wrong magic, version, checksum or size.
struct DecodedHeader {
  store::LayerFileHeader header;
  VersionLayout layout;
  uint64_t body_xxh3 = 0;
};
absl::StatusOr<DecodedHeader> DecodeHeader(const ByteImage& image, uint64_t file_bytes);

// Verifies every tensor's XXH3-64 against the payload in `image`.
// DATA_LOSS naming the first tensor that does not match.
absl::Status VerifyPayload(const DecodedHeader& decoded, const ByteImage& image);
// Verifies tensor `t` of `decoded`, handing its bytes to `then` (if any) on
// the way (HashImageThrough): DATA_LOSS naming it when it does not match,
// after `then` saw every byte.
absl::Status VerifyTensor(const DecodedHeader& decoded, const store::TensorEntry& t,
                          const ByteImage& image, uint64_t piece,
                          const std::function<absl::Status(const char*, uint64_t)>& then);

}  // namespace ckpt
