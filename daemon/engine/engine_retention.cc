// Retention: GC of each rank's history under leases.
#include "daemon/engine/engine.h"

#include <algorithm>
#include <map>

#include "absl/time/clock.h"
#include "daemon/common/kill_point.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/engine/rank_state.h"

namespace ckpt {

absl::Status Engine::GcRank(const std::string& job, uint32_t rank, bool dry_run,
                            v1::GcReply* reply) {
  const RankKey key(job, rank);
  if (!leases_.TryBeginGc(key)) {
    reply->set_ranks_busy(reply->ranks_busy() + 1);
    return absl::OkStatus();
  }
  auto release = [&] { leases_.EndGc(key); };
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(clock_->Now());
  std::map<std::pair<uint32_t, uint64_t>, store::VersionRecord> records;
  absl::Status s = index_->ForEachEvent(job, rank, /*newest_first=*/false,
                                        [&](uint64_t step, const store::EventRecord& e) {
                                          in.events.emplace_back(step, e.unix_ms());
                                          return true;
                                        });
  if (s.ok()) {
    s = index_->ForEachVersion(job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& v) {
      in.versions[k.layer].push_back(k.step);
      records[{k.layer, k.step}] = v;
      return true;
    });
  }
  if (!s.ok()) {
    release();
    return s;
  }
  RetentionPlan plan = PlanRetention(options_.retention, in);
  reply->set_retained_targets(reply->retained_targets() + plan.retained_targets.size());
  reply->set_versions_kept(reply->versions_kept() + plan.versions_kept);
  for (const auto& [lk, rec] : records) {
    if (std::find(plan.delete_versions.begin(), plan.delete_versions.end(), lk) ==
        plan.delete_versions.end()) {
      reply->set_bytes_kept(reply->bytes_kept() + rec.file_bytes());
    }
  }
  // Events first, so no plan can target a step whose versions are going away.
  for (uint64_t step : plan.delete_events) {
    if (!dry_run) s = index_->DeleteEvent(job, rank, step);
    if (!s.ok()) break;
    reply->set_events_deleted(reply->events_deleted() + 1);
  }
  for (const auto& [layer, step] : plan.delete_versions) {
    if (!s.ok()) break;
    const store::VersionRecord& rec = records[{layer, step}];
    if (!dry_run) {
      CKPT_KILL_POINT("gc.before_remove");
      s = store_->Remove(VersionKey{job, rank, layer, step}, rec);
    }
    if (s.ok()) {
      reply->set_versions_deleted(reply->versions_deleted() + 1);
      reply->set_bytes_deleted(reply->bytes_deleted() + rec.file_bytes());
      if (!dry_run) {
        disk_.Release(rec.file_bytes());
        if (Metrics* m = options_.metrics) {
          m->Inc(Counter::kGcVersionsDeleted);
          m->Inc(Counter::kGcDeletedBytes, static_cast<double>(rec.file_bytes()));
        }
      }
    }
  }
  release();
  return s;
}

absl::StatusOr<v1::GcReply> Engine::Gc(const v1::GcRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(req.job_id()));
  v1::GcReply reply;
  for (uint32_t rank : ranks) CKPT_RETURN_IF_ERROR(GcRank(req.job_id(), rank, req.dry_run(), &reply));
  if (!req.dry_run() && reply.versions_deleted() > 0) {
    CKPT_LOG(INFO) << "gc of job " << req.job_id() << ": deleted " << reply.versions_deleted()
                   << " versions (" << reply.bytes_deleted() << " bytes) and "
                   << reply.events_deleted() << " events; kept " << reply.versions_kept();
  }
  return reply;
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
