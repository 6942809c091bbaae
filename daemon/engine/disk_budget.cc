#include "daemon/engine/disk_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt {

absl::Status DiskBudget::Reserve(uint64_t file_bytes) {
  // Writers race: reserve with a compare-and-swap under the bound.
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (max_bytes_ > 0 && used + file_bytes > max_bytes_) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "disk bound of ", max_bytes_, " bytes reached (", used,
              " used); run `ckptctl gc JOB` on the largest jobs (`ckptctl jobs` lists them) or "
              "raise max_disk_bytes")),
          ErrorReason::kDiskFull);
    }
  } while (!used_.compare_exchange_weak(used, used + file_bytes, std::memory_order_relaxed));
  if (absl::Status room = CheckFreeSpace(file_bytes); !room.ok()) {
    Release(file_bytes);
    return room;
  }
  return absl::OkStatus();
}

uint64_t DiskBudget::EffectiveLimit() {
  absl::StatusOr<uint64_t> free = store_->FreeBytes();
  if (!free.ok()) return max_bytes_;
  const uint64_t room = used() + (*free > min_free_bytes_ ? *free - min_free_bytes_ : 0);
  return max_bytes_ > 0 ? std::min(max_bytes_, room) : room;
}

absl::Status DiskBudget::CheckFreeSpace(uint64_t file_bytes) {
  if (min_free_bytes_ == 0) return absl::OkStatus();
  absl::StatusOr<uint64_t> free = store_->FreeBytes();
  if (!free.ok() || *free >= min_free_bytes_ + file_bytes) return absl::OkStatus();
  return WithReason(
      absl::ResourceExhaustedError(
          absl::StrCat("the data file system has ", *free,
                       " bytes free; min_free_disk_bytes keeps ", min_free_bytes_,
                       " for the index (free space, or run `ckptctl gc JOB` on the largest jobs)")),
      ErrorReason::kDiskFull);
}

absl::Status DiskBudget::CheckIndexRoom(uint64_t index_bytes) {
  if (min_free_bytes_ == 0) return absl::OkStatus();
  absl::StatusOr<uint64_t> free = store_->FreeBytes();
  if (!free.ok() || *free >= index_floor_bytes() + index_bytes) return absl::OkStatus();
  return WithReason(
      absl::ResourceExhaustedError(absl::StrCat(
          "the data file system has ", *free, " bytes free; ", index_bytes,
          " bytes of index records would leave less than a quarter of "
          "min_free_disk_bytes (",
          index_floor_bytes(),
          "), which is kept for RocksDB (free space, or run `ckptctl gc JOB` on the largest "
          "jobs)")),
      ErrorReason::kDiskFull);
}

}  // namespace ckpt
