// Index (index.h): lost versions, l/<job>/<rank:8>/<layer:8>/<step:16>. A
// version found damaged with no intact copy in any tier leaves the history
// (its record goes) but not the plans' sight: its LostVersion stays, so a
// plan that needs it refuses (recovery/plan.h). They are few (one per such
// damage) and go with their rank (Engine::DeleteJob) or a restore that
// discards later steps.
#include <rocksdb/write_batch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "daemon/store/index.h"
#include "daemon/store/index_internal.h"

namespace ckpt {

using index_internal::BoundedIterator;
using index_internal::FromRocks;
using index_internal::IndexClosed;
using index_internal::ParseLayerStep;
using index_internal::ParseRecord;
using index_internal::RankPrefix;
using index_internal::VersionKeyString;

namespace {

std::string LostKeyString(const VersionKey& k) {
  return absl::StrFormat("l/%s/%08x/%08x/%016x", k.job, k.rank, k.layer, k.step);
}

}  // namespace

absl::Status Index::MarkLost(const VersionKey& key, const store::LostVersion& rec) {
  const std::string v = VersionKeyString(key);
  absl::MutexLock lock(&version_mu_);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> old, Get(v));
  rocksdb::WriteBatch batch;
  batch.Delete(v);
  batch.Put(LostKeyString(key), rec.SerializeAsString());
  rocksdb::WriteOptions wo;
  wo.sync = true;
  CKPT_RETURN_IF_ERROR(Write(wo, &batch, absl::StrCat("mark lost ", v)));
  if (old.has_value()) {
    store::VersionRecord was;
    CountLocked(key, -1, was.ParseFromString(*old) ? was.file_bytes() : 0);
  }
  return absl::OkStatus();
}

absl::StatusOr<Index::LostMap> Index::LostVersions(const std::string& job, uint32_t rank) {
  const std::string prefix = RankPrefix('l', job, rank);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  LostMap out;
  BoundedIterator it(db_.get(), prefix);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    absl::string_view k(it->key().data(), it->key().size());
    uint32_t layer;
    uint64_t step;
    if (!ParseLayerStep(k.substr(prefix.size()), &layer, &step)) {
      return absl::DataLossError(absl::StrCat("bad index key ", k));
    }
    CKPT_ASSIGN_OR_RETURN(out[std::make_pair(layer, step)],
                          ParseRecord<store::LostVersion>(it->value(), k));
  }
  CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "scan lost versions"));
  return out;
}

absl::Status Index::DeleteLost(const VersionKey& key) { return Delete(LostKeyString(key)); }

}  // namespace ckpt
