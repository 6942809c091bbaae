#include "daemon/gpu/cuda_ipc.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/gpu_uuid.h"

#ifdef CKPT_HAVE_CUDA
#include <cuda.h>  // types of the driver entry point only; libcuda is never linked
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>

#include "absl/synchronization/mutex.h"
#endif

namespace ckpt {
namespace {

constexpr char kStickyPayload[] = "type.ckpt/cuda-sticky-error";

// The sticky cudaError_t values of CUDA 13 (driver_types.h: "the process
// must be terminated and relaunched", and the uncorrectable hardware errors).
constexpr int kStickyCudaErrors[] = {
    214,  // cudaErrorECCUncorrectable
    220,  // cudaErrorNvlinkUncorrectable
    226,  // cudaErrorContained
    700,  // cudaErrorIllegalAddress
    702,  // cudaErrorLaunchTimeout
    710,  // cudaErrorAssert
    714,  // cudaErrorHardwareStackError
    715,  // cudaErrorIllegalInstruction
    716,  // cudaErrorMisalignedAddress
    717,  // cudaErrorInvalidAddressSpace
    718,  // cudaErrorInvalidPc
    719,  // cudaErrorLaunchFailure
    721,  // cudaErrorTensorMemoryLeak
    999,  // cudaErrorUnknown
};

#ifdef CKPT_HAVE_CUDA

static_assert(cudaErrorECCUncorrectable == 214 && cudaErrorNvlinkUncorrectable == 220 &&
                  cudaErrorContained == 226 && cudaErrorIllegalAddress == 700 &&
                  cudaErrorLaunchTimeout == 702 && cudaErrorAssert == 710 &&
                  cudaErrorHardwareStackError == 714 && cudaErrorIllegalInstruction == 715 &&
                  cudaErrorMisalignedAddress == 716 && cudaErrorInvalidAddressSpace == 717 &&
                  cudaErrorInvalidPc == 718 && cudaErrorLaunchFailure == 719 &&
                  cudaErrorTensorMemoryLeak == 721 && cudaErrorUnknown == 999,
              "kStickyCudaErrors must match the toolkit's cudaError_t values");

absl::Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // leave the thread's runtime state clean (a sticky error stays)
  absl::Status s = absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  return IsStickyCudaErrorCode(e) ? MarkStickyCudaError(std::move(s)) : s;
}

// A query's answer: true when the work is complete, false while it is
// pending (cudaErrorNotReady is no error), else the failure.
absl::StatusOr<bool> Completion(const char* what, cudaError_t e) {
  if (e == cudaErrorNotReady) return false;
  absl::Status s = CudaStatus(what, e);
  if (!s.ok()) return s;
  return true;
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

  absl::StatusOr<bool> QueryEvent(int device, void* event) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return Completion("cudaEventQuery", cudaEventQuery(static_cast<cudaEvent_t>(event)));
  }

  absl::StatusOr<bool> QueryStream(int device, void* stream) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return Completion("cudaStreamQuery", cudaStreamQuery(static_cast<cudaStream_t>(stream)));
  }

  absl::Status CopyToHostAsync(int device, void* stream, void* dst, const char* src,
                               uint64_t n) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return CudaStatus(
        "cudaMemcpyAsync (device to host)",
        cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  }

  absl::Status CopyToDeviceAsync(int device, void* stream, char* dst, const void* src,
                                 uint64_t n) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    return CudaStatus(
        "cudaMemcpyAsync (host to device)",
        cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  }

  absl::Status ProbeDevice(int device) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    absl::MutexLock lock(&probe_mu_);  // rare (after an error) and short
    Probe& p = probes_[device];
    if (p.buffer == nullptr) CKPT_CUDA_RETURN(cudaMalloc(&p.buffer, 4));
    if (p.stream == nullptr) {
      CKPT_CUDA_RETURN(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking));
    }
    CKPT_CUDA_RETURN(cudaMemsetAsync(p.buffer, 0, 4, p.stream));
    return Completion("cudaStreamQuery (probe)", cudaStreamQuery(p.stream)).status();
  }

  absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int device) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));
    std::string why;
    std::unique_ptr<drift::DriftKernel> k = drift::MakeCudaDriftKernel(&why);
    if (k == nullptr) return absl::InternalError("CUDA drift kernel unavailable: " + why);
    return k;
  }

 private:
  // ckptd's own resources ProbeDevice asks on, per device (kept for the
  // life of the process: four bytes and a stream per device).
  struct Probe {
    void* buffer = nullptr;
    cudaStream_t stream = nullptr;
  };

  GetAddressRangeFn get_range_ = nullptr;  // resolved once, through the runtime
  absl::Mutex probe_mu_;
  std::map<int, Probe> probes_ ABSL_GUARDED_BY(probe_mu_);
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
  absl::StatusOr<bool> QueryEvent(int, void*) override { return NoCuda(); }
  absl::StatusOr<bool> QueryStream(int, void*) override { return NoCuda(); }
  absl::Status CopyToHostAsync(int, void*, void*, const char*, uint64_t) override {
    return NoCuda();
  }
  absl::Status CopyToDeviceAsync(int, void*, char*, const void*, uint64_t) override {
    return NoCuda();
  }
  absl::Status ProbeDevice(int) override { return NoCuda(); }
  absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int) override {
    return NoCuda();
  }
};

#endif

}  // namespace

bool IsStickyCudaErrorCode(int cuda_error) {
  for (int e : kStickyCudaErrors) {
    if (e == cuda_error) return true;
  }
  return false;
}

absl::Status MarkStickyCudaError(absl::Status status) {
  if (!status.ok()) status.SetPayload(kStickyPayload, absl::Cord("1"));
  return status;
}

bool IsStickyCudaError(const absl::Status& status) {
  return status.GetPayload(kStickyPayload).has_value();
}

std::unique_ptr<CudaIpc> MakeCudaIpc() {
#ifdef CKPT_HAVE_CUDA
  return std::make_unique<RuntimeCudaIpc>();
#else
  return std::make_unique<NoCudaIpc>();
#endif
}

}  // namespace ckpt
