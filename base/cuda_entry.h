// CudaDriverEntry: a function of the CUDA driver API reached through the
// CUDA runtime (cudaGetDriverEntryPointByVersion, CUDA 12.0 ABI), so that
// nothing links libcuda and every binary still starts on a machine without
// a driver. The one loader of the client's GPU export, the daemon's page
// importer and the GPU test trainer.
//
// Header-only, for code built with the CUDA toolkit (CKPT_HAVE_CUDA) that
// links CUDA::cudart; the rest of ckpt_base does not need CUDA.
#pragma once

#if defined(CKPT_HAVE_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

#include <string>

namespace ckpt {

// Sets `*fn` to the driver's `symbol` and returns true; false with `*why`
// saying what failed (the runtime's error is cleared from the thread) and,
// when given, `*error` the runtime's error (cudaSuccess when the driver
// merely lacks the symbol), so a caller can tell a sticky error.
template <typename Fn>
bool CudaDriverEntry(const char* symbol, Fn* fn, std::string* why, cudaError_t* error = nullptr) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q);
  if (error != nullptr) *error = e;
  if (e != cudaSuccess) {
    cudaGetLastError();
    *why = std::string("driver entry point ") + symbol + ": " + cudaGetErrorString(e);
    return false;
  }
  if (p == nullptr || q != cudaDriverEntryPointSuccess) {
    *why = std::string("the CUDA driver has no ") + symbol;
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

}  // namespace ckpt
#endif
