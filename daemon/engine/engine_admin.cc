// Admin queries: Status, Jobs, Layers, History, metrics collection.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

v1::StatusReply Engine::GetStatus(const Caller& caller) {
  v1::StatusReply s;
  s.set_version(CKPT_VERSION);
  s.set_data_dir(options_.data_dir);
  s.set_metrics_address(options_.metrics_address);
  s.set_disk_bytes_used(disk_.used());
  s.set_disk_bytes_limit(disk_.limit());
  s.set_io_backend(io_backend_name_);
  s.set_pool_bytes(pool_->budget_bytes());
  s.set_pool_bytes_in_use(pool_->bytes_in_use());
  s.set_versions_committed(versions_committed_.load(std::memory_order_relaxed));
  s.set_bytes_committed(bytes_committed_.load(std::memory_order_relaxed));
  s.set_snapshots_skipped(snapshots_skipped_.load(std::memory_order_relaxed));
  s.set_write_errors(write_errors_.load(std::memory_order_relaxed));
  s.set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  s.set_orphan_files_quarantined(reconcile_.orphan_files_quarantined);
  s.set_files_quarantined(reconcile_.files_quarantined);
  s.set_dangling_records_removed(reconcile_.dangling_records_removed);
  s.set_temp_files_removed(reconcile_.temp_files_removed);
  s.set_gpu(gpu_support_);
  s.set_node(options_.node_name);
  s.set_rack(options_.node_rack);
  const GpuMappingStats gpu = OpenGpuMappings();
  s.set_open_gpu_mappings(static_cast<uint32_t>(gpu.mappings));
  s.set_open_gpu_mapping_bytes(gpu.bytes);
  for (const PoisonedGpu& p : gpu_health_.Poisoned()) {
    s.add_gpu_poisoned(absl::StrCat(p.uuid, " (CUDA device ", p.device, "): ", p.error));
  }
  const bool all = IsRoot(caller);
  absl::StatusOr<std::vector<std::string>> jobs = index_->ListJobs();
  if (jobs.ok()) {
    uint32_t visible = 0;
    for (const std::string& job : *jobs) {
      absl::StatusOr<std::optional<store::JobRecord>> rec =
          all ? std::optional<store::JobRecord>() : index_->GetJob(job);
      visible += all || (rec.ok() && rec->has_value() && (*rec)->owner_uid() == caller.uid);
    }
    s.set_jobs(visible);
  }
  s.set_remote("none");
  if (DurableTier* remote = TierNamed("remote"); remote != nullptr) {
    const TierReport report = remote->Report(caller);
    s.set_remote(report.description);
    s.set_remote_lag_steps(report.lag.steps);
    s.set_remote_lag_bytes(report.lag.bytes);
    s.set_remote_error(report.error);
  }
  s.set_peer("none");
  if (DurableTier* peer = TierNamed("peer"); peer != nullptr) {
    const TierReport report = peer->Report(caller);
    s.set_peer(report.description);
    s.set_peer_lag_steps(report.lag.steps);
    s.set_peer_lag_bytes(report.lag.bytes);
    s.set_peer_error(report.error);
  }
  absl::MutexLock lock(&mu_);
  uint32_t ranks = 0;
  for (const auto& [key, r] : ranks_) {
    if (!all && r->uid != caller.uid) continue;
    absl::MutexLock rank_lock(&r->mu);
    ranks += r->active ? 1 : 0;
  }
  s.set_registered_ranks(ranks);
  return s;
}

absl::StatusOr<v1::JobsReply> Engine::Jobs(const Caller& caller) {
  DurableTier* const remote = TierNamed("remote");
  DurableTier* const peer = TierNamed("peer");
  v1::JobsReply reply;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(auto rec, index_->GetJob(job));
    if (!rec.has_value() || (rec->owner_uid() != caller.uid && !IsRoot(caller))) continue;
    v1::JobInfo* info = reply.add_jobs();
    info->set_job_id(job);
    info->set_owner_uid(rec->owner_uid());
    if (peer_tier_ != nullptr) {
      for (const std::string& n : peer_tier_->PlacementOf(job)) info->add_peer_nodes(n);
    }
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
    for (uint32_t rank : ranks) {
      v1::RankInfo* ri = info->add_ranks();
      ri->set_rank(rank);
      CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(job, rank));
      if (table.has_value()) ri->set_layers(static_cast<uint32_t>(table->layers_size()));
      CKPT_ASSIGN_OR_RETURN(auto ev, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
      if (ev.has_value()) {
        ri->set_latest_durable_step(ev->first);
        ri->set_agreed_step(ev->second.agreed_step());
      }
      if (remote != nullptr) ri->set_remote_step(remote->DurableStep(RankKey(job, rank)));
      if (peer != nullptr) ri->set_peer_step(peer->DurableStep(RankKey(job, rank)));
      // Counted by the index as versions come and go: no pass over the
      // rank's history (Index::VersionsOf).
      const Index::RankVersions counted = index_->VersionsOf(job, rank);
      info->set_versions(info->versions() + counted.total.versions);
      info->set_bytes(info->bytes() + counted.total.file_bytes);
      FillRegistration(RankKey(job, rank), ri);
    }
  }
  // Jobs only a tier holds (a replacement node before the first pull); a
  // tier that does not answer leaves them out.
  std::map<std::string, v1::JobInfo*> listed;
  for (DurableTier* tier : {peer, remote}) {
    absl::StatusOr<std::vector<TierJob>> tier_jobs =
        tier != nullptr ? tier->Jobs(caller) : std::vector<TierJob>();
    for (const TierJob& tj : tier_jobs.ok() ? *tier_jobs : std::vector<TierJob>()) {
      if (std::find(jobs.begin(), jobs.end(), tj.job) != jobs.end()) continue;
      v1::JobInfo*& info = listed[tj.job];
      if (info == nullptr) {
        info = reply.add_jobs();
        info->set_job_id(tj.job);
        info->set_owner_uid(tj.owner);
      }
      for (const auto& [rank, step] : tj.newest_step) {
        v1::RankInfo* ri = nullptr;
        for (v1::RankInfo& have : *info->mutable_ranks()) {
          if (have.rank() == rank) ri = &have;
        }
        if (ri == nullptr) {
          ri = info->add_ranks();
          ri->set_rank(rank);
        }
        if (tier == peer) {
          ri->set_peer_step(step);
        } else {
          ri->set_remote_step(step);
        }
      }
    }
  }
  return reply;
}

void Engine::FillRegistration(const RankKey& key, v1::RankInfo* ri) {
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(key);
  if (it == ranks_.end()) return;
  const RankState& r = *it->second;
  absl::MutexLock rank_lock(&r.mu);
  if (!r.active) return;
  ri->set_registered(true);
  ri->set_stale(r.memory == nullptr);
  ri->set_generation(r.generation);
  ri->set_last_step_seen(r.last_step_seen);
}

absl::StatusOr<v1::LayersReply> Engine::Layers(const v1::LayersRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
  }
  v1::LayersReply reply;
  reply.set_job_id(req.job_id());
  reply.set_rank(req.rank());
  CKPT_ASSIGN_OR_RETURN(auto ev, index_->EventAtOrBefore(req.job_id(), req.rank(), ~uint64_t{0}));
  const uint64_t latest = ev.has_value() ? ev->first : 0;
  reply.set_latest_durable_step(latest);
  for (const store::LayerSpec& spec : table->layers()) {
    v1::LayerInfo* li = reply.add_layers();
    li->set_layer(spec.id());
    li->set_name(spec.name());
    li->set_kind(ToApi(spec.kind()));
    li->set_frozen(spec.frozen());
    for (const store::TensorSpec& t : spec.tensors()) li->set_bytes(li->bytes() + t.nbytes());
  }
  // Per layer: the index's count of its versions, less those above the
  // latest durable step (being committed: one seek per layer finds them),
  // and its newest version at or below that step (one seek). O(layers),
  // however long the history is.
  const Index::RankVersions counted = index_->VersionsOf(req.job_id(), req.rank());
  std::vector<uint64_t> above(static_cast<size_t>(reply.layers_size()), 0);
  CKPT_RETURN_IF_ERROR(index_->ForEachVersionAfter(
      req.job_id(), req.rank(), latest, [&above](const VersionKey& k, const store::VersionRecord&) {
        if (k.layer < above.size()) ++above[k.layer];
        return true;
      }));
  for (int i = 0; i < reply.layers_size(); ++i) {
    v1::LayerInfo* li = reply.mutable_layers(i);
    const uint32_t l = static_cast<uint32_t>(i);
    const uint64_t all = l < counted.layers.size() ? counted.layers[l].versions : 0;
    li->set_versions(all - std::min(all, above[l]));
    if (li->versions() == 0) continue;
    CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(req.job_id(), req.rank(), l, latest));
    if (v.has_value()) li->set_last_step(v->first);
  }
  for (v1::LayerInfo& li : *reply.mutable_layers()) {
    li.set_staleness(li.last_step() > 0 && !li.frozen() ? latest - li.last_step() : 0);
  }
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(RankKey(req.job_id(), req.rank()));
  if (it == ranks_.end()) return reply;
  const RankState& r = *it->second;
  absl::MutexLock rank_lock(&r.mu);
  for (const PendingStep& p : r.pending) {
    if (p.step > latest) reply.set_newest_staged_step(std::max(reply.newest_staged_step(), p.step));
  }
  if (r.active) {
    reply.set_policy(PolicyName(r.policy.kind));
    if (r.layercheck != nullptr) {
      reply.set_s_max(r.layercheck->config().s_max);
      for (size_t l = 0; l < r.layercheck->layers() && l < static_cast<size_t>(reply.layers_size());
           ++l) {
        v1::LayerInfo* li = reply.mutable_layers(static_cast<int>(l));
        li->set_live(true);
        li->set_accumulated_drift(r.layercheck->accumulated(l));
        li->set_threshold(r.layercheck->threshold(l));
        if (l < r.last_decisions.size()) li->set_last_drift(r.last_decisions[l].d);
      }
    }
  }
  return reply;
}

absl::StatusOr<v1::HistoryReply> Engine::History(const v1::HistoryRequest& req,
                                                 const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(req.job_id(), caller));
  if (req.layer() >= 0) {
    // A layer the rank does not have is a mistake, not an empty history.
    CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
    if (!table.has_value()) {
      return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
    }
    if (req.layer() >= table->layers_size()) {
      return absl::InvalidArgumentError(absl::StrCat("job ", req.job_id(), " rank ", req.rank(),
                                                     " has ", table->layers_size(),
                                                     " layers; there is no layer ", req.layer()));
    }
  }
  v1::HistoryReply reply;
  // Steps whose manifest is in the remote tier.
  DurableTier* const tier = TierNamed("remote");
  const std::set<uint64_t> remote = tier != nullptr
                                        ? tier->DurableSteps(RankKey(req.job_id(), req.rank()))
                                        : std::set<uint64_t>();
  CKPT_RETURN_IF_ERROR(index_->ForEachEvent(
      req.job_id(), req.rank(), /*newest_first=*/true,
      [&](uint64_t step, const store::EventRecord& e) {
        if (req.layer() >= 0 && std::find(e.layers().begin(), e.layers().end(),
                                          static_cast<uint32_t>(req.layer())) == e.layers().end()) {
          return true;
        }
        v1::HistoryEvent* h = reply.add_events();
        h->set_step(step);
        *h->mutable_layers() = e.layers();
        h->set_bytes(e.bytes());
        h->set_failed(e.failed());
        h->set_skipped(e.skipped());
        h->set_remote(remote.count(step) > 0);
        return req.limit() == 0 || static_cast<uint32_t>(reply.events_size()) < req.limit();
      }));
  return reply;
}

void Engine::CollectMetrics() {
  Metrics* m = options_.metrics;
  if (m == nullptr) return;
  m->Set(Gauge::kStagingPoolBytes, static_cast<double>(pool_->budget_bytes()));
  m->Set(Gauge::kStagingPoolInUseBytes, static_cast<double>(pool_->bytes_in_use()));
  m->Set(Gauge::kDiskUsedBytes, static_cast<double>(disk_.used()));
  m->Set(Gauge::kDiskLimitBytes, static_cast<double>(disk_.EffectiveLimit()));
  const QuotaLimits quota = quota_.limits();
  m->Set(Gauge::kUidDiskLimitBytes, static_cast<double>(quota.disk_bytes));
  m->Set(Gauge::kUidIndexLimitBytes, static_cast<double>(quota.index_bytes));
  for (const auto& [uid, u] : quota_.All()) {
    m->Set(Gauge::kUidDiskUsedBytes, absl::StrCat(uid),
           static_cast<double>(u.file_bytes + u.index_bytes + u.replica_bytes));
    m->Set(Gauge::kUidIndexUsedBytes, absl::StrCat(uid), static_cast<double>(u.index_bytes));
  }
  m->Set(Gauge::kIndexDegraded, index_->degraded() ? 1 : 0);
  m->Set(Gauge::kIndexMemoryBytes, static_cast<double>(index_->MemoryBytes()));
  const GpuMappingStats gpu = OpenGpuMappings();
  m->Set(Gauge::kOpenGpuMappings, static_cast<double>(gpu.mappings));
  m->Set(Gauge::kOpenGpuMappingBytes, static_cast<double>(gpu.bytes));
  m->Set(Gauge::kGpuDevicesPoisoned, static_cast<double>(gpu_health_.Poisoned().size()));
  m->Set(Gauge::kMemoryTierBytes, static_cast<double>(memory_tier_.bytes()));
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->CollectMetrics();
  absl::MutexLock lock(&mu_);
  m->Set(Gauge::kWriteQueueDepth, static_cast<double>(write_queue_.size()));
  m->Set(Gauge::kRegisteredRanks, static_cast<double>(ActiveRanksLocked()));
  m->Set(Gauge::kStaleRanks, static_cast<double>(ActiveRanksLocked(/*stale_only=*/true)));
  CollectLagLocked(m);
}

void Engine::CollectLagLocked(Metrics* m) {
  // Durability lag: staged but not yet durable, over every live rank.
  const absl::Time now = clock_->Now();
  double lag_bytes = 0, lag_seconds = 0, global_lag = 0;
  for (const auto& [key, r] : ranks_) {
    absl::MutexLock rank_lock(&r->mu);
    // 0 is "none agreed yet" (a job whose ranks have no common durable step).
    if (r->active && r->global_durable_step.value_or(0) > 0) {
      global_lag = std::max(
          global_lag, static_cast<double>(r->last_step_seen -
                                          std::min(r->last_step_seen, *r->global_durable_step)));
    }
    for (const PendingStep& p : r->pending) {
      lag_bytes += static_cast<double>(p.staged_bytes - std::min(p.staged_bytes, p.event.bytes()));
      lag_seconds = std::max(lag_seconds, absl::ToDoubleSeconds(now - p.staged_at));
    }
    for (uint32_t l = 0; r->active && l < r->last_committed.size(); ++l) {
      const bool frozen = l < static_cast<uint32_t>(r->table.layers_size()) &&
                          r->table.layers(static_cast<int>(l)).frozen();
      const double staleness =
          !frozen && r->last_committed[l] > 0 && r->durable_step >= r->last_committed[l]
              ? static_cast<double>(r->durable_step - r->last_committed[l])
              : 0.0;
      const double drift = r->layercheck != nullptr ? r->layercheck->accumulated(l) : 0.0;
      m->SetLayer(r->job, r->rank, l, r->uid, staleness, drift);
    }
  }
  m->Set(Gauge::kDurabilityLagBytes, lag_bytes);
  m->Set(Gauge::kDurabilityLagSeconds, lag_seconds);
  m->Set(Gauge::kGlobalDurableLagSteps, global_lag);
}

size_t Engine::ActiveRanksLocked(bool stale_only) const {
  size_t n = 0;
  for (const auto& [key, r] : ranks_) {
    absl::MutexLock rank_lock(&r->mu);
    n += r->active && (!stale_only || r->memory == nullptr) ? 1 : 0;
  }
  return n;
}

}  // namespace ckpt
