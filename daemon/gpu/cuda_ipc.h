// CudaIpc: the CUDA calls behind GpuMemory, as an interface with no CUDA
// types, so the validation and lifetime logic is built and unit-tested on
// machines without a GPU (tests substitute a fake) and the daemon builds
// without the toolkit (MakeCudaIpc then returns a twin whose every call is
// FAILED_PRECONDITION).
//
// Nothing here blocks on the device: work is enqueued (copies) and its
// completion is asked for (QueryEvent, QueryStream), so that the caller
// decides how long to wait (GpuMemory polls with a deadline). A trainer
// hung in a kernel, or a wedged device, therefore never holds a ckptd
// thread for longer than the caller allows.
//
// Sticky errors (an illegal address, a launch failure, an uncorrectable ECC
// error, ...) leave the device's CUDA context in this process unusable: every
// later call on that device fails the same way until the process restarts.
// The seam marks the statuses of such errors (IsStickyCudaError). A code
// classified sticky from a call on a handle the trainer supplied (opening
// its memory or event handle, querying its event) does not prove that
// ckptd's context is poisoned (cudaErrorUnknown, for one, also comes from a
// bad handle), so GpuMemory confirms every sticky error with ProbeDevice,
// on resources ckptd owns, before it marks the device poisoned
// (gpu_health.h); a trainer cannot poison a device for the other tenants.
//
// Handles are the raw 64-byte cudaIpcMemHandle_t / cudaIpcEventHandle_t.
// Every call makes `device` current on the calling thread first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/drift.h"

namespace ckpt {

inline constexpr size_t kCudaIpcHandleBytes = 64;

// Whether a cudaError_t value is one of the sticky errors (the CUDA 13
// headers name them; cudaErrorUnknown counts as one).
bool IsStickyCudaErrorCode(int cuda_error);
// `status` marked as a sticky CUDA error (a payload; OK stays OK), and the
// test for the mark.
absl::Status MarkStickyCudaError(absl::Status status);
bool IsStickyCudaError(const absl::Status& status);

class CudaIpc {
 public:
  virtual ~CudaIpc() = default;

  // The ordinal of the device with this UUID ("GPU-xxxxxxxx-xxxx-...").
  virtual absl::StatusOr<int> FindDevice(const std::string& uuid) = 0;

  // Maps an exported allocation; returns its base in this process.
  virtual absl::StatusOr<char*> OpenMemHandle(int device, const std::string& handle) = 0;
  // The size of the allocation that starts at `base` (as the driver sees it);
  // an error when `base` is not the start of an allocation.
  virtual absl::StatusOr<uint64_t> AllocationSize(int device, const char* base) = 0;
  virtual void CloseMemHandle(int device, char* base) = 0;

  // Pages of CUDA's virtual memory management API exported by the trainer:
  // a POSIX descriptor (fd >= 0) or a 64-byte CUmemFabricHandle, and the
  // size declared for it.
  struct Page {
    int fd = -1;
    std::string fabric_handle;
    uint64_t bytes = 0;
  };
  // Imports every page, reserves one address range of their total size and
  // maps them into it in order, readable and writable by `device`; returns
  // the range's base. A page smaller than declared fails the map. On any
  // failure everything done so far is undone. The descriptors stay the
  // caller's (they may be closed once this returns).
  virtual absl::StatusOr<char*> MapPages(int device, const std::vector<Page>& pages) = 0;
  // Unmaps and releases what MapPages(…) returned at `base`.
  virtual void UnmapPages(int device, char* base) = 0;

  // Opaque event and stream handles.
  virtual absl::StatusOr<void*> OpenEventHandle(int device, const std::string& handle) = 0;
  virtual void DestroyEvent(int device, void* event) = 0;
  virtual absl::StatusOr<void*> CreateStream(int device) = 0;
  virtual void DestroyStream(int device, void* stream) = 0;

  // Whether the work captured by the event's latest record has completed
  // (cudaEventQuery): true when it has, false while it is pending. Never
  // waits.
  virtual absl::StatusOr<bool> QueryEvent(int device, void* event) = 0;
  // Whether everything enqueued on `stream` has completed (cudaStreamQuery):
  // true when it has, false while work is pending; the error of a failed
  // copy. Never waits.
  virtual absl::StatusOr<bool> QueryStream(int device, void* stream) = 0;
  // Enqueue copies on `stream`; complete once QueryStream returns true.
  virtual absl::Status CopyToHostAsync(int device, void* stream, void* dst, const char* src,
                                       uint64_t n) = 0;
  virtual absl::Status CopyToDeviceAsync(int device, void* stream, char* dst, const void* src,
                                         uint64_t n) = 0;

  // Whether ckptd's context on `device` is still usable, asked on resources
  // of ckptd's own (a 4-byte device buffer and a stream, made on first use
  // and kept): a cudaMemsetAsync into the buffer, then a query of the
  // stream. OK when both succeed (the memset may still be pending); the
  // error (sticky when the context is poisoned) otherwise. Never waits.
  virtual absl::Status ProbeDevice(int device) = 0;

  // A drift kernel reading device memory of `device`.
  virtual absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int device) = 0;
};

// The CUDA runtime's implementation (or the no-CUDA twin).
std::unique_ptr<CudaIpc> MakeCudaIpc();

}  // namespace ckpt
