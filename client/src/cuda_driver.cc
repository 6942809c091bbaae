#include "cuda_driver.h"

#include "absl/strings/str_cat.h"
#include "base/cuda_entry.h"
#include "base/gpu_uuid.h"
#include "base/status.h"

#ifdef CKPT_HAVE_CUDA
#include <cuda.h>  // driver types only; the functions come through the runtime
#include <cuda_runtime_api.h>

#include <cstring>
#endif

namespace ckpt::internal {

#ifdef CKPT_HAVE_CUDA
namespace {

absl::Status CudaError(const std::string& what, cudaError_t e) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

template <typename Fn>
absl::StatusOr<Fn> DriverFunction(const char* symbol) {
  Fn fn = nullptr;
  std::string why;
  if (!CudaDriverEntry(symbol, &fn, &why)) return absl::InternalError(why);
  return fn;
}

class RuntimeDriver final : public CudaDriver {
 public:
  ~RuntimeDriver() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  absl::StatusOr<int> DeviceOf(uint64_t ptr) override {
    cudaPointerAttributes attr;
    const cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr));
    if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return absl::InvalidArgumentError("not in CUDA device memory");
    }
    return attr.device;
  }

  absl::StatusOr<Range> AllocationRange(uint64_t ptr) override {
    CKPT_RETURN_IF_ERROR(Load());
    CUdeviceptr base = 0;
    size_t size = 0;
    if (get_range_(&base, &size, static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
      return absl::InvalidArgumentError("the driver knows no allocation at it");
    }
    return Range{static_cast<uint64_t>(base), static_cast<uint64_t>(size)};
  }

  absl::StatusOr<bool> LegacyIpcCapable(uint64_t ptr) override {
    CKPT_RETURN_IF_ERROR(Load());
    int capable = 0;
    if (get_attribute_(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                       static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
      return false;
    }
    return capable != 0;
  }

  absl::StatusOr<std::string> IpcMemHandle(uint64_t base) override {
    cudaIpcMemHandle_t handle;
    const cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) return CudaError("cudaIpcGetMemHandle", e);
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }

  absl::StatusOr<Page> PageAt(uint64_t ptr) override {
    CKPT_RETURN_IF_ERROR(LoadPages());
    CUmemGenericAllocationHandle h = 0;
    if (retain_(&h, reinterpret_cast<void*>(ptr)) != CUDA_SUCCESS) {
      return absl::InvalidArgumentError("not memory of CUDA's virtual memory management API");
    }
    CUmemAllocationProp prop;
    std::memset(&prop, 0, sizeof(prop));
    const CUresult r = properties_(&prop, h);
    release_(h);
    if (r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuMemGetAllocationPropertiesFromHandle: ", r));
    }
    CKPT_ASSIGN_OR_RETURN(Range range, AllocationRange(ptr));
    Page page;
    page.base = range.base;
    page.size = range.size;
    page.posix_fd = (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    page.fabric = (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) != 0;
    return page;
  }

  absl::StatusOr<int> ExportPageFd(uint64_t base) override {
    int fd = -1;
    CKPT_RETURN_IF_ERROR(Export(base, &fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    return fd;
  }

  absl::StatusOr<std::string> ExportPageFabric(uint64_t base) override {
    CUmemFabricHandle fabric;
    CKPT_RETURN_IF_ERROR(Export(base, &fabric, CU_MEM_HANDLE_TYPE_FABRIC));
    return std::string(reinterpret_cast<const char*>(&fabric), sizeof(fabric));
  }

  absl::StatusOr<std::string> DeviceUuid(int device) override {
    cudaDeviceProp prop;
    const cudaError_t e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) return CudaError("cudaGetDeviceProperties", e);
    return GpuUuidString(prop.uuid.bytes);
  }

  absl::StatusOr<std::string> CreateStepEvent(int device) override {
    if (event_ == nullptr) {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device);
      cudaError_t e =
          cudaEventCreateWithFlags(&event_, cudaEventInterprocess | cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaIpcGetEventHandle(&event_handle_, event_);
      cudaSetDevice(prev);
      if (e != cudaSuccess) return CudaError("creating the interprocess step event", e);
    }
    return std::string(reinterpret_cast<const char*>(&event_handle_), sizeof(event_handle_));
  }

  absl::Status RecordStepEvent(void* stream) override {
    if (event_ == nullptr) return absl::FailedPreconditionError("no step event");
    const cudaError_t e = cudaEventRecord(event_, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return CudaError("cudaEventRecord (step event)", e);
    return absl::OkStatus();
  }

 private:
  absl::Status Export(uint64_t base, void* out, CUmemAllocationHandleType type) {
    CKPT_RETURN_IF_ERROR(LoadPages());
    CUmemGenericAllocationHandle h = 0;
    if (retain_(&h, reinterpret_cast<void*>(base)) != CUDA_SUCCESS) {
      return absl::InvalidArgumentError("the page is no longer mapped");
    }
    const CUresult r = export_(out, h, type, 0);
    release_(h);  // the export holds the allocation for its receiver
    if (r != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuMemExportToShareableHandle: CUresult ", r));
    }
    return absl::OkStatus();
  }

  absl::Status LoadPages() {
    if (export_ != nullptr) return absl::OkStatus();
    CKPT_RETURN_IF_ERROR(Load());
    using RetainFn = CUresult (*)(CUmemGenericAllocationHandle*, void*);
    using PropFn = CUresult (*)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
    using ReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
    using ExportFn = CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                  unsigned long long);
    CKPT_ASSIGN_OR_RETURN(retain_, DriverFunction<RetainFn>("cuMemRetainAllocationHandle"));
    CKPT_ASSIGN_OR_RETURN(properties_,
                          DriverFunction<PropFn>("cuMemGetAllocationPropertiesFromHandle"));
    CKPT_ASSIGN_OR_RETURN(release_, DriverFunction<ReleaseFn>("cuMemRelease"));
    CKPT_ASSIGN_OR_RETURN(export_, DriverFunction<ExportFn>("cuMemExportToShareableHandle"));
    return absl::OkStatus();
  }

  absl::Status Load() {
    if (get_range_ != nullptr) return absl::OkStatus();
    using RangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    using AttrFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
    CKPT_ASSIGN_OR_RETURN(RangeFn range, DriverFunction<RangeFn>("cuMemGetAddressRange"));
    CKPT_ASSIGN_OR_RETURN(AttrFn attribute, DriverFunction<AttrFn>("cuPointerGetAttribute"));
    get_range_ = range;
    get_attribute_ = attribute;
    return absl::OkStatus();
  }

  CUresult (*get_range_)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*get_attribute_)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*retain_)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*properties_)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*export_)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                      unsigned long long) = nullptr;
  cudaEvent_t event_ = nullptr;
  cudaIpcEventHandle_t event_handle_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDriver>> MakeCudaDriver() {
  return std::make_unique<RuntimeDriver>();
}

#else

absl::StatusOr<std::unique_ptr<CudaDriver>> MakeCudaDriver() {
  return absl::UnimplementedError(
      "this ckpt client was built without CUDA; GPU tensors need a CUDA build");
}

#endif

}  // namespace ckpt::internal
