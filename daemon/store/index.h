// Index: the RocksDB history of every durable layer version and checkpoint event.
//
// Keys (numbers are fixed-width lowercase hex so that byte order = numeric order;
// job ids never contain '/'):
//   m/schema_version                     the records' schema (kIndexSchemaVersion)
//   m/generation                         next registration generation (u64)
//   j/<job>                              JobRecord
//   r/<job>/<rank:8>                     RankRecord
//   v/<job>/<rank:8>/<layer:8>/<step:16> VersionRecord
//   e/<job>/<rank:8>/<step:16>           EventRecord
//
// Every mutation is a synchronous write (WriteOptions::sync): a record that
// exists has reached the WAL on disk. A version record is the commit point of
// the protocol in commit.h; an event record is written only after every
// version of that step. The database is opened with paranoid checks; a
// RocksDB error on a write is returned to the caller and never swallowed.
//
// Thread-safety: all methods are thread-safe (RocksDB is).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/unique_fd.h"
#include "daemon/store/store.pb.h"

namespace rocksdb {
class DB;
class WriteBatch;
struct WriteOptions;
}

namespace ckpt {

struct VersionKey {
  std::string job;
  uint32_t rank = 0;
  uint32_t layer = 0;
  uint64_t step = 0;
};

// The schema of the records (store.proto) this ckptd writes and reads.
// Version 1: the records as first written; an index without the key is of
// version 1. Open refuses an index of a newer schema.
inline constexpr uint32_t kIndexSchemaVersion = 1;

class Index {
 public:
  // Opens or creates the database at `path`. FAILED_PRECONDITION when another
  // Index, in this process or another, holds it (an flock on
  // <path>/ckptd.lock, held for the Index's lifetime); DATA_LOSS on
  // corruption; every other RocksDB failure carries ErrorReason::kIndex.
  // FAILED_PRECONDITION when the index was written with a schema newer than
  // kIndexSchemaVersion (by a newer ckptd); an index without a schema version
  // is stamped with this one.
  static absl::StatusOr<std::unique_ptr<Index>> Open(const std::string& path);
  ~Index();
  Index(const Index&) = delete;
  Index& operator=(const Index&) = delete;

  // Returns a generation never handed out before (persisted counter).
  absl::StatusOr<uint64_t> NextGeneration();
  // Makes every later NextGeneration() return more than `used` (repair: the
  // generations named by layer files an index rebuild found).
  absl::Status RaiseGeneration(uint64_t used);

  absl::Status PutJob(const std::string& job, const store::JobRecord& rec);
  absl::StatusOr<std::optional<store::JobRecord>> GetJob(const std::string& job);
  absl::StatusOr<std::vector<std::string>> ListJobs();

  absl::Status PutRank(const std::string& job, uint32_t rank, const store::RankRecord& rec);
  absl::StatusOr<std::optional<store::RankRecord>> GetRank(const std::string& job, uint32_t rank);
  absl::StatusOr<std::vector<uint32_t>> ListRanks(const std::string& job);
  // The job's and a rank's own records (job deletion; their versions and
  // events are deleted one by one first).
  absl::Status DeleteJob(const std::string& job);
  absl::Status DeleteRank(const std::string& job, uint32_t rank);

  // The commit point of one layer version.
  absl::Status PutVersion(const VersionKey& key, const store::VersionRecord& rec);
  absl::Status DeleteVersion(const VersionKey& key);
  // Newest version of (job, rank, layer) with step <= max_step.
  absl::StatusOr<std::optional<std::pair<uint64_t, store::VersionRecord>>> VersionAtOrBefore(
      const std::string& job, uint32_t rank, uint32_t layer, uint64_t max_step);
  // Versions of one layer in step order; all layers when layer < 0.
  absl::Status ForEachVersion(
      const std::string& job, uint32_t rank, int64_t layer,
      const std::function<bool(const VersionKey&, const store::VersionRecord&)>& fn);

  absl::Status PutEvent(const std::string& job, uint32_t rank, uint64_t step,
                        const store::EventRecord& rec);
  // Several events of one rank in one synchronous write batch.
  absl::Status PutEvents(const std::string& job, uint32_t rank,
                         const std::vector<std::pair<uint64_t, store::EventRecord>>& events);
  // Newest event with step <= max_step (UINT64_MAX: the latest).
  absl::StatusOr<std::optional<std::pair<uint64_t, store::EventRecord>>> EventAtOrBefore(
      const std::string& job, uint32_t rank, uint64_t max_step);
  // Events in step order (newest first when `newest_first`), at most `limit` (0 = all).
  absl::Status ForEachEvent(const std::string& job, uint32_t rank, bool newest_first,
                            const std::function<bool(uint64_t, const store::EventRecord&)>& fn);
  absl::Status DeleteEvent(const std::string& job, uint32_t rank, uint64_t step);

 private:
  Index(std::unique_ptr<rocksdb::DB> db, UniqueFd lock);
  // Stamps a new index with kIndexSchemaVersion; refuses a newer one.
  absl::Status CheckSchema(const std::string& path);
  absl::Status Put(const std::string& key, const std::string& value);
  absl::Status Delete(const std::string& key);
  absl::StatusOr<std::optional<std::string>> Get(const std::string& key);
  // Every RocksDB write goes through here (see index.cc: serialised under TSan).
  absl::Status Write(const rocksdb::WriteOptions& wo, rocksdb::WriteBatch* batch,
                     absl::string_view what);

  UniqueFd lock_;  // released after db_ is closed (declared first)
  std::unique_ptr<rocksdb::DB> db_;
  absl::Mutex tsan_write_mu_;  // taken only in ThreadSanitizer builds
};

}  // namespace ckpt
