// Remote tier: write-behind of every durable step, remote retention, and
// pulling a job onto a replacement node (docs/remote.md).
//
// One uploader thread walks the ranks round-robin. For a rank whose newest
// local event is above its newest manifest, it takes the oldest such event
// (under the rank's lease, so local GC leaves its versions alone), uploads
// every version of that step's composite plan that the remote tier does not
// hold yet (remote_upload_threads at once), then writes the step's manifest:
// the step is remote-durable once the manifest exists. A failure backs the
// rank off (remote_retry_min doubling to remote_retry_max) and the same step
// is tried again; training and local checkpoints never wait for any of it.
#include <algorithm>
#include <atomic>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/common/validate.h"
#include "daemon/engine/rank_state.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt {
namespace {

// The metric label of a failed remote operation.
const char* RemoteReason(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return "denied";
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kDataLoss:
      return "corrupt";
    default:
      return "other";
  }
}

// How long a pull or an upload waits for GC of the rank to finish.
constexpr absl::Duration kLeaseWait = absl::Seconds(30);
// Newest pending events remembered per rank for the lag in bytes.
constexpr size_t kMaxPendingTracked = 100000;
// Manifests a pull copies at most (the newest, and those at or above the
// job's agreed step).
constexpr size_t kMaxPulledManifests = 64;

}  // namespace

void Engine::NoteRemoteFailure(const absl::Status& s, const char* what) {
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRemoteFailures, RemoteReason(s), 1);
    m->Set(Gauge::kRemoteUp, 0);
  }
  absl::MutexLock lock(&remote_mu_);
  if (remote_error_.ok()) CKPT_LOG(WARNING) << "remote tier: " << what << ": " << s;
  remote_error_ = absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

void Engine::NoteLocalEvents(const std::string& job, uint32_t rank, uid_t owner,
                             const std::vector<std::pair<uint64_t, uint64_t>>& steps_bytes) {
  if (options_.remote == nullptr || steps_bytes.empty()) return;
  absl::MutexLock lock(&remote_mu_);
  RemoteRank& rr = remote_[RankKey(job, rank)];
  rr.owner = owner;
  for (const auto& [step, bytes] : steps_bytes) {
    rr.local_step = std::max(rr.local_step, step);
    if (step > rr.remote_step) rr.pending[step] = bytes;
  }
  while (rr.pending.size() > kMaxPendingTracked) rr.pending.erase(rr.pending.begin());
  remote_cv_.Signal();
}

absl::Status Engine::SeedRemote(const RankKey& key, RemoteRank* out) {
  const auto& [job, rank] = key;
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                        options_.remote->List(remote::RankPrefix(job, rank)));
  for (const remote::ObjectInfo& o : objects) {
    std::string file;
    uint64_t step = 0;
    if (remote::ParseVersionObjectKey(o.key, job, rank, &file)) {
      out->objects[file] = o.size;
    } else if (remote::ParseManifestKey(o.key, job, rank, &step)) {
      absl::StatusOr<std::string> bytes = options_.remote->GetBytes(o.key, remote::kMaxManifestBytes);
      absl::StatusOr<store::RemoteManifest> m =
          bytes.ok() ? remote::DecodeManifest(*bytes) : absl::StatusOr<store::RemoteManifest>(bytes.status());
      if (!m.ok()) {
        if (!absl::IsDataLoss(m.status())) return m.status();
        // A damaged manifest does not make its step remote-durable; the
        // step is uploaded again if it is still local.
        CKPT_LOG(WARNING) << "remote tier: manifest " << o.key << " is unusable: " << m.status();
        if (Metrics* mm = options_.metrics) mm->Inc(Counter::kRemoteFailures, "corrupt", 1);
        continue;
      }
      out->manifests[step] = RemoteRank::Manifest{m->event().unix_ms(), m->event().agreed_step()};
    }
  }
  out->remote_step = out->manifests.empty() ? 0 : out->manifests.rbegin()->first;
  out->seeded = true;
  return absl::OkStatus();
}

absl::Status Engine::UploadNext(const RankKey& key) {
  const auto& [job, rank] = key;
  remote::RemoteStore* const store = options_.remote;
  bool seeded;
  uint64_t remote_step;
  uid_t owner;
  {
    absl::MutexLock lock(&remote_mu_);
    const RemoteRank& rr = remote_[key];
    seeded = rr.seeded;
    remote_step = rr.remote_step;
    owner = rr.owner;
  }
  if (!seeded) {
    RemoteRank fresh;
    CKPT_RETURN_IF_ERROR(SeedRemote(key, &fresh));
    absl::MutexLock lock(&remote_mu_);
    RemoteRank& rr = remote_[key];
    rr.objects = std::move(fresh.objects);
    rr.manifests = std::move(fresh.manifests);
    rr.remote_step = fresh.remote_step;
    rr.seeded = true;
    remote_step = rr.remote_step;
    for (auto it = rr.pending.begin(); it != rr.pending.end() && it->first <= remote_step;) {
      it = rr.pending.erase(it);
    }
  }
  // The oldest local event above the remote step.
  CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
  std::optional<ScopedLease> lease;
  lease.emplace(&leases_, key);
  uint64_t step = 0;
  uint64_t newest_local = 0;
  store::EventRecord event;
  CKPT_RETURN_IF_ERROR(index_->ForEachEvent(
      job, rank, /*newest_first=*/false, [&](uint64_t s, const store::EventRecord& e) {
        newest_local = s;
        if (step == 0 && s > remote_step) {
          step = s;
          event = e;
        }
        return true;
      }));
  if (step == 0) {
    absl::MutexLock lock(&remote_mu_);
    RemoteRank& rr = remote_[key];
    rr.local_step = newest_local;
    rr.pending.clear();
    return absl::OkStatus();
  }
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index_->GetRank(job, rank));
  if (!table.has_value()) return absl::OkStatus();  // the rank is being deleted
  const absl::Time start = absl::Now();
  store::RemoteManifest manifest;
  manifest.set_job_id(job);
  manifest.set_rank(rank);
  manifest.set_step(step);
  manifest.set_owner_uid(owner);
  *manifest.mutable_event() = event;
  *manifest.mutable_table() = *table;
  struct Upload {
    VersionKey key;
    store::VersionRecord rec;
  };
  std::vector<Upload> uploads;
  {
    std::set<std::string> there;
    {
      absl::MutexLock lock(&remote_mu_);
      for (const auto& [file, bytes] : remote_[key].objects) there.insert(file);
    }
    for (const store::LayerSpec& layer : table->layers()) {
      CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(job, rank, layer.id(), step));
      if (!v.has_value()) continue;
      store::RemoteVersion* rv = manifest.add_versions();
      rv->set_layer(layer.id());
      rv->set_step(v->first);
      *rv->mutable_record() = v->second;
      if (there.count(v->second.file()) == 0) {
        uploads.push_back({VersionKey{job, rank, layer.id(), v->first}, v->second});
      }
    }
  }
  // The versions, remote_upload_threads at once; the first failure stops
  // the step.
  std::atomic<size_t> next{0};
  absl::Mutex err_mu;
  absl::Status first_error;
  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= uploads.size()) return;
      {
        absl::MutexLock l(&err_mu);
        if (!first_error.ok()) return;
      }
      const Upload& u = uploads[i];
      absl::Status s;
      absl::StatusOr<UniqueFd> fd = store_->OpenCommitted(u.key, u.rec);
      if (!fd.ok()) {
        s = absl::Status(fd.status().code(),
                         absl::StrCat("local copy of ", u.rec.file(), ": ", fd.status().message()));
        if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteFailures, "local", 1);
      } else {
        CKPT_SYNC_POINT("remote.before_put_version");
        s = store->PutFile(remote::VersionObjectKey(job, rank, u.rec.file()), fd->get(),
                           u.rec.file_bytes());
      }
      if (s.ok()) {
        if (Metrics* m = options_.metrics) {
          m->Inc(Counter::kRemoteUploadedVersions);
          m->Inc(Counter::kRemoteUploadedBytes, static_cast<double>(u.rec.file_bytes()));
        }
        absl::MutexLock lock(&remote_mu_);
        remote_[key].objects[u.rec.file()] = u.rec.file_bytes();
      } else {
        absl::MutexLock l(&err_mu);
        if (first_error.ok()) first_error = s;
      }
    }
  };
  {
    const size_t n = std::min<size_t>(std::max(1u, options_.remote_upload_threads), uploads.size());
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n; ++i) threads.emplace_back(worker);
    worker();
    for (std::thread& t : threads) t.join();
  }
  if (!first_error.ok()) return first_error;
  // The manifest last, with a conditional create: it makes the step
  // remote-durable, after every object it names.
  manifest.set_uploaded_unix_ms(absl::ToUnixMillis(absl::Now()));
  const std::string mkey = remote::ManifestKey(job, rank, step);
  const std::string encoded = remote::EncodeManifest(manifest);
  CKPT_SYNC_POINT("remote.before_put_manifest");
  absl::Status put = store->PutBytes(mkey, encoded, /*if_absent=*/true);
  if (absl::IsAlreadyExists(put)) {
    // Written before ckptd restarted, or a step the rank went back before
    // (a restore that discarded later steps): this node's history is the
    // rank's truth, so a different manifest is replaced.
    absl::StatusOr<std::string> have = store->GetBytes(mkey, remote::kMaxManifestBytes);
    absl::StatusOr<store::RemoteManifest> old =
        have.ok() ? remote::DecodeManifest(*have) : absl::StatusOr<store::RemoteManifest>(have.status());
    bool same = old.ok() && old->versions_size() == manifest.versions_size();
    for (int i = 0; same && i < manifest.versions_size(); ++i) {
      same = old->versions(i).record().file() == manifest.versions(i).record().file();
    }
    put = same ? absl::OkStatus() : store->PutBytes(mkey, encoded, /*if_absent=*/false);
    if (!same && put.ok()) {
      CKPT_LOG(WARNING) << "remote tier: replaced the manifest of job " << job << " rank " << rank
                        << " step " << step << " (this node's history differs)";
    }
  }
  CKPT_RETURN_IF_ERROR(put);
  lease.reset();  // local GC may collect the rank again
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRemoteManifests);
    m->Observe(Histogram::kRemoteUploadSeconds, absl::ToDoubleSeconds(absl::Now() - start));
    m->Set(Gauge::kRemoteUp, 1);
  }
  {
    absl::MutexLock lock(&remote_mu_);
    RemoteRank& rr = remote_[key];
    rr.remote_step = std::max(rr.remote_step, step);
    rr.local_step = std::max(rr.local_step, newest_local);
    rr.manifests[step] = RemoteRank::Manifest{event.unix_ms(), event.agreed_step()};
    for (auto it = rr.pending.begin(); it != rr.pending.end() && it->first <= step;) {
      it = rr.pending.erase(it);
    }
    remote_error_ = absl::OkStatus();
    remote_cv_.SignalAll();
  }
  CKPT_SYNC_POINT("remote.after_manifest");
  return absl::OkStatus();
}

absl::Status Engine::RemoteGc(const RankKey& key) {
  const auto& [job, rank] = key;
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(clock_->Now());
  std::map<std::pair<uint32_t, uint64_t>, std::vector<std::string>> files;
  {
    absl::MutexLock lock(&remote_mu_);
    const RemoteRank& rr = remote_[key];
    for (const auto& [step, m] : rr.manifests) in.events.emplace_back(step, m.unix_ms);
    if (!rr.manifests.empty()) in.agreed_step = rr.manifests.rbegin()->second.agreed_step;
    for (const auto& [file, bytes] : rr.objects) {
      uint32_t layer = 0;
      uint64_t step = 0;
      if (ParseFileName(file, &layer, &step)) files[{layer, step}].push_back(file);
    }
  }
  for (const auto& [ls, names] : files) in.versions[ls.first].push_back(ls.second);
  const RetentionPlan plan = PlanRetention(options_.retention, in);
  // Manifests first, so no manifest ever names a deleted object.
  for (uint64_t step : plan.delete_events) {
    CKPT_RETURN_IF_ERROR(options_.remote->Delete(remote::ManifestKey(job, rank, step)));
    if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteGcDeletedObjects);
    absl::MutexLock lock(&remote_mu_);
    remote_[key].manifests.erase(step);
  }
  for (const auto& ls : plan.delete_versions) {
    for (const std::string& file : files[ls]) {
      CKPT_RETURN_IF_ERROR(options_.remote->Delete(remote::VersionObjectKey(job, rank, file)));
      if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteGcDeletedObjects);
      absl::MutexLock lock(&remote_mu_);
      remote_[key].objects.erase(file);
    }
  }
  return absl::OkStatus();
}

void Engine::UploadLoop() {
  // Every rank the index knows: its newest event and owner.
  absl::StatusOr<std::vector<std::string>> jobs = index_->ListJobs();
  for (const std::string& job : jobs.ok() ? *jobs : std::vector<std::string>()) {
    absl::StatusOr<std::optional<store::JobRecord>> jr = index_->GetJob(job);
    absl::StatusOr<std::vector<uint32_t>> ranks = index_->ListRanks(job);
    if (!jr.ok() || !jr->has_value() || !ranks.ok()) continue;
    for (uint32_t rank : *ranks) {
      absl::StatusOr<std::optional<std::pair<uint64_t, store::EventRecord>>> e =
          index_->EventAtOrBefore(job, rank, ~uint64_t{0});
      if (!e.ok() || !e->has_value()) continue;
      absl::MutexLock lock(&remote_mu_);
      RemoteRank& rr = remote_[RankKey(job, rank)];
      rr.owner = (*jr)->owner_uid();
      rr.local_step = std::max(rr.local_step, (*e)->first);
    }
  }
  RankKey last;
  for (;;) {
    RankKey key;
    {
      absl::MutexLock lock(&remote_mu_);
      if (remote_stop_) return;
      // Round-robin from the rank after the last one served.
      const absl::Time now = absl::Now();
      auto due = [&](const RemoteRank& rr) {
        return (!rr.seeded || rr.local_step > rr.remote_step) && now >= rr.retry_at;
      };
      bool found = false;
      for (auto it = remote_.upper_bound(last); it != remote_.end() && !found; ++it) {
        if (due(it->second)) key = it->first, found = true;
      }
      for (auto it = remote_.begin(); it != remote_.end() && !found && it->first <= last; ++it) {
        if (due(it->second)) key = it->first, found = true;
      }
      if (!found) {
        remote_cv_.WaitWithTimeout(&remote_mu_, absl::Milliseconds(500));
        continue;
      }
      last = key;
    }
    absl::Status s = UploadNext(key);
    if (s.ok()) s = RemoteGc(key);
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) continue;
    if (s.ok()) {
      it->second.backoff = absl::ZeroDuration();
      it->second.retry_at = absl::InfinitePast();
      continue;
    }
    RemoteRank& rr = it->second;
    rr.backoff = rr.backoff == absl::ZeroDuration()
                     ? options_.remote_retry_min
                     : std::min(rr.backoff * 2, options_.remote_retry_max);
    rr.retry_at = absl::Now() + rr.backoff;
    remote_mu_.Unlock();
    NoteRemoteFailure(s, absl::StrCat("uploading job ", key.first, " rank ", key.second).c_str());
    remote_mu_.Lock();
  }
}

absl::Status Engine::PullFromRemote(const std::string& job, uint32_t rank, const Caller& caller) {
  remote::RemoteStore* const store = options_.remote;
  if (store == nullptr) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  const RankKey key(job, rank);
  {
    // One pull of a rank at a time; a second caller waits for the first.
    absl::MutexLock lock(&remote_mu_);
    auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(remote_mu_) {
      return pulling_.count(key) == 0 || remote_stop_;
    };
    if (!remote_mu_.AwaitWithTimeout(absl::Condition(&free), options_.restore_timeout)) {
      return absl::DeadlineExceededError(absl::StrCat("job ", job, " rank ", rank,
                                                      " is still being pulled from the remote tier"));
    }
    pulling_.insert(key);
  }
  struct Done {
    Engine* e;
    const RankKey& key;
    ~Done() {
      absl::MutexLock lock(&e->remote_mu_);
      e->pulling_.erase(key);
    }
  } done{this, key};
  CKPT_ASSIGN_OR_RETURN(auto local, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  if (local.has_value()) return absl::OkStatus();  // this node has the rank's history
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<remote::ObjectInfo>> listed =
      store->List(remote::ManifestPrefix(job, rank));
  if (!listed.ok()) {
    NoteRemoteFailure(listed.status(), "listing manifests");
    return absl::Status(listed.status().code(),
                        absl::StrCat("the remote tier (", store->Describe(), "): ",
                                     listed.status().message()));
  }
  std::vector<uint64_t> steps;
  for (const remote::ObjectInfo& o : *listed) {
    uint64_t step = 0;
    if (remote::ParseManifestKey(o.key, job, rank, &step)) steps.push_back(step);
  }
  if (steps.empty()) return absl::OkStatus();
  std::sort(steps.rbegin(), steps.rend());
  // Newest first: the newest manifest whose objects all read back whole,
  // then (several ranks) those down to the agreed step it records, so every
  // rank can restore the step the job agrees on. A manifest or an object
  // that is missing or damaged makes that step unusable, never served.
  std::vector<store::RemoteManifest> usable;
  std::set<std::string> have;
  // Versions put from manifests that turned out unusable: removed again
  // below when no usable step needs them.
  std::vector<std::pair<VersionKey, store::VersionRecord>> adopted;
  uint64_t floor = 0, pulled_bytes = 0;
  uid_t owner = 0;
  size_t tried = 0;
  for (uint64_t step : steps) {
    if (usable.size() >= kMaxPulledManifests || ++tried > 2 * kMaxPulledManifests ||
        (!usable.empty() && step < floor)) {
      break;
    }
    absl::StatusOr<std::string> bytes =
        store->GetBytes(remote::ManifestKey(job, rank, step), remote::kMaxManifestBytes);
    absl::StatusOr<store::RemoteManifest> m =
        bytes.ok() ? remote::DecodeManifest(*bytes) : absl::StatusOr<store::RemoteManifest>(bytes.status());
    if (m.ok() && (m->job_id() != job || m->rank() != rank || m->step() != step)) {
      m = absl::DataLossError("the manifest names another step");
    }
    if (!m.ok()) {
      NoteRemoteFailure(m.status(), absl::StrCat("reading the manifest of step ", step).c_str());
      if (absl::IsDataLoss(m.status()) || absl::IsNotFound(m.status())) continue;
      return m.status();
    }
    if (m->owner_uid() != caller.uid && !IsRoot(caller)) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
    }
    if (!usable.empty() && m->owner_uid() != owner) continue;
    const QuotaOwner quota_owner{m->owner_uid(), job};
    // Its versions, each checked before its record is put.
    absl::Status ok;
    for (const store::RemoteVersion& v : m->versions()) {
      if (have.count(v.record().file()) > 0) continue;
      CKPT_ASSIGN_OR_RETURN(auto existing, index_->VersionAtOrBefore(job, rank, v.layer(), v.step()));
      if (existing.has_value() && existing->first == v.step() &&
          existing->second.file() == v.record().file()) {
        have.insert(v.record().file());
        continue;
      }
      const uint64_t n = v.record().file_bytes();
      CKPT_RETURN_IF_ERROR(quota_.ReserveVersion(quota_owner, n));
      if (absl::Status room = disk_.Reserve(n); !room.ok()) {
        quota_.ReleaseVersion(quota_owner, n);
        return room;
      }
      const std::string okey = remote::VersionObjectKey(job, rank, v.record().file());
      ok = store_->Adopt(VersionKey{job, rank, v.layer(), v.step()}, v.record(),
                         [&](int fd) { return store->GetToFile(okey, fd, n); });
      if (!ok.ok()) {
        disk_.Release(n);
        quota_.ReleaseVersion(quota_owner, n);
        NoteRemoteFailure(ok, absl::StrCat("reading ", okey).c_str());
        if (!absl::IsDataLoss(ok) && !absl::IsNotFound(ok) && !absl::IsInvalidArgument(ok)) return ok;
        break;
      }
      have.insert(v.record().file());
      adopted.emplace_back(VersionKey{job, rank, v.layer(), v.step()}, v.record());
      pulled_bytes += n;
      if (Metrics* mm = options_.metrics) mm->Inc(Counter::kRemotePulledBytes, static_cast<double>(n));
    }
    if (!ok.ok()) {
      CKPT_LOG(WARNING) << "remote tier: step " << step << " of job " << job << " rank " << rank
                        << " is not restorable from there: " << ok;
      continue;
    }
    if (usable.empty()) {
      owner = m->owner_uid();
      floor = m->event().agreed_step() > 0 ? m->event().agreed_step() : step;
    }
    usable.push_back(*std::move(m));
  }
  if (usable.empty()) {
    return absl::DataLossError(absl::StrCat("job ", job, " rank ", rank,
                                            ": every manifest in the remote tier is damaged or "
                                            "names an object that is missing or damaged"));
  }
  const QuotaOwner quota_owner{owner, job};
  {
    // A version above the newest usable step belongs to a step that is not
    // restorable; left in the index, a later plan could pick it up.
    RankHistory h;
    h.owner = owner;
    for (const auto& [vk, rec] : adopted) {
      if (vk.step <= usable.front().step()) continue;
      CKPT_RETURN_IF_ERROR(RemoveVersion(h, vk, rec));
      pulled_bytes -= rec.file_bytes();
    }
  }
  {
    absl::MutexLock jobs_lock(&job_mu_);
    CKPT_ASSIGN_OR_RETURN(std::optional<store::JobRecord> now, index_->GetJob(job));
    if (now.has_value() && now->owner_uid() != owner) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
    }
    if (!now.has_value()) {
      store::JobRecord jr;
      jr.set_owner_uid(owner);
      jr.set_created_unix_ms(absl::ToUnixMillis(clock_->Now()));
      CKPT_RETURN_IF_ERROR(index_->PutJob(job, jr));
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index_->GetRank(job, rank));
  if (!table.has_value()) CKPT_RETURN_IF_ERROR(index_->PutRank(job, rank, usable.front().table()));
  std::vector<std::pair<uint64_t, store::EventRecord>> events;
  for (auto it = usable.rbegin(); it != usable.rend(); ++it) {
    events.emplace_back(it->step(), it->event());
    quota_.Seed(quota_owner, 0, EventIndexBytes(it->event().aux().size()));
  }
  CKPT_RETURN_IF_ERROR(index_->PutEvents(job, rank, events));
  {
    // The remote tier holds these steps already.
    absl::MutexLock lock(&remote_mu_);
    RemoteRank& rr = remote_[key];
    rr.owner = owner;
    rr.local_step = std::max(rr.local_step, events.back().first);
    rr.seeded = false;  // listed afresh by the uploader
  }
  CKPT_LOG(INFO) << "pulled job " << job << " rank " << rank << " from the remote tier ("
                 << store->Describe() << "): steps " << events.front().first << ".."
                 << events.back().first << ", " << pulled_bytes << " bytes in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::JobInfo>> Engine::RemoteJobs(const Caller& caller) {
  std::vector<v1::JobInfo> out;
  if (options_.remote == nullptr) return out;
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                        options_.remote->List(remote::JobsPrefix()));
  std::map<std::string, std::map<uint32_t, uint64_t>> newest;  // job -> rank -> step
  for (const remote::ObjectInfo& o : objects) {
    std::string job;
    uint32_t rank = 0;
    uint64_t step = 0;
    if (!remote::ParseRankOfKey(o.key, &job, &rank)) continue;
    if (remote::ParseManifestKey(o.key, job, rank, &step)) {
      uint64_t& n = newest[job][rank];
      n = std::max(n, step);
    }
  }
  for (const auto& [job, ranks] : newest) {
    // The owner is in every manifest; the newest of rank 0 (or the first
    // rank) says it.
    const auto& [rank, step] = *ranks.begin();
    absl::StatusOr<std::string> bytes =
        options_.remote->GetBytes(remote::ManifestKey(job, rank, step), remote::kMaxManifestBytes);
    if (!bytes.ok()) continue;
    absl::StatusOr<store::RemoteManifest> m = remote::DecodeManifest(*bytes);
    if (!m.ok() || (m->owner_uid() != caller.uid && !IsRoot(caller))) continue;
    v1::JobInfo& info = out.emplace_back();
    info.set_job_id(job);
    info.set_owner_uid(m->owner_uid());
    for (const auto& [r, s] : ranks) {
      v1::RankInfo* ri = info.add_ranks();
      ri->set_rank(r);
      ri->set_remote_step(s);
    }
  }
  return out;
}

}  // namespace ckpt
