// Retention: GC of each rank's history under leases.
#include <algorithm>
#include <map>

#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"

namespace ckpt {

std::optional<LocalKeep> Engine::KeepForTiers(const RankKey& key) const {
  std::optional<LocalKeep> keep;
  for (const std::unique_ptr<DurableTier>& tier : tiers_) {
    const LocalKeep k = tier->KeepLocally(key);
    if (!keep.has_value() || k.copied_step < keep->copied_step) keep = k;
  }
  return keep;
}

absl::Status Engine::GcRank(const std::string& job, uint32_t rank, bool dry_run,
                            v1::GcReply* reply) {
  const RankKey key(job, rank);
  if (!leases_.TryBeginGc(key)) {
    reply->set_ranks_busy(reply->ranks_busy() + 1);
    return absl::OkStatus();
  }
  struct EndGc {
    LeaseTable* leases;
    const RankKey& key;
    ~EndGc() { leases->EndGc(key); }
  } end_gc{&leases_, key};
  CKPT_ASSIGN_OR_RETURN(RankHistory h, history_.Read(job, rank));
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(clock_->Now());
  std::map<uint64_t, const RankHistory::Event*> events;
  for (const RankHistory::Event& e : h.events) {
    in.events.emplace_back(e.step, e.unix_ms);
    events[e.step] = &e;
  }
  // The newest event knows the newest agreement.
  if (!h.events.empty()) in.agreed_step = h.events.back().agreed_step;
  if (std::optional<LocalKeep> keep = KeepForTiers(key); keep.has_value()) {
    // Keep what the tiers have yet to copy.
    in.pending_after = keep->copied_step;
    in.max_pending_events = keep->max_pending;
  }
  for (const auto& [lk, rec] : h.versions) in.versions[lk.first].push_back(lk.second);
  RetentionPlan plan = PlanRetention(options_.retention, in);
  reply->set_retained_targets(reply->retained_targets() + plan.retained_targets.size());
  reply->set_versions_kept(reply->versions_kept() + plan.versions_kept);
  // What stays is everything less what goes: one pass over the history and
  // one lookup per deletion (a search of the deletions for every version
  // was O(versions x deletions): over 600 s at a million versions).
  uint64_t kept_bytes = 0;
  for (const auto& [lk, rec] : h.versions) kept_bytes += rec.file_bytes();
  for (const auto& lk : plan.delete_versions) {
    auto it = h.versions.find(lk);
    if (it != h.versions.end()) kept_bytes -= it->second.file_bytes();
  }
  reply->set_bytes_kept(reply->bytes_kept() + kept_bytes);
  // Events first, so no plan can target a step whose versions are going away.
  for (uint64_t step : plan.delete_events) {
    if (!dry_run) CKPT_RETURN_IF_ERROR(history_.DeleteEvent(h.owner, job, rank, *events[step]));
    reply->set_events_deleted(reply->events_deleted() + 1);
  }
  for (const auto& [layer, step] : plan.delete_versions) {
    auto found = h.versions.find({layer, step});
    if (found == h.versions.end()) continue;  // the plan is made of h.versions: never
    const store::VersionRecord& rec = found->second;
    if (!dry_run) {
      CKPT_KILL_POINT("gc.before_remove");
      CKPT_RETURN_IF_ERROR(
          history_.RemoveVersion(h.owner, VersionKey{job, rank, layer, step}, rec));
    }
    reply->set_versions_deleted(reply->versions_deleted() + 1);
    reply->set_bytes_deleted(reply->bytes_deleted() + rec.file_bytes());
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::GcReply> Engine::Gc(const v1::GcRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(req.job_id()));
  v1::GcReply reply;
  for (uint32_t rank : ranks)
    CKPT_RETURN_IF_ERROR(GcRank(req.job_id(), rank, req.dry_run(), &reply));
  if (!req.dry_run() && reply.versions_deleted() > 0) {
    CKPT_LOG(INFO) << "gc of job " << req.job_id() << ": deleted " << reply.versions_deleted()
                   << " versions (" << reply.bytes_deleted() << " bytes) and "
                   << reply.events_deleted() << " events; kept " << reply.versions_kept();
  }
  return reply;
}

absl::Status Engine::EndJobRegistrations(const std::string& job,
                                         std::vector<std::shared_ptr<RankState>>* ended) {
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
  absl::MutexLock lock(&mu_);
  if (stopping_) return ShuttingDownError();
  if (deleting_jobs_.count(job) != 0) {
    return absl::AbortedError(absl::StrCat("job ", job, " is being deleted already"));
  }
  for (const auto& [key, uid] : registering_) {
    if (key.first == job) {
      return absl::AbortedError(
          absl::StrCat("rank ", key.second, " of job ", job, " is registering; retry"));
    }
  }
  for (const auto& [key, r] : ranks_) {
    if (key.first != job) continue;
    absl::MutexLock rank_lock(&r->mu);
    if (r->active && r->memory != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", key.second, " of job ", job,
          " is registered by a running trainer; stop it or release the rank first (`ckptctl "
          "release ",
          job, " --rank=", key.second,
          "`; root keeps a squatting trainer out with `ckptctl release ", job, " --evict`)"));
    }
  }
  for (const auto& [key, r] : ranks_) {
    if (key.first != job) continue;
    EndRegistrationLocked(*r, "the job is being deleted", &closing);
    ended->push_back(r);
  }
  // The idle ones go now; the others when drained, or (a drain that timed
  // out) when their last version is written.
  for (const std::shared_ptr<RankState>& r : *ended) {
    absl::MutexLock rank_lock(&r->mu);
    ForgetIfDone(&ranks_, r);
  }
  deleting_jobs_.insert(job);
  return absl::OkStatus();
}

absl::Status Engine::DeleteJobHistory(const std::string& job, JobDeleted* out) {
  // Every rank's GC turn, so no restore, verify or export reads what goes.
  CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
  std::vector<RankKey> held;
  auto release = [&] {
    for (const RankKey& key : held) leases_.EndGc(key);
  };
  for (uint32_t rank : ranks) {
    if (!leases_.TryBeginGc(RankKey(job, rank))) {
      release();
      return absl::AbortedError(absl::StrCat("rank ", rank, " of job ", job,
                                             " is being read (restore, verify or export); retry"));
    }
    held.emplace_back(job, rank);
  }
  absl::Status s;
  for (uint32_t rank : ranks) {
    // Events first, so no plan can target a step whose versions are going
    // away; then each version (its record, then its file); then the rank.
    absl::StatusOr<RankHistory> h = history_.Read(job, rank);
    s = h.status();
    for (size_t i = 0; s.ok() && i < h->events.size(); ++i) {
      s = history_.DeleteEvent(h->owner, job, rank, h->events[i]);
      if (s.ok()) ++out->events;
    }
    for (auto it = s.ok() ? h->versions.begin() : h->versions.end();
         s.ok() && it != h->versions.end(); ++it) {
      s = history_.RemoveVersion(h->owner, VersionKey{job, rank, it->first.first, it->first.second},
                                 it->second);
      if (s.ok()) {
        ++out->versions;
        out->bytes += it->second.file_bytes();
      }
    }
    if (s.ok()) s = history_.ForgetLost(job, rank, 0);
    if (s.ok()) {
      absl::StatusOr<std::optional<store::RankRecord>> table = index_->GetRank(job, rank);
      s = table.status();
      if (s.ok()) s = index_->DeleteRank(job, rank);
      if (s.ok() && table->has_value()) {
        quota_.ReleaseIndex(QuotaOwner{h->owner, job}, RankIndexBytes(**table));
      }
    }
    if (s.ok()) s = store_->RemoveRankDir(job, rank, {kDriftTraceFile});
    if (!s.ok()) break;
    ++out->ranks;
  }
  release();
  return s;
}

absl::StatusOr<JobDeleted> Engine::DeleteJob(const std::string& job, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(job, caller));
  std::vector<std::shared_ptr<RankState>> ended;  // registrations whose trainer exited
  CKPT_RETURN_IF_ERROR(EndJobRegistrations(job, &ended));
  struct Undelete {
    Engine* e;
    const std::string& job;
    ~Undelete() {
      absl::MutexLock lock(&e->mu_);
      e->deleting_jobs_.erase(job);
    }
  } undelete{this, job};
  for (const std::shared_ptr<RankState>& r : ended) {
    CKPT_RETURN_IF_ERROR(DrainAndForget(r, absl::Now() + options_.drain_timeout));
  }
  JobDeleted out;
  absl::Status s = DeleteJobHistory(job, &out);
  // The job record last: until it goes, the owner can finish a deletion an
  // error interrupted by deleting again.
  if (s.ok()) s = index_->DeleteJob(job);
  if (!s.ok()) {
    CKPT_LOG(ERROR) << "deleting job " << job << " stopped after " << out.versions
                    << " versions: " << s;
    return s;
  }
  if (Metrics* m = options_.metrics) m->Inc(Counter::kJobsDeleted);
  IgnoreError(index_->CompactJob(job), "compaction only speeds up later lookups");
  memory_tier_.DropJob(job);
  // Its copies in the tiers stay (docs/remote.md); this node stops copying it.
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->ForgetJob(job);
  CKPT_LOG(INFO) << "deleted job " << job << " (by uid " << caller.uid << "): " << out.ranks
                 << " ranks, " << out.versions << " versions, " << out.bytes << " bytes, "
                 << out.events << " events";
  return out;
}

void Engine::GcLoop() {
  Caller root;  // the daemon itself
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), options_.gc_interval)) return;
    }
    absl::StatusOr<std::vector<std::string>> jobs = index_->ListJobs();
    if (!jobs.ok()) continue;
    for (const std::string& job : *jobs) {
      v1::GcRequest req;
      req.set_job_id(job);
      absl::StatusOr<v1::GcReply> r = Gc(req, root);
      if (!r.ok()) CKPT_LOG(WARNING) << "periodic gc of job " << job << ": " << r.status();
    }
  }
}

}  // namespace ckpt
