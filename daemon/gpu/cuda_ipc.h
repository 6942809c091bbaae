// CudaIpc: the CUDA calls behind GpuMemory, as an interface with no CUDA
// types, so the validation and lifetime logic is built and unit-tested on
// machines without a GPU (tests substitute a fake) and the daemon builds
// without the toolkit (MakeCudaIpc then returns a twin whose every call is
// FAILED_PRECONDITION).
//
// Handles are the raw 64-byte cudaIpcMemHandle_t / cudaIpcEventHandle_t.
// Every call makes `device` current on the calling thread first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/drift.h"

namespace ckpt {

inline constexpr size_t kCudaIpcHandleBytes = 64;

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

  // Opaque event and stream handles.
  virtual absl::StatusOr<void*> OpenEventHandle(int device, const std::string& handle) = 0;
  virtual void DestroyEvent(int device, void* event) = 0;
  virtual absl::StatusOr<void*> CreateStream(int device) = 0;
  virtual void DestroyStream(int device, void* stream) = 0;

  // Makes later work on `stream` wait for the event's latest record.
  virtual absl::Status StreamWaitEvent(int device, void* stream, void* event) = 0;
  virtual absl::Status CopyToHostAsync(int device, void* stream, void* dst, const char* src,
                                       uint64_t n) = 0;
  virtual absl::Status CopyToDevice(int device, void* stream, char* dst, const void* src,
                                    uint64_t n) = 0;
  virtual absl::Status Synchronize(int device, void* stream) = 0;

  // A drift kernel reading device memory of `device`.
  virtual absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int device) = 0;
};

// The CUDA runtime's implementation (or the no-CUDA twin).
std::unique_ptr<CudaIpc> MakeCudaIpc();

}  // namespace ckpt
