// LeaseTable: who may read or rewrite a rank's history right now.
//
// Restore, verify and export read a rank's committed versions under a lease;
// garbage collection rewrites the history of one rank at a time and skips a
// rank that is leased (it is counted as busy and collected next time). A
// lease waits, bounded, while GC runs on its rank.
//
// Used by the engine's recovery and retention stages.
// Thread-safety: thread-safe; one mutex of its own, never held while calling
// out (lock order: it is a leaf).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt {

using RankKey = std::pair<std::string, uint32_t>;  // job, rank

class LeaseTable {
 public:
  // OK with a lease on `key` held until Release(key). UNAVAILABLE when GC of
  // the rank is still running at `deadline`.
  absl::Status Acquire(const RankKey& key, absl::Time deadline);
  // REQUIRES: a lease on `key` taken with Acquire.
  void Release(const RankKey& key);

  // GC of one rank: false (nothing taken) while the rank is leased or already
  // being collected; true means EndGc(key) must follow.
  bool TryBeginGc(const RankKey& key);
  void EndGc(const RankKey& key);

 private:
  absl::Mutex mu_;
  std::map<RankKey, int> leases_ ABSL_GUARDED_BY(mu_);
  std::set<RankKey> gc_active_ ABSL_GUARDED_BY(mu_);
};

// Holds a lease taken with LeaseTable::Acquire until it goes out of scope.
class ScopedLease {
 public:
  ScopedLease(LeaseTable* table, RankKey key) : table_(table), key_(std::move(key)) {}
  ~ScopedLease() { table_->Release(key_); }
  ScopedLease(const ScopedLease&) = delete;
  ScopedLease& operator=(const ScopedLease&) = delete;

 private:
  LeaseTable* const table_;
  const RankKey key_;
};

}  // namespace ckpt
