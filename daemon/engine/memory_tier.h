// MemoryTier: the newest committed version of each layer of each rank, kept
// in host memory so that the most common failure (the trainer crashes, the
// node is fine) restores without reading the disk (docs/remote.md, "Memory
// tier").
//
// An entry is the committed file image itself: the staging-pool chunks the
// writer wrote it from (pinned, pre-faulted, counted in the pool), kept
// after the commit instead of being returned. So the tier costs no copy and
// its bytes are pool bytes: it holds at most `budget_bytes` of them, and
// the snapshot stage takes room back (Shrink) before a snapshot would have
// to wait for the pool. A newer version of a layer replaces the older one.
// Over the budget, entries go from the uid holding the most bytes first,
// its least recently stored layers first: so one user's snapshots can take
// another's room only while they hold less than it, and the budget ends up
// shared max-min fairly among the users who use it.
//
// Readers get a shared reference: an entry evicted while a restore reads it
// returns its chunks when the restore is done. A restore checks an entry's
// header before using it and each tensor's checksum as it copies the
// tensor out (recovery/restore.h); an entry that does not check is dropped.
//
// Used by the engine's commit (Put), snapshot (Shrink), recovery (FindImage
// and Drop, as a restore's in-memory source) and retention (DropJob) stages.
// Thread-safety: thread-safe; one mutex of its own, a leaf (chunks are
// returned to the pool after it is released).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/engine/leases.h"
#include "daemon/recovery/restore.h"
#include "daemon/staging/staging_pool.h"

namespace ckpt {

class MemoryTier final : public VersionSource {
 public:
  explicit MemoryTier(uint64_t budget_bytes) : budget_(budget_bytes) {}
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  bool enabled() const { return budget_ > 0; }

  // Keeps `image` (the committed file `file` of `layer` at `step`) in place
  // of the layer's entry (older, or of a history the rank went back
  // before: the newest commit wins). Dropped at once, with the old entry,
  // when it alone exceeds the budget.
  // `uid` owns the rank's job.
  void Put(const RankKey& rank, uint32_t layer, uint64_t step, const std::string& file,
           uint32_t uid, StagingLease image);

  // The entry of exactly that version (same step and file), or null.
  std::shared_ptr<const StagingLease> Find(const RankKey& rank, uint32_t layer, uint64_t step,
                                           const std::string& file);
  // Find, as a restore asks its in-memory sources (restore.h).
  std::shared_ptr<const StagingLease> FindImage(const VersionKey& key,
                                                const store::VersionRecord& rec) override {
    return Find(RankKey(key.job, key.rank), key.layer, key.step, rec.file());
  }
  // An image FindImage gave did not verify (a restore found it): the entry
  // goes, if it is still that version's.
  void Drop(const VersionKey& key, const store::VersionRecord& rec) override;

  // Gives back at least `bytes` (in eviction order), or everything.
  void Shrink(uint64_t bytes);
  void DropJob(const std::string& job);

  uint64_t bytes() const;
  uint64_t bytes_of(uint32_t uid) const;
  uint64_t budget_bytes() const { return budget_; }

 private:
  struct Entry {
    uint64_t step = 0;
    std::string file;
    std::shared_ptr<const StagingLease> image;
    uint64_t bytes = 0;
    uint32_t uid = 0;
    uint64_t stamp = 0;  // order of Put: a uid's smallest is evicted first
  };
  struct UidEntries {
    uint64_t bytes = 0;
    std::map<uint64_t, std::pair<RankKey, uint32_t>> by_stamp;
  };
  using Key = std::pair<RankKey, uint32_t>;  // rank, layer
  // Removes one entry; its image goes to `out` (released by the caller
  // after unlocking). Returns the next entry.
  std::map<Key, Entry>::iterator EraseLocked(std::map<Key, Entry>::iterator it,
                                             std::vector<std::shared_ptr<const StagingLease>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes entries (of the uid holding most, oldest first) until at most
  // `target` bytes are held;
  // moves their images to `out`, released by the caller after unlocking.
  // Of uids holding equal bytes, `storing` (the uid whose Put makes room)
  // gives up its own first.
  void EvictLocked(uint64_t target, std::optional<uint32_t> storing,
                   std::vector<std::shared_ptr<const StagingLease>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, UidEntries> uids_ ABSL_GUARDED_BY(mu_);  // none without entries
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_stamp_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
