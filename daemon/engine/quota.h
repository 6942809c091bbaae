// QuotaTable: what each uid's jobs hold on the data file system and in
// flight, against per-uid quotas, so that one user cannot fill the disk (with
// layer files or with index records such as aux blobs) or the daemon's memory
// (with queued steps) for everyone; and what each job holds on disk, against
// a per-job quota, so that one job of a user cannot take all of that user's.
//
// Accounted per uid (the owner of the job), and the bytes per job too:
//   - file bytes: every committed layer version's file;
//   - replica bytes (per uid only): the replicas this node keeps for the
//     uid's jobs on other nodes (the peer tier, docs/peer.md); they count
//     against the uid's disk quota here like its own files;
//   - index bytes: what the uid's records add to RocksDB, as a fixed
//     estimate: an event counts as its aux blob plus kEventIndexOverhead, a
//     version record as kVersionIndexBytes;
//   - queued steps: steps from StepDone until their checkpoint event is
//     written or dropped. The uid's registered ranks share its bound
//     equally: one rank may hold at most max_queued_steps_per_uid / (the
//     uid's registered ranks) of them (at least one), so a rank that runs
//     ahead of the disk cannot take the whole budget and starve the uid's
//     other ranks.
// Disk quota = file bytes + index bytes + replica bytes; index quota = index
// bytes alone;
// per-job disk quota = the job's file bytes + index bytes.
// The engine seeds the table from the index at start (so the figures survive
// restarts), charges as it writes and releases what GC deletes.
//
// A step's index bytes and its queue slot are reserved at StepDone, before
// anything is written, by a StepCharge that travels with the step; so
// concurrent steps can never take a uid past its quota.
//
// Used by the engine (StepDone, the writers, the event sequencer, GC, admin).
// Thread-safety: thread-safe; mu_ is a leaf mutex (taken under RankState::mu).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {

// Index bytes an event counts for beyond its aux blob (key, lr, layer list,
// counters, RocksDB's per-entry overhead), and a version record in all.
inline constexpr uint64_t kEventIndexOverhead = 512;
inline constexpr uint64_t kVersionIndexBytes = 1024;
inline uint64_t EventIndexBytes(uint64_t aux_bytes) { return aux_bytes + kEventIndexOverhead; }

// Each bound is per uid unless named per job; 0 = none.
struct QuotaLimits {
  uint64_t disk_bytes = 0;      // layer files + index bytes (max_disk_bytes_per_uid)
  uint64_t index_bytes = 0;     // index bytes (max_index_bytes_per_uid)
  uint64_t queued_steps = 0;    // steps in flight (max_queued_steps_per_uid)
  uint64_t job_disk_bytes = 0;  // one job's layer files + index bytes (max_disk_bytes_per_job)
};

// Whose bytes: the job and the uid that owns it; for a step (AdmitStep),
// the rank as well.
struct QuotaOwner {
  uid_t uid = 0;
  std::string_view job;
  uint32_t rank = 0;
};

// What a quota refused, for ckpt_quota_refused_total{kind}.
enum class QuotaKind { kDisk = 0, kIndex = 1, kQueuedSteps = 2 };
inline constexpr int kQuotaKindCount = 3;
const char* QuotaKindName(QuotaKind kind);

class QuotaTable;

// One step's claim: a queue slot and its event's index bytes. Releases the
// slot when destroyed, and the bytes too unless Keep() said the event was
// written. Move-only; a default-constructed one holds nothing.
class StepCharge {
 public:
  StepCharge() = default;
  ~StepCharge() { Release(); }
  StepCharge(StepCharge&& other) noexcept { *this = std::move(other); }
  StepCharge& operator=(StepCharge&& other) noexcept;
  StepCharge(const StepCharge&) = delete;
  StepCharge& operator=(const StepCharge&) = delete;

  // The step's event is in the index: its bytes stay charged (until GC).
  void Keep() { keep_ = true; }

 private:
  friend class QuotaTable;
  void Release();

  QuotaTable* table_ = nullptr;
  uid_t uid_ = 0;
  std::string job_;
  uint32_t rank_ = 0;
  uint64_t index_bytes_ = 0;
  bool keep_ = false;
};

class QuotaTable {
 public:
  struct Usage {
    uint64_t file_bytes = 0;
    uint64_t index_bytes = 0;
    uint64_t queued_steps = 0;
    uint64_t replica_bytes = 0;  // kept here for the uid's jobs on other nodes
  };

  QuotaTable() = default;
  QuotaTable(const QuotaTable&) = delete;
  QuotaTable& operator=(const QuotaTable&) = delete;

  // REQUIRES: called before any Admit or Reserve (Engine::Start, once the
  // data file system's size is known); Seed and SeedReplica may come first.
  void SetLimits(const QuotaLimits& limits) ABSL_LOCKS_EXCLUDED(mu_);
  QuotaLimits limits() const ABSL_LOCKS_EXCLUDED(mu_);

  // Admits one more step of `owner` (its rank included) whose event will
  // take `event_bytes` of index (EventIndexBytes). RESOURCE_EXHAUSTED with
  // ErrorReason::kQuota, naming the option, when the rank holds its share
  // of max_queued_steps_per_uid (see above), the uid has that many steps in
  // flight, or the bytes would pass its index or disk quota or the job's.
  // On a refusal *refused (when given) says which quota it was.
  absl::StatusOr<StepCharge> AdmitStep(const QuotaOwner& owner, uint64_t event_bytes,
                                       QuotaKind* refused = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Reserves a layer version's file and its record before it is written.
  // RESOURCE_EXHAUSTED (kQuota) when it would pass the uid's disk or index
  // quota or the job's disk quota; nothing is reserved then.
  absl::Status ReserveVersion(const QuotaOwner& owner, uint64_t file_bytes,
                              QuotaKind* refused = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Reserves index bytes of a record other than a version or an event (a
  // rank's table); RESOURCE_EXHAUSTED (kQuota) when they would pass the
  // uid's index or disk quota or the job's disk quota.
  absl::Status ReserveIndex(const QuotaOwner& owner, uint64_t index_bytes,
                            QuotaKind* refused = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseIndex(const QuotaOwner& owner, uint64_t index_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back a version (failed commit, GC) or an event (GC).
  void ReleaseVersion(const QuotaOwner& owner, uint64_t file_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseEvent(const QuotaOwner& owner, uint64_t event_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // A rank of `uid` was registered / its registration ended: the ranks
  // that share the uid's steps in flight.
  void AddRank(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveRank(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  // Start-up: what the index already holds for `owner`.
  void Seed(const QuotaOwner& owner, uint64_t file_bytes, uint64_t index_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A replica of `bytes` kept here for a job of `uid` that runs on another
  // node: RESOURCE_EXHAUSTED (kQuota) when it would pass the uid's disk
  // quota, counting `replaced` bytes (of a replica this one replaces, still
  // charged until it is released) as free. Release gives it back;
  // SeedReplica charges what start-up found.
  absl::Status ReserveReplica(uid_t uid, uint64_t bytes, uint64_t replaced = 0,
                              QuotaKind* refused = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseReplica(uid_t uid, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void SeedReplica(uid_t uid, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  Usage Get(uid_t uid) const ABSL_LOCKS_EXCLUDED(mu_);
  // A job's bytes (queued_steps is not kept per job).
  Usage GetJob(std::string_view job) const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<uid_t, Usage> All() const ABSL_LOCKS_EXCLUDED(mu_);
  // Refusals since start, by kind.
  uint64_t refused(QuotaKind kind) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class StepCharge;
  void ReleaseStep(const QuotaOwner& owner, uint64_t index_bytes, bool keep)
      ABSL_LOCKS_EXCLUDED(mu_);
  using RankKey = std::tuple<uid_t, std::string, uint32_t>;
  // OK when `owner` may add `files` file bytes and `index` index bytes.
  absl::Status CheckBytesLocked(const QuotaOwner& owner, uint64_t files, uint64_t index,
                                QuotaKind* refused) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a refusal of `kind` and returns it as kQuota RESOURCE_EXHAUSTED.
  absl::Status RefuseLocked(QuotaKind kind, QuotaKind* refused, std::string message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (or, with `sign` -1, takes away) bytes from the uid's and the job's
  // usage; a job whose usage reaches zero is forgotten.
  void ChargeLocked(const QuotaOwner& owner, int sign, uint64_t files, uint64_t index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  QuotaLimits limits_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, Usage> usage_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Usage, std::less<>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, uint32_t> ranks_ ABSL_GUARDED_BY(mu_);         // registered ranks per uid
  std::map<RankKey, uint64_t> rank_steps_ ABSL_GUARDED_BY(mu_);  // steps in flight per rank
  uint64_t refused_[kQuotaKindCount] ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace ckpt
