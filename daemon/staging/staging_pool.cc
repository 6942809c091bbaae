#include "daemon/staging/staging_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {

StagingLease::~StagingLease() {
  if (pool_ != nullptr) pool_->Release(&chunks_);
}

StagingLease::StagingLease(StagingLease&& o) noexcept
    : pool_(std::exchange(o.pool_, nullptr)),
      chunk_bytes_(o.chunk_bytes_),
      chunks_(std::move(o.chunks_)) {}

StagingLease& StagingLease::operator=(StagingLease&& o) noexcept {
  if (this != &o) {
    if (pool_ != nullptr) pool_->Release(&chunks_);
    pool_ = std::exchange(o.pool_, nullptr);
    chunk_bytes_ = o.chunk_bytes_;
    chunks_ = std::move(o.chunks_);
  }
  return *this;
}

void StagingLease::CopyIn(uint64_t offset, const void* src, uint64_t len) {
  const char* s = static_cast<const char*>(src);
  ForEachPiece(offset, len, [&](char* p, uint64_t n) {
    std::memcpy(p, s, n);
    s += n;
  });
}

void StagingLease::CopyOut(uint64_t offset, void* dst, uint64_t len) const {
  char* d = static_cast<char*>(dst);
  ForEachPiece(offset, len, [&](char* p, uint64_t n) {
    std::memcpy(d, p, n);
    d += n;
  });
}

void StagingLease::Zero(uint64_t offset, uint64_t len) {
  ForEachPiece(offset, len, [](char* p, uint64_t n) { std::memset(p, 0, n); });
}

absl::StatusOr<std::unique_ptr<StagingPool>> StagingPool::Create(const StagingPoolOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes % kChunkAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staging chunk size ", o.chunk_bytes, " is not a positive multiple of ", kChunkAlignment));
  }
  if (o.budget_bytes < o.chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("staging budget ", o.budget_bytes,
                                                   " is below one chunk (", o.chunk_bytes, ")"));
  }
  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->chunk_bytes_ = o.chunk_bytes;
  pool->total_chunks_ = o.budget_bytes / o.chunk_bytes;
  pool->map_bytes_ = pool->total_chunks_ * o.chunk_bytes;
  void* p = ::mmap(nullptr, pool->map_bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap staging pool");
  pool->base_ = p;
  // MAP_POPULATE maps the zero page lazily on some kernels; writing every page
  // makes each one private and resident now, off the snapshot path.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  for (uint64_t off = 0; off < pool->map_bytes_; off += page) static_cast<char*>(p)[off] = 0;
  if (o.lock_memory) {
    if (::mlock(p, pool->map_bytes_) == 0) {
      pool->locked_ = true;
    } else {
      CKPT_LOG(WARNING) << "staging pool: mlock of " << pool->map_bytes_ << " bytes failed ("
                        << std::strerror(errno) << "); raise LimitMEMLOCK. Continuing unlocked.";
    }
  }
  absl::MutexLock lock(&pool->mu_);
  pool->free_.reserve(pool->total_chunks_);
  for (size_t i = pool->total_chunks_; i > 0; --i) {
    pool->free_.push_back(static_cast<char*>(p) + (i - 1) * o.chunk_bytes);
  }
  return pool;
}

StagingPool::~StagingPool() {
  if (base_ != nullptr) ::munmap(base_, map_bytes_);
}

absl::StatusOr<StagingLease> StagingPool::Acquire(uint64_t bytes, absl::Time deadline) {
  // Compare before rounding up: bytes near UINT64_MAX would wrap around.
  const size_t need =
      bytes > budget_bytes()
          ? total_chunks_ + 1
          : std::max<size_t>(1, static_cast<size_t>((bytes + chunk_bytes_ - 1) / chunk_bytes_));
  if (need > total_chunks_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a version of ", bytes, " bytes does not fit the staging pool of ",
                     budget_bytes(), " bytes; raise staging_pool_bytes"));
  }
  // While it waits, the reclaimer is asked again every kReclaimInterval:
  // what it holds can grow meanwhile (the memory tier keeps each version a
  // writer finishes), and room it could give back must not wait for the
  // deadline.
  for (;;) {
    std::shared_ptr<std::function<void(uint64_t)>> reclaimer;
    uint64_t missing = 0;
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() >= need) return TakeLocked(need);
      reclaimer = reclaimer_;
      missing = (need - free_.size()) * chunk_bytes_;
    }
    if (reclaimer != nullptr) (*reclaimer)(missing);
    absl::MutexLock lock(&mu_);
    auto enough = [this, need]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return free_.size() >= need; };
    const absl::Time until =
        reclaimer == nullptr ? deadline : std::min(deadline, absl::Now() + kReclaimInterval);
    if (mu_.AwaitWithDeadline(absl::Condition(&enough), until)) return TakeLocked(need);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("staging pool full: ", need, " chunks wanted, ", free_.size(), " free"));
    }
  }
}

std::optional<StagingLease> StagingPool::TryAcquire(uint64_t bytes) {
  if (bytes > budget_bytes()) return std::nullopt;
  const size_t need =
      std::max<size_t>(1, static_cast<size_t>((bytes + chunk_bytes_ - 1) / chunk_bytes_));
  absl::MutexLock lock(&mu_);
  if (free_.size() < need) return std::nullopt;
  return TakeLocked(need);
}

StagingLease StagingPool::TakeLocked(size_t chunks) {
  StagingLease lease;
  lease.pool_ = this;
  lease.chunk_bytes_ = chunk_bytes_;
  lease.chunks_.assign(free_.end() - static_cast<ptrdiff_t>(chunks), free_.end());
  free_.resize(free_.size() - chunks);
  return lease;
}

void StagingPool::SetReclaimer(std::function<void(uint64_t bytes)> reclaimer) {
  absl::MutexLock lock(&mu_);
  reclaimer_ =
      reclaimer ? std::make_shared<std::function<void(uint64_t)>>(std::move(reclaimer)) : nullptr;
}

void StagingPool::Release(std::vector<char*>* chunks) {
  absl::MutexLock lock(&mu_);
  free_.insert(free_.end(), chunks->begin(), chunks->end());
  chunks->clear();
}

uint64_t StagingPool::bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return (total_chunks_ - free_.size()) * chunk_bytes_;
}

}  // namespace ckpt
