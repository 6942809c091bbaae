// DiskBudget: the bytes of committed layer versions, the optional node-wide
// bound on them (max_disk_bytes) and the free-space reserve kept for the
// index (min_free_disk_bytes). Layer versions stop at the reserve; index
// records (checkpoint events with their aux blobs, registrations) may use
// the reserve down to a quarter of it (CheckIndexRoom), so RocksDB's WAL and
// flushes never meet a full file system through ckptd's own writes.
//
// A writer reserves a version's file bytes before committing it and gives
// them back when the commit fails; GC gives back what it deleted. The counter
// is seeded from the index at start.
//
// Used by the engine's commit pipeline, retention and admin queries.
// Thread-safety: thread-safe (an atomic counter; statvfs through the store).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

class DiskBudget {
 public:
  // max_bytes 0 = no bound; min_free_bytes 0 = no reserve (statvfs skipped).
  // `store` reports the data file system's free bytes; not owned.
  DiskBudget(uint64_t max_bytes, uint64_t min_free_bytes, LayerStore* store)
      : max_bytes_(max_bytes), min_free_bytes_(min_free_bytes), store_(store) {}

  void Reset(uint64_t used) { used_.store(used, std::memory_order_relaxed); }
  // OK with `file_bytes` reserved. RESOURCE_EXHAUSTED (nothing reserved) when
  // they would pass max_bytes, or leave the data file system less than
  // min_free_bytes free (unknown free space counts as room).
  absl::Status Reserve(uint64_t file_bytes);
  // Gives back bytes of a failed commit or of a deleted version.
  void Release(uint64_t file_bytes) { used_.fetch_sub(file_bytes, std::memory_order_relaxed); }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  // The configured bound (0 = none).
  uint64_t limit() const { return max_bytes_; }
  // What the versions may grow to: the configured bound, or, without one (or
  // when the disk holds less), what they use plus the data file system's
  // free space above the reserve. The configured bound when free space is
  // unknown.
  uint64_t EffectiveLimit();

  // OK when `index_bytes` of index records may be written: the data file
  // system keeps at least a quarter of min_free_bytes free after them.
  // RESOURCE_EXHAUSTED (kDiskFull) otherwise; unknown free space counts as
  // room.
  absl::Status CheckIndexRoom(uint64_t index_bytes);
  // The floor CheckIndexRoom keeps free.
  uint64_t index_floor_bytes() const { return min_free_bytes_ / 4; }

 private:
  absl::Status CheckFreeSpace(uint64_t file_bytes);

  const uint64_t max_bytes_;
  const uint64_t min_free_bytes_;
  LayerStore* const store_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace ckpt
