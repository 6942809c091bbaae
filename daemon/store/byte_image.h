// ByteImage: a file image in memory, as a run of contiguous pieces. The
// layer-version format (format.h) reads and writes file images only through
// it; LeaseImage (layer_store.h) views the staging pool's chunks of one lease
// as one, BufferImage one contiguous buffer.
//
// Thread-safety: as the memory behind it; a view owns nothing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

namespace ckpt {

class ByteImage {
 public:
  virtual ~ByteImage() = default;
  virtual uint64_t size() const = 0;
  // Calls fn(ptr, n) for each contiguous piece of [offset, offset + len), in
  // order. REQUIRES: offset + len <= size().
  virtual void ForEachPiece(uint64_t offset, uint64_t len,
                            const std::function<void(char*, uint64_t)>& fn) const = 0;

  // REQUIRES (each): offset + len <= size().
  void CopyIn(uint64_t offset, const void* src, uint64_t len) {
    const char* from = static_cast<const char*>(src);
    ForEachPiece(offset, len, [&from](char* p, uint64_t n) {
      std::memcpy(p, from, n);
      from += n;
    });
  }
  void CopyOut(uint64_t offset, void* dst, uint64_t len) const {
    char* to = static_cast<char*>(dst);
    ForEachPiece(offset, len, [&to](char* p, uint64_t n) {
      std::memcpy(to, p, n);
      to += n;
    });
  }
  void Zero(uint64_t offset, uint64_t len) {
    ForEachPiece(offset, len, [](char* p, uint64_t n) { std::memset(p, 0, n); });
  }
};

// One contiguous buffer of `size` bytes (which must outlive the view).
class BufferImage final : public ByteImage {
 public:
  BufferImage(char* data, uint64_t size) : data_(data), size_(size) {}
  uint64_t size() const override { return size_; }
  void ForEachPiece(uint64_t offset, uint64_t len,
                    const std::function<void(char*, uint64_t)>& fn) const override {
    if (len > 0) fn(data_ + offset, len);
  }

 private:
  char* const data_;
  const uint64_t size_;
};

}  // namespace ckpt
