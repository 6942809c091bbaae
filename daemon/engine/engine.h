// Engine: registered ranks and the per-step pipeline (SPEC §3, §5). The
// facade the gRPC handlers call; each stage lives in its own file:
//
//   engine_registry.cc   Register, Unregister, ownership, trainer exit
//   engine_snapshot.cc   StepDone, snapshot workers, WaitSnapshot (the fence)
//   engine_layercheck.cc LayerCheck drift and decisions, multi-rank drift
//   engine_commit.cc     writer threads, the disk budget (disk_budget.h)
//   engine_events.cc     per-version outcomes, checkpoint events, WaitDurable
//   engine_recovery.cc   Plan, Restore, Verify, Export (over recovery/)
//   engine_retention.cc  GC under leases (leases.h)
//   engine_admin.cc      Status, Jobs, Layers, History, metrics collection
//   engine_remote.cc     the remote tier: uploader, remote GC, pulls
//   memory_tier.h        the memory tier restores read from
//   rank_state.h         the per-rank state these stages share
//
//   StepDone(t) --queue--> snapshot worker: select layers, copy them from the
//   rank's mapped buffers into staging, mark snapshot t taken (WaitSnapshot
//   returns) --queue--> writer threads: commit each layer version
//   (LayerStore::Commit) --> when every version of step t and every earlier
//   step is finished, the step's EventRecord is written (one sync batch) and t
//   becomes durable (WaitDurable returns).
//
// Ordering: snapshots of one rank run in step order (one worker at a time per
// rank); events of one rank are written in step order. A version that fails
// to write (or a layer skipped because the pool was full) is counted, does not
// block later steps, and its layer is re-selected at the next step.
//
// Identity: each call carries the caller's uid from SO_PEERCRED. A job belongs
// to the uid that created it; other uids (except root) get PERMISSION_DENIED.
//
// Thread-safety: all public methods are thread-safe. Every wait is bounded by
// a deadline.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <functional>
#include <set>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "base/unique_fd.h"
#include "daemon/common/clock.h"
#include "daemon/engine/disk_budget.h"
#include "daemon/engine/leases.h"
#include "daemon/engine/memory_tier.h"
#include "daemon/engine/quota.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/step_types.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/io/io_backend.h"
#include "daemon/metrics/metrics.h"
#include "daemon/policy/layercheck.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"
#include "daemon/remote/remote_store.h"
#include "kernels/drift.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/publisher.h"
#include "daemon/store/retention.h"

namespace ckpt {

// The engine's options. The defaults are ckptd's: daemon/config binds each
// configurable one to its config-file key (config.cc), so they are declared
// here and nowhere else.
struct EngineOptions {
  std::string data_dir;               // reported by Status
  std::string metrics_address;        // reported by Status ("" = off)
  unsigned writer_threads = 2;        // layer versions written concurrently
  unsigned snapshot_threads = 1;      // ranks snapshotted concurrently
  IoBackendKind io_backend = IoBackendKind::kAuto;
  unsigned io_queue_depth = 16;       // chunk writes in flight per writer
  absl::Duration admission_timeout = absl::Seconds(2);  // wait for staging, then skip
  absl::Duration drain_timeout = absl::Seconds(60);     // re-register waits this long
  absl::Duration restore_timeout = absl::Minutes(30);
  uint64_t max_aux_bytes = 1 << 20;
  int drift_threads = 2;              // CPU drift kernel workers per snapshot
  // The data device's sustained write bandwidth in bytes/s, as the operator
  // measured it; a LayerCheck write budget given as a share is relative to
  // it. 0 = unknown: such budgets are refused.
  uint64_t device_write_bytes_per_s = 0;
  RetentionPolicy retention;
  uint64_t max_disk_bytes = 0;        // bound on committed version bytes; 0 = none
  // Layer versions are refused while the data file system has less free than
  // this (plus the version), so RocksDB's WAL never meets a full disk.
  uint64_t min_free_disk_bytes = 64 << 20;
  // Per-uid quotas (quota.h), each 0 = none. The disk quota counts a uid's
  // layer files and index records; 0 here means half the size of the data
  // file system, measured at start.
  uint64_t max_disk_bytes_per_uid = 0;
  uint64_t max_index_bytes_per_uid = uint64_t{1} << 30;  // aux blobs, events, version records
  // One job's layer files and index records, whoever owns it; 0 = none.
  uint64_t max_disk_bytes_per_job = 0;
  // A rank's StepDone queue (steps not yet taken by a snapshot worker), and
  // a uid's steps in flight (StepDone until the checkpoint event). Each
  // holds its aux blob in memory; those bytes also count against
  // max_index_bytes_per_uid while in flight.
  uint32_t max_queued_steps_per_rank = 64;
  uint32_t max_queued_steps_per_uid = 1024;
  // Ranks one uid may have registered at once (stale ones included); 0 = none.
  uint32_t max_registrations_per_uid = 256;
  Metrics* metrics = nullptr;         // optional; not owned
  absl::Duration gc_interval = absl::Minutes(5);  // periodic GC of every job; 0 = off
  RegistrationLimits limits;
  // The CUDA calls behind GPU registrations; null = the CUDA runtime's (or,
  // without CUDA, a twin that refuses GPU registrations). Not owned.
  CudaIpc* cuda_ipc = nullptr;
  // What the engine stamps and ages records with (event times, retention,
  // the durability lag); null = the real clock. Not owned.
  Clock* clock = nullptr;
  // How often the exit of trainers holding GPU mappings is checked.
  absl::Duration trainer_watch_interval = absl::Milliseconds(200);
  // The memory tier (memory_tier.h): staging-pool bytes that keep the
  // newest committed version of each layer for restores; 0 = off.
  uint64_t memory_tier_bytes = 0;
  // The remote tier (engine_remote.cc, docs/remote.md); null = none. Not
  // owned.
  remote::RemoteStore* remote = nullptr;
  unsigned remote_upload_threads = 4;  // versions uploaded at once
  // Per rank, the oldest events not yet uploaded that local GC keeps.
  uint32_t remote_max_pending_events = 64;
  // The uploader's back-off after a failure: doubles from the first value
  // up to the second.
  absl::Duration remote_retry_min = absl::Seconds(1);
  absl::Duration remote_retry_max = absl::Seconds(30);
};

struct Caller {
  uid_t uid = 0;
  pid_t pid = 0;
};

// What DeleteJob removed.
struct JobDeleted {
  uint32_t ranks = 0;
  uint64_t versions = 0;
  uint64_t bytes = 0;
  uint64_t events = 0;
};

// What a Restore wrote: the restore's figures (memory_bytes: from the memory
// tier) and the plan it followed.
struct Restored : RestoreStats {
  CompositePlan plan;
};

struct PendingStep;  // rank_state.h

class Engine {
 public:
  Engine(EngineOptions options, Index* index, LayerStore* store, StagingPool* pool);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts the snapshot and writer threads. UNAVAILABLE when the requested
  // io backend cannot be created.
  absl::Status Start();
  // Refuses new steps, lets writers finish queued versions for up to `grace`,
  // discards what is left (nothing half-visible) and releases every mapping.
  void Shutdown(absl::Duration grace);

  // Validates (registration.h), claims nothing itself: `fds` are the host
  // regions the caller handed over, or req.gpu names GPU allocations (opened
  // only after the checks and the ownership test passed, so a refused call
  // maps nothing). Records the job (owner = caller) and the rank's table, and
  // returns a new generation. A live registration of the same rank is
  // drained (bounded) and replaced. The rank's memory (GPU mappings or memfd
  // regions) is released again when the calling process (caller.pid) exits.
  absl::StatusOr<Registered> Register(const Registration& req, std::vector<UniqueFd> fds,
                                      const Caller& caller);
  // Queues the step and returns. FAILED_PRECONDITION for a stale
  // generation or a step not above the last one; INVALID_ARGUMENT for an
  // oversized aux blob or a bad layer list.
  absl::Status StepDone(StepReport report, const Caller& caller);
  // The fence: returns once snapshot `step` is in staging.
  // DEADLINE_EXCEEDED at `deadline` (the snapshot is then void, see
  // docs/design-changes.md); ABORTED when the registration ended.
  absl::StatusOr<SnapshotTaken> WaitSnapshot(const RankRef& rank, uint64_t step,
                                             const Caller& caller, absl::Time deadline);
  // The durable step once every layer's newest version selected at or before
  // `step` is durable. ABORTED when some of them failed (they are retried
  // next step).
  // With `remote`, the step must also be remote-durable (its manifest in
  // the remote tier): FAILED_PRECONDITION without a remote tier,
  // DEADLINE_EXCEEDED when the upload has not finished at `deadline`.
  absl::StatusOr<uint64_t> WaitDurable(const RankRef& rank, uint64_t step, const Caller& caller,
                                       absl::Time deadline, bool remote = false);
  // The composite plan of the rank for `target_step` (0 = its latest
  // durable step); recovery/plan.h says what it holds and when NOT_FOUND.
  absl::StatusOr<CompositePlan> Plan(const std::string& job, uint32_t rank, uint64_t target_step,
                                     const Caller& caller);
  // Writes the plan for `target_step` into the registration's buffers through
  // the verified restore loop (recovery/restore.h). FAILED_PRECONDITION while
  // steps of this registration are still being snapshotted. With
  // `discard_later`, the rank's versions and events after the restored step
  // are then deleted (versions first, so a crash in between leaves no later
  // version under a surviving event), and the next step may be target + 1.
  absl::StatusOr<Restored> Restore(const RankRef& rank, uint64_t target_step,
                                   const Caller& caller, bool discard_later = false);
  // Ends the registration; with `drain`, first waits (until `deadline`) for
  // its staged versions to become durable. Without, the engine keeps the
  // rank until they are written, then forgets it.
  absl::Status Unregister(const RankRef& rank, bool drain, const Caller& caller,
                          absl::Time deadline);
  // Ranks the engine holds: the registered ones, and those unregistered
  // without drain whose staged versions are still being written.
  size_t RanksHeld();
  // Ends a rank's registration on behalf of an operator (owner or root),
  // without its generation: its memory is released and its staged versions
  // are written first (bounded by drain_timeout). Returns the generation that
  // ended. NOT_FOUND when the rank is not registered.
  absl::StatusOr<uint64_t> ReleaseRank(const std::string& job, uint32_t rank,
                                       const Caller& caller);
  // Deletes the job's whole history (every version file, event, rank and
  // the job record); the id is free again. Owner or root. FAILED_PRECONDITION
  // while a rank of it is registered by a live trainer (ReleaseRank or stop
  // it first); ABORTED while a rank of it is registering or being read by a
  // restore, verify or export (retry).
  absl::StatusOr<JobDeleted> DeleteJob(const std::string& job, const Caller& caller);
  // Multi-rank LayerCheck: the rank's partial per-layer sums of `step` (waits
  // until computed), and the all-reduced vector that lets the step proceed.
  absl::StatusOr<std::vector<drift::LayerSums>> DriftPartials(const RankRef& rank, uint64_t step,
                                                              const Caller& caller,
                                                              absl::Time deadline);
  absl::Status SetGlobalDrift(const RankRef& rank, uint64_t step,
                              const std::vector<drift::LayerSums>& global, const Caller& caller);

  // The daemon's state. Node-wide figures (pool, disk, counters, uptime) are
  // the same for every caller; `jobs` and `registered_ranks` count only the
  // caller's own unless the caller is root, so no uid learns how many jobs
  // or trainers other users have.
  v1::StatusReply GetStatus(const Caller& caller = Caller());
  absl::StatusOr<v1::JobsReply> Jobs(const Caller& caller);
  absl::StatusOr<v1::LayersReply> Layers(const v1::LayersRequest& req, const Caller& caller);
  absl::StatusOr<v1::HistoryReply> History(const v1::HistoryRequest& req, const Caller& caller);
  // Applies the retention policy to every rank of the job (retention.h).
  // Ranks a restore or export is reading are skipped and counted as busy.
  absl::StatusOr<v1::GcReply> Gc(const v1::GcRequest& req, const Caller& caller);
  // Streams a rank's composite checkpoint: the header, then every tensor's
  // verified bytes. `sink` returns false when the reader went away (CANCELLED).
  absl::Status Export(const v1::ExportRequest& req, const Caller& caller,
                      const std::function<bool(const v1::ExportChunk&)>& sink);
  // Reads back every committed version of the job (or one rank) and checks
  // every checksum; failures are listed in the reply, not returned as errors.
  absl::StatusOr<v1::VerifyReply> Verify(const v1::VerifyRequest& req, const Caller& caller);

  // A replacement node: when the index holds no checkpoint event of the rank
  // and the remote tier has manifests of it, copies the newest manifest
  // whose objects are all whole (and, several ranks, those down to the
  // job's agreed step it records) with every version they name into the
  // local store, each checked before it becomes visible
  // (LayerStore::Adopt). A missing or damaged manifest or object makes that
  // step unusable and an older one is tried; nothing of a failed pull stays
  // in the index. PERMISSION_DENIED when the job belongs to another uid; OK
  // (nothing done) without a remote tier or when there is nothing there.
  // With `must_know` (Plan, Restore, Export), a remote tier that cannot be
  // listed, or whose every step is damaged, is an error (UNAVAILABLE,
  // DATA_LOSS, ...): the caller must not take "no checkpoint" for an answer.
  // Without it (Register), that is logged and the call goes on, so a new
  // job trains while the remote tier is down; Register skips the remote
  // tier at once while its last operation failed.
  absl::Status PullFromRemote(const std::string& job, uint32_t rank, const Caller& caller,
                              bool must_know);
  // Jobs of the caller (every job for root) that the remote tier holds,
  // with their ranks' newest remote-durable steps; empty without a remote
  // tier.
  absl::StatusOr<std::vector<v1::JobInfo>> RemoteJobs(const Caller& caller);

  void RecordReconcile(const ReconcileReport& report) { reconcile_ = report; }
  // Refreshes the gauges that are read at scrape time (pool, queue,
  // durability lag, disk, per-layer staleness and drift).
  void CollectMetrics();
  uint64_t disk_bytes_used() const { return disk_.used(); }
  // The quotas in force (after Start) and what each uid holds.
  QuotaLimits quota_limits() const { return quota_.limits(); }
  QuotaTable::Usage quota_usage(uid_t uid) const { return quota_.Get(uid); }
  QuotaTable::Usage job_quota_usage(std::string_view job) const { return quota_.GetJob(job); }
  const char* io_backend_name() const { return io_backend_name_.c_str(); }

 private:
  // Stage by stage; each group's methods live in the file named beside it.
  struct Rank;      // rank_state.h
  struct SnapTask;  // rank_state.h
  struct WriteTask; // rank_state.h

  // ---- rank registry (engine_registry.cc): ownership, generations,
  //      registration and drain, watching the trainer process ----
  // The live registration of (job, rank) with this generation, for this
  // caller: NOT_FOUND (kNotRegistered), PERMISSION_DENIED,
  // FAILED_PRECONDITION (kStaleGeneration), or UNAVAILABLE (kShuttingDown)
  // once ckptd is stopping.
  absl::StatusOr<std::shared_ptr<Rank>> FindLocked(const RankRef& ref, const Caller& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same with mu_ taken and released: for calls that then wait on the
  // rank's own mutex.
  absl::StatusOr<std::shared_ptr<Rank>> Find(const RankRef& ref, const Caller& caller)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckOwner(const std::string& job, const Caller& caller);
  // Releases the memory (GPU mappings, memfd regions) of ranks whose trainer
  // process exited.
  void WatchTrainersLoop();
  // Ends a registration: inactive, parked steps dropped, memory moved to
  // `closing` (dropped by the caller once every lock is released).
  void EndRegistrationLocked(Rank& r, const std::string& why,
                             std::vector<std::shared_ptr<RankMemory>>* closing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (until `deadline`) for what the ended registration `r` still has
  // in flight, then forgets it.
  absl::Status DrainAndForget(const std::shared_ptr<Rank>& r, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- snapshotter (engine_snapshot.cc): the StepDone queue, copy into
  //      staging, the fence and an abandoned fence ----
  void SnapshotLoop();
  // Returns false when the task now waits for SetGlobalDrift.
  // `memory` is the rank's memory (null once released).
  bool Snapshot(const std::shared_ptr<Rank>& r, SnapTask& task, RankMemory* memory);
  // What a snapshot has handed to the writers so far.
  struct SpillState {
    bool pending = false;          // the step's PendingStep is in r->pending
    std::vector<uint32_t> layers;  // layers handed over, in order
    uint64_t count = 0, bytes = 0; // versions and payload bytes handed over
  };
  // Hands the versions `staged` so far to the writers before the snapshot
  // goes on (the pool has no room for the next one), unless the fence was
  // abandoned, the rank unregistered or ckptd is stopping: then they go to
  // `skipped` and it returns false (the snapshot copies nothing more).
  bool SpillStaged(const std::shared_ptr<Rank>& r, SnapTask& task,
                   std::vector<StagedVersion>& staged, std::vector<uint32_t>* skipped,
                   SpillState* spill) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues `staged` for the writers as versions of task.step, making the
  // step's PendingStep the first time; returns it. Holds r->mu as well.
  PendingStep* QueueStagedLocked(const std::shared_ptr<Rank>& r, SnapTask& task,
                                 std::vector<StagedVersion>& staged, SpillState* spill)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- LayerCheck decisions (engine_layercheck.cc) ----
  // Builds the rank's drift tasks over `memory` (the rank's, not published
  // yet) and picks the drift kernel that can read it.
  absl::Status SetUpLayerCheck(const Registration& req, RankMemory* memory, Rank* r);
  // Fills task.layers from the drift of this step, read from `memory`.
  // Returns false when the step waits for the all-reduced drift vector.
  bool DecideLayerCheck(const std::shared_ptr<Rank>& r, SnapTask& task, RankMemory* memory);

  // ---- commit pipeline (engine_commit.cc): writers write each version's
  //      bytes, the publisher makes groups of them durable and visible ----
  void WriterLoop(std::unique_ptr<IoBackend> io);
  // What follows a version's commit, on the publisher's thread (or the
  // writer's, when it failed before): metrics, the memory tier, the rank's
  // step bookkeeping; gives back the quota and disk room `reserved` for it
  // when it failed.
  void FinishCommit(std::unique_ptr<WriteTask> task, bool reserved,
                    absl::StatusOr<store::VersionRecord> rec, const CommitTimings& timings)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- event sequencer (engine_events.cc): per-version outcomes, ordered
  //      checkpoint events, the durable step behind WaitDurable ----
  void FinishVersion(const std::shared_ptr<Rank>& r, uint64_t step, uint32_t layer,
                     const absl::StatusOr<store::VersionRecord>& result, uint64_t bytes);
  // Drops `r` from ranks_ once it is unregistered and idle (Rank::Idle):
  // nothing else would, and every unregistered job would stay in memory
  // and in every walk over ranks_ for good. REQUIRES: r->mu held too (Rank
  // is incomplete here for the annotation), and a reference to `r` of the
  // caller's own (the map's may be the last but one).
  void ForgetIfDoneLocked(const std::shared_ptr<Rank>& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceEvents(const std::shared_ptr<Rank>& r);

  // Start-up: the per-uid quotas and what the index holds for each uid.
  absl::Status SeedUsage();

  // ---- admin (engine_admin.cc) ----
  // Registered ranks; with `stale_only`, those whose trainer exited (memory
  // released).
  size_t ActiveRanksLocked(bool stale_only = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- retention (engine_retention.cc) ----
  // What a rank's history holds, as GC and DeleteJob need it: its events in
  // step order and its versions by (layer, step).
  struct RankHistory {
    struct Event {
      uint64_t step = 0;
      int64_t unix_ms = 0;
      uint64_t index_bytes = 0;  // what it counts for in its owner's quota
      uint64_t agreed_step = 0;  // EventRecord::agreed_step
    };
    uid_t owner = 0;
    std::vector<Event> events;
    std::map<std::pair<uint32_t, uint64_t>, store::VersionRecord> versions;
  };
  // The rank's events and versions; with `after`, only those above that
  // step (one seek per layer and the events from the newest down, so the
  // cost does not grow with the history below it).
  absl::StatusOr<RankHistory> ReadRankHistory(const std::string& job, uint32_t rank,
                                              std::optional<uint64_t> after = std::nullopt);
  // Deletes one event / one committed version (record, then file) of the
  // rank and gives what it held back to the disk budget and the owner's
  // quota.
  absl::Status DeleteEvent(const RankHistory& h, const std::string& job, uint32_t rank,
                           const RankHistory::Event& event);
  absl::Status RemoveVersion(const RankHistory& h, const VersionKey& key,
                             const store::VersionRecord& rec);
  absl::Status GcRank(const std::string& job, uint32_t rank, bool dry_run, v1::GcReply* reply);
  // Restore(discard_later): deletes the rank's versions, then its events,
  // after `step` (under the rank's lease).
  absl::Status DiscardAfter(const std::string& job, uint32_t rank, uint64_t step);
  void GcLoop();

  // ---- remote tier (engine_remote.cc): the uploader, remote retention ----
  struct RemoteRank {
    uid_t owner = 0;
    uint64_t local_step = 0;   // newest local checkpoint event
    uint64_t remote_step = 0;  // newest manifest in the remote tier
    bool seeded = false;       // objects and manifests listed from the store
    // Version objects known whole there: named by a manifest that reads
    // back, or uploaded by this node since (file -> bytes). Names repeat
    // across histories of a rank, so a listed object that no manifest names
    // is never trusted: it is uploaded again (over it) when needed.
    std::map<std::string, uint64_t> objects;
    std::set<std::string> stray;  // listed, not trusted; remote GC may delete them
    struct Manifest {
      int64_t unix_ms = 0;
      uint64_t agreed_step = 0;
      std::vector<std::string> files;  // the version objects it names
    };
    std::map<uint64_t, Manifest> manifests;
    std::map<uint64_t, uint64_t> pending;  // local events not uploaded: step -> bytes
    // The rank went back (a restore that discarded later steps, or a pull
    // that fell back past damaged steps): manifests above this step belong
    // to a discarded history and are deleted before anything is uploaded.
    std::optional<uint64_t> discard_above;
    // Why this node neither uploads nor deletes anything of the rank (empty:
    // it does): the remote tier holds it for another uid, or holds another
    // history of it than this node's (started without restoring from it).
    std::string blocked;
    absl::Time retry_at = absl::InfinitePast();
    absl::Duration backoff = absl::ZeroDuration();
  };
  // The largest remote lag in steps and the bytes not uploaded, over the
  // ranks of `owner` (every rank when null).
  std::pair<uint64_t, uint64_t> RemoteLag(const uid_t* owner);
  // The ranks the index holds, with their newest event and owner (Start).
  void LoadRemoteRanks();
  void UploadLoop();
  // Reads the remote tier's objects and manifests of the rank into `out`
  // (manifests that do not read back whole are left out).
  absl::Status SeedRemote(const RankKey& key, RemoteRank* out);
  // After seeding: whether the remote tier's newest step is of this node's
  // history of the rank; the reason to block it otherwise ("" = it is).
  absl::StatusOr<std::string> CheckRemoteHistory(const RankKey& key);
  // The rank's history was cut back to `step` (DiscardAfter, a pull).
  void NoteRewind(const std::string& job, uint32_t rank, uint64_t step);
  // Uploads the rank's oldest local event above its remote step: its plan's
  // versions not there yet, then its manifest.
  absl::Status UploadNext(const RankKey& key);
  absl::Status RemoteGc(const RankKey& key);
  // Called after the rank's checkpoint events of `steps` were written.
  void NoteLocalEvents(const std::string& job, uint32_t rank, uid_t owner,
                       const std::vector<std::pair<uint64_t, uint64_t>>& steps_bytes);
  // Counts and records a failed remote operation; `owner` is the uid whose
  // job it concerns (the error is shown to that uid and root only).
  void NoteRemoteFailure(const absl::Status& s, const std::string& what, uid_t owner = 0);

  // Immutable after construction (io_backend_name_ and reconcile_: after Start).
  const EngineOptions options_;
  Index* const index_;
  LayerStore* const store_;
  StagingPool* const pool_;
  std::string io_backend_name_;
  Clock* const clock_;  // options_.clock or the real clock
  const absl::Time started_ = absl::Now();
  ReconcileReport reconcile_;
  std::unique_ptr<drift::DriftKernel> drift_kernel_;
  std::unique_ptr<CudaIpc> own_cuda_ipc_;  // when options_.cuda_ipc is null
  CudaIpc* cuda_ipc_;
  // What Status reports about CUDA, probed once (the watchdog calls Status
  // every few seconds; the device count does not change under a process).
  const std::string gpu_support_;

  std::vector<std::thread> snapshot_threads_;
  std::vector<std::thread> writer_threads_;
  std::unique_ptr<Publisher> publisher_;  // from Start to the end of Shutdown
  std::thread gc_thread_;
  std::thread watch_thread_;

  // Per-uid usage; declared before the ranks, whose queued steps hold
  // charges against it, so that it outlives them.
  QuotaTable quota_;

  // Locks. mu_ guards the engine-wide state below; each rank's mutable state
  // has its own mutex (Rank::mu, rank_state.h). Lock order:
  //   job_mu_ -> mu_ -> Rank::event_mu -> Rank::mu -> leaf mutexes
  // (LeaseTable, StagingPool, Metrics). Rank::event_mu is never taken with
  // mu_ held. No file I/O, index write or CUDA call happens under mu_ or
  // Rank::mu. Waits on one rank's state wait on its Rank::mu.
  absl::Mutex job_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // job ownership: check-and-create is one step
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;       // no new steps; snapshot workers exit
  bool stop_writers_ ABSL_GUARDED_BY(mu_) = false;   // writers exit, queue discarded
  std::map<RankKey, std::shared_ptr<Rank>> ranks_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Rank>> snapshot_ready_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<WriteTask>> write_queue_ ABSL_GUARDED_BY(mu_);
  // Versions taken from write_queue_ whose commit has not finished yet
  // (being written, or waiting for the publisher).
  unsigned commits_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<RankKey, uid_t> registering_ ABSL_GUARDED_BY(mu_);  // rank -> registering uid
  // Jobs DeleteJob is deleting: registrations of them are refused.
  std::set<std::string> deleting_jobs_ ABSL_GUARDED_BY(mu_);

  LeaseTable leases_;
  DiskBudget disk_;
  // Declared after pool_ is set (the pool outlives the engine): its images
  // are pool chunks.
  MemoryTier memory_tier_;

  // The remote tier's state; remote_mu_ is a leaf (nothing is called out
  // while it is held).
  absl::Mutex remote_mu_;
  // Bumped on new local events, a rewind and stopping: the uploader waits for
  // a change (an absl::Condition, not a CondVar: TSan's view of Debian's
  // uninstrumented absl follows Lock/Unlock/Await only).
  uint64_t remote_wakeups_ ABSL_GUARDED_BY(remote_mu_) = 0;
  std::map<RankKey, RemoteRank> remote_ ABSL_GUARDED_BY(remote_mu_);
  std::set<RankKey> pulling_ ABSL_GUARDED_BY(remote_mu_);
  absl::Status remote_error_ ABSL_GUARDED_BY(remote_mu_);
  uid_t remote_error_uid_ ABSL_GUARDED_BY(remote_mu_) = 0;  // whose job it concerns
  bool remote_stop_ ABSL_GUARDED_BY(remote_mu_) = false;
  std::atomic<bool> remote_stopping_{false};  // mirrors remote_stop_ for the upload workers
  // RemoteJobs' listing of the remote tier, kept for a while (each listing
  // reads every key under jobs/): job -> (owner, rank -> newest manifest).
  struct RemoteJobsCache {
    absl::Time at = absl::InfinitePast();
    std::map<std::string, std::pair<uid_t, std::map<uint32_t, uint64_t>>> jobs;
  };
  RemoteJobsCache remote_jobs_cache_ ABSL_GUARDED_BY(remote_mu_);
  std::thread upload_thread_;

  // Counters (relaxed; read by GetStatus and the metrics).
  std::atomic<uint64_t> versions_committed_{0};
  std::atomic<uint64_t> bytes_committed_{0};
  std::atomic<uint64_t> snapshots_skipped_{0};
  std::atomic<uint64_t> write_errors_{0};
  std::atomic<bool> shutting_down_{false};  // mirrors stopping_ for lock-free checks
};

}  // namespace ckpt
