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
// region; nothing stays mapped. A device that a sticky CUDA error poisoned
// (GpuHealth) is refused before anything is opened (FAILED_PRECONDITION,
// naming the device and saying that ckptd must restart), and a sticky error
// returned by any call marks the device poisoned once ProbeDevice, on
// ckptd's own resources, fails with a sticky error too (a trainer's bad
// handle alone fails only its own registration or step); StepReady then
// fails with that reason.
//
// Snapshots never block on the trainer. StepReady asks whether the
// trainer's step event has completed (cudaEventQuery) and returns at once;
// the engine polls it, serving other ranks meanwhile, and gives the step up
// at its deadline. Once it has completed, the drift kernel and the copies
// read exactly the reported step: CopyOut enqueues device-to-host copies
// into (cudaHostRegister'ed) staging memory on ckptd's own stream, which
// never waits on the trainer's event, and FinishSnapshot polls that stream
// until the copies have landed, DEADLINE_EXCEEDED after `copy_timeout` (a
// wedged device). After such a deadline CopiesInFlight() is true until the
// stream is found idle: the staging memory behind the copies may still be
// written, and StepReady fails (UNAVAILABLE) rather than start new copies.
// Restore copies host to device the same way (CopyIn polls, bounded).
//
// Every mapping is closed by the destructor, which first polls the stream
// for at most `close_timeout` (nothing of the trainer's is on it, so this
// only waits for ckptd's own copies; after a copy deadline it asks once,
// without waiting).
// When the stream is still busy then, or after a copy deadline, the
// mappings, event and stream are left open (leaked, logged, counted in
// OpenGpuMappings().leaked) rather than closed under a device that may
// still write through them. The engine drops the object on unregister,
// re-register, trainer exit and shutdown. OpenGpuMappings() counts the
// mappings open in this process (for metrics and tests).
//
// Thread-safety: as RankMemory (one snapshot or restore at a time).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/gpu/gpu_health.h"
#include "daemon/shm/rank_memory.h"

namespace ckpt {

// Regions (allocations, or runs of pages: each is one mapping and one
// reserved range) and pages of one handover.
inline constexpr size_t kMaxGpuRegions = 4096;
inline constexpr size_t kMaxGpuPages = 65536;

// What a trainer hands over for GPU memory (ckpt.v1.GpuHandover): per region
// either one legacy CUDA IPC handle of an allocation (cudaIpcMemHandle_t
// bytes) or the pages of a run of virtual-memory-management memory (each a
// descriptor among `page_fds` or a CUmemFabricHandle), with the size its
// driver reported; the device's UUID ("GPU-xxxxxxxx-..."), and the
// interprocess event (cudaIpcEventHandle_t bytes) it records after each
// optimizer step.
struct GpuPage {
  uint32_t fd = 0;            // index into the handover's page descriptors
  std::string fabric_handle;  // instead of fd when set
  uint64_t bytes = 0;
};
struct GpuRegion {
  std::string ipc_handle;
  uint64_t bytes = 0;
  std::vector<GpuPage> pages;  // instead of ipc_handle
};
struct GpuHandover {
  std::string device_uuid;
  std::vector<GpuRegion> regions;
  std::string step_event;
  std::vector<std::string> page_tokens;  // name the page descriptors
};

// Checks a handover before anything is opened, with `page_fds` descriptors
// handed over for its pages: INVALID_ARGUMENT naming the first problem.
// Pages given as fabric handles are refused unless `fabric_handles`
// (gpu_fabric_handles: importing one needs an IMEX channel, which ckptd may
// hold where the trainer's user does not; docs/protocol.md).
// Returns the declared region sizes (for ValidateRegistration).
absl::StatusOr<std::vector<uint64_t>> CheckGpuHandover(const GpuHandover& handover, size_t page_fds,
                                                       bool fabric_handles = false);

struct GpuMappingStats {
  uint64_t mappings = 0;  // open and in use
  uint64_t bytes = 0;
  uint64_t leaked = 0;  // left open by a destructor that found the device still busy
};
GpuMappingStats OpenGpuMappings();

// How long GpuMemory waits for the device (each wait polls), and where it
// reports a poisoned one.
struct GpuMemoryOptions {
  absl::Duration copy_timeout = absl::Seconds(120);  // FinishSnapshot, CopyIn
  absl::Duration close_timeout = absl::Seconds(5);   // the destructor
  // When set (the engine's shutdown flag), a wait in progress ends at once
  // with CANCELLED, as at its deadline. Must outlive the object.
  const std::atomic<bool>* cancel = nullptr;
  // Where a sticky CUDA error marks the device poisoned, and what Open and
  // StepReady check first (null: nothing is recorded). Must outlive the object.
  GpuHealth* health = nullptr;
  // Whether pages may come as fabric handles (CheckGpuHandover).
  bool fabric_handles = false;
};

class GpuMemory final : public RankMemory {
 public:
  // `ipc` must outlive the returned object. `page_fds` are the descriptors
  // GpuPage.fd indexes; they are closed once imported.
  static absl::StatusOr<std::unique_ptr<GpuMemory>> Open(const GpuHandover& handover,
                                                         std::vector<UniqueFd> page_fds,
                                                         CudaIpc* ipc,
                                                         GpuMemoryOptions options = {});
  ~GpuMemory() override;
  GpuMemory(const GpuMemory&) = delete;
  GpuMemory& operator=(const GpuMemory&) = delete;

  const char* kind() const override { return "cuda"; }
  size_t region_count() const override { return regions_.size(); }
  uint64_t region_size(size_t region) const override { return regions_[region].bytes; }
  char* base(size_t region) const override { return regions_[region].base; }
  // Whether the trainer's step event has completed; never waits.
  // UNAVAILABLE while copies past their deadline may still land.
  absl::StatusOr<bool> StepReady() override;
  // FAILED_PRECONDITION unless StepReady() returned true since the last
  // snapshot. Does not wait.
  absl::Status BeginSnapshot() override;
  absl::Status CopyOut(void* dst, const char* src, uint64_t n) override;
  // Polls ckptd's stream; DEADLINE_EXCEEDED after copy_timeout, CANCELLED
  // once `cancel` is set.
  absl::Status FinishSnapshot() override;
  bool CopiesInFlight() const override { return in_flight_; }
  // Held until a poll (FinishSnapshot, CopyIn, StepReady, the destructor)
  // sees the stream idle; leaked with the mappings when the destructor
  // does not.
  void HoldUntilCopiesLand(std::shared_ptr<const void> keep) override;
  absl::Status CheckUsable() const override {
    return options_.health == nullptr ? absl::OkStatus() : options_.health->CheckUsable(device_);
  }
  // Complete on OK; DEADLINE_EXCEEDED or CANCELLED as FinishSnapshot.
  absl::Status CopyIn(char* dst, const void* src, uint64_t n) override;
  // The CUDA device the mappings live on (the drift kernel must run there).
  int device() const { return device_; }

 private:
  struct Region {
    char* base = nullptr;
    uint64_t bytes = 0;  // as declared (<= the real allocation)
    bool pages = false;  // a run of pages (MapPages), not an IPC mapping
  };
  // Opens region `i`: its IPC handle, or its pages into one range.
  absl::Status OpenRegion(size_t i, const GpuRegion& r, std::vector<UniqueFd>* page_fds);
  GpuMemory(CudaIpc* ipc, GpuMemoryOptions options) : ipc_(ipc), options_(options) {}
  // Checks that [src, src + n) lies inside one region.
  absl::Status CheckRange(const char* p, uint64_t n) const;
  // Marks the device poisoned when `s` is a sticky CUDA error (and returns
  // `s`).
  void NoteSticky(const absl::Status& s);
  absl::Status Note(absl::Status s) {
    NoteSticky(s);
    return s;
  }
  // Polls ckptd's stream until it is idle, for at most `timeout` (and, when
  // `cancellable`, until options_.cancel is set); sets or clears in_flight_
  // and wedged_.
  absl::Status WaitForStream(absl::Duration timeout, const char* what, bool cancellable);
  // The stream was seen idle: nothing is in flight, and what was held for
  // the copies is dropped.
  void CopiesLanded();

  CudaIpc* ipc_;
  const GpuMemoryOptions options_;
  int device_ = 0;
  std::string uuid_;
  std::vector<Region> regions_;
  void* event_ = nullptr;
  void* stream_ = nullptr;
  bool step_ready_ = false;  // StepReady() found the event complete
  bool in_flight_ = false;   // copies enqueued and not seen complete
  bool wedged_ = false;      // and a wait for them reached its deadline
  // Kept until the copies in flight are seen complete (HoldUntilCopiesLand).
  absl::Mutex held_mu_;
  std::vector<std::shared_ptr<const void>> held_ ABSL_GUARDED_BY(held_mu_);
};

}  // namespace ckpt
