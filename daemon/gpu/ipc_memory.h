// GpuMemory: the GPU twin of HostMemory (daemon/shm/rank_memory.h).
//
// A trainer hands over one legacy CUDA IPC handle per allocation that holds
// registered tensors, the allocation sizes its driver reported, the device's
// UUID and an interprocess event it records on its stream after every
// optimizer step (GpuHandover). Open():
//   1. checks the handover's shape before any CUDA call (handle lengths,
//      region count and sizes, the UUID; registration.h has already checked
//      every tensor's [offset, offset + nbytes) against the declared sizes);
//   2. opens each handle once, and checks that the real allocation behind it
//      starts at the mapped address and is at least as large as declared, so
//      no copy can leave it;
//   3. opens the event and creates ckptd's own stream.
// Any failure closes whatever was opened and returns an error naming the
// region; nothing stays mapped.
//
// Snapshots: BeginSnapshot makes ckptd's stream wait on the trainer's event
// (cudaStreamWaitEvent) and then waits for that stream, so the drift kernel
// and the copies read exactly the reported step; CopyOut enqueues
// device-to-host copies into (cudaHostRegister'ed) staging memory on the same
// stream; FinishSnapshot waits for them. Restore copies host to device.
//
// Every mapping is closed by the destructor; the engine drops the object on
// unregister, re-register, trainer exit and shutdown. OpenGpuMappings()
// counts the mappings open in this process (for metrics and tests).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/shm/rank_memory.h"

namespace ckpt {

inline constexpr size_t kMaxGpuRegions = 4096;

// What a trainer hands over for GPU memory: one legacy CUDA IPC handle per
// allocation (cudaIpcMemHandle_t bytes) with the size its driver reported,
// the device's UUID ("GPU-xxxxxxxx-..."), and the interprocess event
// (cudaIpcEventHandle_t bytes) it records after each optimizer step.
struct GpuRegion {
  std::string ipc_handle;
  uint64_t bytes = 0;
};
struct GpuHandover {
  std::string device_uuid;
  std::vector<GpuRegion> regions;
  std::string step_event;
};

// Checks a handover before anything is opened: INVALID_ARGUMENT naming the
// first problem. Returns the declared region sizes (for ValidateRegistration).
absl::StatusOr<std::vector<uint64_t>> CheckGpuHandover(const GpuHandover& handover);

struct GpuMappingStats {
  uint64_t mappings = 0;
  uint64_t bytes = 0;
};
GpuMappingStats OpenGpuMappings();

class GpuMemory final : public RankMemory {
 public:
  // `ipc` must outlive the returned object.
  static absl::StatusOr<std::unique_ptr<GpuMemory>> Open(const GpuHandover& handover, CudaIpc* ipc);
  ~GpuMemory() override;
  GpuMemory(const GpuMemory&) = delete;
  GpuMemory& operator=(const GpuMemory&) = delete;

  const char* kind() const override { return "cuda"; }
  size_t region_count() const override { return regions_.size(); }
  uint64_t region_size(size_t region) const override { return regions_[region].bytes; }
  char* base(size_t region) const override { return regions_[region].base; }
  absl::Status BeginSnapshot() override;
  absl::Status CopyOut(void* dst, const char* src, uint64_t n) override;
  absl::Status FinishSnapshot() override;
  absl::Status CopyIn(char* dst, const void* src, uint64_t n) override;
  // The CUDA device the mappings live on (the drift kernel must run there).
  int device() const { return device_; }

 private:
  struct Region {
    char* base = nullptr;
    uint64_t bytes = 0;  // as declared (<= the real allocation)
  };
  explicit GpuMemory(CudaIpc* ipc) : ipc_(ipc) {}
  // Checks that [src, src + n) lies inside one region.
  absl::Status CheckRange(const char* p, uint64_t n) const;

  CudaIpc* ipc_;
  int device_ = 0;
  std::vector<Region> regions_;
  void* event_ = nullptr;
  void* stream_ = nullptr;
};

}  // namespace ckpt
