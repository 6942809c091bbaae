// Shared-memory regions: the host-memory handover between a trainer and ckptd.
//
// A trainer's tensors live in memfd regions (MemfdRegion, created by the
// client library). The fds travel to the daemon over the handover socket
// (handover.h), where each is mapped once per registration (MappedRegion).
//
// Regions are sealed against shrinking (F_SEAL_SHRINK) before they are handed
// over, and the daemon refuses an fd without that seal: otherwise a trainer
// could truncate the file and make the daemon's next copy fault with SIGBUS.
//
// Both classes are move-only RAII owners of the fd and the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/unique_fd.h"

namespace ckpt {

// The largest region either side accepts (1 TiB): a sanity bound, not a budget.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 40;

// A file descriptor and its shared read-write mapping, unmapped and closed
// on destruction; what both kinds of region hold.
class SharedMapping {
 public:
  SharedMapping() = default;
  SharedMapping(UniqueFd fd, void* data, uint64_t size)
      : fd_(std::move(fd)), data_(data), size_(size) {}
  ~SharedMapping();
  SharedMapping(SharedMapping&& o) noexcept;
  SharedMapping& operator=(SharedMapping&& o) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

class MemfdRegion {
 public:
  // Creates a memfd of `bytes` (rounded up to the page size), maps it
  // read-write and seals it against shrinking and growing, and against
  // further seals unless `open_to_seals` (an export's window, which ckptd
  // seals against holes: MappedRegion::SealAgainstHoles).
  static absl::StatusOr<MemfdRegion> Create(const std::string& name, uint64_t bytes,
                                            bool open_to_seals = false);

  MemfdRegion() = default;

  void* data() const { return mapping_.data(); }
  uint64_t size() const { return mapping_.size(); }
  int fd() const { return mapping_.fd(); }

 private:
  SharedMapping mapping_;
};

class MappedRegion {
 public:
  // Maps a received fd shared read-write. INVALID_ARGUMENT when the fd is not
  // a memfd of shared memory sealed against shrinking and not against
  // writes (tmpfs: a hugetlbfs one could fault with SIGBUS once its pool ran
  // out) or its size is 0 or above kMaxRegionBytes.
  static absl::StatusOr<MappedRegion> Map(UniqueFd fd);

  MappedRegion() = default;

  char* data() const { return static_cast<char*>(mapping_.data()); }
  uint64_t size() const { return mapping_.size(); }

  // Adds F_SEAL_FUTURE_WRITE: no hole can be punched into the region any
  // more (fallocate, MADV_REMOVE) and no new writable mapping made, while
  // the mappings made before, this one and its owner's, stay writable.
  // Fails when the owner sealed it against further seals.
  absl::Status SealAgainstHoles() const;
  // Whether the first `bytes` of the region have no hole (lseek SEEK_HOLE:
  // every page allocated by its owner, so charged to the owner's memory
  // cgroup, where a page this process made it fault in would be charged to
  // this one), and then locks them in memory here (mlock) until the
  // mapping goes: after SealAgainstHoles, they can then neither be punched
  // nor reclaimed while this process writes them. False when there is a
  // hole or the lock fails (RLIMIT_MEMLOCK). A page of the span the owner's
  // cgroup had swapped out is brought back by the lock, and charged to that
  // cgroup; to this process only when that cgroup no longer exists.
  bool LockWhole(uint64_t bytes) const;

 private:
  SharedMapping mapping_;
};

}  // namespace ckpt
