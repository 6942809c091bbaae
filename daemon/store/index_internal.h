// What the Index's sources (index.cc, index_records.cc, index_versions.cc,
// index_events.cc) share: the spelling of the keys index.h lists, their
// parsers, the records' decoding and how a RocksDB status becomes ours.
// Internal to the Index.
#pragma once

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/slice.h>
#include <rocksdb/status.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "base/status.h"
#include "daemon/store/index.h"

namespace ckpt::index_internal {

// A RocksDB status as ckptd's: corruption is DATA_LOSS, a full disk
// RESOURCE_EXHAUSTED with kDiskFull, not-found NOT_FOUND, anything else
// INTERNAL with kIndex.
inline absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat("rocksdb ", what, ": ", s.ToString());
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsNoSpace()) return WithReason(absl::ResourceExhaustedError(msg), ErrorReason::kDiskFull);
  return WithReason(absl::InternalError(msg), ErrorReason::kIndex);
}

// What every access returns while the database is closed (a reopen failed
// twice, index.h).
inline absl::Status IndexClosed() {
  return WithReason(
      absl::UnavailableError("the index could not be reopened after a write failure; it is retried "
                             "at the next write"),
      ErrorReason::kIndex);
}

// An iterator over the keys that start with `prefix`, and only those: its
// seeks and steps stop at the prefix's bounds (iterate_lower_bound and
// iterate_upper_bound), so a lookup never wades through other ranks' or
// jobs' keys, nor through the tombstones a deleted job leaves until
// compaction (a SeekForPrev for a layer with no version once walked back
// through every key of the job before it). `prefix` must end with '/'.
// Non-copyable; the iterator and the bounds it points to live as long as it.
class BoundedIterator {
 public:
  BoundedIterator(rocksdb::DB* db, std::string prefix) : lower_(std::move(prefix)), upper_(lower_) {
    upper_.back() = static_cast<char>(upper_.back() + 1);  // '/' -> '0'
    lower_slice_ = lower_;
    upper_slice_ = upper_;
    options_.iterate_lower_bound = &lower_slice_;
    options_.iterate_upper_bound = &upper_slice_;
    it_.reset(db->NewIterator(options_));
  }
  BoundedIterator(const BoundedIterator&) = delete;
  BoundedIterator& operator=(const BoundedIterator&) = delete;

  rocksdb::Iterator* operator->() const { return it_.get(); }
  const std::string& prefix() const { return lower_; }

 private:
  std::string lower_, upper_;
  rocksdb::Slice lower_slice_, upper_slice_;
  rocksdb::ReadOptions options_;
  std::unique_ptr<rocksdb::Iterator> it_;
};

// "<kind>/<job>/<rank:8>/": the prefix of a rank's version or event keys.
inline std::string RankPrefix(char kind, const std::string& job, uint32_t rank) {
  return absl::StrFormat("%c/%s/%08x/", kind, job, rank);
}
inline std::string VersionKeyString(const VersionKey& k) {
  return absl::StrFormat("v/%s/%08x/%08x/%016x", k.job, k.rank, k.layer, k.step);
}
inline std::string EventKey(const std::string& job, uint32_t rank, uint64_t step) {
  return absl::StrFormat("e/%s/%08x/%016x", job, rank, step);
}

// Only the canonical form the writers produce (fixed width, lower case, no
// sign or "0x"): any other spelling would parse to a number whose canonical
// key is a different key, so deleting "it" would delete nothing.
inline bool IsLowerHex(absl::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}
inline bool ParseHex32(absl::string_view s, uint32_t* out) {
  if (s.size() != 8 || !IsLowerHex(s)) return false;
  return absl::SimpleHexAtoi(s, out);
}
inline bool ParseHex64(absl::string_view s, uint64_t* out) {
  if (s.size() != 16 || !IsLowerHex(s)) return false;
  return absl::SimpleHexAtoi(s, out);
}

// "<layer:8>/<step:16>", the end of a version key.
inline bool ParseLayerStep(absl::string_view rest, uint32_t* layer, uint64_t* step) {
  return rest.size() == 25 && ParseHex32(rest.substr(0, 8), layer) &&
         ParseHex64(rest.substr(9), step);
}

// The record stored under `key`; DATA_LOSS naming the key when it does not
// parse.
template <typename Msg>
absl::StatusOr<Msg> ParseRecord(const rocksdb::Slice& v, absl::string_view key) {
  Msg m;
  if (!m.ParseFromArray(v.data(), static_cast<int>(v.size()))) {
    return absl::DataLossError(absl::StrCat("index record ", key, " does not parse"));
  }
  return m;
}

}  // namespace ckpt::index_internal
