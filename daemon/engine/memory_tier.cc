#include "daemon/engine/memory_tier.h"

#include <iterator>
#include <vector>

namespace ckpt {

std::map<MemoryTier::Key, MemoryTier::Entry>::iterator MemoryTier::EraseLocked(
    std::map<Key, Entry>::iterator it, std::vector<std::shared_ptr<const StagingLease>>* out) {
  bytes_ -= it->second.bytes;
  by_stamp_.erase(it->second.stamp);
  out->push_back(std::move(it->second.image));
  return entries_.erase(it);
}

void MemoryTier::EvictLocked(uint64_t target,
                             std::vector<std::shared_ptr<const StagingLease>>* out) {
  while (bytes_ > target && !by_stamp_.empty()) {
    EraseLocked(entries_.find(by_stamp_.begin()->second), out);
  }
}

void MemoryTier::Put(const RankKey& rank, uint32_t layer, uint64_t step, const std::string& file,
                     StagingLease image) {
  std::vector<std::shared_ptr<const StagingLease>> released;
  const uint64_t size = image.capacity();
  auto shared = std::make_shared<const StagingLease>(std::move(image));
  absl::MutexLock lock(&mu_);
  const Key key(rank, layer);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    // The layer's entry goes whatever follows: it is older than this
    // version, or of a history the rank went back before.
    EraseLocked(it, &released);
  }
  if (size > budget_) {
    released.push_back(std::move(shared));  // too large to keep
    return;
  }
  EvictLocked(budget_ - size, &released);
  Entry& e = entries_[key];
  e.step = step;
  e.file = file;
  e.image = std::move(shared);
  e.bytes = size;
  e.stamp = next_stamp_++;
  by_stamp_[e.stamp] = key;
  bytes_ += size;
}

std::shared_ptr<const StagingLease> MemoryTier::Find(const RankKey& rank, uint32_t layer,
                                                     uint64_t step, const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(Key(rank, layer));
  if (it == entries_.end() || it->second.step != step || it->second.file != file) return nullptr;
  return it->second.image;
}

void MemoryTier::Shrink(uint64_t bytes) {
  std::vector<std::shared_ptr<const StagingLease>> released;
  absl::MutexLock lock(&mu_);
  EvictLocked(bytes_ > bytes ? bytes_ - bytes : 0, &released);
}

void MemoryTier::DropJob(const std::string& job) {
  std::vector<std::shared_ptr<const StagingLease>> released;
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->first.first.first == job ? EraseLocked(it, &released) : std::next(it);
  }
}

uint64_t MemoryTier::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace ckpt
