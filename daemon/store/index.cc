#include "daemon/store/index.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat("rocksdb ", what, ": ", s.ToString());
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsNoSpace()) return WithReason(absl::ResourceExhaustedError(msg), ErrorReason::kDiskFull);
  return WithReason(absl::InternalError(msg), ErrorReason::kIndex);
}

std::string RankPrefix(char kind, const std::string& job, uint32_t rank) {
  return absl::StrFormat("%c/%s/%08x/", kind, job, rank);
}
std::string VersionKeyString(const VersionKey& k) {
  return absl::StrFormat("v/%s/%08x/%08x/%016x", k.job, k.rank, k.layer, k.step);
}
std::string EventKey(const std::string& job, uint32_t rank, uint64_t step) {
  return absl::StrFormat("e/%s/%08x/%016x", job, rank, step);
}

// Only the canonical form the writers produce (fixed width, lower case, no
// sign or "0x"): any other spelling would parse to a number whose canonical
// key is a different key, so deleting "it" would delete nothing.
bool IsLowerHex(absl::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}
bool ParseHex32(absl::string_view s, uint32_t* out) {
  if (s.size() != 8 || !IsLowerHex(s)) return false;
  return absl::SimpleHexAtoi(s, out);
}
bool ParseHex64(absl::string_view s, uint64_t* out) {
  if (s.size() != 16 || !IsLowerHex(s)) return false;
  return absl::SimpleHexAtoi(s, out);
}

// "<layer:8>/<step:16>", the end of a version key.
bool ParseLayerStep(absl::string_view rest, uint32_t* layer, uint64_t* step) {
  return rest.size() == 25 && ParseHex32(rest.substr(0, 8), layer) &&
         ParseHex64(rest.substr(9), step);
}

// Counts one more version of `layer` in `r`.
void AddVersion(Index::RankVersions& r, uint32_t layer, uint64_t file_bytes) {
  if (r.layers.size() <= layer) r.layers.resize(static_cast<size_t>(layer) + 1);
  ++r.layers[layer].versions;
  r.layers[layer].file_bytes += file_bytes;
  ++r.total.versions;
  r.total.file_bytes += file_bytes;
}

template <typename Msg>
absl::StatusOr<Msg> ParseRecord(const rocksdb::Slice& v, absl::string_view key) {
  Msg m;
  if (!m.ParseFromArray(v.data(), static_cast<int>(v.size()))) {
    return absl::DataLossError(absl::StrCat("index record ", key, " does not parse"));
  }
  return m;
}

absl::Mutex g_generation_mu;

absl::Status IndexClosed() {
  return WithReason(absl::UnavailableError(
                        "the index could not be reopened after a write failure; it is retried "
                        "at the next write"),
                    ErrorReason::kIndex);
}

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
      return absl::FailedPreconditionError(
          absl::StrCat("the index ", path, " is in use by another ckptd (", lock_path, " is locked)"));
    }
    return ErrnoStatus(errno, absl::StrCat("flock ", lock_path));
  }
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, path, &raw);
  CKPT_RETURN_IF_ERROR(FromRocks(s, absl::StrCat("open ", path)));
  std::unique_ptr<Index> index(new Index(std::unique_ptr<rocksdb::DB>(raw), std::move(lock), path,
                                         env, std::move(logger)));
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
    return absl::DataLossError(absl::StrCat("index ", path, ": schema version '", *v, "' is corrupt"));
  }
  if (version > kIndexSchemaVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "index ", path, " has schema version ", version, "; this ckptd reads up to ",
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

namespace {
constexpr char kCleanStopKey[] = "m/clean_stop";
}  // namespace

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
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    entries_read_.fetch_add(1, std::memory_order_relaxed);
    uint32_t r;
    if (ParseHex32(absl::string_view(it->key().data() + prefix.size(), it->key().size() - prefix.size()), &r)) {
      ranks.push_back(r);
    }
  }
  CKPT_RETURN_IF_ERROR(FromRocks(it->status(), "list ranks"));
  return ranks;
}

absl::Status Index::PutVersion(const VersionKey& key, const store::VersionRecord& rec) {
  return PutVersions({key}, {rec});
}

absl::Status Index::PutVersions(const std::vector<VersionKey>& keys,
                                const std::vector<store::VersionRecord>& records) {
  if (keys.size() != records.size()) {
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " version keys for ",
                                                   records.size(), " records"));
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
  if (r.layers.size() <= key.layer) r.layers.resize(static_cast<size_t>(key.layer) + 1);
  VersionCount& l = r.layers[key.layer];
  auto sub = [](uint64_t& v, uint64_t d) { v = v > d ? v - d : 0; };
  sub(l.versions, 1);
  sub(l.file_bytes, file_bytes);
  sub(r.total.versions, 1);
  sub(r.total.file_bytes, file_bytes);
  if (r.total.versions == 0) versions_.erase(it);
}

absl::Status Index::CountVersions() {
  absl::MutexLock lock(&version_mu_);
  versions_.clear();
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  // v/<job>/<rank:8>/<layer:8>/<step:16>; consecutive records are mostly of
  // one rank, whose entry is looked up once per run.
  RankVersions* current = nullptr;
  std::string current_job;
  uint32_t current_rank = 0;
  for (it->Seek("v/"); it->Valid() && it->key().starts_with("v/"); it->Next()) {
    absl::string_view k(it->key().data(), it->key().size());
    if (k.size() < 2 + 1 + 1 + 8 + 1 + 8 + 1 + 16) continue;  // not a version key: not counted
    const absl::string_view tail = k.substr(k.size() - (8 + 1 + 8 + 1 + 16));  // <rank>/<layer>/<step>
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
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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
  CKPT_ASSIGN_OR_RETURN(store::VersionRecord rec, ParseRecord<store::VersionRecord>(it->value(), k));
  return Result(std::make_pair(step, std::move(rec)));
}

absl::Status Index::ForEachVersion(
    const std::string& job, uint32_t rank, int64_t layer,
    const std::function<bool(const VersionKey&, const store::VersionRecord&)>& fn) {
  const std::string prefix = layer < 0 ? absl::StrFormat("v/%s/%08x/", job, rank)
                                       : absl::StrFormat("v/%s/%08x/%08x/", job, rank,
                                                         static_cast<uint32_t>(layer));
  const size_t rank_prefix = absl::StrFormat("v/%s/%08x/", job, rank).size();
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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

absl::Status Index::PutEvent(const std::string& job, uint32_t rank, uint64_t step,
                             const store::EventRecord& rec) {
  return Put(EventKey(job, rank, step), rec.SerializeAsString());
}

absl::Status Index::PutEvents(const std::string& job, uint32_t rank,
                              const std::vector<std::pair<uint64_t, store::EventRecord>>& events) {
  rocksdb::WriteBatch batch;
  for (const auto& [step, rec] : events) batch.Put(EventKey(job, rank, step), rec.SerializeAsString());
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
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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

absl::Status Index::ForEachEvent(const std::string& job, uint32_t rank, bool newest_first,
                                 const std::function<bool(uint64_t, const store::EventRecord&)>& fn) {
  const std::string prefix = RankPrefix('e', job, rank);
  absl::ReaderMutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return IndexClosed();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
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
