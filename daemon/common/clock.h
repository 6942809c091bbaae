// Clock: where ckptd reads the time it stamps on records and compares with
// expiry times (handover tokens, checkpoint events, retention ages, the
// durability lag), so that tests move time instead of waiting for it.
// Deadlines of waits are not read from it: a wait on a mutex or a socket
// waits in real time.
//
// Thread-safety: both implementations are thread-safe.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process's real clock (absl::Now); never destroyed.
  static Clock* Real();
};

// A clock that moves only when told to (tests).
class SimulatedClock final : public Clock {
 public:
  explicit SimulatedClock(absl::Time start) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt
