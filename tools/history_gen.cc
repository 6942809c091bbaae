// ckpt_history_gen: grows the history of one rank in a stopped ckptd's data
// directory to a given number of committed layer versions, faster than a
// trainer can (for the history-length sweep, tests/perf/sweep.py).
//
// Every version goes through ckptd's own commit code (LayerStore::Commit:
// the file format, the temp file, the rename, the RocksDB record) and every
// step gets its checkpoint event (Index::PutEvents), so the data directory is
// what ckptd would have written for the same steps. Only the durability
// barriers differ: the per-version fdatasync, directory fsync and synchronous
// RocksDB write are skipped, and one syncfs(2) at the end makes it all
// durable at once. A ckptd started on the directory afterwards reads it like
// any other.
//
// The rank's layers match ckpt_scale_trainer's with the same --layers,
// --tensors and --tensor-bytes ("layers.<l>", tensors "t<i>" of u8), so a
// scale trainer can register it and restore from it. Each step writes
// --per-step layers, rotating (all of them when 0). The history continues
// after the rank's newest event, so calling it again with a larger
// --versions extends it.
//
// Usage: ckpt_history_gen --data-dir=DIR --job=ID [--rank=R] --versions=N
//        [--layers=100] [--tensors=1] [--tensor-bytes=256] [--per-step=0]
#include <fcntl.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "tools/flags.h"

namespace {

// The file system ckptd uses, without the per-version durability barriers
// (one syncfs at the end replaces them).
class DeferredSyncFileSystem final : public ckpt::FileSystem {
 public:
  absl::Status DataSync(int) override { return absl::OkStatus(); }
  absl::Status SyncDir(int) override { return absl::OkStatus(); }
};

// RocksDB's files, likewise: Sync and Fsync do nothing.
class NoSyncFile final : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  explicit NoSyncFile(std::unique_ptr<rocksdb::FSWritableFile>&& f)
      : rocksdb::FSWritableFileOwnerWrapper(std::move(f)) {}
  rocksdb::IOStatus Sync(const rocksdb::IOOptions&, rocksdb::IODebugContext*) override {
    return rocksdb::IOStatus::OK();
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions&, rocksdb::IODebugContext*) override {
    return rocksdb::IOStatus::OK();
  }
  rocksdb::IOStatus RangeSync(uint64_t, uint64_t, const rocksdb::IOOptions&,
                              rocksdb::IODebugContext*) override {
    return rocksdb::IOStatus::OK();
  }
};

class NoSyncRocksFs final : public rocksdb::FileSystemWrapper {
 public:
  NoSyncRocksFs() : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  const char* Name() const override { return "NoSyncRocksFs"; }
  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* d) override {
    std::unique_ptr<rocksdb::FSWritableFile> inner;
    rocksdb::IOStatus s = target()->NewWritableFile(f, o, &inner, d);
    if (s.ok()) *r = std::make_unique<NoSyncFile>(std::move(inner));
    return s;
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* d) override {
    std::unique_ptr<rocksdb::FSWritableFile> inner;
    rocksdb::IOStatus s = target()->ReopenWritableFile(f, o, &inner, d);
    if (s.ok()) *r = std::make_unique<NoSyncFile>(std::move(inner));
    return s;
  }
};

struct Args {
  std::string data_dir;
  std::string job = "hist";
  uint32_t rank = 0;
  uint64_t versions = 0;
  uint32_t layers = 100;
  uint32_t tensors = 1;
  uint64_t tensor_bytes = 256;
  uint32_t per_step = 0;
};

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k == "--data-dir")
      a->data_dir = v;
    else if (k == "--job")
      a->job = v;
    else if (k == "--rank")
      ok = absl::SimpleAtoi(v, &a->rank);
    else if (k == "--versions")
      ok = absl::SimpleAtoi(v, &a->versions);
    else if (k == "--layers")
      ok = absl::SimpleAtoi(v, &a->layers) && a->layers > 0;
    else if (k == "--tensors")
      ok = absl::SimpleAtoi(v, &a->tensors) && a->tensors > 0;
    else if (k == "--tensor-bytes")
      ok = absl::SimpleAtoi(v, &a->tensor_bytes) && a->tensor_bytes > 0;
    else if (k == "--per-step")
      ok = absl::SimpleAtoi(v, &a->per_step);
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr, "ckpt_history_gen: bad argument '%s'\n", argv[i]);
      return false;
    }
  }
  return !a->data_dir.empty() && a->versions > 0;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "ckpt_history_gen: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

// The data directory open as ckptd opens it, without the per-version
// durability barriers; members in the order they are made (and destroyed
// in reverse).
struct DataDir {
  std::shared_ptr<NoSyncRocksFs> rocks_fs;
  std::unique_ptr<rocksdb::Env> env;
  DeferredSyncFileSystem fs;
  std::unique_ptr<ckpt::Index> index;
  std::unique_ptr<ckpt::LayerStore> store;
  std::unique_ptr<ckpt::IoBackend> io;
  std::unique_ptr<ckpt::StagingPool> pool;
};

// Makes or opens the data directory as ckptd does: <dir>/index, then the
// store; and the backend and staging pool the commits use.
int Open(const Args& a, DataDir* d) {
  d->rocks_fs = std::make_shared<NoSyncRocksFs>();
  d->env = rocksdb::NewCompositeEnv(d->rocks_fs);
  if (absl::StatusOr<ckpt::UniqueFd> dir = d->fs.MakeDirs(a.data_dir); !dir.ok()) {
    return Fail("data dir", dir.status());
  }
  absl::StatusOr<std::unique_ptr<ckpt::Index>> index =
      ckpt::Index::Open(a.data_dir + "/index", d->env.get());
  if (!index.ok()) return Fail("index", index.status());
  d->index = std::move(*index);
  // Buffered writes (the bytes are the same; O_DIRECT would wait for the
  // device on every version).
  d->store = std::make_unique<ckpt::LayerStore>(a.data_dir, &d->fs, d->index.get(),
                                                /*use_direct_io=*/false);
  if (absl::Status s = d->store->Init(); !s.ok()) return Fail("store", s);
  absl::StatusOr<std::unique_ptr<ckpt::IoBackend>> io =
      ckpt::MakeIoBackend(ckpt::IoBackendKind::kPwrite, 1);
  if (!io.ok()) return Fail("io", io.status());
  d->io = std::move(*io);
  ckpt::StagingPoolOptions po;
  po.budget_bytes = 64 << 20;
  po.chunk_bytes = 1 << 20;
  po.lock_memory = false;
  absl::StatusOr<std::unique_ptr<ckpt::StagingPool>> pool = ckpt::StagingPool::Create(po);
  if (!pool.ok()) return Fail("pool", pool.status());
  d->pool = std::move(*pool);
  return 0;
}

// The rank's layers as a registration describes them: its table's layer
// and the header of its files.
void DescribeLayer(const Args& a, uint32_t l, uint64_t generation, ckpt::store::LayerSpec* spec,
                   ckpt::store::LayerFileHeader* h) {
  spec->set_id(l);
  spec->set_name(absl::StrCat("layers.", l));
  spec->set_kind(ckpt::store::LAYER_BLOCK);
  h->set_job_id(a.job);
  h->set_rank(a.rank);
  h->set_layer(l);
  h->set_layer_name(spec->name());
  h->set_generation(generation);
  for (uint32_t t = 0; t < a.tensors; ++t) {
    ckpt::store::TensorSpec* ts = spec->add_tensors();
    ts->set_name(absl::StrCat("t", t));
    ts->set_dtype(ckpt::store::DTYPE_U8);
    ts->add_shape(a.tensor_bytes);
    ts->set_nbytes(a.tensor_bytes);
    ts->set_role(ckpt::store::ROLE_PARAM);
    ts->set_offset(uint64_t{l} * a.tensors * a.tensor_bytes + uint64_t{t} * a.tensor_bytes);
    ckpt::store::TensorEntry* e = h->add_tensors();
    e->set_name(ts->name());
    e->set_dtype(ckpt::store::DTYPE_U8);
    e->add_shape(a.tensor_bytes);
    e->set_role(ckpt::store::ROLE_PARAM);
    e->set_nbytes(a.tensor_bytes);
  }
}

// The job and the rank's table, as a registration writes them; the
// generation and each layer's file header for the versions to come.
int RegisterRank(const Args& a, ckpt::Index* index, uint64_t* generation_out,
                 std::vector<ckpt::store::LayerFileHeader>* headers) {
  absl::StatusOr<std::optional<ckpt::store::JobRecord>> job = index->GetJob(a.job);
  if (!job.ok()) return Fail("job", job.status());
  if (!job->has_value()) {
    ckpt::store::JobRecord jr;
    jr.set_owner_uid(::getuid());
    jr.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
    if (absl::Status s = index->PutJob(a.job, jr); !s.ok()) return Fail("put job", s);
  }
  absl::StatusOr<uint64_t> generation = index->NextGeneration();
  if (!generation.ok()) return Fail("generation", generation.status());
  ckpt::store::RankRecord table;
  table.set_world_size(a.rank + 1);
  table.set_generation(*generation);
  headers->resize(a.layers);
  for (uint32_t l = 0; l < a.layers; ++l) {
    DescribeLayer(a, l, *generation, table.add_layers(), &(*headers)[l]);
  }
  if (absl::Status s = index->PutRank(a.job, a.rank, table); !s.ok()) return Fail("put rank", s);
  *generation_out = *generation;
  return 0;
}

// Where the history stands: the step of the newest event, and the versions so far.
int FindHistory(const Args& a, ckpt::Index* index, uint64_t* step, uint64_t* have) {
  auto last = index->EventAtOrBefore(a.job, a.rank, ~uint64_t{0});
  if (!last.ok()) return Fail("last event", last.status());
  *step = last->has_value() ? (*last)->first : 0;
  uint64_t versions = 0;
  if (absl::Status s = index->ForEachVersion(
          a.job, a.rank, -1,
          [&versions](const ckpt::VersionKey&, const ckpt::store::VersionRecord&) {
            ++versions;
            return true;
          });
      !s.ok()) {
    return Fail("count versions", s);
  }
  *have = versions;
  return 0;
}

// The history to --versions: each step commits up to `per_step` layers
// (rotating, or all of them) and writes the step's event.
class HistoryWriter {
 public:
  HistoryWriter(const Args& a, DataDir* d, uint64_t generation,
                const std::vector<ckpt::store::LayerFileHeader>& headers, uint64_t have)
      : a_(a),
        d_(d),
        generation_(generation),
        headers_(headers),
        have_(have),
        per_step_(a.per_step == 0 || a.per_step > a.layers ? a.layers : a.per_step) {}

  // Writes the steps after `*step` until the history holds --versions
  // versions; `*step` is the last one written. Returns 0 or the exit code.
  int Run(uint64_t* step) {
    while (have_ + written_ < a_.versions) {
      ++*step;
      if (int rc = WriteStep(*step); rc != 0) return rc;
    }
    return 0;
  }

  uint64_t written() const { return written_; }

 private:
  int WriteStep(uint64_t step) {
    ckpt::store::EventRecord event;
    event.set_lr(1e-4);
    const uint32_t first = static_cast<uint32_t>((step * per_step_) % a_.layers);
    for (uint32_t i = 0; i < per_step_ && have_ + written_ < a_.versions; ++i) {
      const uint32_t l = per_step_ == a_.layers ? i : (first + i) % a_.layers;
      if (int rc = CommitVersion(l, step, &event); rc != 0) return rc;
      ++written_;
    }
    event.set_unix_ms(absl::ToUnixMillis(absl::Now()));
    std::vector<std::pair<uint64_t, ckpt::store::EventRecord>> batch;
    batch.emplace_back(step, std::move(event));
    if (absl::Status s = d_->index->PutEvents(a_.job, a_.rank, batch); !s.ok()) {
      return Fail("event", s);
    }
    return 0;
  }

  // Layer l's version of `step` through the store's commit code, added to `event`.
  int CommitVersion(uint32_t l, uint64_t step, ckpt::store::EventRecord* event) {
    ckpt::StagedVersion v;
    v.key = ckpt::VersionKey{a_.job, a_.rank, l, step};
    v.generation = generation_;
    v.header = headers_[l];
    v.header.set_step(step);
    absl::StatusOr<ckpt::VersionLayout> layout = ckpt::PlanLayout(&v.header);
    if (!layout.ok()) return Fail("layout", layout.status());
    v.layout = *layout;
    absl::StatusOr<ckpt::StagingLease> lease =
        d_->pool->Acquire(layout->file_bytes, absl::InfiniteFuture());
    if (!lease.ok()) return Fail("lease", lease.status());
    v.lease = std::move(*lease);
    // The payload: the step number in the first word of each tensor.
    for (const ckpt::store::TensorEntry& t : v.header.tensors()) {
      v.lease.Zero(v.layout.header_bytes + t.offset(), t.nbytes());
      v.lease.CopyIn(v.layout.header_bytes + t.offset(), &step,
                     std::min<uint64_t>(sizeof(step), t.nbytes()));
    }
    absl::StatusOr<ckpt::store::VersionRecord> rec = d_->store->Commit(&v, d_->io.get());
    if (!rec.ok()) return Fail(absl::StrCat("commit layer ", l, " step ", step), rec.status());
    event->add_layers(l);
    event->set_bytes(event->bytes() + v.layout.payload_bytes);
    return 0;
  }

  const Args& a_;
  DataDir* const d_;
  const uint64_t generation_;
  const std::vector<ckpt::store::LayerFileHeader>& headers_;
  const uint64_t have_;
  const uint32_t per_step_;
  uint64_t written_ = 0;
};

// Closes RocksDB (its memtable stays in the WAL), then one barrier for
// everything written.
int SyncAll(const Args& a, DataDir* d) {
  d->index.reset();
  int dfd = ::open(a.data_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::syncfs(dfd) != 0) {
    std::perror("syncfs");
    return 1;
  }
  ::close(dfd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: ckpt_history_gen --data-dir=DIR --job=ID [--rank=R] --versions=N "
                 "[--layers=N] [--tensors=T] [--tensor-bytes=B] [--per-step=K]\n");
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  DataDir d;
  if (int rc = Open(a, &d); rc != 0) return rc;
  uint64_t generation = 0;
  std::vector<ckpt::store::LayerFileHeader> headers;
  if (int rc = RegisterRank(a, d.index.get(), &generation, &headers); rc != 0) return rc;
  uint64_t step = 0, have = 0;
  if (int rc = FindHistory(a, d.index.get(), &step, &have); rc != 0) return rc;
  HistoryWriter writer(a, &d, generation, headers, have);
  if (int rc = writer.Run(&step); rc != 0) return rc;
  if (int rc = SyncAll(a, &d); rc != 0) return rc;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"versions\": %" PRIu64 ", \"written\": %" PRIu64 ", \"last_step\": %" PRIu64
              ", \"seconds\": %.3f}\n",
              have + writer.written(), writer.written(), step, s);
  return 0;
}
