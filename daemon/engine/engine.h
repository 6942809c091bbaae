// Engine: registered ranks and the per-step pipeline. The facade the gRPC
// handlers call, with one file per stage and one component per tier or
// accounting table (docs/architecture.md draws them with their threads and
// locks).
//
//   StepDone(t) --queue--> snapshot worker: select layers, copy them from the
//   rank's mapped buffers into staging, mark snapshot t taken (WaitSnapshot
//   returns) --queue--> writer threads: commit each layer version
//   (LayerStore::Write, then the publisher) --> when every version of step t
//   and every earlier step is finished, the step's EventRecord is written
//   (one sync batch) and t becomes durable (WaitDurable returns) --> each
//   DurableTier (the remote tier) copies it behind.
//
// Stage map: every method of Engine lives in the file its group names
// (`// ---- what (file.cc) ----`); tests/layering/check_stage_map.py checks
// it. The components the engine holds live in files of their own:
//
//   rank_state.h        RankState: one rank's state and its mutex
//   job_owners.h        which uid each job belongs to
//   history.h           a rank's local history as GC and tiers cut it
//   quota.h, disk_budget.h, leases.h   per-uid quotas, the disk bound, leases
//   memory_tier.h       the newest committed version of each layer, in memory
//   durable_tier.h      the interface of the tiers behind the local store
//   remote_tier.h       the remote tier: uploader thread, retention, pulls
//   peer_tier.h         the peer tier: a remote tier per peer node, placement
// and its options in engine_options.h.
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
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/common/clock.h"
#include "daemon/common/holding.h"
#include "daemon/engine/caller.h"
#include "daemon/engine/disk_budget.h"
#include "daemon/engine/durable_tier.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/history.h"
#include "daemon/engine/job_owners.h"
#include "daemon/engine/leases.h"
#include "daemon/engine/memory_tier.h"
#include "daemon/engine/peer_tier.h"
#include "daemon/engine/quota.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/engine/step_types.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/gpu/gpu_health.h"
#include "daemon/io/io_backend.h"
#include "daemon/metrics/metrics.h"
#include "daemon/policy/layercheck.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"
#include "daemon/remote/remote_auth.h"
#include "daemon/remote/remote_store.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/publisher.h"
#include "daemon/store/retention.h"
#include "kernels/drift.h"

namespace ckpt {

// What DeleteJob removed.
struct JobDeleted {
  uint32_t ranks = 0;
  uint64_t versions = 0;
  uint64_t bytes = 0;
  uint64_t events = 0;
};

struct PendingStep;  // rank_state.h
struct RankState;    // rank_state.h
struct SnapTask;     // rank_state.h
struct SpillState;   // rank_state.h
struct WriteTask;    // rank_state.h

class Engine {
 public:
  // ---- construction, start and shutdown (engine.cc) ----
  Engine(EngineOptions options, Index* index, LayerStore* store, StagingPool* pool);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts the snapshot and writer threads and the tiers. UNAVAILABLE when
  // the requested io backend cannot be created.
  absl::Status Start();
  // Refuses new steps, lets writers finish queued versions for up to `grace`,
  // discards what is left (nothing half-visible), stops the tiers and
  // releases every mapping.
  void Shutdown(absl::Duration grace);
  void RecordReconcile(const ReconcileReport& report) { reconcile_ = report; }

  // ---- the rank registry (engine_registry.cc) ----
  // Validates (registration.h), claims nothing itself: `fds` are the host
  // regions the caller handed over, or req.gpu names GPU allocations (opened
  // only after the checks and the ownership test passed, so a refused call
  // maps nothing). Records the job (owner = caller) and the rank's table, and
  // returns a new generation. A live registration of the same rank is
  // drained (bounded) and replaced. The rank's memory (GPU mappings or memfd
  // regions) is released again when the calling process (caller.pid) exits.
  // `held` (may be null) is what the handover counts for `fds`: the
  // registration keeps it as long as it keeps the regions, so they count
  // against the caller's descriptor caps for as long as they are held.
  absl::StatusOr<Registered> Register(const Registration& req, std::vector<UniqueFd> fds,
                                      const Caller& caller,
                                      std::unique_ptr<Holding> held = nullptr);
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
  absl::StatusOr<uint64_t> ReleaseRank(const std::string& job, uint32_t rank, const Caller& caller);
  // Root's release of a whole job that stays released: the job is marked
  // evicted (JobOwners::Evict) so that no rank of it registers again until
  // it is deleted, registrations under way are waited for (bounded by
  // drain_timeout), then every registered rank is released. Returns how
  // many were. PERMISSION_DENIED for any caller but root.
  absl::StatusOr<uint32_t> EvictJob(const std::string& job, const Caller& caller)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- the snapshotter (engine_snapshot.cc) ----
  // Queues the step and returns. FAILED_PRECONDITION for a stale
  // generation or a step not above the last one; INVALID_ARGUMENT for an
  // oversized aux blob or a bad layer list.
  absl::Status StepDone(StepReport report, const Caller& caller);
  // The fence: returns once snapshot `step` is in staging.
  // DEADLINE_EXCEEDED at `deadline` (the snapshot is then void, see
  // docs/design-changes.md); ABORTED when the registration ended.
  absl::StatusOr<SnapshotTaken> WaitSnapshot(const RankRef& rank, uint64_t step,
                                             const Caller& caller, absl::Time deadline);

  // ---- LayerCheck (engine_layercheck.cc) ----
  // Multi-rank LayerCheck: the rank's partial per-layer sums of `step` (waits
  // until computed), and the all-reduced vector that lets the step proceed.
  absl::StatusOr<std::vector<drift::LayerSums>> DriftPartials(const RankRef& rank, uint64_t step,
                                                              const Caller& caller,
                                                              absl::Time deadline);
  absl::Status SetGlobalDrift(const RankRef& rank, uint64_t step,
                              const std::vector<drift::LayerSums>& global, const Caller& caller);

  // ---- the event sequencer (engine_events.cc) ----
  // The durable step once every layer's newest version selected at or before
  // `step` is durable. ABORTED when some of them failed (they are retried
  // next step). With a `tier` ("remote"), the step must also be durable in
  // that tier: FAILED_PRECONDITION when ckptd has no such tier,
  // DEADLINE_EXCEEDED when its copy has not finished at `deadline`.
  absl::StatusOr<uint64_t> WaitDurable(const RankRef& rank, uint64_t step, const Caller& caller,
                                       absl::Time deadline, std::string_view tier = {});

  // ---- recovery (engine_recovery.cc) ----
  // The composite plan of the rank for `target_step` (0 = its latest
  // durable step); recovery/plan.h says what it holds and when NOT_FOUND.
  absl::StatusOr<CompositePlan> Plan(const std::string& job, uint32_t rank, uint64_t target_step,
                                     const Caller& caller, uint64_t older_within = 0);
  // Writes the plan for `target_step` into the registration's buffers through
  // the verified restore loop (recovery/restore.h). FAILED_PRECONDITION while
  // steps of this registration are still being snapshotted. With
  // `discard_later`, the rank's versions and events after the restored step
  // are then deleted (versions first, so a crash in between leaves no later
  // version under a surviving event), and the next step may be target + 1.
  // `older_within`: what a lost version's layer may take instead (BuildPlan).
  absl::StatusOr<Restored> Restore(const RankRef& rank, uint64_t target_step, const Caller& caller,
                                   bool discard_later = false, uint64_t older_within = 0);
  // Streams a rank's composite checkpoint: the header, then every tensor's
  // verified bytes. `sink` returns false when the reader went away (CANCELLED).
  // `region` (may be empty): the caller's sealed memfd that
  // req.region_token handed over; mapped here, the bytes go into it when it
  // is long enough (ExportPlan), read on two threads.
  absl::Status Export(const v1::ExportRequest& req, const Caller& caller,
                      const std::function<bool(const v1::ExportChunk&)>& sink,
                      UniqueFd region = UniqueFd());
  // Reads back every committed version of the job (or one rank) and checks
  // every checksum; failures are listed in the reply, not returned as errors.
  absl::StatusOr<v1::VerifyReply> Verify(const v1::VerifyRequest& req, const Caller& caller);

  // ---- retention (engine_retention.cc) ----
  // Applies the retention policy to every rank of the job (retention.h).
  // Ranks a restore or export is reading are skipped and counted as busy.
  absl::StatusOr<v1::GcReply> Gc(const v1::GcRequest& req, const Caller& caller);
  // Deletes the job's whole history (every version file, event, rank and
  // the job record); the id is free again. Owner or root. FAILED_PRECONDITION
  // while a rank of it is registered by a live trainer (ReleaseRank or stop
  // it first); ABORTED while a rank of it is registering or being read by a
  // restore, verify or export (retry).
  absl::StatusOr<JobDeleted> DeleteJob(const std::string& job, const Caller& caller);

  // ---- admin queries (engine_admin.cc) ----
  // The daemon's state. Node-wide figures (pool, disk, counters, uptime) are
  // the same for every caller; `jobs` and `registered_ranks` count only the
  // caller's own unless the caller is root, so no uid learns how many jobs
  // or trainers other users have.
  v1::StatusReply GetStatus(const Caller& caller = Caller());
  // The caller's jobs (root: all), those only a tier holds included.
  absl::StatusOr<v1::JobsReply> Jobs(const Caller& caller);
  absl::StatusOr<v1::LayersReply> Layers(const v1::LayersRequest& req, const Caller& caller);
  absl::StatusOr<v1::HistoryReply> History(const v1::HistoryRequest& req, const Caller& caller);
  // Refreshes the gauges that are read at scrape time (pool, queue,
  // durability lag, disk, per-layer staleness and drift, the tiers').
  void CollectMetrics();
  uint64_t disk_bytes_used() const { return disk_.used(); }
  // The quotas in force (after Start) and what each uid holds.
  QuotaLimits quota_limits() const { return quota_.limits(); }
  QuotaTable::Usage quota_usage(uid_t uid) const { return quota_.Get(uid); }
  QuotaTable::Usage job_quota_usage(std::string_view job) const { return quota_.GetJob(job); }
  const char* io_backend_name() const { return io_backend_name_.c_str(); }

 private:
  // ---- construction, start and shutdown (engine.cc) ----
  // Start-up: the per-uid quotas and what the index holds for each uid.
  absl::Status SeedUsage();
  // The tier named `name`, or null.
  DurableTier* TierNamed(std::string_view name) const;
  // On a node with no history of the rank: PullFromNewest over the tiers.
  absl::Status PullFromTiers(const std::string& job, uint32_t rank, const Caller& caller,
                             bool must_know);
  // The owner the tiers record for `job` (the first with a record), checked
  // against this node's (`local`, when the job exists here): PERMISSION_
  // DENIED when they differ; a tier that cannot be read is logged and
  // skipped (its uploader claims the job before anything goes there).
  absl::StatusOr<std::optional<uid_t>> TierOwnerOf(const std::string& job,
                                                   std::optional<uid_t> local);
  // Records `owner` as the job's owner in every tier that has no record
  // yet; PERMISSION_DENIED when one names another uid.
  absl::Status ClaimInTiers(const std::string& job, uid_t owner);

  // ---- the rank registry (engine_registry.cc) ----
  // The live registration of (job, rank) with this generation, for this
  // caller: NOT_FOUND (kNotRegistered), PERMISSION_DENIED,
  // FAILED_PRECONDITION (kStaleGeneration), or UNAVAILABLE (kShuttingDown)
  // once ckptd is stopping.
  absl::StatusOr<std::shared_ptr<RankState>> FindLocked(const RankRef& ref, const Caller& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same with mu_ taken and released: for calls that then wait on the
  // rank's own mutex.
  absl::StatusOr<std::shared_ptr<RankState>> Find(const RankRef& ref, const Caller& caller)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Who a new registration's job belongs to: its owner here (`local_owner`)
  // or in the tiers, else the caller. PERMISSION_DENIED when that is another
  // uid (and the caller is not root), or when this node and a tier disagree.
  absl::StatusOr<uid_t> OwnerForRegistration(const std::string& job,
                                             std::optional<uid_t> local_owner,
                                             const Caller& caller);
  // Builds the state of a new registration (its memory, layer templates,
  // policy), not yet published.
  // What a registration handed over: its host regions mapped, or the
  // descriptors of its GPU pages (imported by GpuMemory::Open).
  struct HandedOver {
    std::vector<MappedRegion> regions;
    std::vector<UniqueFd> gpu_pages;
  };
  absl::StatusOr<std::shared_ptr<RankState>> NewRank(const Registration& req, HandedOver memory,
                                                     std::unique_ptr<Holding> held, uid_t owner,
                                                     const Caller& caller);
  // A new registration's steps, from the rank's history in the index: its
  // latest durable step (returned), each layer's newest version at or below
  // it. DEADLINE_EXCEEDED past `deadline`.
  absl::StatusOr<uint64_t> ResumeFromIndex(const std::shared_ptr<RankState>& r,
                                           absl::Time deadline);
  // A rank's new table counts against its owner's index quota. It replaces
  // the rank's old table, so only what it adds is reserved, before anything
  // of a new job is created (whatever generation it takes); RESOURCE_EXHAUSTED
  // (kQuota) past the quota. PutTable writes it and settles the charge to
  // the table's real size; on failure the reservation is given back.
  struct TableCharge {
    uint64_t reserved = 0;
    uint64_t old_bytes = 0;
  };
  absl::StatusOr<TableCharge> ReserveTable(const RankState& r);
  // Register's first step: the registration's host regions mapped (or its
  // GPU handover checked against the page descriptors in `fds`), and the
  // registration checked against their sizes and the limits.
  absl::StatusOr<HandedOver> MapRegistration(const Registration& req, std::vector<UniqueFd> fds);
  // Register's fifth: a new job's records (`job_exists` false) and the
  // rank's table with a fresh generation, charged to the index quota.
  absl::Status CreateRankRecords(RankState* r, bool job_exists, uid_t owner);
  absl::Status PutTable(const RankState& r, const TableCharge& charge);
  // Reserves the caller's registration slot for `key`; Unclaim gives it back.
  absl::Status ClaimRegistration(const RankKey& key, const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);
  void UnclaimRegistration(const RankKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases the memory (GPU mappings, memfd regions) of ranks whose trainer
  // process exited.
  void WatchTrainersLoop();
  // Releases the memory of every rank on a GPU a sticky CUDA error poisoned
  // (GpuHealth), with the reason; their StepDone fails with it. Cheap when
  // nothing was poisoned since the last call; `also` (may be null) is
  // checked (and released) either way.
  void ReleaseRanksOnPoisonedGpus(RankState* also = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a registration: inactive, parked steps dropped, memory moved to
  // `closing` (dropped by the caller once every lock is released).
  void EndRegistrationLocked(RankState& r, const std::string& why,
                             std::vector<std::shared_ptr<RankMemory>>* closing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (until `deadline`) for what the ended registration `r` still has
  // in flight, then forgets it.
  absl::Status DrainAndForget(const std::shared_ptr<RankState>& r, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- the snapshotter (engine_snapshot.cc) ----
  void SnapshotLoop();
  // The next rank to snapshot: the first of snapshot_ready_, once the ranks
  // of snapshot_waiting_ whose poll is due have joined its end. False once
  // stopping (every queued rank is let go).
  bool NextRankLocked(std::shared_ptr<RankState>* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `task`'s step can be snapshotted now: OK when its device has
  // finished it, the error that gives the step up (its deadline passed, its
  // fence gave up, the rank was released, ckptd stops, the query failed),
  // or nullopt while it must wait. Never waits.
  std::optional<absl::Status> PollStep(const std::shared_ptr<RankState>& r, SnapTask& task,
                                       RankMemory* memory) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts `task` back at the front of its rank's queue, and the rank in
  // snapshot_waiting_ until its next poll (after a pause that grows).
  void ParkForPoll(const std::shared_ptr<RankState>& r, SnapTask task) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns false when the task now waits for SetGlobalDrift.
  // `memory` is the rank's memory (null once released); `ready` is
  // PollStep's answer (an error: nothing is copied, every layer retried).
  bool Snapshot(const std::shared_ptr<RankState>& r, SnapTask& task, RankMemory* memory,
                absl::Status ready);
  // Copies the selected layers of `task` into staging; `staged` holds what
  // is not handed to the writers yet, `skipped` the layers left out.
  // Returns the copy's status (an error drops what `staged` holds).
  absl::Status CopyLayers(const std::shared_ptr<RankState>& r, SnapTask& task, RankMemory* memory,
                          std::vector<StagedVersion>* staged, std::vector<uint32_t>* skipped,
                          SpillState* spill);
  // Publishes the snapshot: queues what was staged, seals the step, records
  // its result. Returns whether its event can be written at once.
  bool FinishSnapshot(const std::shared_ptr<RankState>& r, SnapTask& task,
                      std::vector<StagedVersion>& staged, std::vector<uint32_t>& skipped,
                      SpillState* spill) ABSL_LOCKS_EXCLUDED(mu_);
  // Hands the versions `staged` so far to the writers before the snapshot
  // goes on (the pool has no room for the next one), unless the fence was
  // abandoned, the rank unregistered or ckptd is stopping: then they go to
  // `skipped` and it returns false (the snapshot copies nothing more).
  bool SpillStaged(const std::shared_ptr<RankState>& r, SnapTask& task,
                   std::vector<StagedVersion>& staged, std::vector<uint32_t>* skipped,
                   SpillState* spill) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps the staging chunks of `staged` out of the pool while copies into
  // them, not seen to complete, may still land: `memory` holds them until it
  // sees its copies complete (RankMemory::HoldUntilCopiesLand). Nothing
  // (no log, no count) when `staged` is empty.
  void WithholdStaging(const std::shared_ptr<RankState>& r, const SnapTask& task,
                       RankMemory* memory, std::vector<StagedVersion>& staged)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- LayerCheck (engine_layercheck.cc) ----
  // Builds the rank's drift tasks over `memory` (the rank's, not published
  // yet) and picks the drift kernel that can read it.
  absl::Status SetUpLayerCheck(const Registration& req, RankMemory* memory, RankState* r);
  // Fills task.layers from the drift of this step, read from `memory`.
  // Returns false when the step waits for the all-reduced drift vector.
  bool DecideLayerCheck(const std::shared_ptr<RankState>& r, SnapTask& task, RankMemory* memory);

  // ---- the commit pipeline (engine_commit.cc): writers write each
  //      version's bytes, the publisher makes groups of them durable ----
  void WriterLoop(std::unique_ptr<IoBackend> io);
  // What follows a version's commit, on the publisher's thread (or the
  // writer's, when it failed before): metrics, the memory tier, the rank's
  // step bookkeeping; gives back the quota and disk room `reserved` for it
  // when it failed.
  void FinishCommit(std::unique_ptr<WriteTask> task, bool reserved,
                    absl::StatusOr<store::VersionRecord> rec, const CommitTimings& timings)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- the event sequencer (engine_events.cc) ----
  void FinishVersion(const std::shared_ptr<RankState>& r, uint64_t step, uint32_t layer,
                     const absl::StatusOr<store::VersionRecord>& result, uint64_t bytes);
  void AdvanceEvents(const std::shared_ptr<RankState>& r);
  // WaitDurable's local half: the rank's durable step once it is at least
  // `step`, and no layer selected at or before it failed.
  absl::StatusOr<uint64_t> WaitLocallyDurable(const std::shared_ptr<RankState>& r, uint64_t step,
                                              absl::Time deadline);

  // ---- recovery (engine_recovery.cc) ----
  // Restore(discard_later): deletes the rank's versions, then its events,
  // after `step` (under the rank's lease), and tells the tiers.
  absl::Status DiscardAfter(const std::string& job, uint32_t rank, uint64_t step);
  // Marks the registration `ref` as restoring and returns it with its
  // memory; FAILED_PRECONDITION while it has steps in the pipeline.
  absl::StatusOr<std::pair<std::shared_ptr<RankState>, std::shared_ptr<RankMemory>>> BeginRestore(
      const RankRef& ref, const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);
  // Plans and reads under the rank's lease, into `memory`. A version found
  // damaged on disk is replaced by a tier's intact copy of it, else marked
  // lost (ReplaceOrQuarantine), and the restore planned again: the same
  // version, else a refusal or the older one `older_within` allows; up to
  // kMaxDamagedFallbacks times.
  static constexpr int kMaxDamagedFallbacks = 8;
  absl::StatusOr<Restored> RestoreUnderLease(const RankState& r, RankMemory* memory,
                                             uint64_t target_step, bool discard_later,
                                             uint64_t older_within);
  // After a restore of `plan` that took older versions for lost ones: when
  // the step is the rank's newest (training goes on from it), forgets them.
  absl::Status AcceptLosses(const CompositePlan& plan);
  // For each version of (job, rank) in `damaged`: the first tier that holds
  // an intact copy of it puts that copy in place (DurableTier::Repair; its
  // name goes into `*repaired` by layer, when given); a version no tier
  // replaces is marked lost (LocalHistory::QuarantineVersion). Each is
  // logged with `why`. The caller holds the rank's lease.
  absl::Status ReplaceOrQuarantine(uid_t owner, const std::vector<VersionKey>& damaged,
                                   const absl::Status& why,
                                   std::map<uint32_t, std::string>* repaired = nullptr);
  // The rank's state after a successful restore (or only its flag, after a
  // failed one).
  void EndRestore(RankState& r, const absl::StatusOr<Restored>& reply, bool discard_later);
  // What every restore, verify and export reads from: the index, the local
  // store, the memory tier, `readers` I/O backends.
  absl::StatusOr<RecoverySources> Sources(unsigned readers,
                                          std::vector<std::unique_ptr<IoBackend>>* io);

  // ---- retention (engine_retention.cc) ----
  absl::Status GcRank(const std::string& job, uint32_t rank, bool dry_run, v1::GcReply* reply);
  // What the tiers need kept of the rank (the smallest copied step).
  std::optional<LocalKeep> KeepForTiers(const RankKey& key) const;
  // DeleteJob's parts: ends the job's registrations (refusing when one is
  // live), then deletes each rank's history under its GC turn.
  absl::Status EndJobRegistrations(const std::string& job,
                                   std::vector<std::shared_ptr<RankState>>* ended)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DeleteJobHistory(const std::string& job, JobDeleted* out);
  void GcLoop();

  // ---- admin queries (engine_admin.cc) ----
  // Registered ranks; with `stale_only`, those whose trainer exited (memory
  // released).
  size_t ActiveRanksLocked(bool stale_only = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The registration fields of a rank's line in Jobs.
  void FillRegistration(const RankKey& key, v1::RankInfo* ri) ABSL_LOCKS_EXCLUDED(mu_);
  // The durability lag over the live ranks, into the gauges.
  void CollectLagLocked(Metrics* m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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

  // Components, each thread-safe with a lock of its own (a leaf, except
  // JobOwners, taken first). Per-uid usage is declared before the ranks,
  // whose queued steps hold charges against it (options_.quota when given).
  QuotaTable own_quota_;
  QuotaTable& quota_;
  LeaseTable leases_;
  GpuHealth gpu_health_;                    // devices a sticky CUDA error poisoned
  std::atomic<uint64_t> poisoned_seen_{0};  // gpu_health_.version() acted on
  DiskBudget disk_;
  JobOwners owners_;
  LocalHistory history_;
  // Declared after pool_ is set (the pool outlives the engine): its images
  // are pool chunks.
  MemoryTier memory_tier_;
  // The tiers behind the local store, in the order a pull asks them.
  std::vector<std::unique_ptr<DurableTier>> tiers_;
  PeerTier* peer_tier_ = nullptr;  // in tiers_, when there is one

  // Locks. mu_ guards the engine-wide state below; each rank's mutable state
  // has its own mutex (RankState::mu, rank_state.h). Lock order:
  //   JobOwners -> mu_ -> RankState::event_mu -> RankState::mu -> leaf mutexes
  // (LeaseTable, StagingPool, Metrics, GpuHealth, the tiers). RankState::event_mu is
  // never taken with mu_ held. No file I/O, index write or CUDA call happens
  // under mu_ or RankState::mu. Waits on one rank's state wait on its
  // RankState::mu.
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;      // no new steps; snapshot workers exit
  bool stop_writers_ ABSL_GUARDED_BY(mu_) = false;  // writers exit, queue discarded
  std::map<RankKey, std::shared_ptr<RankState>> ranks_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<RankState>> snapshot_ready_ ABSL_GUARDED_BY(mu_);
  // Ranks whose next step waits for its device (a GPU step event still
  // pending), by the time of their next poll; still snap_busy.
  std::multimap<absl::Time, std::shared_ptr<RankState>> snapshot_waiting_ ABSL_GUARDED_BY(mu_);
  // Grows with every rank parked in snapshot_waiting_ (ParkForPoll): an
  // idle snapshot thread's wait ends, and it computes its deadline again.
  uint64_t waiting_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::unique_ptr<WriteTask>> write_queue_ ABSL_GUARDED_BY(mu_);
  // Versions taken from write_queue_ whose commit has not finished yet
  // (being written, or waiting for the publisher).
  unsigned commits_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<RankKey, uid_t> registering_ ABSL_GUARDED_BY(mu_);  // rank -> registering uid
  // Jobs DeleteJob is deleting: registrations of them are refused.
  std::set<std::string> deleting_jobs_ ABSL_GUARDED_BY(mu_);

  // Counters (relaxed; read by GetStatus and the metrics).
  std::atomic<uint64_t> versions_committed_{0};
  std::atomic<uint64_t> bytes_committed_{0};
  std::atomic<uint64_t> snapshots_skipped_{0};
  std::atomic<uint64_t> write_errors_{0};
  std::atomic<bool> shutting_down_{false};  // mirrors stopping_ for lock-free checks
};

}  // namespace ckpt
