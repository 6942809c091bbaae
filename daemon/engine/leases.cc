#include "daemon/engine/leases.h"

namespace ckpt {

absl::Status LeaseTable::Acquire(const RankKey& key, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto free = [this, &key]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gc_active_.count(key) == 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&free), deadline)) {
    return absl::UnavailableError("garbage collection of this rank is running; retry");
  }
  ++leases_[key];
  return absl::OkStatus();
}

void LeaseTable::Release(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  if (--leases_[key] <= 0) leases_.erase(key);
}

bool LeaseTable::TryBeginGc(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  if (leases_.count(key) > 0 || gc_active_.count(key) > 0) return false;
  gc_active_.insert(key);
  return true;
}

void LeaseTable::EndGc(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  gc_active_.erase(key);
}

}  // namespace ckpt
