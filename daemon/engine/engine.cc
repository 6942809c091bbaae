#include "daemon/engine/engine.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/kill_point.h"
#include "daemon/common/logging.h"
#include "daemon/common/status.h"
#include "daemon/common/validate.h"
#include "daemon/policy/selection.h"
#include "daemon/gpu/cuda_host.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/recovery/plan.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/shm/region.h"
#include "nlohmann/json.hpp"

namespace ckpt {

// One layer's copy recipe: the file header template and where its tensors live.
struct LayerTemplate {
  store::LayerFileHeader header;  // tensors with offsets; checksums filled at commit
  std::vector<char*> src;         // per tensor, inside the rank's memory (RankMemory::base)
};

struct PendingStep {
  uint64_t step = 0;
  uint32_t remaining = 0;  // versions still being written
  store::EventRecord event;
  absl::Time staged_at;    // for the durability lag
  uint64_t staged_bytes = 0;
};

struct Engine::SnapTask {
  enum class Stage { kNew, kAwaitingGlobal, kReady };
  uint64_t step = 0;
  double lr = 0;
  std::vector<uint32_t> layers;  // selected at StepDone time (not for layercheck)
  store::EventRecord event;      // aux, lr
  std::vector<v1::GroupStep> group_steps;
  // LayerCheck only.
  Stage stage = Stage::kNew;
  std::vector<drift::LayerSums> client_drift;  // OPTIMIZER_CLIENT
  std::vector<drift::LayerSums> global;        // the vector the decision uses
};

struct Engine::WriteTask {
  std::shared_ptr<Rank> rank;
  StagedVersion version;
};

struct Engine::Rank {
  // Immutable after registration.
  std::string job;
  uint32_t rank = 0;
  uint64_t generation = 0;
  uid_t uid = 0;
  store::RankRecord table;
  PolicyConfig policy;
  // The handed-over memory; null once released (trainer exit). A snapshot
  // or restore holds its own reference while it copies.
  std::shared_ptr<RankMemory> memory;           // guarded by Engine::mu_
  std::string memory_released;                  // why memory is null
  UniqueFd trainer_pidfd;                       // GPU ranks: the registering process
  std::vector<LayerTemplate> layers;
  uint32_t world_size = 1;
  // LayerCheck (null for the other policies).
  std::unique_ptr<LayerCheckPolicy> layercheck;  // guarded by Engine::mu_
  v1::OptimizerKind optimizer = v1::OPTIMIZER_UNSPECIFIED;
  std::vector<drift::TensorTask> drift_tasks;    // pointers into `memory`
  std::vector<uint32_t> drift_task_groups;       // optimizer group of each task
  std::vector<double> drift_task_lr_scale;
  std::unique_ptr<std::ofstream> trace;          // drift.jsonl, when recorded

  // Guarded by Engine::mu_.
  bool active = true;
  bool restoring = false;
  uint64_t last_step_seen = 0;
  uint64_t snapshot_step = 0;
  uint64_t durable_step = 0;
  std::deque<SnapTask> snap_queue;
  bool snap_busy = false;
  std::map<uint64_t, v1::WaitSnapshotReply> snap_results;  // the most recent steps
  std::deque<PendingStep> pending;
  std::vector<bool> never_persisted;
  std::vector<bool> retry;
  // Per layer, the outcome (durable or not) of its recent selected versions by
  // step: WaitDurable(t) checks the newest one at or before t.
  std::vector<std::map<uint64_t, bool>> outcomes;
  uint64_t fence_broken_step = 0;  // a WaitSnapshot gave up on this step (or later)
  std::vector<uint64_t> last_committed;  // per layer: newest committed step (0 = none)
  absl::Status fatal;
  std::map<uint64_t, std::vector<drift::LayerSums>> partials;  // recent steps (layercheck)
  std::vector<LayerDecision> last_decisions;
  bool deferred = false;  // the front task waits for SetGlobalDrift; no worker holds it

  // Serializes event writes of this rank (held without Engine::mu_).
  absl::Mutex event_mu;
};

namespace {

constexpr size_t kSnapResultsKept = 64;
constexpr size_t kOutcomesKept = 64;  // per layer

bool IsRoot(const Caller& c) { return c.uid == 0; }

}  // namespace

Engine::Engine(EngineOptions options, Index* index, LayerStore* store, StagingPool* pool)
    : options_(std::move(options)),
      index_(index),
      store_(store),
      pool_(pool),
      drift_kernel_(drift::MakeCpuDriftKernel(options_.drift_threads)),
      cuda_ipc_(options_.cuda_ipc),
      gpu_support_(CudaSupport()) {
  if (cuda_ipc_ == nullptr) {
    own_cuda_ipc_ = MakeCudaIpc();
    cuda_ipc_ = own_cuda_ipc_.get();
  }
}

Engine::~Engine() { Shutdown(absl::ZeroDuration()); }

absl::Status Engine::Start() {
  std::vector<std::unique_ptr<IoBackend>> backends;
  for (unsigned i = 0; i < std::max(1u, options_.writer_threads); ++i) {
    CKPT_ASSIGN_OR_RETURN(auto io, MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    backends.push_back(std::move(io));
  }
  io_backend_name_ = backends[0]->Name();
  if (options_.metrics != nullptr) options_.metrics->Set(Gauge::kIoBackendInfo, io_backend_name_, 1);
  // Disk usage of committed versions, kept current by commits and GC.
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  uint64_t used = 0;
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
    for (uint32_t rank : ranks) {
      CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
          job, rank, -1, [&used](const VersionKey&, const store::VersionRecord& rec) {
            used += rec.file_bytes();
            return true;
          }));
    }
  }
  disk_used_.store(used, std::memory_order_relaxed);
  if (options_.io_backend == IoBackendKind::kAuto && io_backend_name_ != "io_uring") {
    CKPT_LOG(WARNING) << "io_uring is unavailable (kernel or seccomp); writing with pwrite";
  }
  for (auto& io : backends) {
    writer_threads_.emplace_back([this, b = io.release()] { WriterLoop(std::unique_ptr<IoBackend>(b)); });
  }
  for (unsigned i = 0; i < std::max(1u, options_.snapshot_threads); ++i) {
    snapshot_threads_.emplace_back([this] { SnapshotLoop(); });
  }
  if (options_.gc_interval > absl::ZeroDuration()) gc_thread_ = std::thread([this] { GcLoop(); });
  watch_thread_ = std::thread([this] { WatchTrainersLoop(); });
  return absl::OkStatus();
}

void Engine::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && stop_writers_) return;
    stopping_ = true;
    shutting_down_.store(true, std::memory_order_relaxed);
  }
  for (auto& t : snapshot_threads_) t.join();
  snapshot_threads_.clear();
  if (gc_thread_.joinable()) gc_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  {
    // Let the writers finish what is staged, within the grace period.
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return write_queue_.empty() && writers_busy_ == 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&drained), grace)) {
      CKPT_LOG(WARNING) << "shutdown: discarding " << write_queue_.size()
                        << " staged layer versions that were not written in time";
    }
    stop_writers_ = true;
  }
  for (auto& t : writer_threads_) t.join();
  writer_threads_.clear();
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  write_queue_.clear();
  for (auto& [key, r] : ranks_) {
    r->active = false;
    ReleaseMemoryLocked(r.get(), "ckptd is shutting down", &closing);
  }
  ranks_.clear();
}

void Engine::ReleaseMemoryLocked(Rank* r, const std::string& why,
                                 std::vector<std::shared_ptr<RankMemory>>* closing) {
  if (r->memory == nullptr) return;
  if (std::string(r->memory->kind()) == "cuda") {
    CKPT_LOG(INFO) << "job " << r->job << " rank " << r->rank << ": closing GPU mappings (" << why
                   << ")";
  }
  closing->push_back(std::move(r->memory));
  r->memory.reset();
  r->memory_released = why;
  r->trainer_pidfd = UniqueFd();
}

void Engine::WatchTrainersLoop() {
  for (;;) {
    std::vector<std::shared_ptr<Rank>> watched;
    std::vector<struct pollfd> fds;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      for (auto& [key, r] : ranks_) {
        if (r->memory != nullptr && r->trainer_pidfd.valid()) {
          watched.push_back(r);
          fds.push_back({r->trainer_pidfd.get(), POLLIN, 0});
        }
      }
    }
    // A pidfd becomes readable when its process exits.
    const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.trainer_watch_interval));
    if (fds.empty()) {
      absl::SleepFor(options_.trainer_watch_interval);
      continue;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) continue;
    std::vector<std::shared_ptr<RankMemory>> closing;
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Rank* r = watched[i].get();
      if (r->trainer_pidfd.get() != fds[i].fd) continue;  // released meanwhile
      ReleaseMemoryLocked(r, "its trainer process exited", &closing);
    }
  }
}

absl::Status Engine::CheckOwner(const std::string& job, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  CKPT_ASSIGN_OR_RETURN(auto rec, index_->GetJob(job));
  if (!rec.has_value()) return absl::NotFoundError(absl::StrCat("job ", job, " does not exist"));
  if (rec->owner_uid() != caller.uid && !IsRoot(caller)) {
    return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Engine::Rank>> Engine::FindLocked(const std::string& job,
                                                                 uint32_t rank,
                                                                 uint64_t generation,
                                                                 const Caller& caller) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  auto it = ranks_.find(RankKey(job, rank));
  if (it == ranks_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job, " rank ", rank, " is not registered"));
  }
  const std::shared_ptr<Rank>& r = it->second;
  if (!r->active) {
    return absl::NotFoundError(absl::StrCat("job ", job, " rank ", rank, " is not registered"));
  }
  if (r->uid != caller.uid && !IsRoot(caller)) {
    return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
  }
  if (r->generation != generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "generation ", generation, " of job ", job, " rank ", rank, " is stale (current ",
        r->generation, "); register again"));
  }
  return r;
}

absl::Status Engine::DrainLocked(const std::shared_ptr<Rank>& r, absl::Time deadline) {
  auto idle = [&r, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (r->snap_queue.empty() && !r->snap_busy && r->pending.empty()) || stopping_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::UnavailableError(absl::StrCat("job ", r->job, " rank ", r->rank,
                                               " is still writing earlier steps; retry"));
  }
  if (stopping_) return absl::UnavailableError("ckptd is shutting down");
  return absl::OkStatus();
}

// ---- Register ----

absl::StatusOr<v1::RegisterReply> Engine::Register(const v1::RegisterRequest& req,
                                                   std::vector<UniqueFd> fds,
                                                   const Caller& caller) {
  // 1. Host regions are mapped first (each must already be sealed against
  //    shrinking, so its size cannot change under us); GPU regions are only
  //    checked against the sizes their trainer declared, and opened below
  //    once the caller is known to own the job. Every tensor is validated
  //    against these sizes before any pointer into them is formed.
  const bool gpu = req.has_gpu();
  std::vector<MappedRegion> regions;
  std::vector<uint64_t> sizes;
  if (gpu) {
    if (!fds.empty() || !req.handover_token().empty()) {
      return absl::InvalidArgumentError(
          "a registration hands over host regions or GPU regions, not both");
    }
    CKPT_ASSIGN_OR_RETURN(sizes, CheckGpuHandover(req.gpu()));
  }
  for (UniqueFd& fd : fds) {
    CKPT_ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::Map(std::move(fd)));
    sizes.push_back(region.size());
    regions.push_back(std::move(region));
  }
  RegistrationLimits limits = options_.limits;
  limits.max_layer_file_bytes = pool_->budget_bytes();
  CKPT_RETURN_IF_ERROR(ValidateRegistration(req, sizes, limits));
  CKPT_ASSIGN_OR_RETURN(PolicyConfig policy, PolicyFromProto(req.policy()));

  // 2. Ownership: the first registration creates the job for its uid; the
  //    check and the creation are one step (two uids racing for a new id).
  std::optional<store::JobRecord> job_rec;
  {
    absl::MutexLock jobs_lock(&job_mu_);
    CKPT_ASSIGN_OR_RETURN(job_rec, index_->GetJob(req.job_id()));
    if (job_rec.has_value() && job_rec->owner_uid() != caller.uid && !IsRoot(caller)) {
      return absl::PermissionDeniedError(
          absl::StrCat("job ", req.job_id(), " belongs to another user"));
    }
    if (!job_rec.has_value()) {
      store::JobRecord jr;
      jr.set_owner_uid(caller.uid);
      jr.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
      CKPT_RETURN_IF_ERROR(index_->PutJob(req.job_id(), jr));
      job_rec = jr;
    }
  }
  // One registration of a rank at a time, so its table and generation are
  // written by a single caller.
  const RankKey key(req.job_id(), req.rank());
  {
    absl::MutexLock lock(&mu_);
    if (!registering_.insert(key).second) {
      return absl::AbortedError("a concurrent registration of this rank is in progress; retry");
    }
  }
  struct Unclaim {
    Engine* e;
    RankKey k;
    ~Unclaim() {
      absl::MutexLock lock(&e->mu_);
      e->registering_.erase(k);
    }
  } unclaim{this, key};

  // 3. The rank's state, starting with its memory. An IPC handle that is
  //    still open in the registration this one replaces is opened again
  //    (the driver counts references), so the old one keeps working until it
  //    is drained.
  auto r = std::make_shared<Rank>();
  r->job = req.job_id();
  r->rank = req.rank();
  r->uid = job_rec->owner_uid();
  r->policy = policy;
  if (gpu) {
    CKPT_ASSIGN_OR_RETURN(r->memory, GpuMemory::Open(req.gpu(), cuda_ipc_));
    if (caller.pid > 0) {
      const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, caller.pid, 0));
      if (pidfd >= 0) {
        r->trainer_pidfd = UniqueFd(pidfd);
      } else if (errno == ESRCH) {
        return absl::UnavailableError("the registering process exited");
      } else {
        CKPT_LOG(WARNING) << "pidfd_open: " << std::strerror(errno)
                          << "; GPU mappings of job " << r->job << " rank " << r->rank
                          << " are closed only on unregister, re-register or shutdown";
      }
    }
  } else {
    r->memory = std::make_shared<HostMemory>(std::move(regions), drift_kernel_.get());
  }
  for (const v1::LayerSpec& spec : req.layers()) {
    LayerTemplate lt;
    lt.header.set_job_id(req.job_id());
    lt.header.set_rank(req.rank());
    lt.header.set_layer(spec.id());
    lt.header.set_layer_name(spec.name());
    for (const v1::TensorSpec& t : spec.tensors()) {
      store::TensorEntry* e = lt.header.add_tensors();
      e->set_name(t.name());
      e->set_dtype(t.dtype());
      *e->mutable_shape() = t.shape();
      e->set_role(t.role());
      e->set_group(t.group());
      e->set_nbytes(t.nbytes());
      lt.src.push_back(r->memory->base(t.region()) + t.offset());
    }
    CKPT_RETURN_IF_ERROR(PlanLayout(&lt.header).status());  // assigns tensor offsets
    r->layers.push_back(std::move(lt));
  }
  *r->table.mutable_layers() = req.layers();
  r->table.set_world_size(req.world_size());
  r->world_size = req.world_size();
  if (policy.kind == v1::POLICY_LAYERCHECK) CKPT_RETURN_IF_ERROR(SetUpLayerCheck(req, r.get()));
  const size_t n = r->layers.size();
  r->never_persisted.assign(n, true);
  // The first step after any registration persists every layer: whatever the
  // trainer did since the last durable step is unknown to this daemon (it may
  // have restarted and lost earlier selections). A successful Restore clears
  // this, since the buffers then equal the durable state.
  r->retry.assign(n, true);
  r->outcomes.assign(n, {});

  // 4. Replace a live registration of the same rank once its pipeline drained.
  std::vector<std::shared_ptr<RankMemory>> closing;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("ckptd is shutting down");
    auto it = ranks_.find(RankKey(r->job, r->rank));
    if (it != ranks_.end()) {
      std::shared_ptr<Rank> old = it->second;
      if (old->uid != caller.uid && !IsRoot(caller)) {
        return absl::PermissionDeniedError(absl::StrCat("job ", r->job, " belongs to another user"));
      }
      old->active = false;
      ReleaseDeferredLocked(old.get());
      ReleaseMemoryLocked(old.get(), "the rank registered again", &closing);
      if (options_.metrics != nullptr) options_.metrics->RemoveRank(old->job, old->rank);
      CKPT_RETURN_IF_ERROR(DrainLocked(old, absl::Now() + options_.drain_timeout));
      ranks_.erase(RankKey(r->job, r->rank));
    }
  }

  // 5. Persist the rank's table; take a fresh generation. LayerCheck's
  //    reference learning rate carries over in the latest event.
  CKPT_ASSIGN_OR_RETURN(r->generation, index_->NextGeneration());
  r->table.set_generation(r->generation);
  CKPT_RETURN_IF_ERROR(index_->PutRank(r->job, r->rank, r->table));
  CKPT_ASSIGN_OR_RETURN(auto last_event, index_->EventAtOrBefore(r->job, r->rank, ~uint64_t{0}));
  const uint64_t durable = last_event.has_value() ? last_event->first : 0;
  if (r->layercheck != nullptr && last_event.has_value()) {
    r->layercheck->RaiseLrReference(last_event->second.layercheck_lr_ref());
  }
  r->last_step_seen = durable;
  r->snapshot_step = durable;
  r->durable_step = durable;
  r->last_committed.assign(n, 0);
  for (uint32_t l = 0; l < n; ++l) {
    CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(r->job, r->rank, l, durable));
    r->never_persisted[l] = !v.has_value();
    if (v.has_value()) r->last_committed[l] = v->first;
  }
  if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kRegistrations);

  v1::RegisterReply reply;
  reply.set_generation(r->generation);
  reply.set_latest_durable_step(durable);
  reply.set_io_backend(io_backend_name_);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("ckptd is shutting down");
    if (ranks_.count(RankKey(r->job, r->rank)) != 0) {
      return absl::AbortedError("a concurrent registration of the same rank won; retry");
    }
    ranks_[RankKey(r->job, r->rank)] = r;
  }
  CKPT_LOG(INFO) << "registered job " << r->job << " rank " << r->rank << " generation "
                 << r->generation << ": " << n << " layers, policy " << PolicyName(policy.kind)
                 << ", latest durable step " << durable << ", uid " << caller.uid;
  return reply;
}

// ---- StepDone and the snapshot workers ----

absl::Status Engine::StepDone(const v1::StepDoneRequest& req, const Caller& caller) {
  if (req.aux().size() > options_.max_aux_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("aux blob of ", req.aux().size(),
                                                   " bytes exceeds ", options_.max_aux_bytes));
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("ckptd is shutting down");
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  if (r->restoring) return absl::FailedPreconditionError("a restore of this rank is in progress");
  if (r->memory == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", r->job, " rank ", r->rank,
                                                      ": memory released (", r->memory_released,
                                                      "); register again"));
  }
  if (req.step() <= r->last_step_seen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", req.step(), " is not above the last step ", r->last_step_seen, " of job ", r->job,
        " rank ", r->rank, " (restore the job, or use a new job id to start over)"));
  }
  SnapTask task;
  task.step = req.step();
  task.lr = req.lr();
  if (r->layercheck != nullptr) {
    if (!req.layers().empty()) {
      return absl::InvalidArgumentError("a layer list was given but the rank's policy is layercheck");
    }
    const bool client = r->optimizer == v1::OPTIMIZER_CLIENT;
    if (client != (req.client_drift_size() > 0) ||
        (client && static_cast<size_t>(req.client_drift_size()) != r->layers.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          client ? "optimizer client needs client_drift with one entry per layer ("
                 : "client_drift is only for optimizer client (",
          r->layers.size(), " layers)"));
    }
    for (const v1::LayerDrift& d : req.client_drift()) {
      if (!(d.dw2() >= 0) || !(d.w2() >= 0)) {
        return absl::InvalidArgumentError("client_drift sums must be finite and >= 0");
      }
      task.client_drift.push_back(drift::LayerSums{d.dw2(), d.w2()});
    }
  } else {
    // Validate the layer list now so that the caller sees the error.
    CKPT_ASSIGN_OR_RETURN(task.layers, SelectLayers(r->policy, req.step(),
                                                    static_cast<uint32_t>(r->layers.size()),
                                                    req.layers(), r->never_persisted, r->retry));
  }
  task.event.set_aux(req.aux());
  task.event.set_lr(req.lr());
  task.group_steps.assign(req.group_steps().begin(), req.group_steps().end());
  r->last_step_seen = req.step();
  r->snap_queue.push_back(std::move(task));
  if (!r->snap_busy) {
    r->snap_busy = true;
    snapshot_ready_.push_back(r);
  }
  return absl::OkStatus();
}

void Engine::SnapshotLoop() {
  for (;;) {
    std::shared_ptr<Rank> r;
    SnapTask task;
    std::shared_ptr<RankMemory> memory;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !snapshot_ready_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) {
        for (auto& q : snapshot_ready_) q->snap_busy = false;
        snapshot_ready_.clear();
        return;
      }
      r = std::move(snapshot_ready_.front());
      snapshot_ready_.pop_front();
      task = std::move(r->snap_queue.front());
      r->snap_queue.pop_front();
      memory = r->memory;
    }
    const bool done = Snapshot(r, task, memory.get());
    memory.reset();  // the last reference of a released rank closes its mappings here
    absl::MutexLock lock(&mu_);
    if (!done) {
      // Parked until SetGlobalDrift. Publishing the partial sums and parking
      // happen under one lock, so a SetGlobalDrift that follows the partials
      // always finds the step waiting.
      if (r->active && !stopping_) {
        r->partials[task.step] = task.global;
        while (r->partials.size() > kSnapResultsKept) r->partials.erase(r->partials.begin());
        r->snap_queue.push_front(std::move(task));
        r->deferred = true;
      } else {
        r->snap_queue.clear();  // nobody will send the global vectors
        r->snap_busy = false;
      }
      continue;
    }
    if (!r->snap_queue.empty() && !stopping_) {
      snapshot_ready_.push_back(r);
    } else {
      r->snap_busy = false;
    }
  }
}

bool Engine::Snapshot(const std::shared_ptr<Rank>& r, SnapTask& task, RankMemory* memory) {
  // Wait (on ckptd's side) for the reported step to be complete in the
  // trainer's memory. Without memory, or when that fails, nothing is copied
  // and every selected layer is retried.
  absl::Status copy_status =
      memory == nullptr ? absl::FailedPreconditionError("the rank's memory was released")
                        : memory->BeginSnapshot();
  // Layers selected at StepDone time may since have become retry candidates;
  // the retry set is folded in at the next StepDone, not here (LayerCheck
  // decides here, with the current retry set).
  if (copy_status.ok() && r->layercheck != nullptr && !DecideLayerCheck(r, task, memory)) {
    return false;
  }
  if (!copy_status.ok() && r->layercheck != nullptr) {
    // Nothing was decided: every layer counts as skipped, so the step is not
    // reported durable and every layer is retried.
    task.layers.resize(r->layers.size());
    for (uint32_t l = 0; l < task.layers.size(); ++l) task.layers[l] = l;
  }
  const absl::Time copy_start = absl::Now();
  std::vector<StagedVersion> staged;
  std::vector<uint32_t> skipped;
  for (uint32_t l : task.layers) {
    if (!copy_status.ok()) {
      skipped.push_back(l);
      continue;
    }
    const LayerTemplate& lt = r->layers[l];
    StagedVersion v;
    v.key = VersionKey{r->job, r->rank, l, task.step};
    v.generation = r->generation;
    v.header = lt.header;
    v.header.set_step(task.step);
    v.header.set_generation(r->generation);
    for (const v1::GroupStep& g : task.group_steps) {
      for (const store::TensorEntry& t : lt.header.tensors()) {
        if (t.group() == g.group()) {
          *v.header.add_group_steps() = g;
          break;
        }
      }
    }
    // Step, generation and group counters change the header's size, so each
    // version gets its own layout.
    absl::StatusOr<VersionLayout> layout = PlanLayout(&v.header);
    absl::StatusOr<StagingLease> lease =
        layout.ok() ? pool_->Acquire(layout->file_bytes, absl::Now() + options_.admission_timeout)
                    : absl::StatusOr<StagingLease>(layout.status());
    if (!lease.ok()) {
      skipped.push_back(l);
      continue;
    }
    v.layout = *layout;
    v.lease = std::move(*lease);
    for (int i = 0; i < lt.header.tensors_size() && copy_status.ok(); ++i) {
      const store::TensorEntry& t = lt.header.tensors(i);
      const char* src = lt.src[static_cast<size_t>(i)];
      v.lease.ForEachPiece(v.layout.header_bytes + t.offset(), t.nbytes(),
                           [&](char* piece, uint64_t n) {
                             if (copy_status.ok()) copy_status = memory->CopyOut(piece, src, n);
                             src += n;
                           });
    }
    staged.push_back(std::move(v));
  }
  if (copy_status.ok() && memory != nullptr) copy_status = memory->FinishSnapshot();
  if (!copy_status.ok()) {
    // No partial step: whatever was staged is dropped and retried.
    CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << " step " << task.step
                    << ": snapshot copy failed: " << copy_status;
    if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kErrors, "snapshot_copy", 1);
    for (const StagedVersion& v : staged) skipped.push_back(v.key.layer);
    staged.clear();
  }
  CKPT_KILL_POINT("snapshot.copied");
  CKPT_DELAY_POINT("snapshot.before_publish");
  uint64_t staged_bytes = 0;
  for (const StagedVersion& v : staged) staged_bytes += v.layout.payload_bytes;
  if (Metrics* m = options_.metrics) {
    m->Observe(Histogram::kSnapshotCopySeconds, absl::ToDoubleSeconds(absl::Now() - copy_start));
    m->Inc(Counter::kVersionsStaged, static_cast<double>(staged.size()));
    m->Inc(Counter::kStagedBytes, static_cast<double>(staged_bytes));
    if (!skipped.empty()) m->Inc(Counter::kSnapshotsSkipped, "pool_full", static_cast<double>(skipped.size()));
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || !r->active || r->fence_broken_step >= task.step) {
      // Nobody waited for this copy to finish: the trainer may have changed
      // the buffers meanwhile, so the staged bytes cannot be trusted. Drop
      // them (the layers are retried) rather than make them durable.
      for (const StagedVersion& v : staged) {
        skipped.push_back(v.key.layer);
        r->retry[v.key.layer] = true;
        RecordOutcome(r.get(), v.key.layer, task.step, false);
      }
      CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank << " step " << task.step
                        << ": snapshot finished after its fence was abandoned; discarded";
      staged.clear();
    }
    v1::WaitSnapshotReply result;
    for (const StagedVersion& v : staged) {
      result.add_layers(v.key.layer);
      r->never_persisted[v.key.layer] = false;
      r->retry[v.key.layer] = false;
    }
    for (uint32_t l : skipped) {
      r->retry[l] = true;
      RecordOutcome(r.get(), l, task.step, false);
    }
    result.set_skipped(static_cast<uint32_t>(skipped.size()));
    if (!skipped.empty()) {
      snapshots_skipped_.fetch_add(skipped.size(), std::memory_order_relaxed);
      CKPT_LOG(WARNING) << "job " << r->job << " rank " << r->rank << " step " << task.step << ": "
                        << skipped.size() << " layer versions skipped, staging pool full";
    }
    r->snap_results[task.step] = std::move(result);
    while (r->snap_results.size() > kSnapResultsKept) r->snap_results.erase(r->snap_results.begin());
    r->snapshot_step = task.step;
    PendingStep p;
    p.step = task.step;
    p.remaining = static_cast<uint32_t>(staged.size());
    p.event = std::move(task.event);
    p.event.set_skipped(static_cast<uint32_t>(skipped.size()));
    p.staged_at = absl::Now();
    p.staged_bytes = staged_bytes;
    r->pending.push_back(std::move(p));
    for (StagedVersion& v : staged) {
      auto w = std::make_unique<WriteTask>();
      w->rank = r;
      w->version = std::move(v);
      write_queue_.push_back(std::move(w));
    }
  }
  if (staged.empty()) AdvanceEvents(r);
  return true;
}

absl::Status Engine::SetUpLayerCheck(const v1::RegisterRequest& req, Rank* r) {
  const v1::PolicySpec& spec = req.policy();
  LayerCheckConfig config = LayerCheckFromProto(spec.layercheck());
  CKPT_RETURN_IF_ERROR(config.Validate());
  r->optimizer = spec.optimizer();
  if (r->optimizer == v1::OPTIMIZER_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "policy layercheck needs an optimizer: adamw, adam, sgd or client");
  }
  auto dtype = [](v1::DType t, drift::DType* out) {
    switch (t) {
      case v1::DTYPE_F32: *out = drift::DType::kF32; return true;
      case v1::DTYPE_BF16: *out = drift::DType::kBF16; return true;
      case v1::DTYPE_F16: *out = drift::DType::kF16; return true;
      default: return false;
    }
  };
  std::vector<v1::LayerKind> kinds;
  for (size_t l = 0; l < r->layers.size(); ++l) {
    const v1::LayerSpec& layer = req.layers(static_cast<int>(l));
    kinds.push_back(layer.kind());
    if (r->optimizer == v1::OPTIMIZER_CLIENT) continue;
    bool has_master = false;
    for (const v1::TensorSpec& t : layer.tensors()) has_master |= t.role() == v1::ROLE_MASTER;
    const v1::TensorRole weight_role = has_master ? v1::ROLE_MASTER : v1::ROLE_PARAM;
    for (int i = 0; i < layer.tensors_size(); ++i) {
      const v1::TensorSpec& w = layer.tensors(i);
      if (w.role() != weight_role) continue;
      const std::string where = absl::StrCat("layer ", l, " tensor '", w.name(), "'");
      drift::TensorTask task;
      task.layer = static_cast<uint32_t>(l);
      task.n = w.nbytes() / DTypeBytes(w.dtype());
      task.w = r->layers[l].src[static_cast<size_t>(i)];
      if (!dtype(w.dtype(), &task.w_dtype)) {
        return absl::InvalidArgumentError(where + ": drift needs f32, bf16 or f16 weights");
      }
      task.beta1 = w.beta1() > 0 ? w.beta1() : 0.9;
      task.beta2 = w.beta2() > 0 ? w.beta2() : 0.999;
      task.eps = w.eps() > 0 ? w.eps() : 1e-8;
      task.weight_decay = w.weight_decay();
      // The optimizer state that names this weight.
      for (int j = 0; j < layer.tensors_size(); ++j) {
        const v1::TensorSpec& st = layer.tensors(j);
        if (st.param() != w.name()) continue;
        const void* p = r->layers[l].src[static_cast<size_t>(j)];
        const bool m_role = st.role() == v1::ROLE_EXP_AVG || st.role() == v1::ROLE_MOMENTUM;
        if (!m_role && st.role() != v1::ROLE_EXP_AVG_SQ) continue;
        if (st.nbytes() / DTypeBytes(st.dtype()) != task.n) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": state '", st.name(), "' has a different element count"));
        }
        drift::DType dt;
        if (!dtype(st.dtype(), &dt)) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": state '", st.name(),
                                                         "' must be f32, bf16 or f16"));
        }
        if (m_role) {
          task.m = p;
          task.m_dtype = dt;
        } else {
          task.v = p;
          task.v_dtype = dt;
        }
      }
      switch (r->optimizer) {
        case v1::OPTIMIZER_ADAMW:
        case v1::OPTIMIZER_ADAM:
          if (task.m == nullptr || task.v == nullptr) {
            return absl::InvalidArgumentError(
                where + ": adam(w) drift needs exp_avg and exp_avg_sq tensors naming it in 'param'");
          }
          task.optimizer = r->optimizer == v1::OPTIMIZER_ADAMW ? drift::Optimizer::kAdamW
                                                               : drift::Optimizer::kAdam;
          break;
        case v1::OPTIMIZER_SGD:
          if (task.m == nullptr) {
            return absl::InvalidArgumentError(
                where + ": sgd drift needs a momentum tensor naming it in 'param'");
          }
          task.optimizer = drift::Optimizer::kSgd;
          break;
        default:
          return absl::InvalidArgumentError("unknown optimizer");
      }
      r->drift_tasks.push_back(task);
      r->drift_task_groups.push_back(w.group());
      r->drift_task_lr_scale.push_back(w.lr_scale() > 0 ? w.lr_scale() : 1.0);
    }
    if (r->drift_tasks.empty() || r->drift_tasks.back().layer != l) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " has no ", has_master ? "master" : "param", " tensor for drift accounting"));
    }
  }
  r->layercheck = std::make_unique<LayerCheckPolicy>(config, std::move(kinds));
  if (spec.record_trace()) {
    CKPT_ASSIGN_OR_RETURN(std::string dir, store_->RankDirPath(r->job, r->rank));
    r->trace = std::make_unique<std::ofstream>(dir + "/drift.jsonl", std::ios::app);
    nlohmann::json header;
    header["job"] = r->job;
    header["rank"] = r->rank;
    nlohmann::json layers = nlohmann::json::array();
    for (const v1::LayerSpec& layer : req.layers()) {
      uint64_t bytes = 0;
      for (const v1::TensorSpec& t : layer.tensors()) bytes += t.nbytes();
      layers.push_back({{"name", layer.name()}, {"kind", static_cast<int>(layer.kind())},
                        {"bytes", bytes}});
    }
    header["layers"] = layers;
    header["config"] = {{"k0", config.k0}, {"k0_embedding", config.k0_embedding},
                        {"k_floor", config.k_floor}, {"s_max", config.s_max},
                        {"warmup", config.warmup}, {"warmup_interval", config.warmup_interval},
                        {"full_every", config.full_every}};
    *r->trace << header.dump() << "\n";
    r->trace->flush();
  }
  return absl::OkStatus();
}

bool Engine::DecideLayerCheck(const std::shared_ptr<Rank>& r, SnapTask& task,
                              RankMemory* memory) {
  if (task.stage == SnapTask::Stage::kNew) {
    std::vector<drift::LayerSums> sums(r->layers.size());
    if (r->optimizer == v1::OPTIMIZER_CLIENT) {
      sums = task.client_drift;
    } else {
      std::vector<drift::TensorTask> tasks = r->drift_tasks;
      for (size_t i = 0; i < tasks.size(); ++i) {
        tasks[i].lr = task.lr * r->drift_task_lr_scale[i];
        tasks[i].step = task.step;
        for (const v1::GroupStep& g : task.group_steps) {
          if (g.group() == r->drift_task_groups[i]) tasks[i].step = g.step();
        }
      }
      std::string error;
      const absl::Time drift_start = absl::Now();
      const bool ok = memory->drift_kernel()->Compute(tasks, &sums, &error);
      if (options_.metrics != nullptr) {
        options_.metrics->Observe(Histogram::kDriftSeconds,
                                  absl::ToDoubleSeconds(absl::Now() - drift_start));
      }
      if (!ok) {
        CKPT_LOG(ERROR) << "drift kernel failed (" << error << "); persisting every layer";
        for (drift::LayerSums& s : sums) s = drift::LayerSums{1, 1};
      }
    }
    CKPT_KILL_POINT("snapshot.drift");
    task.global = std::move(sums);  // this rank's partial sums until SetGlobalDrift
    if (r->world_size > 1) {
      task.stage = SnapTask::Stage::kAwaitingGlobal;
      return false;  // SnapshotLoop publishes them and parks the task
    }
    task.stage = SnapTask::Stage::kReady;
  }
  absl::MutexLock lock(&mu_);
  std::vector<LayerDecision> decisions =
      r->layercheck->Decide(task.step, task.lr, task.global, r->retry);
  task.layers.clear();
  const LayerCheckConfig& lc = r->layercheck->config();
  for (uint32_t l = 0; l < decisions.size(); ++l) {
    if (decisions[l].reason != PersistReason::kNone) task.layers.push_back(l);
    // The invariant (SPEC §4): after the base checkpoint no layer's newest
    // selected version is S_max or more steps old. Checked, never expected.
    if (task.step >= lc.warmup && task.step - r->layercheck->last_persisted(l) >= lc.s_max) {
      CKPT_LOG(ERROR) << "staleness invariant broken: job " << r->job << " layer " << l;
      if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kStalenessInvariantViolations);
    }
  }
  if (r->trace != nullptr) {
    nlohmann::json line;
    line["step"] = task.step;
    line["lr"] = task.lr;
    std::vector<double> d;
    for (const LayerDecision& dec : decisions) d.push_back(dec.d);
    line["d"] = d;
    line["persist"] = task.layers;
    *r->trace << line.dump() << "\n";
    r->trace->flush();  // whole lines, in step order across registrations
  }
  r->last_decisions = std::move(decisions);
  // Kept with the step's event for later registrations of the rank (no
  // write of its own).
  task.event.set_layercheck_lr_ref(r->layercheck->lr_reference());
  return true;
}

void Engine::ReleaseDeferredLocked(Rank* r) {
  if (!r->deferred) return;
  // The trainer that would have sent the global vector is gone: the parked
  // steps cannot be decided; drop them.
  r->snap_queue.clear();
  r->deferred = false;
  r->snap_busy = false;
}

absl::StatusOr<v1::DriftReply> Engine::DriftPartials(const v1::WaitRequest& req,
                                                     const Caller& caller, absl::Time deadline) {
  if (req.timeout_ms() > 0) deadline = std::min(deadline, absl::Now() + absl::Milliseconds(req.timeout_ms()));
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  if (r->layercheck == nullptr) return absl::FailedPreconditionError("the rank's policy is not layercheck");
  if (req.step() > r->last_step_seen) {
    return absl::FailedPreconditionError(absl::StrCat("step ", req.step(), " was never reported"));
  }
  auto ready = [&r, &req, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r->partials.count(req.step()) > 0 || r->snapshot_step >= req.step() || !r->active ||
           stopping_;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  auto it = r->partials.find(req.step());
  if (it == r->partials.end()) {
    if (r->snapshot_step >= req.step()) return absl::NotFoundError("step is too old");
    if (!r->active || stopping_) return absl::AbortedError("the registration ended");
    return absl::DeadlineExceededError(absl::StrCat("drift of step ", req.step(), " not ready in time"));
  }
  v1::DriftReply reply;
  reply.set_step(req.step());
  for (const drift::LayerSums& s : it->second) {
    v1::LayerDrift* d = reply.add_layers();
    d->set_dw2(s.dw2);
    d->set_w2(s.w2);
  }
  return reply;
}

absl::Status Engine::SetGlobalDrift(const v1::GlobalDriftRequest& req, const Caller& caller) {
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  if (r->layercheck == nullptr) return absl::FailedPreconditionError("the rank's policy is not layercheck");
  if (static_cast<size_t>(req.layers_size()) != r->layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("global drift has ", req.layers_size(),
                                                   " layers; the rank has ", r->layers.size()));
  }
  if (!r->deferred || r->snap_queue.empty() || r->snap_queue.front().step != req.step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", req.step(), " is not waiting for its global drift (call DriftPartials first)"));
  }
  SnapTask& task = r->snap_queue.front();
  task.global.clear();
  for (const v1::LayerDrift& d : req.layers()) {
    if (!(d.dw2() >= 0) || !(d.w2() >= 0)) {
      return absl::InvalidArgumentError("global drift sums must be finite and >= 0");
    }
    task.global.push_back(drift::LayerSums{d.dw2(), d.w2()});
  }
  task.stage = SnapTask::Stage::kReady;
  r->deferred = false;
  snapshot_ready_.push_back(r);
  return absl::OkStatus();
}

// ---- Writers and events ----

void Engine::WriterLoop(std::unique_ptr<IoBackend> io) {
  for (;;) {
    std::unique_ptr<WriteTask> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_writers_ || !write_queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_writers_) return;
      task = std::move(write_queue_.front());
      write_queue_.pop_front();
      ++writers_busy_;
    }
    CKPT_DELAY_POINT("writer.before_commit");
    const uint64_t bytes = task->version.layout.payload_bytes;
    const uint64_t file_bytes = task->version.layout.file_bytes;
    absl::StatusOr<store::VersionRecord> rec;
    CommitTimings timings;
    // Reserve the bytes under the disk bound before writing (writers race).
    bool reserved = true;
    uint64_t used = disk_used_.load(std::memory_order_relaxed);
    do {
      if (options_.max_disk_bytes > 0 && used + file_bytes > options_.max_disk_bytes) {
        reserved = false;
        break;
      }
    } while (!disk_used_.compare_exchange_weak(used, used + file_bytes, std::memory_order_relaxed));
    if (!reserved) {
      rec = absl::ResourceExhaustedError(absl::StrCat(
          "disk bound of ", options_.max_disk_bytes, " bytes reached (", used,
          " used); run `ckptctl gc` or raise max_disk_bytes"));
    } else if (absl::Status room = CheckFreeSpace(file_bytes); !room.ok()) {
      disk_used_.fetch_sub(file_bytes, std::memory_order_relaxed);
      rec = std::move(room);
    } else {
      rec = store_->Commit(&task->version, io.get(), &timings);
      if (!rec.ok()) disk_used_.fetch_sub(file_bytes, std::memory_order_relaxed);
    }
    if (rec.ok()) {
      if (Metrics* m = options_.metrics) {
        m->Observe(Histogram::kWriteSeconds, timings.write_seconds);
        m->Observe(Histogram::kFsyncSeconds, timings.sync_seconds);
        m->Observe(Histogram::kCommitSeconds, timings.total_seconds);
      }
    }
    const uint64_t step = task->version.key.step;
    const uint32_t layer = task->version.key.layer;
    std::shared_ptr<Rank> r = std::move(task->rank);
    task.reset();  // returns the staging chunks
    FinishVersion(r, step, layer, rec, bytes);
    AdvanceEvents(r);
    absl::MutexLock lock(&mu_);
    --writers_busy_;
  }
}

void Engine::FinishVersion(const std::shared_ptr<Rank>& r, uint64_t step, uint32_t layer,
                           const absl::StatusOr<store::VersionRecord>& rec, uint64_t bytes) {
  if (rec.ok()) {
    versions_committed_.fetch_add(1, std::memory_order_relaxed);
    bytes_committed_.fetch_add(bytes, std::memory_order_relaxed);
    if (Metrics* m = options_.metrics) {
      m->Inc(Counter::kVersionsCommitted);
      m->Inc(Counter::kCommittedBytes, static_cast<double>(bytes));
    }
  } else {
    write_errors_.fetch_add(1, std::memory_order_relaxed);
    if (Metrics* m = options_.metrics) {
      const absl::string_view msg = rec.status().message();
      const char* kind = absl::IsResourceExhausted(rec.status()) ? "disk_full"
                         : msg.find("fdatasync") != absl::string_view::npos ? "fsync"
                         : msg.find("rocksdb") != absl::string_view::npos   ? "index"
                                                                            : "write";
      m->Inc(Counter::kVersionsFailed);
      m->Inc(Counter::kErrors, kind, 1);
    }
    CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank << " layer " << layer << " step "
                    << step << ": version failed, previous version stays: " << rec.status();
  }
  absl::MutexLock lock(&mu_);
  for (PendingStep& p : r->pending) {
    if (p.step != step) continue;
    if (rec.ok()) {
      p.event.add_layers(layer);
      p.event.set_bytes(p.event.bytes() + bytes);
      r->last_committed[layer] = std::max(r->last_committed[layer], step);
      RecordOutcome(r.get(), layer, step, true);
    } else {
      p.event.set_failed(p.event.failed() + 1);
      r->retry[layer] = true;
      RecordOutcome(r.get(), layer, step, false);
    }
    --p.remaining;
    return;
  }
}

absl::Status Engine::CheckFreeSpace(uint64_t file_bytes) {
  if (options_.min_free_disk_bytes == 0) return absl::OkStatus();
  absl::StatusOr<uint64_t> free = store_->FreeBytes();
  if (!free.ok() || *free >= options_.min_free_disk_bytes + file_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the data file system has ", *free, " bytes free; min_free_disk_bytes keeps ",
      options_.min_free_disk_bytes, " for the index (free space or run `ckptctl gc`)"));
}

void Engine::AdvanceEvents(const std::shared_ptr<Rank>& r) {
  absl::MutexLock order(&r->event_mu);
  std::vector<std::pair<uint64_t, store::EventRecord>> batch;
  {
    absl::MutexLock lock(&mu_);
    for (const PendingStep& p : r->pending) {
      if (p.remaining != 0) break;
      store::EventRecord e = p.event;
      std::sort(e.mutable_layers()->begin(), e.mutable_layers()->end());
      e.set_unix_ms(absl::ToUnixMillis(absl::Now()));
      batch.emplace_back(p.step, std::move(e));
    }
  }
  if (batch.empty()) return;
  CKPT_KILL_POINT("event.before_put");
  absl::Status s = index_->PutEvents(r->job, r->rank, batch);
  CKPT_KILL_POINT("event.after_put");
  absl::MutexLock lock(&mu_);
  if (!s.ok()) {
    CKPT_LOG(ERROR) << "job " << r->job << " rank " << r->rank
                    << ": recording checkpoint events failed; durability stops here: " << s;
    r->fatal = s;
    if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kErrors, "index", 1);
  }
  for (size_t i = 0; i < batch.size(); ++i) r->pending.pop_front();
  if (s.ok()) r->durable_step = batch.back().first;
}

// ---- Waits ----

absl::StatusOr<v1::WaitSnapshotReply> Engine::WaitSnapshot(const v1::WaitRequest& req,
                                                           const Caller& caller,
                                                           absl::Time deadline) {
  if (req.timeout_ms() > 0) deadline = std::min(deadline, absl::Now() + absl::Milliseconds(req.timeout_ms()));
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  if (req.step() > r->last_step_seen) {
    return absl::FailedPreconditionError(absl::StrCat("step ", req.step(), " was never reported"));
  }
  auto taken = [&r, &req, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r->snapshot_step >= req.step() || !r->active || stopping_;
  };
  const absl::Time wait_start = absl::Now();
  mu_.AwaitWithDeadline(absl::Condition(&taken), deadline);
  if (options_.metrics != nullptr) {
    options_.metrics->Observe(Histogram::kFenceWaitSeconds,
                              absl::ToDoubleSeconds(absl::Now() - wait_start));
  }
  if (r->snapshot_step < req.step()) {
    // The caller will go on without the fence: a copy still running for this
    // step (or an earlier one) must not become durable.
    r->fence_broken_step = std::max(r->fence_broken_step, req.step());
    if (!r->active || stopping_) return absl::AbortedError("the registration ended before the snapshot");
    return absl::DeadlineExceededError(absl::StrCat("snapshot of step ", req.step(), " not taken in time"));
  }
  auto it = r->snap_results.find(req.step());
  if (it == r->snap_results.end()) return v1::WaitSnapshotReply();  // an old step: taken long ago
  return it->second;
}

absl::StatusOr<v1::WaitDurableReply> Engine::WaitDurable(const v1::WaitRequest& req,
                                                         const Caller& caller,
                                                         absl::Time deadline) {
  if (req.timeout_ms() > 0) deadline = std::min(deadline, absl::Now() + absl::Milliseconds(req.timeout_ms()));
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  if (req.step() > r->last_step_seen) {
    return absl::FailedPreconditionError(absl::StrCat("step ", req.step(), " was never reported"));
  }
  auto durable = [&r, &req, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r->durable_step >= req.step() || !r->fatal.ok() || !r->active || stopping_;
  };
  mu_.AwaitWithDeadline(absl::Condition(&durable), deadline);
  if (!r->fatal.ok()) return r->fatal;
  if (r->durable_step < req.step()) {
    if (!r->active || stopping_) return absl::AbortedError("the registration ended before step became durable");
    return absl::DeadlineExceededError(absl::StrCat("step ", req.step(), " not durable in time"));
  }
  std::vector<uint32_t> failed;
  for (uint32_t l = 0; l < r->outcomes.size(); ++l) {
    const std::map<uint64_t, bool>& o = r->outcomes[l];
    auto it = o.upper_bound(req.step());  // the newest selection at or before the step
    if (it != o.begin() && !std::prev(it)->second) failed.push_back(l);
  }
  if (!failed.empty()) {
    return absl::AbortedError(absl::StrCat("layer versions of layers [", absl::StrJoin(failed, ","),
                                           "] at or before step ", req.step(),
                                           " failed or were skipped; they are retried next step"));
  }
  v1::WaitDurableReply reply;
  reply.set_durable_step(r->durable_step);
  return reply;
}

absl::Status Engine::Unregister(const v1::UnregisterRequest& req, const Caller& caller,
                                absl::Time deadline) {
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Rank> r,
                        FindLocked(req.job_id(), req.rank(), req.generation(), caller));
  r->active = false;
  ReleaseDeferredLocked(r.get());
  ReleaseMemoryLocked(r.get(), "unregistered", &closing);
  if (req.drain()) {
    CKPT_RETURN_IF_ERROR(DrainLocked(r, deadline));
    ranks_.erase(RankKey(r->job, r->rank));
  }
  // Without drain the rank stays (inactive) until its staged versions are
  // written: the next Register of it drains it first.
  if (options_.metrics != nullptr) options_.metrics->RemoveRank(r->job, r->rank);
  CKPT_LOG(INFO) << "unregistered job " << r->job << " rank " << r->rank << " generation "
                 << r->generation;
  return absl::OkStatus();
}

// ---- Plans and restore ----

absl::StatusOr<v1::Plan> Engine::Plan(const v1::PlanRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
  }
  return BuildPlan(index_, req.job_id(), req.rank(), req.target_step(), *table);
}

absl::StatusOr<v1::RestoreReply> Engine::Restore(const v1::RestoreRequest& req,
                                                 const Caller& caller) {
  std::shared_ptr<Rank> r;
  std::shared_ptr<RankMemory> memory;
  {
    absl::MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(r, FindLocked(req.job_id(), req.rank(), req.generation(), caller));
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
  auto restore = [&]() -> absl::StatusOr<v1::RestoreReply> {
    const RankKey key(r->job, r->rank);
    CKPT_RETURN_IF_ERROR(AcquireLease(key, absl::Now() + absl::Seconds(30)));
    LeaseGuard lease(this, key);
    v1::RestoreReply reply;
    CKPT_ASSIGN_OR_RETURN(*reply.mutable_plan(),
                          BuildPlan(index_, r->job, r->rank, req.target_step(), r->table));
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io,
                          MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    TensorDestination dest = [&r](uint32_t layer, uint32_t tensor) {
      return r->layers[layer].src[tensor];
    };
    CKPT_ASSIGN_OR_RETURN(
        RestoreStats stats,
        RestoreInto(reply.plan(), r->table, dest, index_, store_, io.get(), pool_,
                    options_.restore_timeout,
                    [this] { return shutting_down_.load(std::memory_order_relaxed); },
                    [&memory](char* dst, const char* src, uint64_t n) {
                      return memory->CopyIn(dst, src, n);
                    }));
    reply.set_bytes_restored(stats.bytes);
    reply.set_seconds(stats.seconds);
    return reply;
  };
  absl::StatusOr<v1::RestoreReply> reply = restore();
  {
    absl::MutexLock lock(&mu_);
    r->restoring = false;
    if (reply.ok()) {
      r->retry.assign(r->retry.size(), false);
      if (r->layercheck != nullptr) {
        // The buffers now equal each layer's planned version: LayerCheck
        // continues from there instead of starting over.
        std::vector<uint64_t> persisted(r->layers.size(), 0);
        for (const v1::LayerPlan& lp : reply->plan().layers()) {
          if (lp.has_version() && lp.layer() < persisted.size()) persisted[lp.layer()] = lp.step();
        }
        r->layercheck->Resume(reply->plan().target_step(), persisted);
      }
    }
  }
  if (Metrics* m = options_.metrics) {
    if (reply.ok()) {
      m->Inc(Counter::kRestores);
      m->Inc(Counter::kRestoredBytes, static_cast<double>(reply->bytes_restored()));
      m->Observe(Histogram::kRestoreSeconds, reply->seconds());
    } else if (absl::IsDataLoss(reply.status())) {
      m->Inc(Counter::kErrors, "checksum", 1);
    }
  }
  if (!reply.ok()) {
    CKPT_LOG(ERROR) << "restore of job " << r->job << " rank " << r->rank << " failed: "
                    << reply.status();
    return reply.status();
  }
  CKPT_LOG(INFO) << "restored job " << r->job << " rank " << r->rank << " to step "
                 << reply->plan().target_step() << ": " << reply->bytes_restored() << " bytes in "
                 << reply->seconds() << " s, max staleness " << reply->plan().max_staleness();
  return reply;
}

// ---- Admin ----

v1::StatusReply Engine::GetStatus() {
  v1::StatusReply s;
  s.set_version(CKPT_VERSION);
  s.set_data_dir(options_.data_dir);
  s.set_metrics_address(options_.metrics_address);
  s.set_disk_bytes_used(disk_used_.load(std::memory_order_relaxed));
  s.set_disk_bytes_limit(options_.max_disk_bytes);
  s.set_io_backend(io_backend_name_);
  s.set_pool_bytes(pool_->budget_bytes());
  s.set_pool_bytes_in_use(pool_->bytes_in_use());
  s.set_versions_committed(versions_committed_.load(std::memory_order_relaxed));
  s.set_bytes_committed(bytes_committed_.load(std::memory_order_relaxed));
  s.set_snapshots_skipped(snapshots_skipped_.load(std::memory_order_relaxed));
  s.set_write_errors(write_errors_.load(std::memory_order_relaxed));
  s.set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  s.set_orphan_files_removed(reconcile_.orphan_files_removed);
  s.set_dangling_records_removed(reconcile_.dangling_records_removed);
  s.set_temp_files_removed(reconcile_.temp_files_removed);
  s.set_gpu(gpu_support_);
  const GpuMappingStats gpu = OpenGpuMappings();
  s.set_open_gpu_mappings(static_cast<uint32_t>(gpu.mappings));
  s.set_open_gpu_mapping_bytes(gpu.bytes);
  absl::StatusOr<std::vector<std::string>> jobs = index_->ListJobs();
  if (jobs.ok()) s.set_jobs(static_cast<uint32_t>(jobs->size()));
  absl::MutexLock lock(&mu_);
  s.set_registered_ranks(static_cast<uint32_t>(std::count_if(
      ranks_.begin(), ranks_.end(), [](const auto& kv) { return kv.second->active; })));
  return s;
}

absl::StatusOr<v1::JobsReply> Engine::Jobs(const Caller& caller) {
  v1::JobsReply reply;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(auto rec, index_->GetJob(job));
    if (!rec.has_value() || (rec->owner_uid() != caller.uid && !IsRoot(caller))) continue;
    v1::JobInfo* info = reply.add_jobs();
    info->set_job_id(job);
    info->set_owner_uid(rec->owner_uid());
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
    for (uint32_t rank : ranks) {
      v1::RankInfo* ri = info->add_ranks();
      ri->set_rank(rank);
      CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(job, rank));
      if (table.has_value()) ri->set_layers(static_cast<uint32_t>(table->layers_size()));
      CKPT_ASSIGN_OR_RETURN(auto ev, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
      if (ev.has_value()) ri->set_latest_durable_step(ev->first);
      CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
          job, rank, -1, [info](const VersionKey&, const store::VersionRecord& v) {
            info->set_versions(info->versions() + 1);
            info->set_bytes(info->bytes() + v.file_bytes());
            return true;
          }));
      absl::MutexLock lock(&mu_);
      auto it = ranks_.find(RankKey(job, rank));
      if (it != ranks_.end() && it->second->active) {
        ri->set_registered(true);
        ri->set_generation(it->second->generation);
        ri->set_last_step_seen(it->second->last_step_seen);
      }
    }
  }
  return reply;
}

absl::StatusOr<v1::LayersReply> Engine::Layers(const v1::LayersRequest& req, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
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
  for (const v1::LayerSpec& spec : table->layers()) {
    v1::LayerInfo* li = reply.add_layers();
    li->set_layer(spec.id());
    li->set_name(spec.name());
    li->set_kind(spec.kind());
    for (const v1::TensorSpec& t : spec.tensors()) li->set_bytes(li->bytes() + t.nbytes());
  }
  CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
      req.job_id(), req.rank(), -1, [&](const VersionKey& k, const store::VersionRecord&) {
        if (k.layer < static_cast<uint32_t>(reply.layers_size()) && k.step <= latest) {
          v1::LayerInfo* li = reply.mutable_layers(static_cast<int>(k.layer));
          li->set_versions(li->versions() + 1);
          li->set_last_step(std::max(li->last_step(), k.step));
        }
        return true;
      }));
  for (v1::LayerInfo& li : *reply.mutable_layers()) {
    li.set_staleness(li.last_step() > 0 ? latest - li.last_step() : 0);
  }
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(RankKey(req.job_id(), req.rank()));
  if (it != ranks_.end() && it->second->active) {
    const Rank& r = *it->second;
    reply.set_policy(PolicyName(r.policy.kind));
    if (r.layercheck != nullptr) {
      reply.set_s_max(r.layercheck->config().s_max);
      for (size_t l = 0; l < r.layercheck->layers() && l < static_cast<size_t>(reply.layers_size()); ++l) {
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
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  v1::HistoryReply reply;
  CKPT_RETURN_IF_ERROR(index_->ForEachEvent(
      req.job_id(), req.rank(), /*newest_first=*/true,
      [&](uint64_t step, const store::EventRecord& e) {
        if (req.layer() >= 0 &&
            std::find(e.layers().begin(), e.layers().end(), static_cast<uint32_t>(req.layer())) ==
                e.layers().end()) {
          return true;
        }
        v1::HistoryEvent* h = reply.add_events();
        h->set_step(step);
        *h->mutable_layers() = e.layers();
        h->set_bytes(e.bytes());
        h->set_failed(e.failed());
        h->set_skipped(e.skipped());
        return req.limit() == 0 || static_cast<uint32_t>(reply.events_size()) < req.limit();
      }));
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
    // Hold off GC on this rank while its versions are checked.
    const RankKey key(req.job_id(), rank);
    CKPT_RETURN_IF_ERROR(AcquireLease(key, absl::Now() + absl::Seconds(30)));
    LeaseGuard release(this, key);
    std::vector<std::pair<VersionKey, store::VersionRecord>> versions;
    CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
        req.job_id(), rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
          versions.emplace_back(k, rec);
          return true;
        }));
    for (const auto& [key, rec] : versions) {
      absl::Status v = req.deep() ? store_->Read(key, rec, io.get(), pool_,
                                                 absl::Now() + options_.restore_timeout)
                                        .status()
                                  : store_->CheckFile(key, rec);
      reply.set_versions_checked(reply.versions_checked() + 1);
      if (v.ok()) {
        reply.set_bytes_checked(reply.bytes_checked() + rec.payload_bytes());
        continue;
      }
      if (absl::IsNotFound(v) || absl::IsDeadlineExceeded(v)) {
        // Removed concurrently or no staging memory: not a verdict on the data.
        if (absl::IsDeadlineExceeded(v)) return v;
        reply.set_versions_checked(reply.versions_checked() - 1);
        continue;
      }
      v1::VerifyFailure* f = reply.add_failures();
      f->set_rank(rank);
      f->set_layer(key.layer);
      f->set_step(key.step);
      f->set_error(v.ToString());
    }
  }
  reply.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return reply;
}

// ---- Leases, retention and export ----

absl::Status Engine::AcquireLease(const RankKey& key, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return gc_active_.count(key) == 0;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&free), deadline)) {
    return absl::UnavailableError("garbage collection of this rank is running; retry");
  }
  ++leases_[key];
  return absl::OkStatus();
}

void Engine::ReleaseLease(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  if (--leases_[key] <= 0) leases_.erase(key);
}

absl::Status Engine::GcRank(const std::string& job, uint32_t rank, bool dry_run,
                            v1::GcReply* reply) {
  const RankKey key(job, rank);
  {
    absl::MutexLock lock(&mu_);
    if (leases_.count(key) > 0 || gc_active_.count(key) > 0) {
      reply->set_ranks_busy(reply->ranks_busy() + 1);
      return absl::OkStatus();
    }
    gc_active_.insert(key);
  }
  auto release = [&] {
    absl::MutexLock lock(&mu_);
    gc_active_.erase(key);
  };
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(absl::Now());
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
        disk_used_.fetch_sub(rec.file_bytes(), std::memory_order_relaxed);
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

absl::Status Engine::Export(const v1::ExportRequest& req, const Caller& caller,
                            const std::function<bool(const v1::ExportChunk&)>& sink) {
  CKPT_RETURN_IF_ERROR(CheckOwner(req.job_id(), caller));
  CKPT_ASSIGN_OR_RETURN(auto table, index_->GetRank(req.job_id(), req.rank()));
  if (!table.has_value()) {
    return absl::NotFoundError(absl::StrCat("job ", req.job_id(), " has no rank ", req.rank()));
  }
  const RankKey key(req.job_id(), req.rank());
  CKPT_RETURN_IF_ERROR(AcquireLease(key, absl::Now() + absl::Seconds(30)));
  LeaseGuard release(this, key);
  CKPT_ASSIGN_OR_RETURN(v1::Plan plan, BuildPlan(index_, req.job_id(), req.rank(), req.target_step(), *table));
  if (!plan.complete()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan for step ", plan.target_step(), " is incomplete"));
  }
  v1::ExportChunk head;
  v1::ExportHeader* h = head.mutable_header();
  *h->mutable_plan() = plan;
  for (const v1::LayerPlan& lp : plan.layers()) {
    const v1::LayerSpec& spec = table->layers(static_cast<int>(lp.layer()));
    for (const v1::TensorSpec& t : spec.tensors()) {
      v1::ExportTensor* et = h->add_tensors();
      et->set_layer(lp.layer());
      et->set_layer_name(spec.name());
      et->set_name(t.name());
      et->set_dtype(t.dtype());
      *et->mutable_shape() = t.shape();
      et->set_nbytes(t.nbytes());
      et->set_role(t.role());
      et->set_group(t.group());
      et->set_step(lp.step());
      h->set_total_bytes(h->total_bytes() + t.nbytes());
    }
  }
  if (!sink(head)) return absl::CancelledError("the reader went away");
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io,
                        MakeIoBackend(options_.io_backend, options_.io_queue_depth));
  constexpr uint64_t kPiece = 4 << 20;
  for (const v1::LayerPlan& lp : plan.layers()) {
    const VersionKey vk{req.job_id(), req.rank(), lp.layer(), lp.step()};
    CKPT_ASSIGN_OR_RETURN(auto rec, index_->VersionAtOrBefore(vk.job, vk.rank, vk.layer, vk.step));
    if (!rec.has_value() || rec->first != lp.step()) return absl::AbortedError("a planned version vanished");
    absl::StatusOr<LoadedVersion> v =
        store_->Read(vk, rec->second, io.get(), pool_, absl::Now() + options_.restore_timeout);
    if (!v.ok()) {
      return absl::Status(v.status().code(), absl::StrCat("layer ", lp.layer(), " step ", lp.step(),
                                                          ": ", v.status().message()));
    }
    // Copy the verified layer out of staging before streaming it, so a slow
    // reader never holds pinned staging memory that snapshots need.
    std::map<std::string, const store::TensorEntry*> stored;
    for (const store::TensorEntry& t : v->decoded.header.tensors()) stored[t.name()] = &t;
    std::string layer_bytes;
    for (const v1::TensorSpec& t : table->layers(static_cast<int>(lp.layer())).tensors()) {
      auto it = stored.find(t.name());
      if (it == stored.end() || it->second->nbytes() != t.nbytes()) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", t.name(), "' differs between the checkpoint and the table"));
      }
      const size_t at = layer_bytes.size();
      layer_bytes.resize(at + t.nbytes());
      v->lease.CopyOut(v->decoded.layout.header_bytes + it->second->offset(), &layer_bytes[at],
                       t.nbytes());
    }
    v = absl::StatusOr<LoadedVersion>(absl::CancelledError("released"));  // frees the lease
    for (uint64_t off = 0; off < layer_bytes.size(); off += kPiece) {
      v1::ExportChunk chunk;
      chunk.set_data(layer_bytes.substr(off, kPiece));
      if (!sink(chunk)) return absl::CancelledError("the reader went away");
    }
  }
  return absl::OkStatus();
}

void Engine::CollectMetrics() {
  Metrics* m = options_.metrics;
  if (m == nullptr) return;
  m->Set(Gauge::kStagingPoolBytes, static_cast<double>(pool_->budget_bytes()));
  m->Set(Gauge::kStagingPoolInUseBytes, static_cast<double>(pool_->bytes_in_use()));
  m->Set(Gauge::kDiskUsedBytes, static_cast<double>(disk_used_.load(std::memory_order_relaxed)));
  m->Set(Gauge::kDiskLimitBytes, static_cast<double>(options_.max_disk_bytes));
  const GpuMappingStats gpu = OpenGpuMappings();
  m->Set(Gauge::kOpenGpuMappings, static_cast<double>(gpu.mappings));
  m->Set(Gauge::kOpenGpuMappingBytes, static_cast<double>(gpu.bytes));
  absl::MutexLock lock(&mu_);
  m->Set(Gauge::kWriteQueueDepth, static_cast<double>(write_queue_.size()));
  m->Set(Gauge::kRegisteredRanks, static_cast<double>(std::count_if(
      ranks_.begin(), ranks_.end(), [](const auto& kv) { return kv.second->active; })));
  // Durability lag: staged but not yet durable, over every live rank.
  const absl::Time now = absl::Now();
  double lag_bytes = 0, lag_seconds = 0;
  for (const auto& [key, r] : ranks_) {
    for (const PendingStep& p : r->pending) {
      lag_bytes += static_cast<double>(p.staged_bytes - std::min(p.staged_bytes, p.event.bytes()));
      lag_seconds = std::max(lag_seconds, absl::ToDoubleSeconds(now - p.staged_at));
    }
    for (uint32_t l = 0; r->active && l < r->last_committed.size(); ++l) {
      const double staleness = r->last_committed[l] > 0 && r->durable_step >= r->last_committed[l]
                                   ? static_cast<double>(r->durable_step - r->last_committed[l])
                                   : 0.0;
      const double drift = r->layercheck != nullptr ? r->layercheck->accumulated(l) : 0.0;
      m->SetLayer(r->job, r->rank, l, staleness, drift);
    }
  }
  m->Set(Gauge::kDurabilityLagBytes, lag_bytes);
  m->Set(Gauge::kDurabilityLagSeconds, lag_seconds);
}

void Engine::RecordOutcome(Rank* r, uint32_t layer, uint64_t step, bool durable) {
  std::map<uint64_t, bool>& o = r->outcomes[layer];
  o[step] = durable;
  while (o.size() > kOutcomesKept) o.erase(o.begin());
}

}  // namespace ckpt
