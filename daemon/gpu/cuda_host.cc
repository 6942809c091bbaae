#include "daemon/gpu/cuda_host.h"

#include "absl/strings/str_cat.h"

#ifdef CKPT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckpt {

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

HostRegistration::HostRegistration(void* ptr, uint64_t bytes) {
  if (CudaDeviceCount() == 0) {
    reason_ = "no CUDA device; staging memory is locked but not CUDA-registered";
    return;
  }
  cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    reason_ = absl::StrCat("cudaHostRegister failed: ", cudaGetErrorString(e));
    cudaGetLastError();
    return;
  }
  ptr_ = ptr;
  registered_ = true;
  reason_ = absl::StrCat("cudaHostRegister'ed ", bytes, " bytes");
}

HostRegistration::~HostRegistration() {
  if (registered_) cudaHostUnregister(ptr_);
}

#else

int CudaDeviceCount() { return 0; }
std::string CudaSupport() { return "none (built without CUDA)"; }
HostRegistration::HostRegistration(void*, uint64_t) { reason_ = "built without CUDA"; }
HostRegistration::~HostRegistration() = default;

#endif

}  // namespace ckpt
