#include "daemon/gpu/cuda_host.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

#ifdef CKPT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckpt {
namespace {

#ifdef CKPT_HAVE_CUDA

class RuntimeCalls final : public HostRegisterCalls {
 public:
  absl::Status Register(void* ptr, uint64_t bytes) override {
    const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (e == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // leave the thread's runtime state clean
    return absl::InternalError(absl::StrCat("cudaHostRegister: ", cudaGetErrorString(e)));
  }
  absl::Status Unregister(void* ptr) override {
    const cudaError_t e = cudaHostUnregister(ptr);
    if (e == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaHostUnregister: ", cudaGetErrorString(e)));
  }
};

#else

class RuntimeCalls final : public HostRegisterCalls {
 public:
  absl::Status Register(void*, uint64_t) override {
    return absl::FailedPreconditionError("built without CUDA");
  }
  absl::Status Unregister(void*) override {
    return absl::FailedPreconditionError("built without CUDA");
  }
};

#endif

}  // namespace

#ifdef CKPT_HAVE_CUDA

int CudaDeviceCount() {
  int n = 0;  // left untouched by the runtime when there is no driver
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string CudaSupport() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return absl::StrCat("cuda runtime ", v / 1000, ".", (v % 1000) / 10, ", ", CudaDeviceCount(),
                      " device(s)");
}

HostRegistration::HostRegistration(void* ptr, uint64_t bytes, uint64_t pool_chunk_bytes) {
  if (CudaDeviceCount() == 0) {
    reason_ = "no CUDA device; staging memory is locked but not CUDA-registered";
    return;
  }
  calls_ = RuntimeHostRegisterCalls();
  RegisterChunks(static_cast<char*>(ptr), bytes, kHostRegisterChunkBytes, pool_chunk_bytes);
}

#else

int CudaDeviceCount() { return 0; }
std::string CudaSupport() { return "none (built without CUDA)"; }
HostRegistration::HostRegistration(void*, uint64_t, uint64_t) { reason_ = "built without CUDA"; }

#endif

HostRegisterCalls* RuntimeHostRegisterCalls() {
  static HostRegisterCalls* const calls = new RuntimeCalls();
  return calls;
}

HostRegistration::HostRegistration(void* ptr, uint64_t bytes, HostRegisterCalls* calls,
                                   uint64_t chunk_bytes, uint64_t pool_chunk_bytes)
    : calls_(calls) {
  RegisterChunks(static_cast<char*>(ptr), bytes,
                 chunk_bytes == 0 ? kHostRegisterChunkBytes : chunk_bytes, pool_chunk_bytes);
}

void HostRegistration::RegisterChunks(char* ptr, uint64_t bytes, uint64_t chunk_bytes,
                                      uint64_t pool_chunk_bytes) {
  if (bytes == 0) {
    reason_ = "nothing to register";
    return;
  }
  // Every range but the last ends on a pool-chunk boundary, so that no
  // chunk of the pool (one copy's destination) straddles two ranges.
  if (pool_chunk_bytes > 0) {
    chunk_bytes = std::max(pool_chunk_bytes, chunk_bytes / pool_chunk_bytes * pool_chunk_bytes);
  }
  const uint64_t count = (bytes + chunk_bytes - 1) / chunk_bytes;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t offset = i * chunk_bytes;
    const uint64_t n = std::min(chunk_bytes, bytes - offset);
    const absl::Status s = calls_->Register(ptr + offset, n);
    if (s.ok()) {
      chunks_.push_back(ptr + offset);
      continue;
    }
    reason_ = absl::StrCat("registering chunk ", i + 1, " of ", count, " (", n, " bytes at offset ",
                           offset, " of ", bytes, ") failed: ", s.message(), "; ");
    // Nothing stays half-registered: the chunks before it are unregistered.
    uint64_t unregistered = 0;
    while (!chunks_.empty()) {
      const absl::Status u = calls_->Unregister(chunks_.back());
      if (u.ok()) {
        ++unregistered;
      } else {
        absl::StrAppend(&reason_, "unregistering chunk ", chunks_.size(), " failed: ", u.message(),
                        "; ");
      }
      chunks_.pop_back();
    }
    absl::StrAppend(&reason_, unregistered, " registered chunk(s) unregistered again; staging ",
                    "memory is locked but not CUDA-registered (device-to-host copies are slower)");
    return;
  }
  reason_ = absl::StrCat("cudaHostRegister'ed ", bytes, " bytes in ", chunks_.size(),
                         " chunk(s) of ", "at most ", chunk_bytes, " bytes");
}

HostRegistration::~HostRegistration() {
  while (!chunks_.empty()) {
    IgnoreError(calls_->Unregister(chunks_.back()), "closing: nobody to tell, the pool goes next");
    chunks_.pop_back();
  }
}

}  // namespace ckpt
