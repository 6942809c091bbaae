#include "daemon/gpu/cuda_ipc.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/cuda_entry.h"
#include "base/gpu_uuid.h"
#include "base/logging.h"
#include "base/status.h"

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

absl::Status DriverStatus(const char* what, CUresult r) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  absl::Status s = absl::InternalError(absl::StrCat(what, ": CUresult ", static_cast<int>(r)));
  return IsStickyCudaErrorCode(static_cast<int>(r)) ? MarkStickyCudaError(std::move(s)) : s;
}

template <typename Fn>
absl::Status LoadDriverFunction(const char* symbol, Fn* fn) {
  std::string why;
  cudaError_t e = cudaSuccess;
  if (CudaDriverEntry(symbol, fn, &why, &e)) return absl::OkStatus();
  absl::Status s = absl::InternalError(why);
  return IsStickyCudaErrorCode(e) ? MarkStickyCudaError(std::move(s)) : s;
}

// The trainer's pages of virtual-memory-management memory, imported and
// mapped into one reserved range per run (CudaIpc::MapPages). The range is
// exactly the run's size: never one sized to the device, which would cost
// address space per import.
class PageMapper {
 public:
  absl::StatusOr<char*> Map(int device, const std::vector<CudaIpc::Page>& pages) {
    CKPT_RETURN_IF_ERROR(Load());
    Run run;
    for (const CudaIpc::Page& p : pages) run.bytes += p.bytes;
    absl::Status s = DriverStatus("cuMemAddressReserve", reserve_(&run.base, run.bytes, 0, 0, 0));
    if (!s.ok()) return s;
    if (s = MapInto(device, pages, &run); !s.ok()) {
      Undo(run);
      return s;
    }
    char* base = reinterpret_cast<char*>(run.base);
    absl::MutexLock lock(&mu_);
    runs_[base] = std::move(run);
    return base;
  }

  void Unmap(char* base) {
    Run run;
    {
      absl::MutexLock lock(&mu_);
      auto it = runs_.find(base);
      if (it == runs_.end()) return;
      run = std::move(it->second);
      runs_.erase(it);
    }
    Undo(run);
  }

 private:
  struct Run {
    CUdeviceptr base = 0;
    uint64_t bytes = 0;
    std::vector<uint64_t> mapped;  // the sizes of the pages mapped from base, in order
    std::vector<CUmemGenericAllocationHandle> handles;
  };

  absl::Status MapInto(int device, const std::vector<CudaIpc::Page>& pages, Run* run) {
    uint64_t offset = 0;
    for (const CudaIpc::Page& p : pages) {
      CUmemGenericAllocationHandle h = 0;
      CUmemFabricHandle fabric;
      absl::Status s;
      if (p.fd < 0 && p.fabric_handle.size() != sizeof(fabric)) {
        return absl::InvalidArgumentError("a fabric handle of the wrong size");
      }
      if (p.fd >= 0) {
        s = DriverStatus("cuMemImportFromShareableHandle (POSIX descriptor)",
                         import_(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(p.fd)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      } else {
        std::memcpy(&fabric, p.fabric_handle.data(), sizeof(fabric));
        s = DriverStatus("cuMemImportFromShareableHandle (fabric)",
                         import_(&h, &fabric, CU_MEM_HANDLE_TYPE_FABRIC));
      }
      CKPT_RETURN_IF_ERROR(s);
      run->handles.push_back(h);
      CKPT_RETURN_IF_ERROR(DriverStatus("cuMemMap", map_(run->base + offset, p.bytes, 0, h, 0)));
      run->mapped.push_back(p.bytes);
      offset += p.bytes;
    }
    CUmemAccessDesc access;
    std::memset(&access, 0, sizeof(access));
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return DriverStatus("cuMemSetAccess", set_access_(run->base, run->bytes, &access, 1));
  }

  // Each mapping is undone by itself; what fails is logged (and leaked).
  void Undo(const Run& run) {
    uint64_t offset = 0;
    int failed = 0;
    for (uint64_t bytes : run.mapped) {
      failed += unmap_(run.base + offset, bytes) != CUDA_SUCCESS;
      offset += bytes;
    }
    for (CUmemGenericAllocationHandle h : run.handles) failed += release_(h) != CUDA_SUCCESS;
    failed += address_free_(run.base, run.bytes) != CUDA_SUCCESS;
    if (failed > 0) {
      CKPT_LOG(ERROR) << "releasing a run of " << run.handles.size()
                      << " imported pages: " << failed
                      << " driver calls failed (their memory stays mapped)";
    }
  }

  absl::Status Load() {
    absl::MutexLock lock(&mu_);
    if (address_free_ != nullptr) return absl::OkStatus();
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemImportFromShareableHandle", &import_));
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemAddressReserve", &reserve_));
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemMap", &map_));
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemSetAccess", &set_access_));
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemUnmap", &unmap_));
    CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemRelease", &release_));
    return LoadDriverFunction("cuMemAddressFree", &address_free_);
  }

  absl::Mutex mu_;
  // Resolved once by Load, under mu_, which every caller passes first.
  CUresult (*import_)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*reserve_)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*map_)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                   unsigned long long) = nullptr;
  CUresult (*set_access_)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free_)(CUdeviceptr, size_t) = nullptr;
  std::map<char*, Run> runs_ ABSL_GUARDED_BY(mu_);
};

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
    GetAddressRangeFn get_range = nullptr;
    {
      absl::MutexLock lock(&probe_mu_);  // registrations run on several threads
      if (get_range_ == nullptr) {
        CKPT_RETURN_IF_ERROR(LoadDriverFunction("cuMemGetAddressRange", &get_range_));
      }
      get_range = get_range_;
    }
    CUdeviceptr start = 0;
    size_t size = 0;
    const CUresult r = get_range(&start, &size, reinterpret_cast<CUdeviceptr>(base));
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

  absl::StatusOr<char*> MapPages(int device, const std::vector<Page>& pages) override {
    CKPT_CUDA_RETURN(cudaSetDevice(device));  // the primary context, current for the driver calls
    return pages_.Map(device, pages);
  }

  void UnmapPages(int device, char* base) override {
    cudaSetDevice(device);
    pages_.Unmap(base);
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

  PageMapper pages_;
  // Guards the probes and the driver function resolved on first use.
  absl::Mutex probe_mu_;
  GetAddressRangeFn get_range_ ABSL_GUARDED_BY(probe_mu_) = nullptr;
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
  absl::StatusOr<char*> MapPages(int, const std::vector<Page>&) override { return NoCuda(); }
  void UnmapPages(int, char*) override {}
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
