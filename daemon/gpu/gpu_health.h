// GpuHealth: the GPUs whose CUDA context in ckptd a sticky error has
// poisoned (cuda_ipc.h, IsStickyCudaError). Such a context fails every later
// call on its device, for every rank, until ckptd restarts: a poisoned
// device is refused to new registrations with a reason that names it and
// says so, and the engine releases the memory of the ranks on it.
//
// Who calls it: GpuMemory marks a device when a call of the CudaIpc seam
// returns a sticky error and a probe on ckptd's own resources
// (CudaIpc::ProbeDevice) fails sticky too (a trainer's bad handle alone
// poisons nothing), and checks it before it opens, snapshots or restores
// anything; the engine reads it for its status, metrics and releases.
//
// Thread-safety: every method is thread-safe (one leaf mutex).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {

struct PoisonedGpu {
  int device = 0;     // the CUDA ordinal in ckptd
  std::string uuid;   // "GPU-..."
  std::string error;  // the first sticky error seen on it
};

class GpuHealth {
 public:
  // Records that a sticky `error` poisoned `device` (UUID `uuid`). Returns
  // true the first time, false when it was poisoned already (the first
  // error is kept).
  bool MarkPoisoned(int device, const std::string& uuid, const absl::Status& error);
  bool IsPoisoned(int device) const;
  // OK while `device` is usable; else FAILED_PRECONDITION naming the device,
  // the sticky error and that only a restart of ckptd recovers it.
  absl::Status CheckUsable(int device) const;
  std::vector<PoisonedGpu> Poisoned() const;
  // Grows by one with every newly poisoned device (a cheap "anything new?").
  uint64_t version() const;

 private:
  mutable absl::Mutex mu_;
  std::map<int, PoisonedGpu> poisoned_ ABSL_GUARDED_BY(mu_);
};

// The reason a poisoned device's ranks are released and its registrations
// refused with.
std::string PoisonedGpuReason(const PoisonedGpu& gpu);

}  // namespace ckpt
