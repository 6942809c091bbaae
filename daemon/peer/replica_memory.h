// ReplicaMemory: the memory a ReplicaStore keeps replicas in (docs/peer.md).
//
// One mapping of peer_memory_bytes, cut into pieces (1 MiB) that
// replicas take and give back. The mapping is populated once, at start
// (about 0.35 s a GiB on the VM the figures come from), and never
// returned to the kernel, so a
// node that receives replicas reuses the same pages: allocating fresh
// memory for every replica cost more than copying its bytes on the VMs the
// figures come from (each new page zeroed by the guest and backed by the
// host on first touch: 16 % of the peer's CPU time in `clear_page_erms`,
// measured with perf; replication of a step at 0.41 GB/s with fresh pages
// against 0.68 GB/s with reused ones).
// Pieces are 4 KiB-aligned, so a replica's file is written with O_DIRECT
// straight from them.
//
// Thread-safety: thread-safe; mu_ is a leaf. A Span must not outlive the
// pool it came from.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ckpt::peer {

class ReplicaMemory {
 public:
  static constexpr size_t kDefaultPieceBytes = size_t{1} << 20;

  // The pieces holding one replica's bytes (piece i holds bytes
  // [i * piece_bytes(), ...)); they go back to the pool when the Span is
  // destroyed, that is when the replica leaves memory and no read holds it.
  class Span {
   public:
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

    uint64_t size() const { return size_; }
    size_t pieces() const { return pieces_.size(); }
    // The bytes of piece `i` that belong to the replica.
    std::string_view Piece(size_t i) const;
    // Piece `i`'s whole piece_bytes(), for filling it.
    char* MutablePiece(size_t i);

   private:
    friend class ReplicaMemory;
    Span(ReplicaMemory* pool, uint64_t size, std::vector<uint32_t> pieces)
        : pool_(pool), size_(size), pieces_(std::move(pieces)) {}
    ReplicaMemory* const pool_;
    const uint64_t size_;
    const std::vector<uint32_t> pieces_;
  };

  // Maps `bytes` (rounded down to whole pieces of `piece_bytes`) and, with
  // `populate`, populates it (where the kernel can: Linux 5.14's
  // MADV_POPULATE_WRITE; else pages come as they are first used).
  // RESOURCE_EXHAUSTED when the mapping fails;
  // INVALID_ARGUMENT unless piece_bytes is a positive multiple of 4 KiB.
  // 0 bytes: a pool that never has room.
  static absl::StatusOr<std::unique_ptr<ReplicaMemory>> Create(uint64_t bytes, size_t piece_bytes,
                                                               bool populate);
  ~ReplicaMemory();
  ReplicaMemory(const ReplicaMemory&) = delete;
  ReplicaMemory& operator=(const ReplicaMemory&) = delete;

  // Pieces for `size` bytes (at least one), or null when fewer are free.
  std::shared_ptr<Span> Take(uint64_t size) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `size` bytes would fit in the whole pool.
  bool Fits(uint64_t size) const { return PiecesFor(size) <= count_; }
  uint64_t free_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t capacity() const { return static_cast<uint64_t>(count_) * piece_bytes_; }
  size_t piece_bytes() const { return piece_bytes_; }

 private:
  ReplicaMemory(char* base, size_t count, size_t piece_bytes);
  size_t PiecesFor(uint64_t size) const {
    return static_cast<size_t>(std::max<uint64_t>(1, (size + piece_bytes_ - 1) / piece_bytes_));
  }
  void Give(const std::vector<uint32_t>& pieces) ABSL_LOCKS_EXCLUDED(mu_);

  char* const base_;  // the mapping (null when count_ is 0)
  const size_t count_;
  const size_t piece_bytes_;
  mutable absl::Mutex mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::peer
