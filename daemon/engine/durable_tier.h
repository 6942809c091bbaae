// DurableTier: a place beyond this node's disk that holds copies of the
// steps that are durable here: the remote tier (an object store or a shared
// directory, remote_tier.h); a peer node's ckptd plugs in the same way.
//
// The engine holds its tiers in a list and talks to each through this
// interface only: it tells a tier what became durable locally, that a rank
// went back, that a job was deleted; it asks a tier how far a rank is
// copied (WaitDurable, lag, reports) and, on a node that has no history of
// a rank, to bring that history here (Pull). A tier copies on its own
// threads, behind the local commit: nothing the engine calls waits for a
// copy except WaitDurable.
//
// Thread-safety: every method is thread-safe. An implementation owns its
// state, its mutex (a leaf for the engine: it calls nothing of the engine's
// while holding it) and its threads (Start .. StopAndJoin).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/engine/caller.h"
#include "daemon/engine/leases.h"
#include "daemon/store/index.h"

namespace ckpt {

// A checkpoint event just written to this node's index.
struct LocalEvent {
  uint64_t step = 0;
  uint64_t bytes = 0;  // the layer bytes the step wrote
};

// How far a tier trails this node, over the ranks of one uid or of all.
struct TierLag {
  uint64_t steps = 0;  // the largest, over the ranks
  uint64_t bytes = 0;  // not yet copied, summed
};

// What Status shows of a tier to one caller.
struct TierReport {
  std::string description;  // where it copies to, without secrets
  TierLag lag;              // over the caller's ranks (root: all)
  std::string error;        // the last failure, or "" (worded for the caller)
};

// A job the tier holds, as Jobs lists it.
struct TierJob {
  std::string job;
  uid_t owner = 0;
  std::map<uint32_t, uint64_t> newest_step;  // rank -> newest step copied there
};

// What local retention must keep of a rank for a tier: the events above
// `copied_step` are not copied yet; GC keeps the oldest `max_pending` of
// them (a long outage costs the newest steps only).
struct LocalKeep {
  uint64_t copied_step = 0;
  uint32_t max_pending = 0;
};

class DurableTier {
 public:
  virtual ~DurableTier() = default;

  // The tier's name: the label of its metrics and the `tier` of WaitDurable.
  virtual const char* name() const = 0;

  // Starts the tier's threads (after the engine's index and store are
  // ready); StopAndJoin ends them: what is not copied yet is copied after
  // the next start.
  virtual void Start() = 0;
  virtual void StopAndJoin() = 0;

  // The rank registered here; `job_nodes` names the node of each rank of
  // its job as the trainer reported it (empty: not reported). A tier that
  // places copies by topology (the peer tier) places the job now.
  virtual void OnRegister(const RankKey& rank, const std::vector<std::string>& job_nodes) {}
  // The rank's checkpoint events `events` were written locally (in step
  // order), its job owned by `owner`.
  virtual void OnLocalEvents(const RankKey& rank, uid_t owner,
                             absl::Span<const LocalEvent> events) = 0;
  // The rank's history was cut back to `step` (a restore that discarded
  // later steps, or a pull that fell back past damaged ones): copies above
  // it are of a discarded history.
  virtual void OnRewind(const RankKey& rank, uint64_t step) = 0;
  // The job was deleted on this node; the tier stops copying it (its copies
  // there stay).
  virtual void ForgetJob(const std::string& job) = 0;

  // Returns the rank's newest step copied to the tier once it is at least
  // `step`. DEADLINE_EXCEEDED at `deadline`; ABORTED when the job was
  // deleted meanwhile; UNAVAILABLE (kShuttingDown) when ckptd stops.
  // REQUIRES: `step` is durable locally.
  virtual absl::StatusOr<uint64_t> WaitDurable(const RankKey& rank, uint64_t step,
                                               absl::Time deadline) = 0;
  // The rank's newest step copied there (0: none), and every step the tier
  // holds a copy of.
  virtual uint64_t DurableStep(const RankKey& rank) = 0;
  virtual std::set<uint64_t> DurableSteps(const RankKey& rank) = 0;
  // What local GC keeps of the rank for this tier.
  virtual LocalKeep KeepLocally(const RankKey& rank) = 0;

  // On a node whose index has no checkpoint event of the rank: brings the
  // rank's newest usable history from the tier into the local store, each
  // version checked before it becomes visible. OK with nothing done when
  // the tier has nothing of the rank. PERMISSION_DENIED when the job
  // belongs to another uid. With `must_know`, a tier that cannot be read is
  // an error; without, it is logged and OK is returned.
  virtual absl::Status Pull(const std::string& job, uint32_t rank, const Caller& caller,
                            bool must_know) = 0;
  // The newest step the tier lists of the rank (0: none), read from its
  // listing alone, so a pull can start at the tier that is furthest ahead;
  // the step itself may still prove unusable. Without `must_know`, a tier
  // whose last operation failed answers 0 at once.
  virtual absl::StatusOr<uint64_t> NewestListedStep(const std::string& job, uint32_t rank,
                                                    bool must_know) = 0;
  // A version this node holds (`rec`, of the job `owner` owns) was found
  // damaged or missing by a read: puts the tier's copy of that same version
  // in its place (LayerStore::Replace: the copy is checked against `rec`
  // before the damaged file is moved to quarantine/). true when replaced;
  // false when the tier holds no intact copy of it (nothing changed then).
  // Other errors: the tier could not be read.
  virtual absl::StatusOr<bool> Repair(const VersionKey& key, const store::VersionRecord& rec,
                                      uid_t owner) = 0;
  // The caller's jobs (root: all) that the tier holds.
  virtual absl::StatusOr<std::vector<TierJob>> Jobs(const Caller& caller) = 0;

  // A job's owner is one fact for every node that shares the tier. JobOwner
  // is the uid the tier records for `job` (nullopt: no record); DATA_LOSS
  // when its record is not authentic, UNAVAILABLE (and other codes) when
  // the tier cannot be read. ClaimJob records `owner` unless a record exists:
  // OK when it now names `owner`, PERMISSION_DENIED when it names another
  // uid. Without `must_know` (Register), a tier whose last operation failed
  // answers UNAVAILABLE at once rather than wait for its store.
  virtual absl::StatusOr<std::optional<uid_t>> JobOwner(const std::string& job, bool must_know) = 0;
  virtual absl::Status ClaimJob(const std::string& job, uid_t owner, bool must_know) = 0;

  virtual TierReport Report(const Caller& caller) = 0;
  // Refreshes the tier's scrape-time gauges.
  virtual void CollectMetrics() = 0;
};

// Brings (job, rank)'s history from the first of `tiers` that has one,
// starting at the tier that lists the newest step (the given order among
// equals): restoring from one that is behind would take an older step, and
// the tier ahead would then refuse this node's history as not its own.
// `arrived()` says whether a history is here after a tier's pull. A tier
// that cannot be read (a peer that is down with the node it served) leaves
// the rank to the next one; its error stands only when no tier brought a
// history, and, with `any_answer`, only when no tier answered at all (the
// peer nodes of one tier: one node that is down, the lost node itself
// among them, must not stop every plan and registration). Another uid's
// job (PERMISSION_DENIED) ends it at once.
absl::Status PullFromNewest(const std::vector<DurableTier*>& tiers, const std::string& job,
                            uint32_t rank, const Caller& caller, bool must_know,
                            const std::function<absl::StatusOr<bool>()>& arrived,
                            bool any_answer = false);

// Calls fn(rank, owner uid, newest step) for each rank of `job` with an
// event in this node's index: what a tier must copy of the job. Nothing
// when the job's record or its ranks cannot be read.
void ForEachNewestRankEvent(
    Index* index, const std::string& job,
    const std::function<void(uint32_t rank, uid_t owner, uint64_t step)>& fn);

}  // namespace ckpt
