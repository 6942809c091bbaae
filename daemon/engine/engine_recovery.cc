// Recovery in the engine: Plan, Restore, Verify, Export (over recovery/).
#include <cmath>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/export_region.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"
#include "daemon/recovery/export.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"
#include "daemon/recovery/verify.h"

namespace ckpt {

namespace {

// How long a restore, verify or export waits for GC of its rank to finish.
constexpr absl::Duration kLeaseWait = absl::Seconds(30);
// How long Restore waits for a snapshot worker finishing a taken step.
constexpr absl::Duration kSnapshotIdleWait = absl::Seconds(5);

// Another user's job reads exactly like a missing one (JobOwners), in the
// tiers too.
absl::Status OwnerOnly(absl::Status s, const std::string& job) {
  if (absl::IsPermissionDenied(s))
    return absl::NotFoundError(absl::StrCat("job ", job, " does not exist"));
  return s;
}

// Counts a restore or export whose plan met a lost version: refused, or
// given the layers' older versions (logged, by layer).
void CountLost(Metrics* m, const absl::Status& s, const CompositePlan* plan) {
  if (!s.ok()) {
    if (m != nullptr && ReasonOf(s) == ErrorReason::kLostVersion) {
      m->Inc(Counter::kLostVersionRestores, "refused", 1);
    }
    return;
  }
  bool older = false;
  for (const PlannedLayer& lp : plan->layers) {
    if (lp.lost_step == 0) continue;
    older = true;
    CKPT_LOG(WARNING) << "job " << plan->job << " rank " << plan->rank << " layer " << lp.layer
                      << " '" << lp.name << "': its version of step " << lp.lost_step
                      << " was lost; step " << lp.step << " was restored instead, as asked";
  }
  if (older && m != nullptr) m->Inc(Counter::kLostVersionRestores, "older", 1);
}

}  // namespace

absl::StatusOr<RecoverySources> Engine::Sources(unsigned readers,
                                                std::vector<std::unique_ptr<IoBackend>>* io) {
  RecoverySources sources;
  sources.index = index_;
  sources.store = store_;
  sources.pool = pool_;
  for (unsigned i = 0; i < readers; ++i) {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> backend,
                          MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    sources.readers.push_back(backend.get());
    io->push_back(std::move(backend));
  }
  if (memory_tier_.enabled()) sources.in_memory.push_back(&memory_tier_);
  sources.timeout = options_.restore_timeout;
  sources.cancelled = &shutting_down_;
  return sources;
}

absl::StatusOr<CompositePlan> Engine::Plan(const std::string& job, uint32_t rank,
                                           uint64_t target_step, const Caller& caller,
                                           uint64_t older_within) {
  CKPT_RETURN_IF_ERROR(OwnerOnly(PullFromTiers(job, rank, caller, /*must_know=*/true), job));
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(job, caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(job, rank));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", job, " has no rank ", rank));
  }
  return BuildPlan(index_, job, rank, target_step, *table, older_within);
}

absl::Status Engine::DiscardAfter(const std::string& job, uint32_t rank, uint64_t step) {
  // Only what lies after `step` is read (reading the whole history made a
  // restore O(history); docs/scaling.md).
  CKPT_ASSIGN_OR_RETURN(RankHistory h, history_.Read(job, rank, step));
  uint64_t versions = 0, events = 0;
  for (auto it = h.versions.rbegin(); it != h.versions.rend(); ++it) {
    CKPT_RETURN_IF_ERROR(history_.RemoveVersion(
        h.owner, VersionKey{job, rank, it->first.first, it->first.second}, it->second));
    ++versions;
  }
  for (auto it = h.events.rbegin(); it != h.events.rend(); ++it) {
    CKPT_RETURN_IF_ERROR(history_.DeleteEvent(h.owner, job, rank, *it));
    ++events;
  }
  CKPT_RETURN_IF_ERROR(history_.ForgetLost(job, rank, step + 1));
  // The tiers follow: their copies above `step` are of a discarded history
  // now.
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->OnRewind(RankKey(job, rank), step);
  if (versions + events > 0) {
    CKPT_LOG(INFO) << "job " << job << " rank " << rank << " restored to step " << step
                   << ": discarded " << versions << " later layer versions and " << events
                   << " later events";
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::shared_ptr<RankState>, std::shared_ptr<RankMemory>>>
Engine::BeginRestore(const RankRef& ref, const Caller& caller) {
  {
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> found, Find(ref, caller));
    // Every reported step may be snapshotted (even durable: the step's last
    // write can finish first) while the snapshot worker still finishes its
    // bookkeeping; that is not "still being snapshotted". Wait for it,
    // briefly, without the engine's lock (the worker needs it).
    absl::MutexLock rank_lock(&found->mu);
    if (found->snap_busy && found->snap_queue.empty() &&
        found->snapshot_step >= found->last_step_seen) {
      CKPT_SYNC_POINT("restore.wait_snapshot_idle");
      auto idle = [&found]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(found->mu) {
        return !found->snap_busy || !found->snap_queue.empty();
      };
      found->mu.AwaitWithTimeout(absl::Condition(&idle), kSnapshotIdleWait);
    }
  }
  // A replacement node: the rank's history comes from a tier (for the
  // rank's registered owner only); a tier that cannot be read is an error
  // here, never "nothing to restore".
  CKPT_RETURN_IF_ERROR(PullFromTiers(ref.job, ref.rank, caller, /*must_know=*/true));
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, FindLocked(ref, caller));
  absl::MutexLock rank_lock(&r->mu);
  if (!r->snap_queue.empty() || r->snap_busy || r->restoring) {
    return absl::FailedPreconditionError(
        "steps are still being snapshotted; restore before reporting steps");
  }
  if (r->memory == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", r->job, " rank ", r->rank,
                                                      ": memory released (", r->memory_released,
                                                      "); register again"));
  }
  // A poisoned device (a sticky CUDA error) fails the restore with that
  // reason before anything is copied.
  CKPT_RETURN_IF_ERROR(r->memory->CheckUsable());
  r->restoring = true;
  return std::make_pair(r, r->memory);
}

absl::StatusOr<Restored> Engine::RestoreUnderLease(const RankState& r, RankMemory* memory,
                                                   uint64_t target_step, bool discard_later,
                                                   uint64_t older_within) {
  // Plan and read under a lease (GC keeps off the rank); `restoring` keeps
  // StepDone off it until the buffers are written.
  const RankKey key(r.job, r.rank);
  CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
  ScopedLease lease(&leases_, key);
  Restored reply;
  // Two threads, each checking and copying one version out while its next
  // version's reads are in flight.
  std::vector<std::unique_ptr<IoBackend>> io;
  CKPT_ASSIGN_OR_RETURN(RecoverySources sources, Sources(/*readers=*/2, &io));
  RestoreTarget target;
  target.memory = memory;
  for (const LayerTemplate& lt : r.layers) target.tensors.push_back(lt.src);
  for (int fallbacks = 0;; ++fallbacks) {
    CKPT_ASSIGN_OR_RETURN(reply.plan,
                          BuildPlan(index_, r.job, r.rank, target_step, r.table, older_within));
    std::vector<VersionKey> damaged, damaged_images;
    absl::StatusOr<RestoreStats> stats =
        RestoreInto(reply.plan, r.table, target, sources, &damaged, &damaged_images);
    if (stats.ok()) {
      static_cast<RestoreStats&>(reply) = *stats;
      break;
    }
    // A damaged file (truncated, a flipped bit) is found here when nothing
    // checked it before (start-up after a clean stop looks files up by
    // name only): a tier's intact copy of that version takes its place,
    // else it is marked lost and the next plan refuses (or takes the
    // layer's previous version, when older_within allows it). A damaged
    // memory image was dropped from the tier: the same version is read
    // from disk next time.
    if ((damaged.empty() && damaged_images.empty()) || fallbacks == kMaxDamagedFallbacks) {
      return stats.status();
    }
    CKPT_RETURN_IF_ERROR(ReplaceOrQuarantine(r.uid, damaged, stats.status(), &reply.repaired_from));
  }
  if (discard_later) CKPT_RETURN_IF_ERROR(DiscardAfter(r.job, r.rank, reply.plan.target_step));
  CKPT_RETURN_IF_ERROR(AcceptLosses(reply.plan));
  return reply;
}

absl::Status Engine::AcceptLosses(const CompositePlan& plan) {
  // Only when training goes on from the restored step: with later steps
  // kept (no discard_later), those still need the lost versions.
  bool any = false;
  for (const PlannedLayer& lp : plan.layers) any |= lp.lost_step != 0;
  if (!any) return absl::OkStatus();  // every restore but those: no index read
  CKPT_ASSIGN_OR_RETURN(auto newest, index_->EventAtOrBefore(plan.job, plan.rank, ~uint64_t{0}));
  if (!newest.has_value() || newest->first != plan.target_step) return absl::OkStatus();
  // Every lost version above the one taken: the step's plan takes it now.
  CKPT_ASSIGN_OR_RETURN(Index::LostMap lost, index_->LostVersions(plan.job, plan.rank));
  for (const PlannedLayer& lp : plan.layers) {
    if (lp.lost_step == 0) continue;
    for (auto it = lost.upper_bound({lp.layer, lp.step});
         it != lost.end() && it->first.first == lp.layer && it->first.second <= plan.target_step;
         ++it) {
      it->second.set_accepted(true);
      CKPT_RETURN_IF_ERROR(index_->MarkLost(
          VersionKey{plan.job, plan.rank, lp.layer, it->first.second}, it->second));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::ReplaceOrQuarantine(uid_t owner, const std::vector<VersionKey>& damaged,
                                         const absl::Status& why,
                                         std::map<uint32_t, std::string>* repaired) {
  for (const VersionKey& k : damaged) {
    CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(k.job, k.rank, k.layer, k.step));
    if (!v.has_value() || v->first != k.step) continue;  // gone already
    const std::string what =
        absl::StrCat("job ", k.job, " rank ", k.rank, " layer ", k.layer, " step ", k.step);
    const DurableTier* from = nullptr;
    for (const std::unique_ptr<DurableTier>& tier : tiers_) {
      absl::StatusOr<bool> replaced = tier->Repair(k, v->second, owner);
      if (replaced.ok() && *replaced) {
        from = tier.get();
        break;
      }
      if (!replaced.ok()) {
        CKPT_LOG(WARNING) << what << ": the " << tier->name()
                          << " tier could not be asked for an intact copy: " << replaced.status();
      }
    }
    if (from != nullptr) {
      CKPT_LOG(WARNING) << what << ": the version on disk is damaged (" << why.message()
                        << "); replaced by the " << from->name()
                        << " tier's intact copy of it, the damaged file is in quarantine/";
      if (repaired != nullptr) (*repaired)[k.layer] = from->name();
      if (Metrics* m = options_.metrics) m->Inc(Counter::kVersionsRepaired, from->name(), 1);
      continue;
    }
    CKPT_LOG(ERROR) << what << ": the version on disk is damaged (" << why.message()
                    << ") and no tier holds an intact copy; it is marked lost: plans that need "
                       "it refuse unless asked to take the layer's previous version";
    CKPT_RETURN_IF_ERROR(
        history_.QuarantineVersion(owner, k, v->second, absl::StrCat("damaged: ", why.message())));
  }
  return absl::OkStatus();
}

void Engine::EndRestore(RankState& r, const absl::StatusOr<Restored>& reply, bool discard_later) {
  absl::MutexLock rank_lock(&r.mu);
  r.restoring = false;
  if (!reply.ok()) return;
  r.retry.assign(r.retry.size(), false);
  if (discard_later) {
    const uint64_t t = reply->plan.target_step;
    r.last_step_seen = r.snapshot_step = r.durable_step = t;
    for (const PlannedLayer& lp : reply->plan.layers) {
      if (lp.layer < r.last_committed.size()) r.last_committed[lp.layer] = lp.step;
    }
  }
  if (r.layercheck != nullptr) {
    // The buffers now equal each layer's planned version: LayerCheck
    // continues from there instead of starting over.
    std::vector<uint64_t> persisted(r.layers.size(), 0);
    for (const PlannedLayer& lp : reply->plan.layers) {
      if (lp.has_version && lp.layer < persisted.size()) persisted[lp.layer] = lp.step;
    }
    r.layercheck->Resume(reply->plan.target_step, persisted);
  }
}

absl::StatusOr<Restored> Engine::Restore(const RankRef& ref, uint64_t target_step,
                                         const Caller& caller, bool discard_later,
                                         uint64_t older_within) {
  CKPT_ASSIGN_OR_RETURN(auto begun, BeginRestore(ref, caller));
  const std::shared_ptr<RankState> r = std::move(begun.first);
  const std::shared_ptr<RankMemory> memory = std::move(begun.second);
  absl::StatusOr<Restored> reply =
      RestoreUnderLease(*r, memory.get(), target_step, discard_later, older_within);
  EndRestore(*r, reply, discard_later);
  CountLost(options_.metrics, reply.status(), reply.ok() ? &reply->plan : nullptr);
  if (Metrics* m = options_.metrics) {
    if (reply.ok()) {
      m->Inc(Counter::kRestores);
      m->Inc(Counter::kRestoredBytes, static_cast<double>(reply->bytes));
      m->Inc(Counter::kMemoryTierRestoredBytes, static_cast<double>(reply->memory_bytes));
      m->Observe(Histogram::kRestoreSeconds, reply->seconds);
    } else if (absl::IsDataLoss(reply.status())) {
      m->Inc(Counter::kErrors, "checksum", 1);  // no ErrorReason: DATA_LOSS says it
    }
  }
  if (!reply.ok()) {
    CKPT_LOG(ERROR) << "restore of job " << r->job << " rank " << r->rank
                    << " failed: " << reply.status();
    return reply.status();
  }
  CKPT_LOG(INFO) << "restored job " << r->job << " rank " << r->rank << " to step "
                 << reply->plan.target_step << ": " << reply->bytes << " bytes ("
                 << reply->memory_bytes << " from the memory tier) in " << reply->seconds
                 << " s (read calls under way " << std::lround(100 * reply->ReadingShare())
                 << " % of it), max staleness " << reply->plan.max_staleness;
  return reply;
}

absl::StatusOr<v1::VerifyReply> Engine::Verify(const v1::VerifyRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(req.job_id(), caller));
  std::vector<uint32_t> ranks;
  if (req.rank() < 0) {
    CKPT_ASSIGN_OR_RETURN(ranks, index_->ListRanks(req.job_id()));
  } else {
    ranks.push_back(static_cast<uint32_t>(req.rank()));
  }
  std::vector<std::unique_ptr<IoBackend>> io;
  CKPT_ASSIGN_OR_RETURN(RecoverySources sources, Sources(/*readers=*/1, &io));
  const absl::Time start = absl::Now();
  v1::VerifyReply reply;
  for (uint32_t rank : ranks) {
    // GC keeps off the rank while its versions are checked.
    const RankKey key(req.job_id(), rank);
    CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
    ScopedLease lease(&leases_, key);
    CKPT_RETURN_IF_ERROR(VerifyRank(req.job_id(), rank, req.deep(), sources, &reply));
  }
  reply.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return reply;
}

absl::Status Engine::Export(const v1::ExportRequest& req, const Caller& caller,
                            const std::function<bool(const v1::ExportChunk&)>& sink,
                            UniqueFd region) {
  CKPT_RETURN_IF_ERROR(
      OwnerOnly(PullFromTiers(req.job_id(), req.rank(), caller, /*must_know=*/true), req.job_id()));
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
  }
  const RankKey key(req.job_id(), req.rank());
  CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
  ScopedLease lease(&leases_, key);
  absl::StatusOr<CompositePlan> planned = BuildPlan(
      index_, req.job_id(), req.rank(), req.target_step(), *table, req.older_within_steps());
  CountLost(options_.metrics, planned.status(), planned.ok() ? &*planned : nullptr);
  CKPT_RETURN_IF_ERROR(planned.status());
  const CompositePlan& plan = *planned;
  // The caller's region, mapped for this call only (a memfd of shared
  // memory sealed against shrinking: MappedRegion refuses any other file,
  // INVALID_ARGUMENT). Only pages its owner populated are written: a page
  // ckptd faulted in would be ckptd's memory for as long as the caller
  // keeps the memfd. So the region is sealed against holes first (the
  // caller could punch them after the check otherwise), then the span this
  // export writes (the control page and at most the plan's bytes of the
  // window) is checked whole and locked against reclaim; a region that
  // cannot be sealed, has a hole there, or cannot be locked gets the stream.
  std::optional<MappedRegion> mapped;
  bool through_region = false;
  ExportRegion into{nullptr, 0, &through_region};
  if (region.valid()) {
    CKPT_ASSIGN_OR_RETURN(MappedRegion m, MappedRegion::Map(std::move(region)));
    if (m.SealAgainstHoles().ok() && m.LockWhole(kExportRegionControlBytes + plan.total_bytes)) {
      mapped = std::move(m);
      into.data = mapped->data();
      into.size = mapped->size();
    }
  }
  // A stream goes one layer at a time, as the reader takes it; a region is
  // filled on two threads, as a restore is.
  std::vector<std::unique_ptr<IoBackend>> io;
  CKPT_ASSIGN_OR_RETURN(RecoverySources sources, Sources(into.data != nullptr ? 2 : 1, &io));
  // Each version from the memory tier where it holds an image that checks,
  // else from disk (ExportPlan): a damaged file is not read while an intact
  // copy is in memory, and a damaged image is dropped for the file.
  std::vector<VersionKey> damaged;
  absl::StatusOr<uint64_t> bytes = ExportPlan(plan, *table, sources, sink, &damaged, into);
  if (!bytes.ok() && !damaged.empty()) {
    // The plan went out with the stream's header, so this export cannot
    // fall back; the next one reads the intact copy a tier put in place,
    // or plans without the damaged versions.
    CKPT_ASSIGN_OR_RETURN(std::optional<uid_t> owner, owners_.OwnerOf(req.job_id()));
    std::map<uint32_t, std::string> repaired;
    CKPT_RETURN_IF_ERROR(
        ReplaceOrQuarantine(owner.value_or(caller.uid), damaged, bytes.status(), &repaired));
    if (repaired.size() == damaged.size()) {
      return WithReason(
          absl::AbortedError(absl::StrCat(
              bytes.status().message(), "; an intact copy of the same version from the ",
              repaired.begin()->second, " tier took its place: export again")),
          ErrorReason::kRepaired);
    }
    return WithReason(
        absl::Status(bytes.status().code(),
                     absl::StrCat(bytes.status().message(),
                                  "; no tier holds an intact copy, the version is marked lost: "
                                  "export again (older_within_steps takes the layer's previous "
                                  "version)")),
        ErrorReason::kLostVersion);
  }
  CKPT_RETURN_IF_ERROR(bytes.status());
  // An export is a restore into files (ckptctl export and restore).
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRestores);
    m->Inc(Counter::kRestoredBytes, static_cast<double>(*bytes));
    m->Inc(Counter::kExportedBytes, through_region ? "window" : "stream",
           static_cast<double>(*bytes));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
