#include "daemon/shm/rank_memory.h"

#include <cstring>

namespace ckpt {

absl::Status HostMemory::CopyOut(void* dst, const char* src, uint64_t n) {
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

absl::Status HostMemory::CopyIn(char* dst, const void* src, uint64_t n) {
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

}  // namespace ckpt
