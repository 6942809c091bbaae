// Index (index.h): the version records, v/<job>/<rank:8>/<layer:8>/<step:16>
// -- the commit point of every layer version -- the per-rank counts of them
// kept beside (VersionsOf), and the lookups and scans over them.
#include <rocksdb/db.h>
#include <rocksdb/iterator.h>
#include <rocksdb/write_batch.h>

#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "daemon/store/index.h"
#include "daemon/store/index_internal.h"

namespace ckpt {

using index_internal::BoundedIterator;
using index_internal::FromRocks;
using index_internal::IndexClosed;
using index_internal::ParseHex32;
using index_internal::ParseHex64;
using index_internal::ParseLayerStep;
using index_internal::ParseRecord;
using index_internal::VersionKeyString;

namespace {

// Counts one more version of `layer` in `r`.
void AddVersion(Index::RankVersions& r, uint32_t layer, uint64_t file_bytes) {
  if (layer < Index::kMaxCountedLayer) {
    if (r.layers.size() <= layer) r.layers.resize(static_cast<size_t>(layer) + 1);
    ++r.layers[layer].versions;
    r.layers[layer].file_bytes += file_bytes;
  }
  ++r.total.versions;
  r.total.file_bytes += file_bytes;
}

}  // namespace

absl::Status Index::PutVersion(const VersionKey& key, const store::VersionRecord& rec) {
  return PutVersions({key}, {rec});
}

absl::Status Index::PutVersions(const std::vector<VersionKey>& keys,
                                const std::vector<store::VersionRecord>& records) {
  if (keys.size() != records.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " version keys for ", records.size(), " records"));
  }
  absl::MutexLock lock(&version_mu_);
  // A record written over (the same layer and step again) replaces the one
  // it counted.
  std::vector<std::string> k(keys.size());
  std::vector<std::optional<std::string>> old(keys.size());
  rocksdb::WriteBatch batch;
  for (size_t i = 0; i < keys.size(); ++i) {
    k[i] = VersionKeyString(keys[i]);
    CKPT_ASSIGN_OR_RETURN(old[i], Get(k[i]));
    batch.Put(k[i], records[i].SerializeAsString());
  }
  rocksdb::WriteOptions wo;
  wo.sync = true;
  CKPT_RETURN_IF_ERROR(Write(wo, &batch,
                             keys.size() == 1 ? absl::StrCat("put ", k[0])
                                              : absl::StrCat("put ", keys.size(), " versions")));
  // A key twice in the batch: the second record replaces the first.
  std::map<absl::string_view, uint64_t> put_bytes;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [it, first] = put_bytes.try_emplace(k[i], records[i].file_bytes());
    if (!first) {
      CountLocked(keys[i], -1, it->second);
      it->second = records[i].file_bytes();
    } else if (old[i].has_value()) {
      store::VersionRecord was;
      CountLocked(keys[i], -1, was.ParseFromString(*old[i]) ? was.file_bytes() : 0);
    }
    CountLocked(keys[i], +1, records[i].file_bytes());
  }
  return absl::OkStatus();
}

absl::Status Index::DeleteVersion(const VersionKey& key) {
  const std::string k = VersionKeyString(key);
  absl::MutexLock lock(&version_mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> old, Get(k));
  CKPT_RETURN_IF_ERROR(Delete(k));
  if (old.has_value()) {
    store::VersionRecord was;
    CountLocked(key, -1, was.ParseFromString(*old) ? was.file_bytes() : 0);
  }
  return absl::OkStatus();
}

void Index::CountLocked(const VersionKey& key, int sign, uint64_t file_bytes) {
  auto it = versions_.find(std::make_pair(key.job, key.rank));
  if (it == versions_.end()) {
    if (sign < 0) return;
    it = versions_.emplace(std::make_pair(key.job, key.rank), RankVersions()).first;
  }
  RankVersions& r = it->second;
  if (sign > 0) {
    AddVersion(r, key.layer, file_bytes);
    return;
  }
  auto sub = [](uint64_t& v, uint64_t d) { v = v > d ? v - d : 0; };
  if (key.layer < r.layers.size()) {
    VersionCount& l = r.layers[key.layer];
    sub(l.versions, 1);
    sub(l.file_bytes, file_bytes);
  }
  sub(r.total.versions, 1);
  sub(r.total.file_bytes, file_bytes);
  if (r.total.versions == 0) versions_.erase(it);
}

absl::Status Index::CountVersions() {
  absl::MutexLock lock(&version_mu_);
  versions_.clear();
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), "v/");
  // v/<job>/<rank:8>/<layer:8>/<step:16>; consecutive records are mostly of
  // one rank, whose entry is looked up once per run.
  RankVersions* current = nullptr;
  std::string current_job;
  uint32_t current_rank = 0;
  for (it->Seek("v/"); it->Valid() && it->key().starts_with("v/"); it->Next()) {
    absl::string_view k(it->key().data(), it->key().size());
    if (k.size() < 2 + 1 + 1 + 8 + 1 + 8 + 1 + 16) continue;  // not a version key: not counted
    // <rank>/<layer>/<step>
    const absl::string_view tail = k.substr(k.size() - (8 + 1 + 8 + 1 + 16));
    const absl::string_view job = k.substr(2, k.size() - 2 - tail.size() - 1);
    uint32_t rank = 0, layer = 0;
    uint64_t step = 0;
    if (k[k.size() - tail.size() - 1] != '/' || tail[8] != '/' || tail[17] != '/' ||
        !ParseHex32(tail.substr(0, 8), &rank) || !ParseLayerStep(tail.substr(9), &layer, &step)) {
      continue;
    }
    if (current == nullptr || job != current_job || rank != current_rank) {
      current_job = std::string(job);
      current_rank = rank;
      current = &versions_[std::make_pair(current_job, rank)];
    }
    store::VersionRecord rec;
    const uint64_t bytes =
        rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))
            ? rec.file_bytes()
            : 0;
    AddVersion(*current, layer, bytes);
  }
  return FromRocks(it->status(), "count versions");
}

Index::RankVersions Index::VersionsOf(const std::string& job, uint32_t rank) const {
  absl::MutexLock lock(&version_mu_);
  auto it = versions_.find(std::make_pair(job, rank));
  return it == versions_.end() ? RankVersions() : it->second;
}

absl::StatusOr<std::optional<std::pair<uint64_t, store::VersionRecord>>> Index::VersionAtOrBefore(
    const std::string& job, uint32_t rank, uint32_t layer, uint64_t max_step) {
  using Result = std::optional<std::pair<uint64_t, store::VersionRecord>>;
  const std::string prefix = absl::StrFormat("v/%s/%08x/%08x/", job, rank, layer);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  it->SeekForPrev(absl::StrFormat("%s%016x", prefix, max_step));
  if (it->Valid()) entries_read_.fetch_add(1, std::memory_order_relaxed);
  if (!it->Valid() || !it->key().starts_with(prefix)) {
    CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "seek version"));
    return Result();
  }
  uint64_t step;
  absl::string_view k(it->key().data(), it->key().size());
  if (!ParseHex64(k.substr(prefix.size()), &step)) {
    return absl::DataLossError(absl::StrCat("bad index key ", k));
  }
  CKPT_ASSIGN_OR_RETURN(store::VersionRecord rec,
                        ParseRecord<store::VersionRecord>(it->value(), k));
  return Result(std::make_pair(step, std::move(rec)));
}

absl::Status Index::ForEachVersion(
    const std::string& job, uint32_t rank, int64_t layer,
    const std::function<bool(const VersionKey&, const store::VersionRecord&)>& fn) {
  const std::string prefix =
      layer < 0 ? absl::StrFormat("v/%s/%08x/", job, rank)
                : absl::StrFormat("v/%s/%08x/%08x/", job, rank, static_cast<uint32_t>(layer));
  const size_t rank_prefix = absl::StrFormat("v/%s/%08x/", job, rank).size();
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    absl::string_view k(it->key().data(), it->key().size());
    VersionKey vk{job, rank, 0, 0};
    if (!ParseLayerStep(k.substr(rank_prefix), &vk.layer, &vk.step)) {
      return absl::DataLossError(absl::StrCat("bad index key ", k));
    }
    CKPT_ASSIGN_OR_RETURN(store::VersionRecord rec,
                          ParseRecord<store::VersionRecord>(it->value(), k));
    if (!fn(vk, rec)) break;
  }
  return FromRocks(it->status(), "scan versions");
}

absl::Status Index::ForEachVersionAfter(
    const std::string& job, uint32_t rank, uint64_t after_step,
    const std::function<bool(const VersionKey&, const store::VersionRecord&)>& fn) {
  const std::string prefix = absl::StrFormat("v/%s/%08x/", job, rank);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  it->Seek(prefix);
  while (it->Valid() && it->key().starts_with(prefix)) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    absl::string_view k(it->key().data(), it->key().size());
    VersionKey vk{job, rank, 0, 0};
    if (!ParseLayerStep(k.substr(prefix.size()), &vk.layer, &vk.step)) {
      return absl::DataLossError(absl::StrCat("bad index key ", k));
    }
    if (vk.step <= after_step) {
      // The rest of this layer's history below the step is skipped with one
      // seek (after_step + 1 cannot wrap: a step above it exists only then).
      if (after_step == ~uint64_t{0}) {
        if (vk.layer == ~uint32_t{0}) break;
        it->Seek(absl::StrFormat("%s%08x/", prefix, vk.layer + 1));
      } else {
        it->Seek(absl::StrFormat("%s%08x/%016x", prefix, vk.layer, after_step + 1));
      }
      continue;
    }
    CKPT_ASSIGN_OR_RETURN(store::VersionRecord rec,
                          ParseRecord<store::VersionRecord>(it->value(), k));
    if (!fn(vk, rec)) break;
    it->Next();
  }
  return FromRocks(it->status(), "scan versions");
}

}  // namespace ckpt
