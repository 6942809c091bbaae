// Recovery in the engine: Plan, Restore, Verify, Export (over recovery/).
#include "daemon/engine/engine.h"

#include <cmath>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
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

// Another user's job reads exactly like a missing one (CheckOwner), in the
// remote tier too.
absl::Status OwnerOnly(absl::Status s, const std::string& job) {
  if (absl::IsPermissionDenied(s)) return absl::NotFoundError(absl::StrCat("job ", job, " does not exist"));
  return s;
}

}  // namespace

absl::StatusOr<CompositePlan> Engine::Plan(const std::string& job, uint32_t rank,
                                           uint64_t target_step, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(OwnerOnly(PullFromRemote(job, rank, caller, /*must_know=*/true), job));
  CKPT_RETURN_IF_ERROR(CheckOwner(job, caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(job, rank));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", job, " has no rank ", rank));
  }
  return BuildPlan(index_, job, rank, target_step, *table);
}

absl::Status Engine::DiscardAfter(const std::string& job, uint32_t rank, uint64_t step) {
  // Only what lies after `step` is read (reading the whole history made a
  // restore O(history); docs/scaling.md).
  CKPT_ASSIGN_OR_RETURN(RankHistory h, ReadRankHistory(job, rank, step));
  uint64_t versions = 0, events = 0;
  for (auto it = h.versions.rbegin(); it != h.versions.rend(); ++it) {
    CKPT_RETURN_IF_ERROR(
        RemoveVersion(h, VersionKey{job, rank, it->first.first, it->first.second}, it->second));
    ++versions;
  }
  for (auto it = h.events.rbegin(); it != h.events.rend(); ++it) {
    CKPT_RETURN_IF_ERROR(DeleteEvent(h, job, rank, *it));
    ++events;
  }
  // The remote tier follows: manifests above `step` are of a discarded
  // history now.
  NoteRewind(job, rank, step);
  if (versions + events > 0) {
    CKPT_LOG(INFO) << "job " << job << " rank " << rank << " restored to step " << step
                   << ": discarded " << versions << " later layer versions and " << events
                   << " later events";
  }
  return absl::OkStatus();
}

absl::StatusOr<Restored> Engine::Restore(const RankRef& ref, uint64_t target_step,
                                         const Caller& caller, bool discard_later) {
  // A replacement node: the rank's history comes from the remote tier (for
  // the rank's registered owner only); a remote tier that cannot be read is
  // an error here, never "nothing to restore".
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> found, Find(ref, caller));
  {
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
  CKPT_RETURN_IF_ERROR(PullFromRemote(ref.job, ref.rank, caller, /*must_know=*/true));
  std::shared_ptr<Rank> r;
  std::shared_ptr<RankMemory> memory;
  {
    absl::MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(r, FindLocked(ref, caller));
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
    memory = r->memory;
    r->restoring = true;
  }
  // Plan and read under a lease (GC keeps off the rank); `restoring` keeps
  // StepDone off it until the buffers are written.
  auto restore = [&]() -> absl::StatusOr<Restored> {
    const RankKey key(r->job, r->rank);
    CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
    ScopedLease lease(&leases_, key);
    Restored reply;
    CKPT_ASSIGN_OR_RETURN(reply.plan, BuildPlan(index_, r->job, r->rank, target_step, r->table));
    // Two threads, each checking and copying one version out while its
    // next version's reads are in flight.
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io0,
                          MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io1,
                          MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    const RestoreDestination dest(
        [&r](uint32_t layer, uint32_t tensor) { return r->layers[layer].src[tensor]; },
        [&memory](char* dst, const char* src, uint64_t n) { return memory->CopyIn(dst, src, n); },
        /*cpu=*/std::string_view(memory->kind()) == "host");
    CKPT_ASSIGN_OR_RETURN(
        RestoreStats stats,
        RestoreInto(reply.plan, r->table, dest, index_, store_, {io0.get(), io1.get()}, pool_,
                    options_.restore_timeout,
                    [this] { return shutting_down_.load(std::memory_order_relaxed); },
                    [this, &key](const VersionKey& vk, const store::VersionRecord& rec) {
                      return memory_tier_.Find(key, vk.layer, vk.step, rec.file());
                    }));
    static_cast<RestoreStats&>(reply) = stats;
    if (discard_later) CKPT_RETURN_IF_ERROR(DiscardAfter(r->job, r->rank, reply.plan.target_step));
    return reply;
  };
  absl::StatusOr<Restored> reply = restore();
  {
    absl::MutexLock rank_lock(&r->mu);
    r->restoring = false;
    if (reply.ok()) {
      r->retry.assign(r->retry.size(), false);
      if (discard_later) {
        const uint64_t t = reply->plan.target_step;
        r->last_step_seen = r->snapshot_step = r->durable_step = t;
        for (const PlannedLayer& lp : reply->plan.layers) {
          if (lp.layer < r->last_committed.size()) r->last_committed[lp.layer] = lp.step;
        }
      }
      if (r->layercheck != nullptr) {
        // The buffers now equal each layer's planned version: LayerCheck
        // continues from there instead of starting over.
        std::vector<uint64_t> persisted(r->layers.size(), 0);
        for (const PlannedLayer& lp : reply->plan.layers) {
          if (lp.has_version && lp.layer < persisted.size()) persisted[lp.layer] = lp.step;
        }
        r->layercheck->Resume(reply->plan.target_step, persisted);
      }
    }
  }
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
    CKPT_LOG(ERROR) << "restore of job " << r->job << " rank " << r->rank << " failed: "
                    << reply.status();
    return reply.status();
  }
  CKPT_LOG(INFO) << "restored job " << r->job << " rank " << r->rank << " to step "
                 << reply->plan.target_step << ": " << reply->bytes << " bytes ("
                 << reply->memory_bytes << " from the memory tier) in "
                 << reply->seconds << " s (read calls under way "
                 << std::lround(100 * reply->ReadingShare())
                 << " % of it), max staleness " << reply->plan.max_staleness;
  return reply;
}

absl::StatusOr<v1::VerifyReply> Engine::Verify(const v1::VerifyRequest& req,
                                               const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  std::vector<uint32_t> ranks;
  if (req.rank() < 0) {
    CKPT_ASSIGN_OR_RETURN(ranks, index_->ListRanks(req.job_id()));
  } else {
    ranks.push_back(static_cast<uint32_t>(req.rank()));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io,
                        MakeIoBackend(options_.io_backend, options_.io_queue_depth));
  const absl::Time start = absl::Now();
  v1::VerifyReply reply;
  for (uint32_t rank : ranks) {
    // GC keeps off the rank while its versions are checked.
    const RankKey key(req.job_id(), rank);
    CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
    ScopedLease lease(&leases_, key);
    CKPT_RETURN_IF_ERROR(VerifyRank(req.job_id(), rank, req.deep(), index_, store_, io.get(),
                                    pool_, options_.restore_timeout, &reply));
  }
  reply.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return reply;
}

absl::Status Engine::Export(const v1::ExportRequest& req, const Caller& caller,
                            const std::function<bool(const v1::ExportChunk&)>& sink) {
  CKPT_RETURN_IF_ERROR(
      OwnerOnly(PullFromRemote(req.job_id(), req.rank(), caller, /*must_know=*/true), req.job_id()));
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
  }
  const RankKey key(req.job_id(), req.rank());
  CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
  ScopedLease lease(&leases_, key);
  CKPT_ASSIGN_OR_RETURN(CompositePlan plan,
                        BuildPlan(index_, req.job_id(), req.rank(), req.target_step(), *table));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io,
                        MakeIoBackend(options_.io_backend, options_.io_queue_depth));
  CKPT_ASSIGN_OR_RETURN(
      uint64_t bytes,
      ExportPlan(plan, *table, index_, store_, io.get(), pool_, options_.restore_timeout,
                 [this] { return shutting_down_.load(std::memory_order_relaxed); }, sink));
  // An export is a restore into files (ckptctl export and restore).
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRestores);
    m->Inc(Counter::kRestoredBytes, static_cast<double>(bytes));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
