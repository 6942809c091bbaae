// Index (index.h): the job and rank records, j/<job> and r/<job>/<rank:8>.
#include <rocksdb/db.h>
#include <rocksdb/iterator.h>

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
using index_internal::ParseRecord;

absl::Status Index::PutJob(const std::string& job, const store::JobRecord& rec) {
  return Put(absl::StrCat("j/", job), rec.SerializeAsString());
}

absl::StatusOr<std::optional<store::JobRecord>> Index::GetJob(const std::string& job) {
  const std::string key = absl::StrCat("j/", job);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get(key));
  if (!v.has_value()) return std::optional<store::JobRecord>();
  CKPT_ASSIGN_OR_RETURN(store::JobRecord rec, ParseRecord<store::JobRecord>(*v, key));
  return std::optional<store::JobRecord>(std::move(rec));
}

absl::StatusOr<std::vector<std::string>> Index::ListJobs() {
  std::vector<std::string> jobs;
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), "j/");
  for (it->Seek("j/"); it->Valid() && it->key().starts_with("j/"); it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    jobs.push_back(it->key().ToString().substr(2));
  }
  CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "list jobs"));
  return jobs;
}

absl::Status Index::PutRank(const std::string& job, uint32_t rank, const store::RankRecord& rec) {
  return Put(absl::StrFormat("r/%s/%08x", job, rank), rec.SerializeAsString());
}

absl::Status Index::DeleteJob(const std::string& job) { return Delete(absl::StrCat("j/", job)); }

absl::Status Index::CompactJob(const std::string& job) {
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  // Forced at the bottom level: a range that fits one file would otherwise
  // be moved down as it is, tombstones and all.
  rocksdb::CompactRangeOptions options;
  options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  for (const char kind : {'e', 'l', 'r', 'v'}) {
    const std::string begin = absl::StrCat(std::string(1, kind), "/", job, "/");
    std::string end = begin;
    end.back() = static_cast<char>(end.back() + 1);
    const rocksdb::Slice b(begin), e(end);
    CKPT_RETURN_IF_ERROR(FromRocks(db_->CompactRange(options, &b, &e), "compact"));
  }
  return absl::OkStatus();
}

absl::Status Index::DeleteRank(const std::string& job, uint32_t rank) {
  return Delete(absl::StrFormat("r/%s/%08x", job, rank));
}

absl::StatusOr<std::optional<store::RankRecord>> Index::GetRank(const std::string& job,
                                                                uint32_t rank) {
  const std::string key = absl::StrFormat("r/%s/%08x", job, rank);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get(key));
  if (!v.has_value()) return std::optional<store::RankRecord>();
  CKPT_ASSIGN_OR_RETURN(store::RankRecord rec, ParseRecord<store::RankRecord>(*v, key));
  return std::optional<store::RankRecord>(std::move(rec));
}

absl::StatusOr<std::vector<uint32_t>> Index::ListRanks(const std::string& job) {
  std::vector<uint32_t> ranks;
  const std::string prefix = absl::StrCat("r/", job, "/");
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  BoundedIterator it(db_.get(), prefix);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    uint32_t r;
    if (ParseHex32(
            absl::string_view(it->key().data() + prefix.size(), it->key().size() - prefix.size()),
            &r)) {
      ranks.push_back(r);
    }
  }
  CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "list ranks"));
  return ranks;
}

}  // namespace ckpt
