// CudaDriver: the CUDA calls of the trainer's side of the GPU handover
// (internal to ckpt_client), as an interface with no CUDA types, so that
// GpuExport's checks and bookkeeping are built and unit-tested on machines
// without a GPU (tests substitute a fake). The daemon's side has its own
// seam (daemon/gpu/cuda_ipc.h).
//
// Device addresses are plain integers. The CUDA runtime's implementation
// reaches the driver's functions through the runtime's entry points:
// linking libcuda would make every binary unstartable without a driver.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::internal {

class CudaDriver {
 public:
  virtual ~CudaDriver() = default;

  // The device whose memory holds `ptr`; INVALID_ARGUMENT when it is not
  // device memory.
  virtual absl::StatusOr<int> DeviceOf(uint64_t ptr) = 0;
  // The allocation that holds `ptr`, as the driver reports it
  // (cuMemGetAddressRange): its base and size.
  struct Range {
    uint64_t base = 0;
    uint64_t size = 0;
  };
  virtual absl::StatusOr<Range> AllocationRange(uint64_t ptr) = 0;
  // Whether legacy CUDA IPC can export the allocation at `ptr` (memory of
  // the virtual memory management API cannot).
  virtual absl::StatusOr<bool> LegacyIpcCapable(uint64_t ptr) = 0;
  // The cudaIpcMemHandle_t bytes of the allocation starting at `base`.
  virtual absl::StatusOr<std::string> IpcMemHandle(uint64_t base) = 0;

  // Memory of the virtual memory management API (PyTorch's expandable
  // segments) is mapped one physical allocation, a page, at a time. The
  // page that holds `ptr` (cuMemRetainAllocationHandle): its mapped range
  // (cuMemGetAddressRange) and the handle types it may be exported as
  // (cuMemGetAllocationPropertiesFromHandle); INVALID_ARGUMENT when `ptr`
  // is not such memory.
  struct Page {
    uint64_t base = 0;
    uint64_t size = 0;
    bool posix_fd = false;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    bool fabric = false;    // CU_MEM_HANDLE_TYPE_FABRIC
  };
  virtual absl::StatusOr<Page> PageAt(uint64_t ptr) = 0;
  // The page at `base` exported (cuMemExportToShareableHandle) as a POSIX
  // descriptor, which the caller closes, or as CUmemFabricHandle bytes.
  virtual absl::StatusOr<int> ExportPageFd(uint64_t base) = 0;
  virtual absl::StatusOr<std::string> ExportPageFabric(uint64_t base) = 0;
  // "GPU-xxxxxxxx-..." of `device`.
  virtual absl::StatusOr<std::string> DeviceUuid(int device) = 0;
  // Creates the interprocess step event on `device` (once) and returns its
  // cudaIpcEventHandle_t bytes; RecordStepEvent records it on a stream.
  virtual absl::StatusOr<std::string> CreateStepEvent(int device) = 0;
  virtual absl::Status RecordStepEvent(void* stream) = 0;
};

// The CUDA runtime's implementation; UNIMPLEMENTED in a build without CUDA.
absl::StatusOr<std::unique_ptr<CudaDriver>> MakeCudaDriver();

}  // namespace ckpt::internal
