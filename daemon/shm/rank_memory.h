// RankMemory: the memory a registered rank handed over, as the engine sees it.
//
// Two twins implement it: HostMemory (memfd regions mapped into ckptd,
// below) and GpuMemory (CUDA IPC allocations, daemon/gpu/ipc_memory.h). The
// policy, staging, writers and recovery only ever see this interface, so one
// protocol serves both: the bytes of a layer are read with CopyOut between
// BeginSnapshot and FinishSnapshot, written back with CopyIn on restore, and
// the drift kernel the engine picks for the memory's kind reads the same
// addresses. Nothing here waits for a trainer: StepReady says whether the
// reported step has finished writing the buffers, and the engine polls it.
//
// Addresses (base(), and pointers derived from it) are only meaningful to
// this object and to a drift kernel of its kind: host pointers for HostMemory, device
// pointers in ckptd's CUDA context for GpuMemory.
//
// Thread-safety: one snapshot or restore at a time per object (the engine
// runs one snapshot per rank at a time and refuses a restore while one runs).
// Within a restore, HostMemory::CopyIn runs on several threads at once, into
// different tensors; a restore calls GpuMemory::CopyIn from one thread at a
// time (restore.h, RestoreTarget).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/region.h"
#include "daemon/common/holding.h"

namespace ckpt {

class RankMemory {
 public:
  virtual ~RankMemory() = default;

  virtual const char* kind() const = 0;  // "host" or "cuda"
  virtual size_t region_count() const = 0;
  virtual uint64_t region_size(size_t region) const = 0;
  virtual char* base(size_t region) const = 0;

  // Whether the trainer's step that was reported last has finished writing
  // the buffers, without waiting (GPU: a query of the trainer's step event);
  // always true for memory the trainer writes from the CPU. An error means
  // the step cannot be snapshotted (its layers are retried).
  virtual absl::StatusOr<bool> StepReady() { return true; }
  // Starts the snapshot of that step. REQUIRES: StepReady() returned true.
  // Does not wait.
  virtual absl::Status BeginSnapshot() = 0;
  // Copies n bytes at `src` (inside this memory) to host memory `dst`; may
  // complete asynchronously until FinishSnapshot.
  virtual absl::Status CopyOut(void* dst, const char* src, uint64_t n) = 0;
  // Returns when every CopyOut since BeginSnapshot has completed, or with
  // an error (GPU: DEADLINE_EXCEEDED past its deadline, CANCELLED when
  // ckptd stops) when it could not see them complete.
  virtual absl::Status FinishSnapshot() = 0;
  // True after a FinishSnapshot or CopyIn that returned without seeing its
  // copies complete, until they are seen complete: the host memory they
  // copy into may still be written, so it must not be reused.
  virtual bool CopiesInFlight() const { return false; }
  // Keeps `keep` (a staging lease such copies read or write) alive until
  // the copies in flight are seen complete, then drops it; leaked with the
  // memory when they never are. Memory without copies in flight drops it
  // at once. Thread-safe.
  virtual void HoldUntilCopiesLand(std::shared_ptr<const void> keep) { keep.reset(); }
  // OK while the memory's device is usable; the reason when it is not
  // (GPU: a sticky CUDA error poisoned it, gpu_health.h). Thread-safe.
  virtual absl::Status CheckUsable() const { return absl::OkStatus(); }
  // Copies n host bytes into this memory at `dst`; complete on return.
  virtual absl::Status CopyIn(char* dst, const void* src, uint64_t n) = 0;
};

// Host memfd regions, mapped by ckptd. Copies are memcpy. `held` (may be
// null) is the handover's count of the regions' descriptors, given back when
// this memory is destroyed (its mappings and descriptors closed).
class HostMemory final : public RankMemory {
 public:
  explicit HostMemory(std::vector<MappedRegion> regions, std::unique_ptr<Holding> held = nullptr)
      : held_(std::move(held)), regions_(std::move(regions)) {}

  const char* kind() const override { return "host"; }
  size_t region_count() const override { return regions_.size(); }
  uint64_t region_size(size_t region) const override { return regions_[region].size(); }
  char* base(size_t region) const override { return regions_[region].data(); }
  absl::Status BeginSnapshot() override { return absl::OkStatus(); }
  absl::Status CopyOut(void* dst, const char* src, uint64_t n) override;
  absl::Status FinishSnapshot() override { return absl::OkStatus(); }
  absl::Status CopyIn(char* dst, const void* src, uint64_t n) override;

 private:
  // Declared first, so the regions are unmapped and closed before the
  // count of them is given back.
  std::unique_ptr<Holding> held_;
  std::vector<MappedRegion> regions_;
};

}  // namespace ckpt
