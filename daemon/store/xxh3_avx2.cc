// See xxh3_avx2.h. This file alone is compiled with -mavx2 (CMakeLists.txt);
// it must stay free of anything but xxHash's code, whose functions
// XXH_INLINE_ALL makes local to this file, so no AVX2 code can be picked by
// the linker for a caller elsewhere.
#include "daemon/store/xxh3_avx2.h"

#if defined(__x86_64__) && defined(__AVX2__)

#define XXH_INLINE_ALL
#define XXH_VECTOR 2  // XXH_AVX2
#include <xxhash.h>

#include <new>

namespace ckpt::xxh3_avx2 {

static_assert(sizeof(XXH3_state_t) <= sizeof(Stream) && alignof(XXH3_state_t) <= 64,
              "Stream's storage does not fit an XXH3_state_t");

bool Available() { return __builtin_cpu_supports("avx2"); }

uint64_t Hash(const void* data, size_t len) { return XXH3_64bits(data, len); }

Stream::Stream() { XXH3_64bits_reset(new (state_) XXH3_state_t); }

void Stream::Update(const void* data, size_t len) {
  XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state_), data, len);
}

uint64_t Stream::Digest() const {
  return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

}  // namespace ckpt::xxh3_avx2

#else  // no AVX2 build: format.cc uses the library

namespace ckpt::xxh3_avx2 {

bool Available() { return false; }
uint64_t Hash(const void*, size_t) { return 0; }
Stream::Stream() : state_() {}
void Stream::Update(const void*, size_t) {}
uint64_t Stream::Digest() const { return 0; }

}  // namespace ckpt::xxh3_avx2

#endif
