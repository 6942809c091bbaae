#include "daemon/gpu/cuda_ipc.h"

#include "absl/strings/str_cat.h"
#include "base/gpu_uuid.h"

#ifdef CKPT_HAVE_CUDA
#include <cuda.h>  // types of the driver entry point only; libcuda is never linked
#include <cuda_runtime_api.h>

#include <cstring>
#endif

namespace ckpt {
namespace {

#ifdef CKPT_HAVE_CUDA

absl::Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // leave the thread's runtime state clean
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Returns the failure of a CUDA runtime call as a Status.
#define CKPT_CUDA_RETURN(expr)                                  \
  do {                                                          \
    const absl::Status ckpt_cuda_s = CudaStatus(#expr, (expr)); \
    if (!ckpt_cuda_s.ok()) return ckpt_cuda_s;                  \
  } while (0)

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

class RuntimeCudaIpc final : public CudaIpc {
 public:
  absl::StatusOr<int> FindDevice(const std::string& uuid) override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::FailedPreconditionError("this ckptd sees no CUDA device");
    }
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop;
      if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
      if (GpuUuidString(prop.uuid.bytes) == uuid) return d;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("device ", uuid, " is not visible to ckptd (", count,
                     " visible; check CUDA_VISIBLE_DEVICES of the service)"));
  }

  absl::StatusOr<char*> OpenMemHandle(int device, const std::string& handle) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    CKPT_CUDA_RETURN(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    return static_cast<char*>(p);
  }

  absl::StatusOr<uint64_t> AllocationSize(int device, const char* base) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    if (get_range_ == nullptr) {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q;
      CKPT_CUDA_RETURN(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                        cudaEnableDefault, &q));
      if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
        return absl::InternalError("the driver has no cuMemGetAddressRange");
      }
      get_range_ = reinterpret_cast<GetAddressRangeFn>(fn);
    }
    CUdeviceptr start = 0;
    size_t size = 0;
    const CUresult r = get_range_(&start, &size, reinterpret_cast<CUdeviceptr>(base));
    if (r != CUDA_SUCCESS) return absl::InternalError(absl::StrCat("cuMemGetAddressRange: ", r));
    if (start != reinterpret_cast<CUdeviceptr>(base)) {
      return absl::InvalidArgumentError("the mapped address is not the start of its allocation");
    }
    return static_cast<uint64_t>(size);
  }

  void CloseMemHandle(int device, char* base) override {
    cudaSetDevice(device);
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
  }

  absl::StatusOr<void*> OpenEventHandle(int device, const std::string& handle) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t e = nullptr;
    CKPT_CUDA_RETURN(cudaIpcOpenEventHandle(&e, h));
    return static_cast<void*>(e);
  }

  void DestroyEvent(int device, void* event) override {
    cudaSetDevice(device);
    if (cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) cudaGetLastError();
  }

  absl::StatusOr<void*> CreateStream(int device) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    cudaStream_t s = nullptr;
    CKPT_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return static_cast<void*>(s);
  }

  void DestroyStream(int device, void* stream) override {
    cudaSetDevice(device);
    if (cudaStreamDestroy(static_cast<cudaStream_t>(stream)) != cudaSuccess) cudaGetLastError();
  }

  absl::Status StreamWaitEvent(int device, void* stream, void* event) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return CudaStatus(
        "cudaStreamWaitEvent",
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  }

  absl::Status CopyToHostAsync(int device, void* stream, void* dst, const char* src,
                               uint64_t n) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return CudaStatus(
        "cudaMemcpyAsync (device to host)",
        cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  }

  absl::Status CopyToDevice(int device, void* stream, char* dst, const void* src,
                            uint64_t n) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    auto s = static_cast<cudaStream_t>(stream);
    CKPT_CUDA_RETURN(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
    return CudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(s));
  }

  absl::Status Synchronize(int device, void* stream) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return CudaStatus("cudaStreamSynchronize",
                      cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }

  absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int device) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    std::string why;
    std::unique_ptr<drift::DriftKernel> k = drift::MakeCudaDriftKernel(&why);
    if (k == nullptr) return absl::InternalError("CUDA drift kernel unavailable: " + why);
    return k;
  }

 private:
  GetAddressRangeFn get_range_ = nullptr;  // resolved once, through the runtime
};

#else  // no CUDA toolkit at build time

absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "this ckptd was built without CUDA; GPU regions need a CUDA build");
}

class NoCudaIpc final : public CudaIpc {
 public:
  absl::StatusOr<int> FindDevice(const std::string&) override { return NoCuda(); }
  absl::StatusOr<char*> OpenMemHandle(int, const std::string&) override { return NoCuda(); }
  absl::StatusOr<uint64_t> AllocationSize(int, const char*) override { return NoCuda(); }
  void CloseMemHandle(int, char*) override {}
  absl::StatusOr<void*> OpenEventHandle(int, const std::string&) override { return NoCuda(); }
  void DestroyEvent(int, void*) override {}
  absl::StatusOr<void*> CreateStream(int) override { return NoCuda(); }
  void DestroyStream(int, void*) override {}
  absl::Status StreamWaitEvent(int, void*, void*) override { return NoCuda(); }
  absl::Status CopyToHostAsync(int, void*, void*, const char*, uint64_t) override {
    return NoCuda();
  }
  absl::Status CopyToDevice(int, void*, char*, const void*, uint64_t) override { return NoCuda(); }
  absl::Status Synchronize(int, void*) override { return NoCuda(); }
  absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int) override {
    return NoCuda();
  }
};

#endif

}  // namespace

std::unique_ptr<CudaIpc> MakeCudaIpc() {
#ifdef CKPT_HAVE_CUDA
  return std::make_unique<RuntimeCudaIpc>();
#else
  return std::make_unique<NoCudaIpc>();
#endif
}

}  // namespace ckpt
