// RankState registry: Register, Unregister, ownership, drain, trainer exit.
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/common/validate.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

void Engine::WatchTrainersLoop() {
  for (;;) {
    std::vector<std::shared_ptr<RankState>> watched;
    std::vector<struct pollfd> fds;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      for (auto& [key, r] : ranks_) {
        absl::MutexLock rank_lock(&r->mu);
        if (r->memory != nullptr && r->trainer_pidfd.valid()) {
          watched.push_back(r);
          fds.push_back({r->trainer_pidfd.get(), POLLIN, 0});
        }
      }
    }
    // A pidfd becomes readable when its process exits.
    const int timeout_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options_.trainer_watch_interval));
    if (fds.empty()) {
      absl::SleepFor(options_.trainer_watch_interval);
      continue;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) continue;
    std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      RankState* r = watched[i].get();
      absl::MutexLock rank_lock(&r->mu);
      if (r->trainer_pidfd.get() != fds[i].fd) continue;  // released meanwhile
      r->ReleaseMemory("its trainer process exited", &closing);
    }
  }
}

absl::StatusOr<std::shared_ptr<RankState>> Engine::FindLocked(const RankRef& ref,
                                                              const Caller& caller) {
  // Every call of a registration fails alike once ckptd is stopping, so the
  // client sees the loss of ckptd whatever it calls (a wait for a step that
  // a refused StepDone never reported included).
  if (stopping_) return ShuttingDownError();
  CKPT_RETURN_IF_ERROR(ValidateJobId(ref.job));
  const absl::Status not_registered = WithReason(
      absl::NotFoundError(absl::StrCat("job ", ref.job, " rank ", ref.rank, " is not registered")),
      ErrorReason::kNotRegistered);
  auto it = ranks_.find(RankKey(ref.job, ref.rank));
  if (it == ranks_.end()) return not_registered;
  const std::shared_ptr<RankState>& r = it->second;
  {
    absl::MutexLock rank_lock(&r->mu);
    if (!r->active) return not_registered;
  }
  // Another user's registration reads like none at all.
  if (r->uid != caller.uid && !IsRoot(caller)) return not_registered;
  if (r->generation != ref.generation) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "generation ", ref.generation, " of job ", ref.job, " rank ", ref.rank,
                          " is stale (current ", r->generation, "); register again")),
                      ErrorReason::kStaleGeneration);
  }
  return r;
}

absl::StatusOr<std::shared_ptr<RankState>> Engine::Find(const RankRef& ref, const Caller& caller) {
  absl::MutexLock lock(&mu_);
  return FindLocked(ref, caller);
}

absl::Status Engine::ClaimRegistration(const RankKey& key, const Caller& caller) {
  absl::MutexLock lock(&mu_);
  if (options_.max_registrations_per_uid > 0) {
    // Live registrations of the caller, and those it is making now; a rank
    // registering again replaces itself and is not counted twice.
    size_t held = 0;
    for (const auto& [k, r] : ranks_) {
      if (r->uid != caller.uid || k == key) continue;
      absl::MutexLock rank_lock(&r->mu);
      held += r->active ? 1 : 0;
    }
    for (const auto& [k, uid] : registering_) held += uid == caller.uid && k != key;
    if (held >= options_.max_registrations_per_uid) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "uid ", caller.uid, " has ", held,
              " ranks registered (max_registrations_per_uid); unregister or release some")),
          ErrorReason::kQuota);
    }
  }
  if (deleting_jobs_.count(key.first) != 0) {
    return absl::AbortedError(absl::StrCat("job ", key.first, " is being deleted; retry"));
  }
  if (!registering_.emplace(key, caller.uid).second) {
    return absl::AbortedError("a concurrent registration of this rank is in progress; retry");
  }
  return absl::OkStatus();
}

void Engine::UnclaimRegistration(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  registering_.erase(key);
}

absl::StatusOr<uint64_t> Engine::ResumeFromIndex(const std::shared_ptr<RankState>& r,
                                                 absl::Time deadline) {
  const size_t n = r->layers.size();
  CKPT_ASSIGN_OR_RETURN(auto last_event, index_->EventAtOrBefore(r->job, r->rank, ~uint64_t{0}));
  const uint64_t durable = last_event.has_value() ? last_event->first : 0;
  std::vector<uint64_t> last_committed(n, 0);
  std::vector<bool> never_persisted(n, true);
  // One pass over the rank's versions (one seek, within its own key range):
  // each layer's are in step order, so its newest at or below `durable` is
  // the last one seen.
  uint64_t seen = 0;
  bool late = false;
  CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
      r->job, r->rank, /*layer=*/-1, [&](const VersionKey& k, const store::VersionRecord&) {
        if (++seen % 1024 == 0 && absl::Now() >= deadline) {
          late = true;
          return false;
        }
        if (k.layer < n && k.step <= durable) {
          last_committed[k.layer] = k.step;
          never_persisted[k.layer] = false;
        }
        return true;
      }));
  if (late) return absl::DeadlineExceededError("the registration ran past its caller's deadline");
  absl::MutexLock rank_lock(&r->mu);
  if (r->layercheck != nullptr && last_event.has_value()) {
    r->layercheck->RaiseLrReference(last_event->second.layercheck_lr_ref());
  }
  r->last_step_seen = durable;
  r->snapshot_step = durable;
  r->durable_step = durable;
  r->last_committed = std::move(last_committed);
  r->never_persisted = std::move(never_persisted);
  return durable;
}

absl::StatusOr<Engine::TableCharge> Engine::ReserveTable(const RankState& r) {
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> old, index_->GetRank(r.job, r.rank));
  TableCharge charge;
  charge.old_bytes = old.has_value() ? RankIndexBytes(*old) : 0;
  store::RankRecord largest = r.table;
  largest.set_generation(~uint64_t{0});  // the longest generation it can take
  const uint64_t most = RankIndexBytes(largest);
  charge.reserved = most > charge.old_bytes ? most - charge.old_bytes : 0;
  QuotaKind refused = QuotaKind::kIndex;
  if (absl::Status s = quota_.ReserveIndex(QuotaOwner{r.uid, r.job}, charge.reserved, &refused);
      !s.ok()) {
    if (Metrics* m = options_.metrics) m->Inc(Counter::kQuotaRefused, QuotaKindName(refused), 1);
    return s;
  }
  return charge;
}

absl::Status Engine::PutTable(const RankState& r, const TableCharge& charge) {
  const QuotaOwner owner{r.uid, r.job};
  if (absl::Status s = index_->PutRank(r.job, r.rank, r.table); !s.ok()) {
    quota_.ReleaseIndex(owner, charge.reserved);
    return s;
  }
  // Charged so far: old_bytes + reserved >= the new table's bytes.
  quota_.ReleaseIndex(owner, charge.reserved + charge.old_bytes - RankIndexBytes(r.table));
  return absl::OkStatus();
}

absl::StatusOr<uid_t> Engine::OwnerForRegistration(const std::string& job,
                                                   std::optional<uid_t> local_owner,
                                                   const Caller& caller) {
  // A job's owner is one fact for every node that shares a tier: a job id
  // another uid holds there is refused like one it holds here.
  CKPT_ASSIGN_OR_RETURN(std::optional<uid_t> owner, TierOwnerOf(job, local_owner));
  if (owner.has_value() && *owner != caller.uid && !IsRoot(caller)) {
    return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
  }
  return owner.value_or(caller.uid);
}

absl::StatusOr<std::shared_ptr<RankState>> Engine::NewRank(const Registration& req,
                                                           HandedOver handed_over,
                                                           std::unique_ptr<Holding> held,
                                                           uid_t owner, const Caller& caller) {
  // An IPC handle that is still open in the registration this one replaces
  // is opened again (the driver counts references), so the old one keeps
  // working until it is drained.
  auto r = std::make_shared<RankState>();
  r->job = req.job;
  r->rank = req.rank;
  r->uid = owner;
  r->policy = req.policy.selection;
  std::shared_ptr<RankMemory> memory;
  UniqueFd pidfd;
  // The registering process is watched: when it exits, the rank's memory
  // (GPU mappings, or the memfd regions and their descriptors) is released.
  if (caller.pid > 0) {
    pidfd = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, caller.pid, 0)));
    if (!pidfd.valid() && errno == ESRCH) {
      return absl::UnavailableError("the registering process exited");
    }
    if (!pidfd.valid()) {
      CKPT_LOG(WARNING) << "pidfd_open: " << std::strerror(errno) << "; the memory of job "
                        << r->job << " rank " << r->rank
                        << " is released only on unregister, re-register or shutdown";
    }
  }
  if (req.gpu.has_value()) {
    GpuMemoryOptions gpu;
    gpu.copy_timeout = options_.gpu_wait_timeout;
    gpu.close_timeout = std::min(gpu.close_timeout, options_.gpu_wait_timeout);
    gpu.cancel = &shutting_down_;  // a stopping ckptd waits for no device
    gpu.health = &gpu_health_;
    gpu.fabric_handles = options_.gpu_fabric_handles;
    CKPT_ASSIGN_OR_RETURN(
        memory, GpuMemory::Open(*req.gpu, std::move(handed_over.gpu_pages), cuda_ipc_, gpu));
  } else {
    memory = std::make_shared<HostMemory>(std::move(handed_over.regions), std::move(held));
  }
  for (const LayerDesc& spec : req.layers) {
    LayerTemplate lt;
    lt.header = HeaderTemplateOf(req.job, req.rank, spec);
    for (const TensorDesc& t : spec.tensors) lt.src.push_back(memory->base(t.region) + t.offset);
    CKPT_RETURN_IF_ERROR(PlanLayout(&lt.header).status());  // assigns tensor offsets
    r->layers.push_back(std::move(lt));
    *r->table.add_layers() = TableEntryOf(spec);
    r->frozen.push_back(spec.frozen);
  }
  r->table.set_world_size(req.world_size);
  for (const std::string& n : req.job_nodes) r->table.add_job_nodes(n);
  r->world_size = req.world_size;
  r->local_drift = req.policy.layercheck.local_drift;
  if (r->policy.kind == PolicyKind::kLayerCheck) {
    CKPT_RETURN_IF_ERROR(SetUpLayerCheck(req, memory.get(), r.get()));
  }
  const size_t n = r->layers.size();
  absl::MutexLock rank_lock(&r->mu);  // not published yet: uncontended
  r->memory = std::move(memory);
  r->trainer_pidfd = std::move(pidfd);
  r->never_persisted.assign(n, true);
  // The first step after any registration persists every layer: whatever
  // the trainer did since the last durable step is unknown to this daemon
  // (it may have restarted and lost earlier selections). A successful
  // Restore clears this, since the buffers then equal the durable state.
  r->retry.assign(n, true);
  r->outcomes.assign(n, {});
  return r;
}

absl::StatusOr<Engine::HandedOver> Engine::MapRegistration(const Registration& req,
                                                           std::vector<UniqueFd> fds) {
  // Host regions are mapped first (each must already be sealed against
  // shrinking, so its size cannot change under us); GPU regions are only
  // checked against the sizes their trainer declared, and opened (their
  // pages imported) once the caller is known to own the job. Every tensor
  // is validated against these sizes before any pointer into them is formed.
  HandedOver h;
  std::vector<uint64_t> sizes;
  if (req.gpu.has_value()) {
    if (!req.handover_token.empty()) {
      return absl::InvalidArgumentError(
          "a registration hands over host regions or GPU regions, not both");
    }
    CKPT_ASSIGN_OR_RETURN(sizes,
                          CheckGpuHandover(*req.gpu, fds.size(), options_.gpu_fabric_handles));
    h.gpu_pages = std::move(fds);
  } else {
    for (UniqueFd& fd : fds) {
      CKPT_ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::Map(std::move(fd)));
      sizes.push_back(region.size());
      h.regions.push_back(std::move(region));
    }
  }
  RegistrationLimits limits = options_.limits;
  limits.max_layer_file_bytes = pool_->budget_bytes();
  CKPT_RETURN_IF_ERROR(ValidateRegistration(req, sizes, limits));
  CKPT_RETURN_IF_ERROR(req.policy.selection.Validate());
  return h;
}

absl::Status Engine::CreateRankRecords(RankState* r, bool job_exists, uid_t owner) {
  // The table's quota is reserved before anything is created, so a refused
  // registration leaves no job. A new job is created in the tiers first:
  // check and creation are one step (ClaimJob, JobOwners::Claim: of two uids
  // racing for a new id, the second is refused). These records stay above
  // the index's free-space floor too.
  CKPT_RETURN_IF_ERROR(disk_.CheckIndexRoom(r->table.ByteSizeLong() + 4096));
  CKPT_ASSIGN_OR_RETURN(const TableCharge charge, ReserveTable(*r));
  absl::Status created = job_exists ? absl::OkStatus() : ClaimInTiers(r->job, owner);
  if (created.ok()) created = owners_.Claim(r->job, owner);
  if (created.ok()) {
    absl::StatusOr<uint64_t> generation = index_->NextGeneration();
    created = generation.status();
    if (generation.ok()) r->generation = *generation;
  }
  if (!created.ok()) {
    quota_.ReleaseIndex(QuotaOwner{r->uid, r->job}, charge.reserved);
    return created;
  }
  r->table.set_generation(r->generation);
  return PutTable(*r, charge);
}

// Register is one numbered sequence: each step may refuse the registration,
// and nothing before step 5 leaves a trace.
absl::StatusOr<Registered> Engine::Register(const Registration& req, std::vector<UniqueFd> fds,
                                            const Caller& caller, std::unique_ptr<Holding> held) {
  // 1. The handed-over memory, mapped and checked (MapRegistration).
  CKPT_ASSIGN_OR_RETURN(HandedOver handed_over, MapRegistration(req, std::move(fds)));
  // Every later step may take time (the tiers, a drain, the index): none
  // goes on once the caller has stopped waiting.
  auto caller_gone = [&req]() -> absl::Status {
    if (absl::Now() < req.deadline) return absl::OkStatus();
    return absl::DeadlineExceededError("the registration ran past its caller's deadline");
  };

  // 2. Ownership: another uid's job is refused here. A new job is created
  //    only once the registration has succeeded up to writing its table
  //    (step 5), so a refused registration leaves no job behind.
  //    On a replacement node, the rank's history comes from a tier first
  //    (checked against the caller's uid).
  CKPT_RETURN_IF_ERROR(PullFromTiers(req.job, req.rank, caller, /*must_know=*/false));
  CKPT_ASSIGN_OR_RETURN(std::optional<uid_t> local_owner, owners_.OwnerOf(req.job));
  CKPT_ASSIGN_OR_RETURN(const uid_t owner, OwnerForRegistration(req.job, local_owner, caller));
  CKPT_RETURN_IF_ERROR(caller_gone());
  // One registration of a rank at a time, so its table and generation are
  // written by a single caller.
  const RankKey key(req.job, req.rank);
  CKPT_RETURN_IF_ERROR(ClaimRegistration(key, caller));
  struct Unclaim {
    Engine* e;
    const RankKey& k;
    ~Unclaim() { e->UnclaimRegistration(k); }
  } unclaim{this, key};
  // After the claim: an eviction either came first (refused here) or waits
  // for this registration and then releases it.
  CKPT_RETURN_IF_ERROR(owners_.CheckAdmits(req.job));

  // 3. The rank's state, starting with its memory.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r,
                        NewRank(req, std::move(handed_over), std::move(held), owner, caller));
  const size_t n = r->layers.size();

  // 4. Replace a live registration of the same rank once its pipeline drained.
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
  std::shared_ptr<RankState> old;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return ShuttingDownError();
    auto it = ranks_.find(key);
    if (it != ranks_.end()) {
      old = it->second;
      if (old->uid != caller.uid && !IsRoot(caller)) {
        return absl::PermissionDeniedError(
            absl::StrCat("job ", r->job, " belongs to another user"));
      }
      EndRegistrationLocked(*old, "the rank registered again", &closing);
    }
  }
  if (old != nullptr) {
    CKPT_RETURN_IF_ERROR(
        DrainAndForget(old, std::min(absl::Now() + options_.drain_timeout, req.deadline)));
  }
  CKPT_RETURN_IF_ERROR(caller_gone());

  // 5. The job if it is new and the rank's table (CreateRankRecords); then
  //    the rank's steps so far, from the index. LayerCheck's reference
  //    learning rate carries over in the latest event.
  CKPT_RETURN_IF_ERROR(CreateRankRecords(r.get(), local_owner.has_value(), owner));
  // The tiers learn the job's topology with its table (the peer tier
  // places the job's copies from it) before its first step.
  for (const std::unique_ptr<DurableTier>& tier : tiers_) tier->OnRegister(key, req.job_nodes);
  CKPT_ASSIGN_OR_RETURN(const uint64_t durable, ResumeFromIndex(r, req.deadline));
  if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kRegistrations);

  // 6. Publish the rank.
  CKPT_SYNC_POINT("engine.register.before_publish");
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return ShuttingDownError();
    if (ranks_.count(key) != 0) {
      return absl::AbortedError("a concurrent registration of the same rank won; retry");
    }
    {
      // Its device may have been poisoned since it was opened, after the
      // ranks on it were released (ReleaseRanksOnPoisonedGpus, under mu_
      // too): refused here, it cannot escape that release.
      absl::MutexLock rank_lock(&r->mu);
      CKPT_RETURN_IF_ERROR(r->memory->CheckUsable());
    }
    ranks_[key] = r;
    quota_.AddRank(r->uid);  // its share of the uid's steps in flight
  }
  CKPT_LOG(INFO) << "registered job " << r->job << " rank " << r->rank << " generation "
                 << r->generation << ": " << n << " layers, policy " << PolicyName(r->policy.kind)
                 << ", latest durable step " << durable << ", uid " << caller.uid;
  Registered reply;
  reply.generation = r->generation;
  reply.latest_durable_step = durable;
  reply.io_backend = io_backend_name_;
  return reply;
}

absl::Status Engine::Unregister(const RankRef& rank, bool drain, const Caller& caller,
                                absl::Time deadline) {
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
  std::shared_ptr<RankState> r;
  {
    absl::MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(r, FindLocked(rank, caller));
    EndRegistrationLocked(*r, "unregistered", &closing);
    if (!drain) {
      absl::MutexLock rank_lock(&r->mu);
      ForgetIfDone(&ranks_, r);
    }
  }
  // Without drain a rank still writing stays (inactive) until its staged
  // versions are written (the last one to finish forgets it), and a Register
  // of it meanwhile drains it first.
  if (drain) {
    CKPT_RETURN_IF_ERROR(DrainAndForget(r, deadline));
  } else if (options_.metrics != nullptr) {
    options_.metrics->RemoveRank(r->job, r->rank);
  }
  CKPT_LOG(INFO) << "unregistered job " << r->job << " rank " << r->rank << " generation "
                 << r->generation;
  return absl::OkStatus();
}

void Engine::EndRegistrationLocked(RankState& r, const std::string& why,
                                   std::vector<std::shared_ptr<RankMemory>>* closing) {
  absl::MutexLock rank_lock(&r.mu);
  if (r.active) quota_.RemoveRank(r.uid);
  r.active = false;
  r.ReleaseDeferred();
  r.ReleaseMemory(why, closing);
  // Its directory's descriptor too: writes still running hold their own,
  // and the next registration of the rank opens it again.
  store_->ForgetRankDir(r.job, r.rank);
}

size_t Engine::RanksHeld() {
  absl::MutexLock lock(&mu_);
  return ranks_.size();
}

absl::Status Engine::DrainAndForget(const std::shared_ptr<RankState>& r, absl::Time deadline) {
  if (options_.metrics != nullptr) options_.metrics->RemoveRank(r->job, r->rank);
  {
    absl::MutexLock rank_lock(&r->mu);
    CKPT_RETURN_IF_ERROR(r->Drain(deadline));
  }
  absl::MutexLock lock(&mu_);
  absl::MutexLock rank_lock(&r->mu);
  ForgetIfDone(&ranks_, r);  // idle and inactive now
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::ReleaseRank(const std::string& job, uint32_t rank,
                                             const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(job, caller));
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
  std::shared_ptr<RankState> r;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return ShuttingDownError();
    auto it = ranks_.find(RankKey(job, rank));
    bool active = false;
    if (it != ranks_.end()) {
      absl::MutexLock rank_lock(&it->second->mu);
      active = it->second->active;
    }
    if (!active) {
      return absl::NotFoundError(absl::StrCat("job ", job, " rank ", rank, " is not registered"));
    }
    r = it->second;
    EndRegistrationLocked(*r, absl::StrCat("released by uid ", caller.uid), &closing);
  }
  if (options_.metrics != nullptr) options_.metrics->Inc(Counter::kRanksReleased);
  CKPT_SYNC_POINT("engine.release_rank.drain");
  CKPT_RETURN_IF_ERROR(DrainAndForget(r, absl::Now() + options_.drain_timeout));
  CKPT_LOG(INFO) << "released job " << job << " rank " << rank << " generation " << r->generation
                 << " (by uid " << caller.uid << ")";
  return r->generation;
}

void Engine::ReleaseRanksOnPoisonedGpus(RankState* also) {
  const uint64_t version = gpu_health_.version();
  const bool news = poisoned_seen_.exchange(version, std::memory_order_relaxed) != version;
  if (!news && also == nullptr) return;
  if (news) CKPT_SYNC_POINT("engine.release_poisoned_gpu_ranks");
  std::vector<std::shared_ptr<RankMemory>> closing;  // closed after the locks are released
  auto release = [&closing](RankState& r) {
    absl::MutexLock rank_lock(&r.mu);
    if (r.memory == nullptr) return;
    const absl::Status usable = r.memory->CheckUsable();
    if (!usable.ok()) r.ReleaseMemory(std::string(usable.message()), &closing);
  };
  {
    absl::MutexLock lock(&mu_);
    if (news) {
      for (auto& [key, r] : ranks_) release(*r);
    } else {
      release(*also);
    }
  }
  closing.clear();
  if (news) CKPT_SYNC_POINT("engine.poisoned_gpu_ranks_released");
}

absl::StatusOr<uint32_t> Engine::EvictJob(const std::string& job, const Caller& caller) {
  CKPT_RETURN_IF_ERROR(owners_.CheckVisible(job, caller));
  if (!IsRoot(caller)) {
    return absl::PermissionDeniedError(
        absl::StrCat("only root evicts a job; its owner releases a rank (ckptctl release ", job,
                     " --rank=R) or deletes the job (ckptctl delete ", job, ")"));
  }
  CKPT_RETURN_IF_ERROR(owners_.Evict(job));
  std::vector<uint32_t> ranks;
  {
    absl::MutexLock lock(&mu_);
    auto settled = [this, &job]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = registering_.lower_bound(RankKey(job, 0));
      return it == registering_.end() || it->first.first != job;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&settled), options_.drain_timeout)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", job, " is evicted, but a registration of it is still under way; release again"));
    }
    for (auto it = ranks_.lower_bound(RankKey(job, 0));
         it != ranks_.end() && it->first.first == job; ++it) {
      absl::MutexLock rank_lock(&it->second->mu);
      if (it->second->active) ranks.push_back(it->first.second);
    }
  }
  uint32_t released = 0;
  for (uint32_t rank : ranks) {
    absl::StatusOr<uint64_t> g = ReleaseRank(job, rank, caller);
    if (g.ok()) {
      ++released;
    } else if (!absl::IsNotFound(g.status())) {  // gone meanwhile is fine
      return g.status();
    }
  }
  CKPT_LOG(WARNING) << "job " << job << " evicted by uid " << caller.uid << ": " << released
                    << " registrations released; none registers until the job is deleted";
  return released;
}

}  // namespace ckpt
