// Index (index.h): the checkpoint event records, e/<job>/<rank:8>/<step:16>,
// each written after every version of its step.
#include <rocksdb/db.h>
#include <rocksdb/iterator.h>
#include <rocksdb/write_batch.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "daemon/store/index.h"
#include "daemon/store/index_internal.h"

namespace ckpt {

using index_internal::BoundedIterator;
using index_internal::EventKey;
using index_internal::FromRocks;
using index_internal::IndexClosed;
using index_internal::ParseHex64;
using index_internal::ParseRecord;
using index_internal::RankPrefix;

absl::Status Index::PutEvent(const std::string& job, uint32_t rank, uint64_t step,
                             const store::EventRecord& rec) {
  return Put(EventKey(job, rank, step), rec.SerializeAsString());
}

absl::Status Index::PutEvents(const std::string& job, uint32_t rank,
                              const std::vector<std::pair<uint64_t, store::EventRecord>>& events) {
  rocksdb::WriteBatch batch;
  for (const auto& [step, rec] : events) {
    batch.Put(EventKey(job, rank, step), rec.SerializeAsString());
  }
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return Write(wo, &batch, "put events");
}

absl::Status Index::DeleteEvent(const std::string& job, uint32_t rank, uint64_t step) {
  return Delete(EventKey(job, rank, step));
}

absl::StatusOr<std::optional<std::pair<uint64_t, store::EventRecord>>> Index::EventAtOrBefore(
    const std::string& job, uint32_t rank, uint64_t max_step) {
  using Result = std::optional<std::pair<uint64_t, store::EventRecord>>;
  const std::string prefix = RankPrefix('e', job, rank);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  it->SeekForPrev(EventKey(job, rank, max_step));
  if (it->Valid()) entries_read_.fetch_add(1, std::memory_order_relaxed);
  if (!it->Valid() || !it->key().starts_with(prefix)) {
    CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "seek event"));
    return Result();
  }
  absl::string_view k(it->key().data(), it->key().size());
  uint64_t step;
  if (!ParseHex64(k.substr(prefix.size()), &step)) {
    return absl::DataLossError(absl::StrCat("bad index key ", k));
  }
  CKPT_ASSIGN_OR_RETURN(store::EventRecord rec, ParseRecord<store::EventRecord>(it->value(), k));
  return Result(std::make_pair(step, std::move(rec)));
}

absl::Status Index::ForEachEvent(
    const std::string& job, uint32_t rank, bool newest_first,
    const std::function<bool(uint64_t, const store::EventRecord&)>& fn) {
  const std::string prefix = RankPrefix('e', job, rank);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  if (newest_first) {
    it->SeekForPrev(EventKey(job, rank, ~uint64_t{0}));
  } else {
    it->Seek(prefix);
  }
  for (; it->Valid() && it->key().starts_with(prefix); newest_first ? it->Prev() : it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    absl::string_view k(it->key().data(), it->key().size());
    uint64_t step;
    if (!ParseHex64(k.substr(prefix.size()), &step)) {
      return absl::DataLossError(absl::StrCat("bad index key ", k));
    }
    CKPT_ASSIGN_OR_RETURN(store::EventRecord rec, ParseRecord<store::EventRecord>(it->value(), k));
    if (!fn(step, rec)) break;
  }
  return FromRocks(it->status(), "scan events");
}

}  // namespace ckpt
