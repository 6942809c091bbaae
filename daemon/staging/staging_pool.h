// StagingPool: the node-wide pinned host memory that snapshots are copied into
// and that the writer and restore paths do their O_DIRECT I/O from.
//
// The pool is one mapping of `budget_bytes`, split into fixed-size chunks
// (4096-aligned, so any chunk is a valid O_DIRECT buffer). It is pre-faulted
// (MAP_POPULATE plus a touch of every page: first-touch memory is very slow on
// VMs with free page reporting) and mlock'ed, so copies into it run at memcpy
// speed and it never pages out. Where CUDA is available the owner registers it
// with cudaHostRegister (daemon/gpu, later).
//
// Admission control: Acquire() takes all the chunks a layer version needs or
// none. When not enough are free it waits up to a deadline and then returns
// DEADLINE_EXCEEDED; a request larger than the whole pool is
// RESOURCE_EXHAUSTED at once. The pool never grows past its budget.
//
// Thread-safety: all methods are thread-safe. A StagingLease returns its chunks
// on destruction and may be moved between threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt {

class StagingPool;

// A set of chunks lent out by the pool, viewed as one logical byte image
// (chunk i holds bytes [i*chunk, (i+1)*chunk)).
class StagingLease {
 public:
  StagingLease() = default;
  ~StagingLease();
  StagingLease(StagingLease&& o) noexcept;
  StagingLease& operator=(StagingLease&& o) noexcept;
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;

  size_t chunk_count() const { return chunks_.size(); }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t capacity() const { return chunk_bytes_ * chunks_.size(); }
  char* chunk(size_t i) const { return chunks_[i]; }

  // Copies `len` bytes from `src` into the image at `offset`.
  // REQUIRES: offset + len <= capacity().
  void CopyIn(uint64_t offset, const void* src, uint64_t len);
  // Copies `len` bytes of the image at `offset` into `dst`.
  void CopyOut(uint64_t offset, void* dst, uint64_t len) const;
  // Zeroes [offset, offset+len) of the image.
  void Zero(uint64_t offset, uint64_t len);
  // Calls fn(ptr, n) for each contiguous piece of [offset, offset+len).
  template <typename Fn>
  void ForEachPiece(uint64_t offset, uint64_t len, Fn&& fn) const {
    while (len > 0) {
      size_t c = offset / chunk_bytes_;
      uint64_t in = offset % chunk_bytes_;
      uint64_t n = std::min(len, chunk_bytes_ - in);
      fn(chunks_[c] + in, n);
      offset += n;
      len -= n;
    }
  }

 private:
  friend class StagingPool;
  StagingPool* pool_ = nullptr;
  uint64_t chunk_bytes_ = 0;
  std::vector<char*> chunks_;
};

// Chunks are written with O_DIRECT, so their size is a multiple of the
// direct-I/O alignment (kDirectAlignment, daemon/io/io_backend.h; the store
// checks that the two agree).
inline constexpr uint64_t kChunkAlignment = 4096;

struct StagingPoolOptions {
  uint64_t budget_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  bool lock_memory = true;  // mlock; failure is a warning, not an error
};

class StagingPool {
 public:
  // Maps, pre-faults and locks the pool. INVALID_ARGUMENT for a budget below
  // one chunk or a chunk size that is not a multiple of 4096.
  static absl::StatusOr<std::unique_ptr<StagingPool>> Create(const StagingPoolOptions& options);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Chunks for `bytes` (rounded up), all or nothing, waiting until `deadline`
  // (a deadline in the past: no waiting). When too few are free, the
  // reclaimer (if any) is asked for the missing bytes first, without the
  // pool's lock held, and again every kReclaimInterval while it waits.
  absl::StatusOr<StagingLease> Acquire(uint64_t bytes, absl::Time deadline);
  static constexpr absl::Duration kReclaimInterval = absl::Milliseconds(10);
  // Chunks for `bytes` when that many are free now; else nullopt, without
  // waiting and without asking the reclaimer (for work that is only worth
  // doing in free room, such as a restore's read-ahead).
  std::optional<StagingLease> TryAcquire(uint64_t bytes);
  // What gives pool bytes back on demand (the engine's memory tier, which
  // keeps committed versions in pool chunks); null = none. The reclaimer
  // must not call Acquire.
  void SetReclaimer(std::function<void(uint64_t bytes)> reclaimer);

  uint64_t budget_bytes() const { return chunk_bytes_ * total_chunks_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t bytes_in_use() const;
  bool locked() const { return locked_; }
  void* base() const { return base_; }

 private:
  friend class StagingLease;
  StagingPool() = default;
  void Release(std::vector<char*>* chunks);
  // REQUIRES: `chunks` free chunks.
  StagingLease TakeLocked(size_t chunks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void* base_ = nullptr;
  uint64_t map_bytes_ = 0;
  uint64_t chunk_bytes_ = 0;
  size_t total_chunks_ = 0;
  bool locked_ = false;

  mutable absl::Mutex mu_;
  std::vector<char*> free_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<std::function<void(uint64_t)>> reclaimer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt
