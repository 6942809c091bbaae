// Engine facade: construction, start and shutdown of the stage threads and
// the tiers.
#include "daemon/engine/engine.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/rank_state.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/gpu/cuda_host.h"
#include "daemon/gpu/ipc_memory.h"

namespace ckpt {

Engine::Engine(EngineOptions options, Index* index, LayerStore* store, StagingPool* pool)
    : options_(std::move(options)),
      index_(index),
      store_(store),
      pool_(pool),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      drift_kernel_(drift::MakeCpuDriftKernel(options_.drift_threads)),
      cuda_ipc_(options_.cuda_ipc),
      gpu_support_(CudaSupport()),
      quota_(options_.quota != nullptr ? *options_.quota : own_quota_),
      disk_(options_.max_disk_bytes, options_.min_free_disk_bytes, store),
      owners_(index, clock_),
      history_(index, store, &disk_, &quota_, options_.metrics),
      memory_tier_(options_.memory_tier_bytes) {
  if (cuda_ipc_ == nullptr) {
    own_cuda_ipc_ = MakeCudaIpc();
    cuda_ipc_ = own_cuda_ipc_.get();
  }
  // The fastest source first: a pull or a repair takes the first tier that
  // has the copy.
  const RemoteTierDeps deps{index_,   store_,
                            &leases_, &quota_,
                            &disk_,   &history_,
                            &owners_, options_.metrics,
                            clock_,   memory_tier_.enabled() ? &memory_tier_ : nullptr};
  PeerTierOptions peers = options_.peers;
  if (peers.peers.empty() && options_.peer.store != nullptr) {
    peers.tier = options_.peer;
    peers.peers.push_back(PeerTarget{PeerNodeInfo{"peer", ""}, options_.peer.store});
  }
  if (!peers.peers.empty() && peers.tier.key != nullptr) {
    peers.tier.pull_wait = options_.restore_timeout;
    peers.tier.retention = options_.retention;
    auto tier = std::make_unique<PeerTier>(std::move(peers), deps);
    peer_tier_ = tier.get();
    tiers_.push_back(std::move(tier));
  }
  if (options_.remote.store != nullptr && options_.remote.key != nullptr) {
    RemoteTierOptions ro = options_.remote;
    ro.pull_wait = options_.restore_timeout;
    ro.retention = options_.retention;
    tiers_.push_back(std::make_unique<RemoteTier>(std::move(ro), deps));
  }
}

Engine::~Engine() {
  Shutdown(absl::ZeroDuration());
  // The pool outlives the engine; its memory tier does not.
  if (memory_tier_.enabled()) pool_->SetReclaimer(nullptr);
}

absl::Status Engine::Start() {
  for (const RemoteTierOptions* tier : {&options_.peer, &options_.peers.tier, &options_.remote}) {
    const bool used =
        tier->store != nullptr || (tier == &options_.peers.tier && !options_.peers.peers.empty());
    if (used && tier->key == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("a ", tier->name,
                       " tier needs the cluster key that signs what goes there "
                       "(remote_key_file)"));
    }
  }
  std::vector<std::unique_ptr<IoBackend>> backends;
  for (unsigned i = 0; i < std::max(1u, options_.writer_threads); ++i) {
    CKPT_ASSIGN_OR_RETURN(auto io, MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    backends.push_back(std::move(io));
  }
  io_backend_name_ = backends[0]->Name();
  if (options_.metrics != nullptr)
    options_.metrics->Set(Gauge::kIoBackendInfo, io_backend_name_, 1);
  CKPT_RETURN_IF_ERROR(SeedUsage());
  if (options_.io_backend == IoBackendKind::kAuto && io_backend_name_ != "io_uring") {
    CKPT_LOG(WARNING) << "io_uring is unavailable (kernel or seccomp); writing with pwrite";
  }
  publisher_ = std::make_unique<Publisher>(store_);
  for (auto& io : backends) {
    writer_threads_.emplace_back(
        [this, b = io.release()] { WriterLoop(std::unique_ptr<IoBackend>(b)); });
  }
  for (unsigned i = 0; i < std::max(1u, options_.snapshot_threads); ++i) {
    snapshot_threads_.emplace_back([this] { SnapshotLoop(); });
  }
  if (options_.gc_interval > absl::ZeroDuration()) gc_thread_ = std::thread([this] { GcLoop(); });
  watch_thread_ = std::thread([this] { WatchTrainersLoop(); });
  if (memory_tier_.enabled()) {
    // Every user of the pool (snapshots, restores, verify) gets room back
    // from the memory tier before it would wait.
    pool_->SetReclaimer([this](uint64_t bytes) { memory_tier_.Shrink(bytes); });
  }
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->Start();
  return absl::OkStatus();
}

DurableTier* Engine::TierNamed(std::string_view name) const {
  for (const std::unique_ptr<DurableTier>& tier : tiers_) {
    if (name == tier->name()) return tier.get();
  }
  return nullptr;
}

absl::StatusOr<std::optional<uid_t>> Engine::TierOwnerOf(const std::string& job,
                                                         std::optional<uid_t> local) {
  for (const std::unique_ptr<DurableTier>& tier : tiers_) {
    absl::StatusOr<std::optional<uid_t>> owner = tier->JobOwner(job, /*must_know=*/false);
    if (absl::IsDataLoss(owner.status())) return owner.status();  // never trusted, never replaced
    if (!owner.ok()) {
      CKPT_LOG(WARNING) << "the " << tier->name() << " tier could not say who job " << job
                        << " belongs to (" << owner.status()
                        << "); going on with this node's record";
      continue;
    }
    if (!owner->has_value()) continue;
    if (local.has_value() && *local != **owner) {
      return absl::PermissionDeniedError(absl::StrCat(
          "job ", job, " belongs to uid ", *local, " on this node but to uid ", **owner, " in the ",
          tier->name(), " tier; an operator must delete one of them"));
    }
    return owner;
  }
  return local;
}

absl::Status Engine::ClaimInTiers(const std::string& job, uid_t owner) {
  for (const std::unique_ptr<DurableTier>& tier : tiers_) {
    absl::Status s = tier->ClaimJob(job, owner, /*must_know=*/false);
    if (absl::IsPermissionDenied(s)) return s;
    if (!s.ok()) {
      CKPT_LOG(WARNING) << "could not record job " << job << " as uid " << owner << "'s in the "
                        << tier->name() << " tier (" << s << "); its uploader does before the "
                        << "job's first upload";
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::PullFromTiers(const std::string& job, uint32_t rank, const Caller& caller,
                                   bool must_know) {
  CKPT_ASSIGN_OR_RETURN(auto here, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  if (here.has_value()) return absl::OkStatus();  // the tiers copy from this node
  std::vector<DurableTier*> tiers;
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tiers.push_back(tier.get());
  return PullFromNewest(tiers, job, rank, caller, must_know, [&]() -> absl::StatusOr<bool> {
    CKPT_ASSIGN_OR_RETURN(auto local, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
    return local.has_value();
  });
}

absl::Status Engine::SeedUsage() {
  QuotaLimits limits;
  limits.disk_bytes = options_.max_disk_bytes_per_uid;
  if (limits.disk_bytes == 0) {
    // Half the data file system: two users can never fill it alone.
    absl::StatusOr<uint64_t> total = store_->TotalBytes();
    if (total.ok()) limits.disk_bytes = std::max<uint64_t>(*total / 2, 1);
  }
  limits.index_bytes = options_.max_index_bytes_per_uid;
  limits.queued_steps = options_.max_queued_steps_per_uid;
  limits.job_disk_bytes = options_.max_disk_bytes_per_job;
  quota_.SetLimits(limits);
  // Disk usage of committed versions (node-wide and per uid) and the index
  // records of each uid, kept current by commits, events and GC.
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  uint64_t used = 0;
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> rec, index_->GetJob(job));
    const uid_t uid = rec.has_value() ? rec->owner_uid() : 0;
    uint64_t files = 0, index_bytes = 0;
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
    for (uint32_t rank : ranks) {
      // The index counted its versions when it opened.
      const Index::RankVersions counted = index_->VersionsOf(job, rank);
      files += counted.total.file_bytes;
      index_bytes += counted.total.versions * kVersionIndexBytes;
      CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index_->GetRank(job, rank));
      if (table.has_value()) index_bytes += RankIndexBytes(*table);
      CKPT_RETURN_IF_ERROR(index_->ForEachEvent(job, rank, /*newest_first=*/false,
                                                [&](uint64_t, const store::EventRecord& e) {
                                                  index_bytes += EventIndexBytes(e.aux().size());
                                                  return true;
                                                }));
    }
    used += files;
    quota_.Seed(QuotaOwner{uid, job}, files, index_bytes);
  }
  disk_.Reset(used);
  CKPT_LOG(INFO) << "per-uid quotas: max_disk_bytes_per_uid " << limits.disk_bytes
                 << (options_.max_disk_bytes_per_uid == 0 ? " (half the data file system)" : "")
                 << ", max_index_bytes_per_uid " << limits.index_bytes
                 << ", max_queued_steps_per_uid " << limits.queued_steps
                 << ", max_queued_steps_per_rank " << options_.max_queued_steps_per_rank
                 << ", max_disk_bytes_per_job " << limits.job_disk_bytes;
  return absl::OkStatus();
}

void Engine::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && stop_writers_) return;
    stopping_ = true;
    shutting_down_.store(true, std::memory_order_relaxed);
    // Waits on a rank's own mutex see the shutdown through its flag.
    for (auto& [key, r] : ranks_) {
      absl::MutexLock rank_lock(&r->mu);
      r->stopping = true;
    }
  }
  // A delay point too, so a test can hold a real ckptd here: stopping, with
  // its sockets still answering.
  CKPT_DELAY_POINT("engine.shutdown.stopping");
  for (auto& t : snapshot_threads_) t.join();
  snapshot_threads_.clear();
  if (gc_thread_.joinable()) gc_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  {
    // Let the writers finish what is staged, within the grace period.
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return write_queue_.empty() && commits_in_flight_ == 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&drained), grace)) {
      CKPT_LOG(WARNING) << "shutdown: discarding " << write_queue_.size()
                        << " staged layer versions that were not written in time";
    }
    stop_writers_ = true;
  }
  for (auto& t : writer_threads_) t.join();
  writer_threads_.clear();
  // What the writers wrote is published (the publisher never drops one).
  if (publisher_ != nullptr) publisher_->Stop();
  // After the writers (their grace period first): each tier stops before
  // its next copy; what is not copied yet is copied after the next start.
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->StopAndJoin();
  // Mappings and the ranks themselves (a GPU rank's drift kernel synchronizes
  // its stream) are destroyed after the locks are released.
  std::vector<std::shared_ptr<RankMemory>> closing;
  std::map<RankKey, std::shared_ptr<RankState>> ranks;
  absl::MutexLock lock(&mu_);
  write_queue_.clear();
  for (auto& [key, r] : ranks_) {
    absl::MutexLock rank_lock(&r->mu);
    r->active = false;
    r->ReleaseMemory("ckptd is shutting down", &closing);
  }
  ranks.swap(ranks_);
}

}  // namespace ckpt
