// ckpt_bench's parts (the benchmark is described in ckpt_bench.cc): the
// parsed flags, the Bench that owns the directory, the I/O backends, the
// staging pool and the store and runs the four timed paths, and the helpers
// they share. The sources, by path:
//   ckpt_bench.cc          flags, usage, main
//   ckpt_bench_setup.cc    Bench::Setup: directory, backends, staging, store
//   ckpt_bench_write.cc    path A, the daemon's commit path
//   ckpt_bench_raw.cc      paths B and D, the raw O_DIRECT write and read
//   ckpt_bench_restore.cc  path C, the daemon's restore path
//   ckpt_bench_report.cc   the rounds, the figures and their report
// A Bench is driven by one thread (Run); each path runs its own threads
// inside one call and joins them before it returns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/region.h"
#include "base/unique_fd.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/plan.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt::bench {

// The command line (ckpt_bench.cc's usage text says what each flag means).
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

// Runs Setup, then the rounds, and prints the report on stdout (a table, or
// with --json one JSON object). ckpt_bench_report.cc.
absl::Status Run(const Args& a);

// The median of `v`; REQUIRES: `v` is not empty.
double Median(std::vector<double> v);

// User plus system CPU time of this process so far, its io_uring workers
// included (they are threads of it).
double ProcessCpuSeconds();

// Runs fn(w) on `n` threads and returns the wall time from releasing them all
// at once until the last one returned and then `after()` did. Thread
// start-up is not timed.
template <typename Fn, typename After = void (*)()>
absl::Duration TimeThreads(
    uint32_t n, Fn fn, After after = [] {}) {
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

class Bench {
 public:
  // REQUIRES: `a` outlives the Bench.
  explicit Bench(const Args& a) : a_(a), fs_(DefaultFileSystem()) {}

  // Makes the directory, the backends, the staging pool (filled before any
  // clock starts) and the store; removes the leftovers of an interrupted
  // run; with --restore also the trainers' memory. RESOURCE_EXHAUSTED when
  // the directory's disk cannot hold one round.
  absl::Status Setup();

  // Path A: `versions_` commits through LayerStore, `writers` at a time;
  // version i is layer i / ranks of rank i % ranks. They stay until
  // RemoveVersions().
  absl::StatusOr<absl::Duration> RunStore(uint32_t round);
  absl::Status RemoveVersions();

  // Path B: each writer writes its share of the payload bytes (whole layers,
  // rounded up to 4096 for O_DIRECT) sequentially into its own file. The
  // files stay until RemoveRaw().
  absl::StatusOr<absl::Duration> RunRaw();
  absl::Status RemoveRaw();

  // Path C: one RestoreInto per rank at once, of every version RunStore
  // committed for it, into a fresh mapping of the rank's memfd.
  // FAILED_PRECONDITION before a complete RunStore.
  absl::StatusOr<absl::Duration> RunRestore();

  // Path D: B's files read back by one thread per rank, each a contiguous
  // share of their chunks, one IoBackend call per file in the share.
  // FAILED_PRECONDITION before a complete RunRaw.
  absl::StatusOr<absl::Duration> RunRawRead();

  // Where the last RunStore's commits spent their time, summed over versions:
  // write (with the checksums computed meanwhile), fdatasync, rest (temp
  // file, rename, directory fsync, index put), and the checksums alone.
  std::vector<double> CommitBreakdown() const;
  // The median time from a version's temp file to its record in the last
  // RunStore, in seconds.
  double MedianCommitSeconds() const;

  uint64_t versions() const { return versions_; }
  // Groups the last RunStore published its versions in (one per version
  // with --commit=serial).
  uint64_t groups() const { return groups_; }
  // CPU seconds (all threads) of the last RunRestore and RunRawRead.
  double restore_cpu_seconds() const { return restore_cpu_seconds_; }
  double raw_read_cpu_seconds() const { return raw_read_cpu_seconds_; }
  // Of the last RunRestore, the share of its time some thread was in a read
  // call (RestoreStats::ReadingShare; the lowest of the ranks').
  double restore_reading_share() const { return restore_reading_share_; }
  bool restore() const { return a_.restore; }
  uint64_t bytes_per_round() const { return bytes_per_round_; }
  uint64_t file_bytes() const { return layout_.file_bytes; }
  const char* backend() const { return io_[0]->Name(); }
  bool direct() const { return direct_; }
  uint64_t leftovers() const { return leftovers_; }

 private:
  // What one restore may hold: two leases per thread (the version it copies
  // out and the one it reads meanwhile), two threads.
  static constexpr uint32_t kRestoreLeases = 4;

  // Setup's steps, in order (ckpt_bench_setup.cc).
  absl::Status PlanVersion();
  absl::Status CheckFreeSpace() const;
  absl::Status SetupStaging(uint64_t lease_bytes);
  absl::Status OpenStore();
  absl::Status ProbeDirectIo();
  // Grows `ios` to `count` backends of `kind` with --queue-depth.
  absl::Status AddBackends(IoBackendKind kind, size_t count,
                           std::vector<std::unique_ptr<IoBackend>>* ios) const;

  // Path A's versions of `round`, staged as a trainer's would be.
  std::vector<StagedVersion> StageVersions(uint32_t round) const;

  // Path B's and D's files (ckpt_bench_raw.cc).
  static std::string RawName(uint32_t w);
  uint64_t RawFileBytes(uint32_t w) const;
  absl::Status WriteRawFile(uint32_t w, std::vector<char>* created);
  absl::Status RemoveRawLeftovers();

  // Path C's set-up and check (ckpt_bench_restore.cc).
  absl::Status SetupRestore(uint64_t lease_bytes);
  absl::Status PlanRestores(std::vector<CompositePlan>* plans, std::vector<HostMemory>* memory);
  absl::Status CheckRestored(const std::vector<CompositePlan>& plans);
  // A new mapping of a trainer's memfd, as ckptd makes at a registration.
  static absl::StatusOr<MappedRegion> MapFresh(const MemfdRegion& m);

  const Args& a_;
  FileSystem* const fs_;
  UniqueFd dir_fd_;
  uint64_t versions_ = 0;
  uint64_t bytes_per_round_ = 0;
  std::vector<std::unique_ptr<IoBackend>> io_;
  std::vector<std::unique_ptr<IoBackend>> restore_io_;  // two per rank
  store::LayerFileHeader header_;
  VersionLayout layout_;
  std::unique_ptr<StagingPool> pool_;
  std::vector<StagingLease> leases_;
  std::vector<StagingLease> read_leases_;  // one per rank, for path D
  std::vector<MemfdRegion> trainer_;       // one per rank
  std::vector<store::RankRecord> tables_;  // one per rank
  // What the last RunStore committed.
  std::vector<VersionKey> keys_;
  std::vector<store::VersionRecord> recs_;
  std::vector<char> committed_;
  std::vector<CommitTimings> timings_;  // per version of the last RunStore
  uint64_t groups_ = 0;                 // the last RunStore's publish groups
  double restore_cpu_seconds_ = 0;
  double raw_read_cpu_seconds_ = 0;
  double restore_reading_share_ = 0;
  std::vector<char> raw_created_;  // RunRaw's files, until RemoveRaw()
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
  bool direct_ = false;
  uint64_t leftovers_ = 0;
};

}  // namespace ckpt::bench
