#include "daemon/engine/memory_tier.h"

#include <iterator>
#include <optional>
#include <vector>

namespace ckpt {

std::map<MemoryTier::Key, MemoryTier::Entry>::iterator MemoryTier::EraseLocked(
    std::map<Key, Entry>::iterator it, std::vector<std::shared_ptr<const StagingLease>>* out) {
  bytes_ -= it->second.bytes;
  auto owner = uids_.find(it->second.uid);
  owner->second.bytes -= it->second.bytes;
  owner->second.by_stamp.erase(it->second.stamp);
  if (owner->second.by_stamp.empty()) uids_.erase(owner);
  out->push_back(std::move(it->second.image));
  return entries_.erase(it);
}

void MemoryTier::EvictLocked(uint64_t target, std::optional<uint32_t> storing,
                             std::vector<std::shared_ptr<const StagingLease>>* out) {
  while (bytes_ > target && !uids_.empty()) {
    // The uid holding the most; of equals, the one storing (it may not take
    // an equal's room), else the one with the oldest entry.
    auto richest = uids_.begin();
    for (auto it = std::next(uids_.begin()); it != uids_.end(); ++it) {
      const uint64_t mine = it->second.bytes, best = richest->second.bytes;
      if (mine != best) {
        if (mine > best) richest = it;
      } else if (richest->first != storing &&
                 (it->first == storing ||
                  it->second.by_stamp.begin()->first < richest->second.by_stamp.begin()->first)) {
        richest = it;
      }
    }
    EraseLocked(entries_.find(richest->second.by_stamp.begin()->second), out);
  }
}

void MemoryTier::Put(const RankKey& rank, uint32_t layer, uint64_t step, const std::string& file,
                     uint32_t uid, StagingLease image) {
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
  EvictLocked(budget_ - size, uid, &released);
  Entry& e = entries_[key];
  e.step = step;
  e.file = file;
  e.image = std::move(shared);
  e.bytes = size;
  e.uid = uid;
  e.stamp = next_stamp_++;
  UidEntries& owner = uids_[uid];
  owner.by_stamp[e.stamp] = key;
  owner.bytes += size;
  bytes_ += size;
}

std::shared_ptr<const StagingLease> MemoryTier::Find(const RankKey& rank, uint32_t layer,
                                                     uint64_t step, const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(Key(rank, layer));
  if (it == entries_.end() || it->second.step != step || it->second.file != file) return nullptr;
  return it->second.image;
}

void MemoryTier::Drop(const VersionKey& key, const store::VersionRecord& rec) {
  std::vector<std::shared_ptr<const StagingLease>> released;  // after unlocking
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(Key(RankKey(key.job, key.rank), key.layer));
  if (it != entries_.end() && it->second.step == key.step && it->second.file == rec.file()) {
    EraseLocked(it, &released);
  }
}

void MemoryTier::Shrink(uint64_t bytes) {
  std::vector<std::shared_ptr<const StagingLease>> released;
  absl::MutexLock lock(&mu_);
  EvictLocked(bytes_ > bytes ? bytes_ - bytes : 0, std::nullopt, &released);
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

uint64_t MemoryTier::bytes_of(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = uids_.find(uid);
  return it == uids_.end() ? 0 : it->second.bytes;
}

}  // namespace ckpt
