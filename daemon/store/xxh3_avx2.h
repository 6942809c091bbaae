// XXH3-64 built for AVX2. Debian's libxxhash is compiled for the x86-64
// baseline (SSE2), which checksums at about 0.6 of the speed of reading the
// same memory on one core; xxh3_avx2.cc, the one file built with -mavx2,
// compiles xxHash's own code for AVX2. The hash is the same function (XXH3
// defines its output independently of the vector width); format.cc uses
// this only when the CPU has AVX2 (Available()).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckpt::xxh3_avx2 {

// True when this build has the AVX2 code and the CPU runs it.
bool Available();

uint64_t Hash(const void* data, size_t len);

// XXH3-64 of the concatenation of every Update.
class Stream {
 public:
  Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void Update(const void* data, size_t len);
  uint64_t Digest() const;

 private:
  alignas(64) unsigned char state_[640];  // an XXH3_state_t (checked in the .cc)
};

}  // namespace ckpt::xxh3_avx2
