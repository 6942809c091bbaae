#include "daemon/peer/replica_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt::peer {

ReplicaMemory::Span::~Span() { pool_->Give(pieces_); }

std::string_view ReplicaMemory::Span::Piece(size_t i) const {
  const size_t piece = pool_->piece_bytes_;
  const uint64_t start = static_cast<uint64_t>(i) * piece;
  const size_t n = static_cast<size_t>(std::min<uint64_t>(piece, size_ - start));
  return std::string_view(pool_->base_ + static_cast<size_t>(pieces_[i]) * piece, n);
}

char* ReplicaMemory::Span::MutablePiece(size_t i) {
  return pool_->base_ + static_cast<size_t>(pieces_[i]) * pool_->piece_bytes_;
}

absl::StatusOr<std::unique_ptr<ReplicaMemory>> ReplicaMemory::Create(uint64_t bytes,
                                                                     size_t piece_bytes,
                                                                     bool populate) {
  if (piece_bytes == 0 || piece_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica memory pieces of ", piece_bytes, " bytes; a multiple of 4096"));
  }
  const size_t count = static_cast<size_t>(bytes / piece_bytes);
  char* base = nullptr;
  if (count > 0) {
    void* p = mmap(nullptr, count * piece_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("map ", bytes, " bytes for replicas in memory (peer_memory_bytes): ",
                       ErrnoStatus(errno, "mmap").message()));
    }
    base = static_cast<char*>(p);
  }
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  if (populate && count > 0) (void)madvise(base, count * piece_bytes, MADV_POPULATE_WRITE);
  return std::unique_ptr<ReplicaMemory>(new ReplicaMemory(base, count, piece_bytes));
}

ReplicaMemory::ReplicaMemory(char* base, size_t count, size_t piece_bytes)
    : base_(base), count_(count), piece_bytes_(piece_bytes) {
  free_.reserve(count);
  // Taken from the back: the lowest pieces first, so a lightly used pool
  // touches few pages.
  for (size_t i = count; i > 0; --i) free_.push_back(static_cast<uint32_t>(i - 1));
}

ReplicaMemory::~ReplicaMemory() {
  if (base_ != nullptr) munmap(base_, count_ * piece_bytes_);
}

std::shared_ptr<ReplicaMemory::Span> ReplicaMemory::Take(uint64_t size) {
  const size_t n = PiecesFor(size);
  std::vector<uint32_t> pieces;
  {
    absl::MutexLock lock(&mu_);
    if (free_.size() < n) return nullptr;
    pieces.assign(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
    free_.resize(free_.size() - n);
  }
  std::reverse(pieces.begin(), pieces.end());
  return std::shared_ptr<Span>(new Span(this, size, std::move(pieces)));
}

void ReplicaMemory::Give(const std::vector<uint32_t>& pieces) {
  absl::MutexLock lock(&mu_);
  free_.insert(free_.end(), pieces.rbegin(), pieces.rend());
}

uint64_t ReplicaMemory::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint64_t>(free_.size()) * piece_bytes_;
}

}  // namespace ckpt::peer
