// Index: the RocksDB history of every durable layer version and checkpoint event.
//
// Keys (numbers are fixed-width lowercase hex so that byte order = numeric order;
// job ids never contain '/'):
//   m/schema_version                     the records' schema (kIndexSchemaVersion)
//   m/generation                         next registration generation (u64)
//   m/clean_stop                         the sequence number before a clean stop's mark
//   j/<job>                              JobRecord
//   r/<job>/<rank:8>                     RankRecord
//   v/<job>/<rank:8>/<layer:8>/<step:16> VersionRecord
//   e/<job>/<rank:8>/<step:16>           EventRecord
//   l/<job>/<rank:8>/<layer:8>/<step:16> LostVersion
//
// Every mutation is a synchronous write (WriteOptions::sync): a record that
// exists has reached the WAL on disk. A version record is the commit point of
// the protocol in commit.h; an event record is written only after every
// version of that step. The database is opened with paranoid checks; a
// RocksDB error on a write is returned to the caller and never swallowed.
//
// A full disk (ENOSPC) never takes ckptd down. Debian's librocksdb 7.8.3 is
// built with assertions, and its WritableFileWriter asserts when a file that
// already failed a write is written again: the info LOG after its own ENOSPC,
// and the WAL after RocksDB cleared the background error without switching
// to a new WAL (fixed upstream after 7.8). So:
//   - RocksDB's info log goes to ckptd's log (warnings and errors), never to
//     a file on the data file system;
//   - writes are serialised, so a failed WAL write is seen before the next
//     write reaches RocksDB;
//   - after a failed write the index is *degraded*: reads go on, every write
//     first closes and reopens the database (a new WAL; the torn tail record
//     is dropped on replay), and fails without reaching RocksDB while that
//     does not succeed. (The engine keeps writes away from a full disk, so
//     reopens are rare.) When the read-write
//     open fails (still no space), the database is opened read-only so reads
//     keep working.
//
// Thread-safety: all methods are thread-safe. Callbacks of ForEachVersion and
// ForEachEvent run with the database pinned and must not call the Index.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
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
class Env;
class Logger;
class WriteBatch;
struct WriteOptions;
}  // namespace rocksdb

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
  // `env` replaces RocksDB's default environment (tests inject faults with
  // it); not owned, must outlive the Index.
  static absl::StatusOr<std::unique_ptr<Index>> Open(const std::string& path,
                                                     rocksdb::Env* env = nullptr);
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
  // Compacts the key ranges of a deleted job, so the tombstones its records
  // left do not slow every later lookup near them until RocksDB gets there
  // by itself (a deleted job of 30,000 layers once slowed another user's
  // Register 40-fold). Index errors as is.
  absl::Status CompactJob(const std::string& job);

  // A clean stop: ckptd's last index write when it stops with every commit
  // finished, holding the database's sequence number before it. CleanStop
  // says whether the mark is there and nothing was written after it: after
  // a start that wrote anything (a commit, an event, a repair) and then a
  // crash, it is false, and no write at start is needed to make it so (a
  // start on a full disk still starts).
  absl::Status MarkCleanStop();
  absl::StatusOr<bool> CleanStop();

  // The commit point of one layer version.
  absl::Status PutVersion(const VersionKey& key, const store::VersionRecord& rec);
  // The commit point of several (keys[i] with records[i], as long as each
  // other): one synchronous write, all of them or none.
  absl::Status PutVersions(const std::vector<VersionKey>& keys,
                           const std::vector<store::VersionRecord>& records);
  absl::Status DeleteVersion(const VersionKey& key);

  // How many versions of a rank the index holds, and their files' bytes, per
  // layer and in all. Counted once by Open (one pass over the version
  // records) and kept current by PutVersion(s) and DeleteVersion, so reading
  // them reads no index entry: `ckptctl layers` and `jobs` cost O(layers)
  // instead of O(history). A record that does not parse counts with 0 bytes.
  struct VersionCount {
    uint64_t versions = 0;
    uint64_t file_bytes = 0;
  };
  // Layer numbers counted one by one; a version of a higher one (no
  // registration has it: a damaged or forged key) counts in `total` only.
  static constexpr uint32_t kMaxCountedLayer = 1 << 20;
  struct RankVersions {
    VersionCount total;
    std::vector<VersionCount> layers;  // by layer id; may be shorter than the table
  };
  RankVersions VersionsOf(const std::string& job, uint32_t rank) const
      ABSL_LOCKS_EXCLUDED(version_mu_);
  // Newest version of (job, rank, layer) with step <= max_step.
  absl::StatusOr<std::optional<std::pair<uint64_t, store::VersionRecord>>> VersionAtOrBefore(
      const std::string& job, uint32_t rank, uint32_t layer, uint64_t max_step);
  // Versions of one layer in step order; all layers when layer < 0.
  absl::Status ForEachVersion(
      const std::string& job, uint32_t rank, int64_t layer,
      const std::function<bool(const VersionKey&, const store::VersionRecord&)>& fn);
  // Versions of every layer of the rank with step > `after_step`, by layer
  // and then step. Each layer costs one seek past `after_step`, so the
  // entries read are the layers plus the versions found, however long the
  // history below `after_step` is.
  absl::Status ForEachVersionAfter(
      const std::string& job, uint32_t rank, uint64_t after_step,
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

  // Lost versions, l/<job>/<rank:8>/<layer:8>/<step:16> (index_lost.cc):
  // MarkLost replaces the version record of `key` by `rec` in one write.
  absl::Status MarkLost(const VersionKey& key, const store::LostVersion& rec)
      ABSL_LOCKS_EXCLUDED(version_mu_);
  // The rank's lost versions by (layer, step); one seek when there are none.
  using LostMap = std::map<std::pair<uint32_t, uint64_t>, store::LostVersion>;
  absl::StatusOr<LostMap> LostVersions(const std::string& job, uint32_t rank);
  absl::Status DeleteLost(const VersionKey& key);

  // True from a failed write until a reopen succeeded: writes are refused
  // (RESOURCE_EXHAUSTED with kDiskFull after ENOSPC, else kIndex) while reads
  // go on.
  bool degraded() const { return degraded_.load(std::memory_order_relaxed); }
  // Writes that failed inside RocksDB, and reopens that made the index
  // writable again, since Open.
  uint64_t write_failures() const { return write_failures_.load(std::memory_order_relaxed); }
  uint64_t recoveries() const { return recoveries_.load(std::memory_order_relaxed); }
  // Index entries read since Open: every record a lookup returned and every
  // entry an iteration stepped over (the tests bound what one operation
  // reads with it, docs/scaling.md).
  uint64_t entries_read() const { return entries_read_.load(std::memory_order_relaxed); }

  // What RocksDB holds in memory: its memtables (records written since the
  // last flush, up to two write buffers), the block cache and the table
  // readers' index and filter blocks. 0 while the index is closed.
  uint64_t MemoryBytes() ABSL_LOCKS_EXCLUDED(db_mu_);

 private:
  Index(std::unique_ptr<rocksdb::DB> db, UniqueFd lock, std::string path, rocksdb::Env* env,
        std::shared_ptr<rocksdb::Logger> logger);
  // Stamps a new index with kIndexSchemaVersion; refuses a newer one.
  absl::Status CheckSchema(const std::string& path);
  absl::Status Put(const std::string& key, const std::string& value);
  absl::Status Delete(const std::string& key);
  absl::StatusOr<std::optional<std::string>> Get(const std::string& key);
  // Counts every version record (Open).
  absl::Status CountVersions() ABSL_LOCKS_EXCLUDED(version_mu_);
  // Adds `sign` x (one version of `file_bytes`) to the counts of `key`.
  void CountLocked(const VersionKey& key, int sign, uint64_t file_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(version_mu_);
  // Every RocksDB write goes through here, one at a time.
  absl::Status Write(const rocksdb::WriteOptions& wo, rocksdb::WriteBatch* batch,
                     absl::string_view what) ABSL_LOCKS_EXCLUDED(write_mu_, db_mu_);
  // Closes and reopens a degraded database. OK when it is writable again.
  absl::Status ReopenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(db_mu_);

  // Immutable.
  UniqueFd lock_;  // released after db_ is closed (declared first)
  const std::string path_;
  rocksdb::Env* const env_;                        // null = RocksDB's default
  const std::shared_ptr<rocksdb::Logger> logger_;  // RocksDB's info log -> ckptd's log

  // Lock order: version_mu_ -> write_mu_ -> db_mu_. Readers and writers
  // hold db_mu_ shared while they use db_; a reopen holds it exclusively.
  // version_mu_ makes a version record's write and its count one step.
  mutable absl::Mutex version_mu_ ABSL_ACQUIRED_BEFORE(write_mu_);
  std::map<std::pair<std::string, uint32_t>, RankVersions> versions_ ABSL_GUARDED_BY(version_mu_);
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(db_mu_);
  absl::Mutex db_mu_;
  std::unique_ptr<rocksdb::DB> db_ ABSL_GUARDED_BY(db_mu_);  // null only if a reopen failed twice
  bool read_only_ ABSL_GUARDED_BY(db_mu_) = false;
  absl::Status broken_by_ ABSL_GUARDED_BY(write_mu_);  // the failed write; OK when writable
  std::atomic<bool> degraded_{false};  // mirrors !broken_by_.ok(), for lock-free reads
  std::atomic<uint64_t> write_failures_{0};
  std::atomic<uint64_t> recoveries_{0};
  mutable std::atomic<uint64_t> entries_read_{0};
};

}  // namespace ckpt
