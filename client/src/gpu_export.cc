#include "gpu_export.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/gpu_uuid.h"

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
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess) return CudaError(absl::StrCat("driver entry point ", symbol), e);
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    return absl::InternalError(absl::StrCat("the CUDA driver has no ", symbol));
  }
  return reinterpret_cast<Fn>(fn);
}

class CudaGpuExport final : public GpuExport {
 public:
  ~CudaGpuExport() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  absl::StatusOr<std::pair<uint32_t, uint64_t>> Add(const void* ptr, uint64_t bytes,
                                                    const std::string& name) override {
    const std::string what = absl::StrCat("tensor '", name, "'");
    cudaPointerAttributes attr;
    cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
    if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(what, " is not in CUDA device memory"));
    }
    if (device_ >= 0 && attr.device != device_) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is on device ", attr.device,
                                                     "; this rank's other tensors are on device ",
                                                     device_));
    }
    if (get_range_ == nullptr) {
      using RangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
      using AttrFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
      auto range = DriverFunction<RangeFn>("cuMemGetAddressRange");
      if (!range.ok()) return range.status();
      auto attribute = DriverFunction<AttrFn>("cuPointerGetAttribute");
      if (!attribute.ok()) return attribute.status();
      get_range_ = *range;
      get_attribute_ = *attribute;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    const auto p = reinterpret_cast<CUdeviceptr>(ptr);
    if (get_range_(&base, &size, p) != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the driver knows no allocation at it"));
    }
    if (bytes > size || p - base > size - bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " (", bytes, " bytes) runs past the end of its allocation"));
    }
    for (size_t i = 0; i < regions_.size(); ++i) {
      if (regions_[i].base == base) return std::make_pair(static_cast<uint32_t>(i), p - base);
    }
    int capable = 0;
    if (get_attribute_(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) !=
            CUDA_SUCCESS ||
        capable == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          " lives in an allocation that legacy CUDA IPC cannot export (virtual memory "
          "management, e.g. PyTorch expandable_segments:True); allocate it with cudaMalloc"));
    }
    Region r;
    r.base = base;
    r.size = size;
    e = cudaIpcGetMemHandle(&r.handle, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) return CudaError(absl::StrCat(what, ": cudaIpcGetMemHandle"), e);
    if (device_ < 0) {
      device_ = attr.device;
      cudaDeviceProp prop;
      e = cudaGetDeviceProperties(&prop, device_);
      if (e != cudaSuccess) return CudaError("cudaGetDeviceProperties", e);
      uuid_ = GpuUuidString(prop.uuid.bytes);
    }
    regions_.push_back(r);
    return std::make_pair(static_cast<uint32_t>(regions_.size() - 1), p - base);
  }

  bool empty() const override { return regions_.empty(); }

  absl::StatusOr<v1::GpuHandover> Handover() override {
    if (regions_.empty()) return absl::FailedPreconditionError("no GPU tensors were added");
    if (event_ == nullptr) {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device_);
      cudaError_t e =
          cudaEventCreateWithFlags(&event_, cudaEventInterprocess | cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaIpcGetEventHandle(&event_handle_, event_);
      cudaSetDevice(prev);
      if (e != cudaSuccess) return CudaError("creating the interprocess step event", e);
    }
    v1::GpuHandover h;
    h.set_device_uuid(uuid_);
    for (const Region& r : regions_) {
      v1::GpuRegion* g = h.add_regions();
      g->set_ipc_handle(std::string(reinterpret_cast<const char*>(&r.handle), sizeof(r.handle)));
      g->set_bytes(r.size);
    }
    h.set_step_event(
        std::string(reinterpret_cast<const char*>(&event_handle_), sizeof(event_handle_)));
    return h;
  }

  absl::Status RecordStep(void* stream) override {
    if (event_ == nullptr) return absl::FailedPreconditionError("not registered");
    const cudaError_t e = cudaEventRecord(event_, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return CudaError("cudaEventRecord (step event)", e);
    return absl::OkStatus();
  }

 private:
  struct Region {
    CUdeviceptr base = 0;
    uint64_t size = 0;
    cudaIpcMemHandle_t handle;
  };
  CUresult (*get_range_)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*get_attribute_)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  int device_ = -1;
  std::string uuid_;
  std::vector<Region> regions_;
  cudaEvent_t event_ = nullptr;
  cudaIpcEventHandle_t event_handle_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuExport>> GpuExport::Create() {
  return std::make_unique<CudaGpuExport>();
}

#else

absl::StatusOr<std::unique_ptr<GpuExport>> GpuExport::Create() {
  return absl::UnimplementedError(
      "this ckpt client was built without CUDA; GPU tensors need a CUDA build");
}

#endif

}  // namespace ckpt::internal
