// ckpt_bench: write-path and restore-path benchmark. In one process and on
// one directory it alternates rounds of
//   A  the daemon's real commit path (LayerStore::Write from a StagingPool:
//      checksums, header, O_DIRECT writes, fdatasync, on `writers` threads;
//      then a Publisher: renames, one dir fsync per rank directory and one
//      RocksDB sync batch per group, as ckptd commits), the versions spread
//      over `ranks` ranks (--commit=serial: LayerStore::Commit per version
//      on the writers, the whole protocol one version at a time), and
//   B  a raw baseline: the same bytes written sequentially with O_DIRECT by
//      `writers` threads, one file each, through the same IoBackend kind,
//      chunk size and queue depth, then fdatasync;
// then, on the versions A committed,
//   C  the daemon's restore path (RestoreInto: index lookups, O_DIRECT reads,
//      every checksum, copies into a freshly mapped memfd per rank, as after
//      a trainer's new registration), one restore per rank at once, and
//   D  a raw baseline: B's files read back with O_DIRECT by one thread per
//      rank, each a contiguous share, through the same IoBackend kind, chunk
//      size and queue depth (one queue kept full across a whole share: the
//      most a reader gets from this disk);
// and reports the median throughput of each and the median per-round ratios.
// Staging buffers are filled before the clock starts; cleanup is not timed.
#include <fcntl.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/region.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/publisher.h"
#include "nlohmann/json.hpp"

namespace {

using ckpt::AlignUp;
using Json = nlohmann::json;

constexpr char kUsage[] =
    R"(usage: ckpt_bench --dir=PATH [--total-bytes=SIZE] [--layer-bytes=SIZE] [--writers=N]
                  [--ranks=N] [--queue-depth=N] [--chunk-bytes=SIZE]
                  [--backend=auto|io_uring|pwrite] [--commit=grouped|serial] [--rounds=N]
                  [--no-restore] [--json]

Compares ckptd's layer-version commit path with raw O_DIRECT writes of the
same bytes, and ckptd's restore path with raw O_DIRECT reads of the files it
wrote, on the same directory (created when missing; the benchmark removes
what it writes). SIZE takes a K, M or G suffix (powers of 1024).

  --dir=PATH          directory on the disk under test (required)
  --total-bytes=SIZE  bytes written per path per round (default 2G)
  --layer-bytes=SIZE  payload of one layer version (default 64M)
  --writers=N         layer versions / raw files in flight (default 2)
  --ranks=N           ranks the versions belong to; restores run one per rank
                      at once (default 1)
  --queue-depth=N     I/O queue depth per writer (default 16)
  --chunk-bytes=SIZE  staging chunk = I/O segment size, multiple of 4096 (default 4M)
  --backend=KIND      auto, io_uring or pwrite (default auto)
  --commit=HOW        grouped: writers write, one publisher makes groups of
                      versions durable and visible, as ckptd does (default);
                      serial: each writer runs the whole protocol per version
  --rounds=N          A/B rounds, alternating which path goes first (default 3)
  --no-restore        measure the write paths only
  --json              one JSON object on stdout

GB/s are 10^9 payload bytes per second. Exit: 0 ok, 1 benchmark failed, 2 usage.
)";

struct Args {
  std::string dir;
  uint64_t total_bytes = uint64_t{2} << 30;
  uint64_t layer_bytes = uint64_t{64} << 20;
  uint32_t writers = 2;
  uint32_t queue_depth = 16;
  uint64_t chunk_bytes = uint64_t{4} << 20;
  std::string backend = "auto";
  uint32_t rounds = 3;
  uint32_t ranks = 1;
  bool restore = true;
  bool serial_commit = false;
  bool json = false;
};

// Digits with an optional K/M/G suffix; no sign, no spaces, no overflow.
bool ParseSize(absl::string_view s, uint64_t* out) {
  uint64_t mult = 1;
  if (!s.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(s.back()))) {
      case 'K':
        mult = uint64_t{1} << 10;
        break;
      case 'M':
        mult = uint64_t{1} << 20;
        break;
      case 'G':
        mult = uint64_t{1} << 30;
        break;
      default:
        break;
    }
    if (mult != 1) s.remove_suffix(1);
  }
  if (s.empty() || s.size() > 20) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v > UINT64_MAX / mult) return false;
  *out = v * mult;
  return true;
}

bool ParseCount(absl::string_view s, uint32_t lo, uint32_t hi, uint32_t* out) {
  if (s.empty() || s.size() > 10) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v < lo || v > hi) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

absl::Status ParseArgs(int argc, char** argv, Args* a, bool* help) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      *help = true;
      continue;
    }
    if (arg == "--json") {
      a->json = true;
      continue;
    }
    if (arg == "--no-restore") {
      a->restore = false;
      continue;
    }
    size_t eq = arg.find('=');
    if (!absl::StartsWith(arg, "--") || eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument '", arg, "'"));
    }
    absl::string_view k = arg.substr(0, eq), v = arg.substr(eq + 1);
    bool ok = true;
    if (k == "--dir") {
      a->dir = std::string(v);
      ok = !v.empty();
    } else if (k == "--total-bytes") {
      ok = ParseSize(v, &a->total_bytes) && a->total_bytes > 0;
    } else if (k == "--layer-bytes") {
      ok = ParseSize(v, &a->layer_bytes) && a->layer_bytes > 0 &&
           a->layer_bytes <= (uint64_t{1} << 40);
    } else if (k == "--writers") {
      ok = ParseCount(v, 1, 256, &a->writers);
    } else if (k == "--ranks") {
      ok = ParseCount(v, 1, 64, &a->ranks);
    } else if (k == "--queue-depth") {
      ok = ParseCount(v, 1, 4096, &a->queue_depth);
    } else if (k == "--chunk-bytes") {
      ok = ParseSize(v, &a->chunk_bytes) && a->chunk_bytes > 0 &&
           a->chunk_bytes % ckpt::kDirectAlignment == 0 && a->chunk_bytes <= (uint64_t{1} << 30);
    } else if (k == "--backend") {
      a->backend = std::string(v);
      ok = ckpt::ParseIoBackendKind(a->backend).ok();
    } else if (k == "--commit") {
      ok = v == "grouped" || v == "serial";
      a->serial_commit = v == "serial";
    } else if (k == "--rounds") {
      ok = ParseCount(v, 1, 1000, &a->rounds);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", k, "'"));
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("bad value for ", k, ": '", v, "'"));
  }
  if (*help) return absl::OkStatus();
  if (a->dir.empty()) return absl::InvalidArgumentError("--dir is required");
  if (a->total_bytes < a->layer_bytes) {
    return absl::InvalidArgumentError("--total-bytes must be at least --layer-bytes");
  }
  if (a->total_bytes / a->layer_bytes < a->ranks) {
    return absl::InvalidArgumentError("--total-bytes must hold one --layer-bytes version per rank");
  }
  return absl::OkStatus();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string HumanBytes(uint64_t b) {
  if (b % (uint64_t{1} << 30) == 0) return absl::StrCat(b >> 30, " GiB");
  if (b % (uint64_t{1} << 20) == 0) return absl::StrCat(b >> 20, " MiB");
  if (b % (uint64_t{1} << 10) == 0) return absl::StrCat(b >> 10, " KiB");
  return absl::StrCat(b, " B");
}

// Runs fn(w) on `n` threads and returns the wall time from releasing them all
// at once until the last one returned and then `after()` did. Thread
// start-up is not timed.
template <typename Fn, typename After = void (*)()>
absl::Duration TimeThreads(uint32_t n, Fn fn, After after = [] {}) {
  absl::Notification go;
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < n; ++w) {
    threads.emplace_back([&go, &fn, w] {
      go.WaitForNotification();
      fn(w);
    });
  }
  absl::Time start = absl::Now();
  go.Notify();
  for (std::thread& t : threads) t.join();
  after();
  return absl::Now() - start;
}

// User plus system CPU time of this process so far, its io_uring workers
// included (they are threads of it).
double ProcessCpuSeconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& tv) { return static_cast<double>(tv.tv_sec) + tv.tv_usec / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

class Bench {
 public:
  explicit Bench(const Args& a) : a_(a), fs_(ckpt::DefaultFileSystem()) {}

  absl::Status Setup() {
    CKPT_ASSIGN_OR_RETURN(ckpt::IoBackendKind kind, ckpt::ParseIoBackendKind(a_.backend));
    CKPT_ASSIGN_OR_RETURN(dir_fd_, fs_->MakeDirs(a_.dir));
    versions_ = a_.total_bytes / a_.layer_bytes;
    bytes_per_round_ = versions_ * a_.layer_bytes;

    // One backend per writer thread, shared by both paths (same kind, same depth).
    for (uint32_t w = 0; w < a_.writers; ++w) {
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ckpt::IoBackend> io,
                            ckpt::MakeIoBackend(kind, a_.queue_depth));
      io_.push_back(std::move(io));
    }

    // The layout every version shares: one u8 tensor of layer_bytes.
    header_.set_job_id("bench");
    header_.set_rank(0);
    header_.set_generation(1);
    ckpt::store::TensorEntry* t = header_.add_tensors();
    t->set_name("w");
    t->set_dtype(ckpt::store::DTYPE_U8);
    t->add_shape(a_.layer_bytes);
    t->set_nbytes(a_.layer_bytes);
    CKPT_ASSIGN_OR_RETURN(layout_, ckpt::PlanLayout(&header_));

    CKPT_ASSIGN_OR_RETURN(uint64_t free_bytes, fs_->FreeBytes(dir_fd_.get()));
    const uint64_t need = versions_ * layout_.file_bytes + a_.writers * a_.chunk_bytes;
    if (free_bytes < need) {
      return absl::ResourceExhaustedError(absl::StrCat(
          a_.dir, " has ", free_bytes, " free bytes; one round needs about ", need));
    }

    // Staging: pre-faulted at creation; each writer holds one lease for the run.
    const uint64_t lease_bytes = AlignUp(layout_.file_bytes, a_.chunk_bytes);
    ckpt::StagingPoolOptions po;
    po.chunk_bytes = a_.chunk_bytes;
    // Writers hold two leases each; a restore holds up to kRestoreLeases per
    // rank and a raw reader one.
    po.budget_bytes = (uint64_t{2} * a_.writers + uint64_t{kRestoreLeases + 1} * a_.ranks) *
                      lease_bytes;
    po.lock_memory = false;  // locking does not change write speed; avoids RLIMIT noise
    CKPT_ASSIGN_OR_RETURN(pool_, ckpt::StagingPool::Create(po));
    for (uint32_t w = 0; w < a_.writers; ++w) {
      CKPT_ASSIGN_OR_RETURN(ckpt::StagingLease lease,
                            pool_->Acquire(lease_bytes, absl::Now() + absl::Seconds(1)));
      for (size_t c = 0; c < lease.chunk_count(); ++c) {
        char* p = lease.chunk(c);
        for (uint64_t i = 0; i < lease.chunk_bytes(); ++i) {
          p[i] = static_cast<char>(((c * 7919 + i * 31 + w) & 0x7f) | 1);  // never zero
        }
      }
      leases_.push_back(std::move(lease));
    }

    CKPT_ASSIGN_OR_RETURN(index_, ckpt::Index::Open(a_.dir + "/index"));
    store_ = std::make_unique<ckpt::LayerStore>(a_.dir, fs_, index_.get(), /*use_direct_io=*/true);
    CKPT_RETURN_IF_ERROR(store_->Init());
    // Leftovers of an interrupted earlier run (no event records, so every
    // version is "uncommitted") are moved to <dir>/quarantine/ here.
    CKPT_ASSIGN_OR_RETURN(ckpt::ReconcileReport rep, store_->Reconcile());
    leftovers_ = rep.temp_files_removed + rep.orphan_files_quarantined +
                 rep.uncommitted_versions_removed + rep.dangling_records_removed;
    for (uint32_t w = 0; w < a_.writers; ++w) {
      absl::Status s = fs_->Unlink(dir_fd_.get(), RawName(w));
      if (!s.ok() && !absl::IsNotFound(s)) return s;
    }
    if (a_.restore) CKPT_RETURN_IF_ERROR(SetupRestore(lease_bytes));

    // Whether the disk takes O_DIRECT (tmpfs does not; both paths then fall back).
    CKPT_ASSIGN_OR_RETURN(ckpt::UniqueFd probe,
                          fs_->CreateExclusive(dir_fd_.get(), "bench.probe", true, &direct_));
    CKPT_RETURN_IF_ERROR(probe.Close());
    return fs_->Unlink(dir_fd_.get(), "bench.probe");
  }

  // Path A: `versions_` commits through LayerStore, `writers` at a time;
  // version i is layer i / ranks of rank i % ranks. They stay until
  // RemoveVersions().
  absl::StatusOr<absl::Duration> RunStore(uint32_t round) {
    std::vector<ckpt::StagedVersion> vs(versions_);
    for (uint64_t i = 0; i < versions_; ++i) {
      ckpt::StagedVersion& v = vs[i];
      v.key = ckpt::VersionKey{"bench", static_cast<uint32_t>(i % a_.ranks),
                               static_cast<uint32_t>(i / a_.ranks), round * uint64_t{100000} + i};
      v.generation = 1;
      v.header = header_;
      v.header.set_rank(v.key.rank);
      v.header.set_layer(v.key.layer);
      v.header.set_layer_name(absl::StrCat("bench.", i));
      v.header.set_step(v.key.step);
      v.layout = layout_;
    }
    keys_.assign(versions_, ckpt::VersionKey{});
    recs_.assign(versions_, ckpt::store::VersionRecord{});
    committed_.assign(versions_, 0);
    timings_.assign(versions_, ckpt::CommitTimings{});
    std::atomic<uint64_t> next{0};
    absl::Mutex mu;
    absl::Status first_error;
    // Where version i's commit ended (on a writer or on the publisher).
    auto finish = [&](uint64_t i, absl::StatusOr<ckpt::store::VersionRecord> rec,
                      const ckpt::CommitTimings& t) {
      timings_[i] = t;
      if (!rec.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = rec.status();
        next.store(versions_);
        return;
      }
      recs_[i] = *std::move(rec);
      keys_[i] = vs[i].key;
      committed_[i] = 1;  // distinct elements per i; read after the round
    };
    // As the engine commits: writers write, one publisher publishes groups
    // (--commit=grouped); or each writer runs the whole protocol for one
    // version at a time (--commit=serial, for comparison).
    ckpt::Publisher publisher(store_.get());
    absl::Duration d = TimeThreads(
        a_.writers,
        [&](uint32_t w) {
          for (uint64_t i = next.fetch_add(1); i < versions_; i = next.fetch_add(1)) {
            vs[i].lease = std::move(leases_[w]);
            if (a_.serial_commit) {
              ckpt::CommitTimings t;
              absl::StatusOr<ckpt::store::VersionRecord> rec =
                  store_->Commit(&vs[i], io_[w].get(), &t);
              leases_[w] = std::move(vs[i].lease);
              finish(i, std::move(rec), t);
              continue;
            }
            absl::StatusOr<ckpt::WrittenVersion> written = store_->Write(&vs[i], io_[w].get());
            // Every write completed: the lease may be filled again.
            leases_[w] = std::move(vs[i].lease);
            if (!written.ok()) {
              finish(i, written.status(), ckpt::CommitTimings());
              continue;
            }
            publisher.Submit(*std::move(written),
                             [&finish, i](absl::StatusOr<ckpt::store::VersionRecord> rec,
                                          const ckpt::CommitTimings& t) {
                               finish(i, std::move(rec), t);
                             });
          }
        },
        [&publisher] { publisher.Stop(); });
    groups_ = a_.serial_commit ? versions_ : publisher.groups();
    if (!first_error.ok()) {
      ckpt::IgnoreError(RemoveVersions(), "the round already failed");
      return first_error;
    }
    return d;
  }

  absl::Status RemoveVersions() {
    absl::Status first_error;
    for (uint64_t i = 0; i < committed_.size(); ++i) {
      if (!committed_[i]) continue;
      absl::Status s = store_->Remove(keys_[i], recs_[i]);
      if (first_error.ok() && !s.ok()) first_error = s;
      committed_[i] = 0;
    }
    return first_error;
  }

  // Path C: one RestoreInto per rank at once, of every version RunStore
  // committed for it, into a fresh mapping of the rank's memfd.
  absl::StatusOr<absl::Duration> RunRestore() {
    std::vector<ckpt::CompositePlan> plans(a_.ranks);
    std::vector<ckpt::HostMemory> memory;
    for (uint32_t r = 0; r < a_.ranks; ++r) {
      ckpt::CompositePlan& plan = plans[r];
      plan.job = "bench";
      plan.rank = r;
      plan.complete = true;
      CKPT_ASSIGN_OR_RETURN(ckpt::MappedRegion m, MapFresh(trainer_[r]));
      std::vector<ckpt::MappedRegion> regions;
      regions.push_back(std::move(m));
      memory.emplace_back(std::move(regions));
    }
    for (uint64_t i = 0; i < versions_; ++i) {
      if (!committed_[i]) return absl::FailedPreconditionError("restore before a complete write round");
      ckpt::CompositePlan& plan = plans[keys_[i].rank];
      ckpt::PlannedLayer lp;
      lp.layer = keys_[i].layer;
      lp.name = absl::StrCat("bench.", keys_[i].layer);
      lp.has_version = true;
      lp.step = keys_[i].step;
      lp.bytes = a_.layer_bytes;
      lp.file = recs_[i].file();
      plan.target_step = std::max(plan.target_step, lp.step);
      plan.layers.push_back(std::move(lp));
    }
    absl::Mutex mu;
    absl::Status first_error;
    double reading_share = 1;  // the lowest of the ranks'
    const double cpu = ProcessCpuSeconds();
    absl::Duration d = TimeThreads(a_.ranks, [&](uint32_t r) {
      ckpt::HostMemory& mem = memory[r];
      ckpt::RestoreTarget target;
      target.memory = &mem;
      for (int l = 0; l < tables_[r].layers_size(); ++l) {
        target.tensors.push_back({mem.base(0) + uint64_t(l) * a_.layer_bytes});
      }
      ckpt::RecoverySources sources;
      sources.index = index_.get();
      sources.store = store_.get();
      sources.pool = pool_.get();
      sources.readers = {restore_io_[2 * r].get(), restore_io_[2 * r + 1].get()};
      sources.timeout = absl::Minutes(10);
      absl::StatusOr<ckpt::RestoreStats> stats =
          ckpt::RestoreInto(plans[r], tables_[r], target, sources);
      absl::Status s = stats.status();
      if (s.ok() && stats->bytes != plans[r].layers.size() * a_.layer_bytes) {
        s = absl::InternalError(absl::StrCat("rank ", r, " restored ", stats->bytes, " bytes"));
      }
      absl::MutexLock lock(&mu);
      if (!s.ok()) {
        if (first_error.ok()) first_error = s;
      } else {
        reading_share = std::min(reading_share, stats->ReadingShare());
      }
    });
    restore_cpu_seconds_ = ProcessCpuSeconds() - cpu;
    restore_reading_share_ = reading_share;
    CKPT_RETURN_IF_ERROR(first_error);
    // The bytes arrived: staging data is never zero, the memfd was zeroed.
    for (uint32_t r = 0; r < a_.ranks; ++r) {
      const char* p = static_cast<const char*>(trainer_[r].data());
      for (size_t l = 0; l < plans[r].layers.size(); ++l) {
        if (p[l * a_.layer_bytes] == 0 || p[(l + 1) * a_.layer_bytes - 1] == 0) {
          return absl::InternalError(absl::StrCat("rank ", r, " layer ", l, " was not restored"));
        }
      }
      std::memset(trainer_[r].data(), 0, trainer_[r].size());
    }
    return d;
  }

  // Path B: each writer writes its share of the payload bytes (whole layers,
  // rounded up to 4096 for O_DIRECT) sequentially into its own file. The
  // files stay until RemoveRaw().
  absl::StatusOr<absl::Duration> RunRaw() {
    absl::Mutex mu;
    absl::Status first_error;
    std::vector<char> created(a_.writers, 0);  // not vector<bool>: written concurrently
    absl::Duration d = TimeThreads(a_.writers, [&](uint32_t w) {
      absl::Status s = WriteRawFile(w, &created);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
      }
    });
    raw_created_ = std::move(created);
    if (!first_error.ok()) {
      ckpt::IgnoreError(RemoveRaw(), "the round already failed");
      return first_error;
    }
    return d;
  }

  absl::Status RemoveRaw() {
    absl::Status first_error;
    for (uint32_t w = 0; w < raw_created_.size(); ++w) {
      if (!raw_created_[w]) continue;
      absl::Status s = fs_->Unlink(dir_fd_.get(), RawName(w));
      if (first_error.ok() && !s.ok()) first_error = s;
      raw_created_[w] = 0;
    }
    if (first_error.ok()) first_error = fs_->SyncDir(dir_fd_.get());
    return first_error;
  }

  // Path D: B's files read back by one thread per rank, each a contiguous
  // share of their chunks, one IoBackend call per file in the share.
  absl::StatusOr<absl::Duration> RunRawRead() {
    struct Piece {
      uint32_t file;
      uint64_t offset, len;
    };
    std::vector<Piece> pieces;
    for (uint32_t w = 0; w < a_.writers; ++w) {
      if (!raw_created_[w]) return absl::FailedPreconditionError("read before a raw write round");
      const uint64_t size = RawFileBytes(w);
      for (uint64_t off = 0; off < size; off += a_.chunk_bytes) {
        pieces.push_back(Piece{w, off, std::min(a_.chunk_bytes, size - off)});
      }
    }
    std::vector<ckpt::UniqueFd> fds;
    for (uint32_t w = 0; w < a_.writers; ++w) {
      bool direct_used = false;
      CKPT_ASSIGN_OR_RETURN(ckpt::UniqueFd fd,
                            fs_->OpenForRead(dir_fd_.get(), RawName(w), true, &direct_used));
      fds.push_back(std::move(fd));
    }
    absl::Mutex mu;
    absl::Status first_error;
    const double cpu = ProcessCpuSeconds();
    absl::Duration d = TimeThreads(a_.ranks, [&](uint32_t r) {
      const size_t begin = pieces.size() * r / a_.ranks, end = pieces.size() * (r + 1) / a_.ranks;
      const ckpt::StagingLease& lease = read_leases_[r];
      absl::Status s;
      for (size_t i = begin; i < end && s.ok();) {
        std::vector<ckpt::IoSegment> segs;
        const uint32_t file = pieces[i].file;
        for (; i < end && pieces[i].file == file; ++i) {
          segs.push_back(ckpt::IoSegment{lease.chunk(segs.size() % lease.chunk_count()),
                                         pieces[i].len, pieces[i].offset});
        }
        s = io_[r]->ReadAll(fds[file].get(), segs);
      }
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
      }
    });
    raw_read_cpu_seconds_ = ProcessCpuSeconds() - cpu;
    CKPT_RETURN_IF_ERROR(first_error);
    return d;
  }

  // Where the last RunStore's commits spent their time, summed over versions:
  // write (with the checksums computed meanwhile), fdatasync, rest (temp
  // file, rename, directory fsync, index put), and the checksums alone.
  std::vector<double> CommitBreakdown() const {
    std::vector<double> sum(4, 0.0);
    for (const ckpt::CommitTimings& t : timings_) {
      sum[0] += t.write_seconds;
      sum[1] += t.sync_seconds;
      sum[2] += t.total_seconds - t.write_seconds - t.sync_seconds;
      sum[3] += t.hash_seconds;
    }
    return sum;
  }

  uint64_t versions() const { return versions_; }
  // Groups the last RunStore published its versions in (one per version
  // with --commit=serial), and the median time from a version's temp file
  // to its record, in seconds.
  uint64_t groups() const { return groups_; }
  // CPU seconds (all threads) of the last RunRestore and RunRawRead.
  double restore_cpu_seconds() const { return restore_cpu_seconds_; }
  double raw_read_cpu_seconds() const { return raw_read_cpu_seconds_; }
  // Of the last RunRestore, the share of its time some thread was in a read
  // call (RestoreStats::ReadingShare; the lowest of the ranks').
  double restore_reading_share() const { return restore_reading_share_; }
  double MedianCommitSeconds() const {
    std::vector<double> t;
    for (const ckpt::CommitTimings& c : timings_) t.push_back(c.total_seconds);
    return Median(std::move(t));
  }
  bool restore() const { return a_.restore; }
  uint64_t bytes_per_round() const { return bytes_per_round_; }
  uint64_t file_bytes() const { return layout_.file_bytes; }
  const char* backend() const { return io_[0]->Name(); }
  bool direct() const { return direct_; }
  uint64_t leftovers() const { return leftovers_; }

 private:
  static std::string RawName(uint32_t w) { return absl::StrCat("raw.", w, ".bench"); }
  // What one restore may hold: two leases per thread (the version it copies
  // out and the one it reads meanwhile), two threads.
  static constexpr uint32_t kRestoreLeases = 4;

  absl::Status SetupRestore(uint64_t lease_bytes) {
    const uint64_t per_rank = (versions_ + a_.ranks - 1) / a_.ranks * a_.layer_bytes;
    for (uint32_t r = 0; r < a_.ranks; ++r) {
      // The trainer's memfd, touched as a trainer's tensors would be.
      CKPT_ASSIGN_OR_RETURN(ckpt::MemfdRegion m,
                            ckpt::MemfdRegion::Create(absl::StrCat("bench-rank-", r), per_rank));
      std::memset(m.data(), 0, m.size());
      trainer_.push_back(std::move(m));
      ckpt::store::RankRecord table;
      for (uint64_t l = 0; l * a_.ranks + r < versions_; ++l) {
        ckpt::store::LayerSpec* spec = table.add_layers();
        spec->set_id(static_cast<uint32_t>(l));
        spec->set_name(absl::StrCat("bench.", l));
        ckpt::store::TensorSpec* t = spec->add_tensors();
        t->set_name("w");
        t->set_dtype(ckpt::store::DTYPE_U8);
        t->add_shape(a_.layer_bytes);
        t->set_nbytes(a_.layer_bytes);
      }
      tables_.push_back(std::move(table));
      CKPT_ASSIGN_OR_RETURN(ckpt::StagingLease lease,
                            pool_->Acquire(lease_bytes, absl::Now() + absl::Seconds(1)));
      read_leases_.push_back(std::move(lease));
    }
    // Each raw reader uses one backend, each restore two (ckptd's engine
    // gives a restore two readers).
    CKPT_ASSIGN_OR_RETURN(ckpt::IoBackendKind kind, ckpt::ParseIoBackendKind(a_.backend));
    while (io_.size() < a_.ranks) {
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ckpt::IoBackend> io,
                            ckpt::MakeIoBackend(kind, a_.queue_depth));
      io_.push_back(std::move(io));
    }
    while (restore_io_.size() < 2 * a_.ranks) {
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ckpt::IoBackend> io,
                            ckpt::MakeIoBackend(kind, a_.queue_depth));
      restore_io_.push_back(std::move(io));
    }
    return absl::OkStatus();
  }

  // A new mapping of a trainer's memfd, as ckptd makes at a registration.
  static absl::StatusOr<ckpt::MappedRegion> MapFresh(const ckpt::MemfdRegion& m) {
    int fd = ::fcntl(m.fd(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return ckpt::ErrnoStatus(errno, "dup");
    return ckpt::MappedRegion::Map(ckpt::UniqueFd(fd));
  }

  uint64_t RawFileBytes(uint32_t w) const {
    const uint64_t blocks = versions_ / a_.writers + (w < versions_ % a_.writers ? 1 : 0);
    return AlignUp(blocks * a_.layer_bytes, ckpt::kDirectAlignment);
  }

  absl::Status WriteRawFile(uint32_t w, std::vector<char>* created) {
    const uint64_t size = RawFileBytes(w);
    bool direct_used = false;
    CKPT_ASSIGN_OR_RETURN(ckpt::UniqueFd fd,
                          fs_->CreateExclusive(dir_fd_.get(), RawName(w), true, &direct_used));
    (*created)[w] = 1;  // one element per thread
    const ckpt::StagingLease& lease = leases_[w];
    std::vector<ckpt::IoSegment> segs;
    segs.reserve(size / a_.chunk_bytes + 1);
    for (uint64_t off = 0, k = 0; off < size; off += a_.chunk_bytes, ++k) {
      segs.push_back(ckpt::IoSegment{lease.chunk(k % lease.chunk_count()),
                                     std::min(a_.chunk_bytes, size - off), off});
    }
    CKPT_RETURN_IF_ERROR(io_[w]->WriteAll(fd.get(), segs));
    CKPT_RETURN_IF_ERROR(fs_->DataSync(fd.get()));
    return fd.Close();
  }

  const Args& a_;
  ckpt::FileSystem* const fs_;
  ckpt::UniqueFd dir_fd_;
  uint64_t versions_ = 0;
  uint64_t bytes_per_round_ = 0;
  std::vector<std::unique_ptr<ckpt::IoBackend>> io_;
  std::vector<std::unique_ptr<ckpt::IoBackend>> restore_io_;  // two per rank
  ckpt::store::LayerFileHeader header_;
  ckpt::VersionLayout layout_;
  std::unique_ptr<ckpt::StagingPool> pool_;
  std::vector<ckpt::StagingLease> leases_;
  std::vector<ckpt::StagingLease> read_leases_;  // one per rank, for path D
  std::vector<ckpt::MemfdRegion> trainer_;        // one per rank
  std::vector<ckpt::store::RankRecord> tables_;   // one per rank
  // What the last RunStore committed.
  std::vector<ckpt::VersionKey> keys_;
  std::vector<ckpt::store::VersionRecord> recs_;
  std::vector<char> committed_;
  std::vector<ckpt::CommitTimings> timings_;  // per version of the last RunStore
  uint64_t groups_ = 0;                       // the last RunStore's publish groups
  double restore_cpu_seconds_ = 0;
  double raw_read_cpu_seconds_ = 0;
  double restore_reading_share_ = 0;
  std::vector<char> raw_created_;  // RunRaw's files, until RemoveRaw()
  std::unique_ptr<ckpt::Index> index_;
  std::unique_ptr<ckpt::LayerStore> store_;
  bool direct_ = false;
  uint64_t leftovers_ = 0;
};

double GBps(uint64_t bytes, absl::Duration d) {
  double s = absl::ToDoubleSeconds(d);
  return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0;
}

absl::Status Run(const Args& a) {
  Bench b(a);
  CKPT_RETURN_IF_ERROR(b.Setup());
  if (!a.json) {
    std::printf(
        "dir %s: backend %s, O_DIRECT %s, %u writers, %u ranks, queue depth %u, chunk %s\n"
        "per round and path: %llu layer versions x %s = %s (ckptd file: %llu bytes each)\n",
        a.dir.c_str(), b.backend(), b.direct() ? "yes" : "no (file system refuses it)",
        a.writers, a.ranks, a.queue_depth, HumanBytes(a.chunk_bytes).c_str(),
        static_cast<unsigned long long>(b.versions()), HumanBytes(a.layer_bytes).c_str(),
        HumanBytes(b.bytes_per_round()).c_str(), static_cast<unsigned long long>(b.file_bytes()));
    if (b.leftovers() > 0) {
      std::printf("removed %llu leftovers of an earlier run\n",
                  static_cast<unsigned long long>(b.leftovers()));
    }
    std::fflush(stdout);
  }
  std::vector<double> ga, gb, ratio, gc, gd, restore_ratio, groups, commit_ms;
  std::vector<double> restore_cpu, raw_read_cpu;  // CPU seconds per GiB
  std::vector<double> reading_share;              // of the restore's time
  std::vector<std::vector<double>> share(4);  // of commit time: write, sync, rest; checksums
  Json rounds = Json::array();
  for (uint32_t r = 1; r <= a.rounds; ++r) {
    absl::Duration da, db, dc, dd;
    // Alternate which path goes first so drift (disk warm-up, GC) hits both.
    if (r % 2 == 1) {
      CKPT_ASSIGN_OR_RETURN(da, b.RunStore(r));
      CKPT_ASSIGN_OR_RETURN(db, b.RunRaw());
    } else {
      CKPT_ASSIGN_OR_RETURN(db, b.RunRaw());
      CKPT_ASSIGN_OR_RETURN(da, b.RunStore(r));
    }
    if (b.restore()) {
      absl::Status s = absl::OkStatus();
      absl::StatusOr<absl::Duration> c, d;
      if (r % 2 == 1) {
        c = b.RunRestore();
        if (c.ok()) d = b.RunRawRead();
      } else {
        d = b.RunRawRead();
        if (d.ok()) c = b.RunRestore();
      }
      s = c.ok() ? d.status() : c.status();
      absl::Status removed = b.RemoveVersions();
      absl::Status removed_raw = b.RemoveRaw();
      CKPT_RETURN_IF_ERROR(s);
      CKPT_RETURN_IF_ERROR(removed);
      CKPT_RETURN_IF_ERROR(removed_raw);
      dc = *c;
      dd = *d;
    } else {
      CKPT_RETURN_IF_ERROR(b.RemoveVersions());
      CKPT_RETURN_IF_ERROR(b.RemoveRaw());
    }
    ga.push_back(GBps(b.bytes_per_round(), da));
    gb.push_back(GBps(b.bytes_per_round(), db));
    ratio.push_back(gb.back() > 0 ? ga.back() / gb.back() : 0);
    Json round{{"round", r},
               {"ckptd_gbps", ga.back()},
               {"raw_gbps", gb.back()},
               {"ratio", ratio.back()},
               {"ckptd_seconds", absl::ToDoubleSeconds(da)},
               {"raw_seconds", absl::ToDoubleSeconds(db)}};
    if (b.restore()) {
      gc.push_back(GBps(b.bytes_per_round(), dc));
      gd.push_back(GBps(b.bytes_per_round(), dd));
      restore_ratio.push_back(gd.back() > 0 ? gc.back() / gd.back() : 0);
      round["restore_gbps"] = gc.back();
      round["raw_read_gbps"] = gd.back();
      round["restore_ratio"] = restore_ratio.back();
      const double gib = static_cast<double>(b.bytes_per_round()) / (1 << 30);
      restore_cpu.push_back(b.restore_cpu_seconds() / gib);
      raw_read_cpu.push_back(b.raw_read_cpu_seconds() / gib);
      round["restore_cpu_seconds_per_gib"] = restore_cpu.back();
      round["raw_read_cpu_seconds_per_gib"] = raw_read_cpu.back();
      reading_share.push_back(b.restore_reading_share());
      round["restore_reading_share"] = reading_share.back();
    }
    const std::vector<double> parts = b.CommitBreakdown();
    const double all = parts[0] + parts[1] + parts[2];
    for (size_t i = 0; i < parts.size(); ++i) {
      share[i].push_back(all > 0 ? parts[i] / all : 0);
    }
    round["commit_share"] = Json{{"write", share[0].back()},
                                 {"datasync", share[1].back()},
                                 {"create_rename_dirsync_index", share[2].back()},
                                 {"checksums_during_write", share[3].back()}};
    round["publish_groups"] = b.groups();
    round["median_commit_seconds"] = b.MedianCommitSeconds();
    groups.push_back(b.groups());
    commit_ms.push_back(1e3 * b.MedianCommitSeconds());
    rounds.push_back(std::move(round));
    if (!a.json) {
      std::printf("round %u: write ckptd %.2f GB/s, raw %.2f GB/s, ratio %.2f", r, ga.back(),
                  gb.back(), ratio.back());
      if (b.restore()) {
        std::printf("; restore ckptd %.2f GB/s, raw read %.2f GB/s, ratio %.2f", gc.back(),
                    gd.back(), restore_ratio.back());
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (a.json) {
    Json j{{"dir", a.dir},
           {"backend", b.backend()},
           {"direct_io", b.direct()},
           {"writers", a.writers},
           {"commit", a.serial_commit ? "serial" : "grouped"},
           {"ranks", a.ranks},
           {"queue_depth", a.queue_depth},
           {"chunk_bytes", a.chunk_bytes},
           {"layer_bytes", a.layer_bytes},
           {"versions_per_round", b.versions()},
           {"bytes_per_round", b.bytes_per_round()},
           {"rounds", std::move(rounds)},
           {"ckptd_gbps", Median(ga)},
           {"raw_gbps", Median(gb)},
           {"ratio", Median(ratio)}};
    if (b.restore()) {
      j["restore_gbps"] = Median(gc);
      j["raw_read_gbps"] = Median(gd);
      j["restore_ratio"] = Median(restore_ratio);
      j["restore_cpu_seconds_per_gib"] = Median(restore_cpu);
      j["raw_read_cpu_seconds_per_gib"] = Median(raw_read_cpu);
      j["restore_reading_share"] = Median(reading_share);
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("ckptd write path (%s commit): %.2f GB/s (median of %u)\n",
                a.serial_commit ? "serial" : "grouped", Median(ga), a.rounds);
    std::printf("raw O_DIRECT:     %.2f GB/s\n", Median(gb));
    std::printf("ratio (ckptd / raw): %.2f (median of per-round ratios)\n", Median(ratio));
    std::printf("commit time (summed over versions, medians): write %.0f%% (checksums computed "
                "meanwhile: %.0f%%), fdatasync %.0f%%, temp file + rename + directory fsync + "
                "index%s %.0f%%\n",
                100 * Median(share[0]), 100 * Median(share[3]), 100 * Median(share[1]),
                a.serial_commit ? "" : " + waiting for the publisher", 100 * Median(share[2]));
    std::printf("versions per publish group: %.1f; time from temp file to record: %.0f ms "
                "(medians)\n",
                b.versions() / std::max(1.0, Median(groups)), Median(commit_ms));
    if (b.restore()) {
      std::printf("ckptd restore path: %.2f GB/s (median of %u)\n", Median(gc), a.rounds);
      std::printf("raw O_DIRECT read:  %.2f GB/s\n", Median(gd));
      std::printf("restore ratio (ckptd / raw): %.2f (median of per-round ratios)\n",
                  Median(restore_ratio));
      std::printf("CPU per GiB read (all threads, medians): restore %.3f s, raw read %.3f s\n",
                  Median(restore_cpu), Median(raw_read_cpu));
      std::printf("read calls under way during the restore: %.0f%% of its time (the lowest "
                  "rank's, median of rounds)\n",
                  100 * Median(reading_share));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bool help = false;
  if (absl::Status s = ParseArgs(argc, argv, &a, &help); !s.ok()) {
    std::fprintf(stderr, "ckpt_bench: %s\n%s", std::string(s.message()).c_str(), kUsage);
    return 2;
  }
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (absl::Status s = Run(a); !s.ok()) {
    std::fprintf(stderr, "ckpt_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
