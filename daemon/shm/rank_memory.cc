#include "daemon/shm/rank_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace ckpt {
namespace {

// memcpy with non-temporal stores where the CPU has them: the destination is
// written whole and not read again by ckptd, so its lines are neither read
// from memory first (as a plain store's cache fill does) nor left in the
// cache.
void CopyStreaming(char* dst, const char* src, uint64_t n) {
#if defined(__SSE2__)
  const uint64_t head = std::min<uint64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
  _mm_sfence();
#endif
  std::memcpy(dst, src, n);
}

}  // namespace

absl::Status HostMemory::CopyOut(void* dst, const char* src, uint64_t n) {
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

absl::Status HostMemory::CopyIn(char* dst, const void* src, uint64_t n) {
  // A restore is usually the first write through ckptd's mapping of the
  // trainer's memfd, and mapping its pages here costs more than the copy.
  // Written page by page, each 4 KiB page faults (0.156 s for 512 MiB on the
  // development VM, against 0.035 s for the copy alone); MADV_POPULATE_WRITE
  // maps them in one call but still takes the write-fault path for every
  // page (0.126 s). MADV_POPULATE_READ faults one page in 16: a read fault
  // on shared memory maps its already-allocated neighbours as well
  // (fault-around), writable, since tmpfs does not track writes to them
  // (0.070 s). A hint: a kernel without it (EINVAL) faults on write.
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = reinterpret_cast<uintptr_t>(dst) / page * page;
  const uint64_t end = (reinterpret_cast<uintptr_t>(dst) + n) / page * page;
  if (end > begin + page) {
    (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);
  }
  CopyStreaming(dst, static_cast<const char*>(src), n);
  return absl::OkStatus();
}

}  // namespace ckpt
