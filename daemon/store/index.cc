// Index (index.h): opening the database under its lock, the schema stamp,
// the one writer every write goes through and the degraded state after a
// failed one, and the m/ keys (the generation counter, the clean-stop mark).
// Jobs and ranks are in index_records.cc, version records and their counts
// in index_versions.cc, events in index_events.cc.
#include "daemon/store/index.h"

#include <fcntl.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/store/index_internal.h"

namespace ckpt {

using index_internal::FromRocks;
using index_internal::IndexClosed;

namespace {

// Makes the read and the write of m/generation one step (NextGeneration,
// RaiseGeneration).
absl::Mutex g_generation_mu;
constexpr char kCleanStopKey[] = "m/clean_stop";

// RocksDB's info log, into ckptd's log: warnings and errors only (background
// errors, recovery), and never a file on the data file system (see index.h).
class RocksLogger : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel()) return;
    char buf[1024];
    std::vsnprintf(buf, sizeof(buf), format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      CKPT_LOG(ERROR) << "rocksdb: " << buf;
    } else {
      CKPT_LOG(WARNING) << "rocksdb: " << buf;
    }
  }
};

rocksdb::Options MakeOptions(rocksdb::Env* env, const std::shared_ptr<rocksdb::Logger>& logger) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.paranoid_checks = true;
  // Every write is synced before it is acknowledged, so only a record torn by
  // a crash mid-write may be dropped; any other WAL damage must fail the open.
  // (The default, point-in-time recovery, silently rolled acknowledged records
  // back, and start-up reconciliation then deleted their files as orphans.)
  options.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  options.max_background_jobs = 2;
  options.keep_log_file_num = 4;
  options.max_log_file_size = 8 << 20;
  options.info_log = logger;
  if (env != nullptr) options.env = env;
  return options;
}

}  // namespace

Index::Index(std::unique_ptr<rocksdb::DB> db, UniqueFd lock, std::string path, rocksdb::Env* env,
             std::shared_ptr<rocksdb::Logger> logger)
    : lock_(std::move(lock)),
      path_(std::move(path)),
      env_(env),
      logger_(std::move(logger)),
      db_(std::move(db)) {}

Index::~Index() {
  absl::MutexLock lock(&db_mu_);
  if (db_ != nullptr) IgnoreError(FromRocks(db_->Close(), "close"), "nothing to do about it now");
  db_.reset();
}

absl::StatusOr<std::unique_ptr<Index>> Index::Open(const std::string& path, rocksdb::Env* env) {
  std::shared_ptr<rocksdb::Logger> logger = std::make_shared<RocksLogger>();
  const rocksdb::Options options = MakeOptions(env, logger);
  // One holder at a time. flock conflicts between two open file descriptions
  // even within one process, so a second Index of this process is refused as
  // well as another ckptd.
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("create ", path));
  }
  const std::string lock_path = path + "/ckptd.lock";
  UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock.valid()) return ErrnoStatus(errno, absl::StrCat("open ", lock_path));
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the index ", path, " is in use by another ckptd (", lock_path, " is locked)"));
    }
    return ErrnoStatus(errno, absl::StrCat("flock ", lock_path));
  }
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, path, &raw);
  CKPT_RETURN_IF_ERROR(FromRocks(s, absl::StrCat("open ", path)));
  std::unique_ptr<Index> index(
      new Index(std::unique_ptr<rocksdb::DB>(raw), std::move(lock), path, env, std::move(logger)));
  CKPT_RETURN_IF_ERROR(index->CheckSchema(path));
  CKPT_RETURN_IF_ERROR(index->CountVersions());
  return index;
}

absl::Status Index::Write(const rocksdb::WriteOptions& wo, rocksdb::WriteBatch* batch,
                          absl::string_view what) {
  // One write at a time: RocksDB would otherwise group concurrent writers and
  // a follower's batch could reach a WAL that just failed (index.h). This
  // also makes the hand-over between writers visible to ThreadSanitizer,
  // which does not see the atomics inside the uninstrumented library.
  absl::MutexLock lock(&write_mu_);
  if (!broken_by_.ok()) CKPT_RETURN_IF_ERROR(ReopenLocked());
  rocksdb::Status s;
  {
    absl::ReaderMutexLock db_lock(&db_mu_);
    if (db_ == nullptr) return IndexClosed();
    s = db_->Write(wo, batch);
  }
  absl::Status status = FromRocks(s, what);
  if (!status.ok()) {
    // RocksDB has stopped writes (a background error) or its WAL writer is
    // spent: no write reaches it again before a reopen.
    write_failures_.fetch_add(1, std::memory_order_relaxed);
    broken_by_ = status;
    degraded_.store(true, std::memory_order_relaxed);
    CKPT_LOG(ERROR) << "index " << path_ << ": write failed; index writes are refused until it "
                    << "reopens (reads go on): " << status;
  }
  return status;
}

absl::Status Index::ReopenLocked() {
  const rocksdb::Options options = MakeOptions(env_, logger_);
  absl::WriterMutexLock db_lock(&db_mu_);
  if (db_ != nullptr) {
    // The spent WAL writer is not flushed again (RocksDB skips a writer that
    // saw an error); what it failed to write was never acknowledged.
    IgnoreError(FromRocks(db_->Close(), "close"), "the failed write is reported already");
    db_.reset();
  }
  rocksdb::DB* raw = nullptr;
  absl::Status s = FromRocks(rocksdb::DB::Open(options, path_, &raw), "reopen");
  if (s.ok()) {
    db_.reset(raw);
    read_only_ = false;
    broken_by_ = absl::OkStatus();
    degraded_.store(false, std::memory_order_relaxed);
    recoveries_.fetch_add(1, std::memory_order_relaxed);
    CKPT_LOG(WARNING) << "index " << path_ << ": reopened after a write failure; writable again";
    return absl::OkStatus();
  }
  // Still no room (or another failure): keep serving reads from a read-only
  // instance, which writes nothing.
  raw = nullptr;
  if (FromRocks(rocksdb::DB::OpenForReadOnly(options, path_, &raw), "open read-only").ok()) {
    db_.reset(raw);
    read_only_ = true;
  }
  return WithReason(absl::Status(s.code(), absl::StrCat("the index refuses writes since a write "
                                                        "failed; reopening it failed: ",
                                                        s.message())),
                    ReasonOf(s) == ErrorReason::kUnspecified ? ErrorReason::kIndex : ReasonOf(s));
}

absl::Status Index::Put(const std::string& key, const std::string& value) {
  rocksdb::WriteBatch batch;
  batch.Put(key, value);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return Write(wo, &batch, absl::StrCat("put ", key));
}

absl::Status Index::Delete(const std::string& key) {
  rocksdb::WriteBatch batch;
  batch.Delete(key);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return Write(wo, &batch, absl::StrCat("delete ", key));
}

absl::StatusOr<std::optional<std::string>> Index::Get(const std::string& key) {
  std::string v;
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &v);
  entries_read_.fetch_add(1, std::memory_order_relaxed);
  if (s.IsNotFound()) return std::optional<std::string>();
  CKPT_RETURN_IF_ERROR(FromRocks(s, absl::StrCat("get ", key)));
  return std::optional<std::string>(std::move(v));
}

absl::Status Index::CheckSchema(const std::string& path) {
  constexpr absl::string_view kKey = "m/schema_version";
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get(std::string(kKey)));
  if (!v.has_value()) return Put(std::string(kKey), absl::StrCat(kIndexSchemaVersion));
  uint32_t version = 0;
  if (!absl::SimpleAtoi(*v, &version)) {
    return absl::DataLossError(
        absl::StrCat("index ", path, ": schema version '", *v, "' is corrupt"));
  }
  if (version > kIndexSchemaVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("index ", path, " has schema version ", version, "; this ckptd reads up to ",
                     kIndexSchemaVersion, " (it was written by a newer ckptd)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Index::NextGeneration() {
  absl::MutexLock lock(&g_generation_mu);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get("m/generation"));
  uint64_t next = 1;
  if (v.has_value() && !absl::SimpleAtoi(*v, &next)) {
    return absl::DataLossError("index generation counter is corrupt");
  }
  CKPT_RETURN_IF_ERROR(Put("m/generation", absl::StrCat(next + 1)));
  return next;
}

absl::Status Index::RaiseGeneration(uint64_t used) {
  absl::MutexLock lock(&g_generation_mu);
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get("m/generation"));
  uint64_t next = 1;
  if (v.has_value() && !absl::SimpleAtoi(*v, &next)) {
    return absl::DataLossError("index generation counter is corrupt");
  }
  if (next > used) return absl::OkStatus();
  return Put("m/generation", absl::StrCat(used + 1));
}

absl::Status Index::MarkCleanStop() {
  uint64_t before = 0;
  {
    absl::ReaderMutexLock db_lock(&db_mu_);
    if (db_ == nullptr) return IndexClosed();
    before = db_->GetLatestSequenceNumber();
  }
  return Put(kCleanStopKey, absl::StrCat(before));
}

absl::StatusOr<bool> Index::CleanStop() {
  CKPT_ASSIGN_OR_RETURN(std::optional<std::string> v, Get(kCleanStopKey));
  uint64_t before = 0;
  if (!v.has_value() || !absl::SimpleAtoi(*v, &before)) return false;
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  // The mark's own write is one sequence number; any later write moves it on.
  return db_->GetLatestSequenceNumber() == before + 1;
}

uint64_t Index::MemoryBytes() {
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return 0;
  uint64_t sum = 0;
  for (const char* p : {"rocksdb.cur-size-all-mem-tables", "rocksdb.block-cache-usage",
                        "rocksdb.estimate-table-readers-mem"}) {
    uint64_t v = 0;
    if (db_->GetIntProperty(p, &v)) sum += v;
  }
  return sum;
}

}  // namespace ckpt
