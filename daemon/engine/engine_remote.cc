// Remote tier: write-behind of every durable step, remote retention, and
// pulling a job onto a replacement node (docs/remote.md).
//
// One uploader thread walks the ranks round-robin. For a rank whose newest
// local event is above its newest manifest, it takes the oldest such event;
// under the rank's lease (local GC keeps off meanwhile) it plans the step and
// opens the local files of the plan's versions that the remote tier does not
// hold yet, then lets the lease go and uploads them (remote_upload_threads at
// once) from the open descriptors, then writes the step's manifest: the step
// is remote-durable once the manifest exists. A failure backs the rank off
// (remote_retry_min doubling to remote_retry_max) and the same step is tried
// again; training and local checkpoints never wait for any of it.
#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/common/validate.h"
#include "daemon/engine/engine.h"
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

// A manifest or object that is not there whole: the step it belongs to is
// not usable, but the store itself answered.
bool Unusable(const absl::Status& s) {
  return absl::IsDataLoss(s) || absl::IsNotFound(s) || absl::IsInvalidArgument(s);
}

// The manifest of `key`, checked.
absl::StatusOr<store::RemoteManifest> ReadManifest(remote::RemoteStore* store,
                                                   const std::string& job, uint32_t rank,
                                                   uint64_t step) {
  CKPT_ASSIGN_OR_RETURN(std::string bytes, store->GetBytes(remote::ManifestKey(job, rank, step),
                                                           remote::kMaxManifestBytes));
  CKPT_ASSIGN_OR_RETURN(store::RemoteManifest m, remote::DecodeManifest(bytes));
  if (m.job_id() != job || m.rank() != rank || m.step() != step) {
    return absl::DataLossError(absl::StrCat("the manifest of step ", step, " names another step"));
  }
  return m;
}

std::vector<std::string> FilesOf(const store::RemoteManifest& m) {
  std::vector<std::string> files;
  for (const store::RemoteVersion& v : m.versions()) files.push_back(v.record().file());
  return files;
}

// How long a pull or an upload waits for GC of the rank to finish.
constexpr absl::Duration kLeaseWait = absl::Seconds(30);
// Newest pending events remembered per rank for the lag in bytes.
constexpr size_t kMaxPendingTracked = 100000;
// Manifests a pull copies at most (the newest, and those down to the job's
// agreed step), and how many it reads looking for whole ones.
constexpr size_t kMaxPulledManifests = 64;
constexpr size_t kMaxTriedManifests = 256;
// How long RemoteJobs reuses a listing of the remote tier.
constexpr absl::Duration kRemoteJobsCacheTtl = absl::Seconds(30);

}  // namespace

void Engine::NoteRemoteFailure(const absl::Status& s, const std::string& what, uid_t owner) {
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRemoteFailures, RemoteReason(s), 1);
    m->Set(Gauge::kRemoteUp, 0);
  }
  absl::MutexLock lock(&remote_mu_);
  if (remote_error_.ok()) CKPT_LOG(WARNING) << "remote tier: " << what << ": " << s;
  remote_error_ = absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  remote_error_uid_ = owner;
}

std::pair<uint64_t, uint64_t> Engine::RemoteLag(const uid_t* owner) {
  uint64_t steps = 0, bytes = 0;
  absl::MutexLock lock(&remote_mu_);
  for (const auto& [key, rr] : remote_) {
    if (owner != nullptr && rr.owner != *owner) continue;
    steps = std::max(steps, rr.local_step - std::min(rr.local_step, rr.remote_step));
    for (const auto& [step, b] : rr.pending) bytes += b;
  }
  return {steps, bytes};
}

void Engine::NoteLocalEvents(const std::string& job, uint32_t rank, uid_t owner,
                             const std::vector<std::pair<uint64_t, uint64_t>>& steps_bytes) {
  if (options_.remote == nullptr || steps_bytes.empty()) return;
  absl::MutexLock lock(&remote_mu_);
  RemoteRank& rr = remote_[RankKey(job, rank)];
  if (rr.owner != owner) {
    // The id was deleted and made again by another uid: start over.
    rr = RemoteRank();
    rr.owner = owner;
  }
  for (const auto& [step, bytes] : steps_bytes) {
    rr.local_step = std::max(rr.local_step, step);
    if (step > rr.remote_step) rr.pending[step] = bytes;
  }
  while (rr.pending.size() > kMaxPendingTracked) rr.pending.erase(rr.pending.begin());
  ++remote_wakeups_;
}

void Engine::NoteRewind(const std::string& job, uint32_t rank, uint64_t step) {
  if (options_.remote == nullptr) return;
  absl::MutexLock lock(&remote_mu_);
  RemoteRank& rr = remote_[RankKey(job, rank)];
  rr.discard_above = std::min(rr.discard_above.value_or(step), step);
  rr.local_step = step;
  // Until the manifests above it are gone, nothing above `step` counts as
  // remote-durable.
  rr.remote_step = 0;
  for (auto it = rr.manifests.begin(); it != rr.manifests.end() && it->first <= step; ++it) {
    rr.remote_step = it->first;
  }
  rr.pending.erase(rr.pending.upper_bound(step), rr.pending.end());
  // The rank's next steps reuse the file names of the discarded ones: those
  // objects are no longer trusted (they are uploaded again, over them).
  for (auto it = rr.objects.begin(); it != rr.objects.end();) {
    uint32_t layer = 0;
    uint64_t s = 0;
    if (ParseFileName(it->first, &layer, &s) && s > step) {
      rr.stray.insert(it->first);
      it = rr.objects.erase(it);
    } else {
      ++it;
    }
  }
  // Going back on purpose settles a history conflict (not another owner).
  if (rr.blocked.rfind("history:", 0) == 0) rr.blocked.clear();
  ++remote_wakeups_;
}

absl::Status Engine::SeedRemote(const RankKey& key, RemoteRank* out) {
  const std::string& job = key.first;
  const uint32_t rank = key.second;
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                        options_.remote->List(remote::RankPrefix(job, rank)));
  std::map<std::string, uint64_t> listed;  // version objects there -> bytes
  for (const remote::ObjectInfo& o : objects) {
    std::string file;
    uint64_t step = 0;
    if (remote::ParseVersionObjectKey(o.key, job, rank, &file)) {
      listed[file] = o.size;
    } else if (remote::ParseManifestKey(o.key, job, rank, &step)) {
      absl::StatusOr<store::RemoteManifest> m = ReadManifest(options_.remote, job, rank, step);
      if (!m.ok()) {
        if (!Unusable(m.status())) return m.status();
        // A damaged manifest does not make its step remote-durable; the
        // step is uploaded again if it is still local.
        CKPT_LOG(WARNING) << "remote tier: manifest " << o.key << " is unusable: " << m.status();
        if (Metrics* mm = options_.metrics) mm->Inc(Counter::kRemoteFailures, "corrupt", 1);
        continue;
      }
      if (m->owner_uid() != out->owner) {
        out->blocked = absl::StrCat("owner: the remote tier holds job ", job, " rank ", rank,
                                    " for another user");
      }
      out->manifests[step] =
          RemoteRank::Manifest{m->event().unix_ms(), m->event().agreed_step(), FilesOf(*m)};
    }
  }
  // Trusted: what a readable manifest names.
  std::set<std::string> named;
  for (const auto& [s, m] : out->manifests) named.insert(m.files.begin(), m.files.end());
  for (const auto& [file, size] : listed) {
    if (named.count(file) > 0) {
      out->objects[file] = size;
    } else {
      out->stray.insert(file);
    }
  }
  out->remote_step = out->manifests.empty() ? 0 : out->manifests.rbegin()->first;
  out->seeded = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::CheckRemoteHistory(const RankKey& key) {
  const std::string& job = key.first;
  const uint32_t rank = key.second;
  uint64_t newest = 0;
  std::vector<std::string> files;
  {
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end() || it->second.manifests.empty()) return std::string();
    newest = it->second.manifests.rbegin()->first;
    files = it->second.manifests.rbegin()->second.files;
  }
  CKPT_ASSIGN_OR_RETURN(auto local, index_->EventAtOrBefore(job, rank, ~uint64_t{0}));
  const uint64_t local_head = local.has_value() ? local->first : 0;
  if (newest > local_head) {
    return absl::StrCat("history: the remote tier holds job ", job, " rank ", rank, " up to step ",
                        newest, ", this node only up to ", local_head,
                        " (started without restoring from it?); restore from it, or delete it there");
  }
  // Where this node still has the step, its plan must name the same files.
  CKPT_ASSIGN_OR_RETURN(auto at, index_->EventAtOrBefore(job, rank, newest));
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index_->GetRank(job, rank));
  if (!at.has_value() || at->first != newest || !table.has_value()) return std::string();
  std::vector<std::string> local_files;
  for (const store::LayerSpec& layer : table->layers()) {
    CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(job, rank, layer.id(), newest));
    if (v.has_value()) local_files.push_back(v->second.file());
  }
  std::sort(local_files.begin(), local_files.end());
  std::sort(files.begin(), files.end());
  if (local_files != files) {
    return absl::StrCat("history: the remote tier's step ", newest, " of job ", job, " rank ", rank,
                        " is of another history than this node's; restore from it, or delete it "
                        "there");
  }
  return std::string();
}

absl::Status Engine::UploadNext(const RankKey& key) {
  const std::string& job = key.first;
  const uint32_t rank = key.second;
  remote::RemoteStore* const store = options_.remote;
  const std::string rank_name = absl::StrCat("job ", job, " rank ", rank);
  // A rank DeleteJob dropped ends the turn: it is not brought back.
  const absl::Status gone = absl::AbortedError(absl::StrCat(rank_name, " was deleted"));
  RemoteRank state;  // a copy of what is needed below
  {
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return gone;
    state.owner = it->second.owner;
    state.seeded = it->second.seeded;
    state.discard_above = it->second.discard_above;
  }
  if (!state.seeded) {
    RemoteRank fresh;
    fresh.owner = state.owner;
    CKPT_RETURN_IF_ERROR(SeedRemote(key, &fresh));
    {
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it == remote_.end()) return gone;
      RemoteRank& rr = it->second;
      rr.objects = std::move(fresh.objects);
      rr.stray = std::move(fresh.stray);
      rr.manifests = std::move(fresh.manifests);
      rr.blocked = fresh.blocked;
      rr.seeded = true;
      remote_error_ = absl::OkStatus();  // the store answered
    }
    if (!state.discard_above.has_value()) {
      CKPT_ASSIGN_OR_RETURN(std::string conflict, CheckRemoteHistory(key));
      if (!conflict.empty()) {
        absl::MutexLock lock(&remote_mu_);
        auto it = remote_.find(key);
        if (it != remote_.end() && it->second.blocked.empty()) it->second.blocked = conflict;
      }
    }
  }
  {
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return gone;
    RemoteRank& rr = it->second;
    if (!rr.blocked.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(rr.blocked.substr(rr.blocked.find(':') + 2),
                       "; this node neither uploads nor deletes anything of it"));
    }
    state.discard_above = rr.discard_above;
    rr.remote_step = 0;
    for (const auto& [s, m] : rr.manifests) {
      if (!rr.discard_above.has_value() || s <= *rr.discard_above) rr.remote_step = s;
    }
    rr.pending.erase(rr.pending.begin(), rr.pending.upper_bound(rr.remote_step));
    state.remote_step = rr.remote_step;
    state.objects = rr.objects;
  }
  if (state.discard_above.has_value()) {
    // Manifests of the discarded history go first: a replacement node must
    // never restore a step this rank went back before.
    std::vector<uint64_t> stale;
    {
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it == remote_.end()) return gone;
      for (const auto& [s, m] : it->second.manifests) {
        if (s > *state.discard_above) stale.push_back(s);
      }
    }
    for (uint64_t s : stale) {
      CKPT_RETURN_IF_ERROR(store->Delete(remote::ManifestKey(job, rank, s)));
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it == remote_.end()) return gone;
      it->second.manifests.erase(s);
    }
    if (!stale.empty()) {
      CKPT_LOG(WARNING) << "remote tier: " << rank_name << " went back to step "
                        << *state.discard_above << "; deleted the manifests of " << stale.size()
                        << " later steps of the discarded history";
    }
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return gone;
    if (it->second.discard_above == state.discard_above) it->second.discard_above.reset();
  }

  // Under the lease: the local event to upload, its plan, and the local
  // files the remote tier does not hold yet, opened.
  struct Upload {
    store::VersionRecord rec;
    UniqueFd fd;
  };
  std::vector<Upload> uploads;
  store::RemoteManifest manifest;
  uint64_t step = 0;
  uint64_t newest_local = 0;
  {
    CKPT_RETURN_IF_ERROR(leases_.Acquire(key, absl::Now() + kLeaseWait));
    ScopedLease lease(&leases_, key);
    // The oldest event above the remote step; when more than
    // remote_max_pending_events wait (a long outage), the newest instead
    // (several ranks: the newest at or below the job's agreed step, which
    // every rank has), so catching up costs one step, not the backlog.
    // Steps and agreed steps only: the chosen event (with its aux blob) is
    // read once below, not every pending one copied.
    std::vector<std::pair<uint64_t, uint64_t>> pending;  // step, agreed step
    CKPT_RETURN_IF_ERROR(index_->ForEachEvent(
        job, rank, /*newest_first=*/false, [&](uint64_t s, const store::EventRecord& e) {
          newest_local = s;
          if (s > state.remote_step) pending.emplace_back(s, e.agreed_step());
          return true;
        }));
    if (pending.empty()) {
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it == remote_.end()) return gone;
      it->second.local_step = newest_local;
      it->second.pending.clear();
      return absl::OkStatus();
    }
    step = pending.front().first;
    if (pending.size() > options_.remote_max_pending_events) {
      const uint64_t agreed = pending.back().second;
      for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
        if (agreed == 0 || it->first <= agreed) {
          step = std::max(step, it->first);
          break;
        }
      }
      if (step != pending.front().first) {
        CKPT_LOG(INFO) << "remote tier: " << rank_name << " is " << pending.size()
                       << " steps behind; uploading step " << step
                       << " and skipping the steps before it";
      }
    }
    CKPT_ASSIGN_OR_RETURN(auto event, index_->EventAtOrBefore(job, rank, step));
    if (!event.has_value() || event->first != step) return gone;
    CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index_->GetRank(job, rank));
    if (!table.has_value()) return gone;
    manifest.set_job_id(job);
    manifest.set_rank(rank);
    manifest.set_step(step);
    manifest.set_owner_uid(state.owner);
    *manifest.mutable_event() = std::move(event->second);
    *manifest.mutable_table() = *table;
    for (const store::LayerSpec& layer : table->layers()) {
      CKPT_ASSIGN_OR_RETURN(auto v, index_->VersionAtOrBefore(job, rank, layer.id(), step));
      if (!v.has_value()) continue;
      store::RemoteVersion* rv = manifest.add_versions();
      rv->set_layer(layer.id());
      rv->set_step(v->first);
      *rv->mutable_record() = v->second;
      if (state.objects.count(v->second.file()) > 0) continue;
      absl::StatusOr<UniqueFd> fd =
          store_->OpenCommitted(VersionKey{job, rank, layer.id(), v->first}, v->second);
      if (!fd.ok()) {
        if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteFailures, "local", 1);
        return absl::Status(fd.status().code(), absl::StrCat("the local copy of ", v->second.file(),
                                                             ": ", fd.status().message()));
      }
      uploads.push_back({v->second, std::move(*fd)});
    }
  }
  // The lease is gone: local GC may run while the bytes travel (the open
  // descriptors keep them readable).
  const std::string encoded = remote::EncodeManifest(manifest);
  if (encoded.size() > remote::kMaxManifestBytes) {
    // It could never be read back; refuse it here rather than wedge a pull.
    if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteFailures, "local", 1);
    return absl::FailedPreconditionError(absl::StrCat(
        "the manifest of step ", step, " would be ", encoded.size(), " bytes, more than the ",
        remote::kMaxManifestBytes, " a pull reads (a smaller aux blob or fewer layers)"));
  }
  const absl::Time start = absl::Now();
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
      absl::Status s = remote_stopping_.load()
                           ? absl::CancelledError("ckptd is stopping")
                           : absl::OkStatus();
      const Upload& u = uploads[i];
      if (s.ok()) {
        CKPT_SYNC_POINT("remote.before_put_version");
        s = store->PutFile(remote::VersionObjectKey(job, rank, u.rec.file()), u.fd.get(),
                           u.rec.file_bytes());
      }
      if (s.ok()) {
        if (Metrics* m = options_.metrics) {
          m->Inc(Counter::kRemoteUploadedVersions);
          m->Inc(Counter::kRemoteUploadedBytes, static_cast<double>(u.rec.file_bytes()));
        }
        absl::MutexLock lock(&remote_mu_);
        auto it = remote_.find(key);
        if (it != remote_.end()) {
          it->second.objects[u.rec.file()] = u.rec.file_bytes();
          it->second.stray.erase(u.rec.file());
        }
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
  uploads.clear();
  if (!first_error.ok()) return first_error;
  // The manifest last, with a conditional create: it makes the step
  // remote-durable, after every object it names.
  const std::string mkey = remote::ManifestKey(job, rank, step);
  CKPT_SYNC_POINT("remote.before_put_manifest");
  absl::Status put = store->PutBytes(mkey, encoded, /*if_absent=*/true);
  if (absl::IsAlreadyExists(put)) {
    // Written before ckptd restarted (the same records: kept), or left by a
    // history this rank went back before (replaced). Another user's, or one
    // that cannot be read right now, is never replaced.
    absl::StatusOr<store::RemoteManifest> old = ReadManifest(store, job, rank, step);
    if (!old.ok() && !Unusable(old.status())) return old.status();
    if (old.ok() && old->owner_uid() != state.owner) {
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it != remote_.end()) {
        it->second.blocked =
            absl::StrCat("owner: the remote tier holds ", rank_name, " for another user");
      }
      return absl::FailedPreconditionError(
          absl::StrCat("the remote tier holds ", rank_name, " for another user"));
    }
    auto records = [](const store::RemoteManifest& m) {
      std::string out;
      for (const store::RemoteVersion& v : m.versions()) out += v.SerializeAsString();
      return out;
    };
    const bool same = old.ok() && records(*old) == records(manifest);
    put = same ? absl::OkStatus() : store->PutBytes(mkey, encoded, /*if_absent=*/false);
    if (!same && put.ok()) {
      CKPT_LOG(WARNING) << "remote tier: replaced the manifest of " << rank_name << " step "
                        << step << " (it named other versions)";
    }
  }
  CKPT_RETURN_IF_ERROR(put);
  if (Metrics* m = options_.metrics) {
    m->Inc(Counter::kRemoteManifests);
    m->Observe(Histogram::kRemoteUploadSeconds, absl::ToDoubleSeconds(absl::Now() - start));
    m->Set(Gauge::kRemoteUp, 1);
  }
  {
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return gone;
    RemoteRank& rr = it->second;
    rr.manifests[step] = RemoteRank::Manifest{manifest.event().unix_ms(),
                                              manifest.event().agreed_step(), FilesOf(manifest)};
    // A rewind that came meanwhile deletes this manifest first (next turn).
    if (!rr.discard_above.has_value() || step <= *rr.discard_above) {
      rr.remote_step = std::max(rr.remote_step, step);
    }
    rr.local_step = std::max(rr.local_step, newest_local);
    rr.pending.erase(rr.pending.begin(), rr.pending.upper_bound(rr.remote_step));
    remote_error_ = absl::OkStatus();
    ++remote_wakeups_;
  }
  return absl::OkStatus();
}

absl::Status Engine::RemoteGc(const RankKey& key) {
  const std::string& job = key.first;
  const uint32_t rank = key.second;
  RetentionInput in;
  in.now_unix_ms = absl::ToUnixMillis(clock_->Now());
  std::map<uint64_t, std::vector<std::string>> manifest_files;
  std::vector<std::string> objects;
  {
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return absl::OkStatus();
    const RemoteRank& rr = it->second;
    if (!rr.blocked.empty() || rr.discard_above.has_value()) return absl::OkStatus();
    for (const auto& [step, m] : rr.manifests) {
      in.events.emplace_back(step, m.unix_ms);
      manifest_files[step] = m.files;
    }
    if (!rr.manifests.empty()) in.agreed_step = rr.manifests.rbegin()->second.agreed_step;
    for (const auto& [file, bytes] : rr.objects) objects.push_back(file);
    objects.insert(objects.end(), rr.stray.begin(), rr.stray.end());
  }
  if (in.events.empty()) return absl::OkStatus();
  const uint64_t newest = in.events.back().first;
  const RetentionPlan plan = PlanRetention(options_.retention, in);
  // What the kept manifests name, exactly (not recomputed from the listing:
  // objects of two histories may share the prefix).
  std::set<std::string> needed;
  for (uint64_t step : plan.retained_targets) {
    for (const std::string& f : manifest_files[step]) needed.insert(f);
  }
  // Manifests first, so no manifest ever names a deleted object.
  for (uint64_t step : plan.delete_events) {
    CKPT_RETURN_IF_ERROR(options_.remote->Delete(remote::ManifestKey(job, rank, step)));
    if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteGcDeletedObjects);
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return absl::OkStatus();
    it->second.manifests.erase(step);
  }
  for (const std::string& file : objects) {
    uint32_t layer = 0;
    uint64_t step = 0;
    // Objects above the newest manifest belong to a step being uploaded.
    if (needed.count(file) > 0 || !ParseFileName(file, &layer, &step) || step > newest) continue;
    CKPT_RETURN_IF_ERROR(options_.remote->Delete(remote::VersionObjectKey(job, rank, file)));
    if (Metrics* m = options_.metrics) m->Inc(Counter::kRemoteGcDeletedObjects);
    absl::MutexLock lock(&remote_mu_);
    auto it = remote_.find(key);
    if (it == remote_.end()) return absl::OkStatus();
    it->second.objects.erase(file);
    it->second.stray.erase(file);
  }
  CKPT_SYNC_POINT("remote.after_gc");
  return absl::OkStatus();
}

void Engine::LoadRemoteRanks() {
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
}

void Engine::UploadLoop() {
  RankKey last;
  for (;;) {
    RankKey key;
    uid_t owner = 0;
    {
      absl::MutexLock lock(&remote_mu_);
      if (remote_stop_) return;
      // Round-robin from the rank after the last one served.
      const absl::Time now = absl::Now();
      auto due = [&](const RemoteRank& rr) {
        return rr.blocked.empty() && now >= rr.retry_at &&
               (!rr.seeded || rr.discard_above.has_value() || rr.local_step > rr.remote_step);
      };
      bool found = false;
      for (auto it = remote_.upper_bound(last); it != remote_.end() && !found; ++it) {
        if (due(it->second)) key = it->first, owner = it->second.owner, found = true;
      }
      for (auto it = remote_.begin(); it != remote_.end() && !found && it->first <= last; ++it) {
        if (due(it->second)) key = it->first, owner = it->second.owner, found = true;
      }
      if (!found) {
        const uint64_t seen = remote_wakeups_;
        auto woken = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(remote_mu_) {
          return remote_stop_ || remote_wakeups_ != seen;
        };
        // Bounded: a rank's back-off ends without a wake-up.
        remote_mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Milliseconds(500));
        continue;
      }
      last = key;
    }
    absl::Status s = UploadNext(key);
    if (s.ok()) s = RemoteGc(key);
    if (absl::IsCancelled(s)) return;  // stopping
    if (absl::IsAborted(s)) continue;  // the job was deleted meanwhile
    {
      absl::MutexLock lock(&remote_mu_);
      auto it = remote_.find(key);
      if (it == remote_.end()) continue;
      RemoteRank& rr = it->second;
      if (s.ok()) {
        rr.backoff = absl::ZeroDuration();
        rr.retry_at = absl::InfinitePast();
        continue;
      }
      rr.backoff = rr.backoff == absl::ZeroDuration()
                       ? options_.remote_retry_min
                       : std::min(rr.backoff * 2, options_.remote_retry_max);
      rr.retry_at = absl::Now() + rr.backoff;
    }
    NoteRemoteFailure(s, absl::StrCat("uploading job ", key.first, " rank ", key.second), owner);
  }
}

absl::Status Engine::PullFromRemote(const std::string& job, uint32_t rank, const Caller& caller,
                                    bool must_know) {
  remote::RemoteStore* const store = options_.remote;
  if (store == nullptr) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  const RankKey key(job, rank);
  {
    absl::MutexLock lock(&remote_mu_);
    // Register does not wait for a remote tier that is failing.
    if (!must_know && !remote_error_.ok()) return absl::OkStatus();
    // One pull of a rank at a time; a second caller waits for the first.
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
  // What a pull that cannot finish does: an error for a caller that must
  // know, else a warning (the rank starts without a checkpoint).
  auto give_up = [&](const absl::Status& s) {
    if (must_know) return s;
    CKPT_LOG(WARNING) << "remote tier: could not look for a checkpoint of job " << job << " rank "
                      << rank << " (" << s << "); registering without one";
    return absl::OkStatus();
  };
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<remote::ObjectInfo>> listed =
      store->List(remote::ManifestPrefix(job, rank));
  if (!listed.ok()) {
    NoteRemoteFailure(listed.status(), "listing manifests", caller.uid);
    return give_up(absl::Status(
        listed.status().code(),
        absl::StrCat("cannot look for a checkpoint of job ", job, " in the remote tier (",
                     store->Describe(), "): ", listed.status().message())));
  }
  std::vector<uint64_t> steps;
  for (const remote::ObjectInfo& o : *listed) {
    uint64_t step = 0;
    if (remote::ParseManifestKey(o.key, job, rank, &step)) steps.push_back(step);
  }
  if (steps.empty()) return absl::OkStatus();
  std::sort(steps.rbegin(), steps.rend());

  // Every version this pull puts in the index, removed again unless a
  // usable step needs it: nothing of a failed pull stays.
  std::vector<std::pair<VersionKey, store::VersionRecord>> adopted;
  uid_t owner = 0;
  auto remove_adopted = [&](uint64_t above) {
    RankHistory h;
    h.owner = owner;
    uint64_t removed = 0;
    for (const auto& [vk, rec] : adopted) {
      if (vk.step <= above) continue;
      IgnoreError(RemoveVersion(h, vk, rec), "a leftover is quarantined at the next start");
      removed += rec.file_bytes();
    }
    return removed;
  };
  struct Cleanup {
    std::function<uint64_t(uint64_t)> fn;
    bool armed = true;
    ~Cleanup() {
      if (armed) fn(0);
    }
  } cleanup{remove_adopted};

  // Newest first: the newest manifest whose objects all read back whole,
  // then (several ranks) those down to the agreed step it records, and one
  // at or below it, so every rank can restore the step the job agrees on.
  std::vector<store::RemoteManifest> usable;
  std::set<std::string> have;
  uint64_t floor = 0, pulled_bytes = 0;
  size_t tried = 0;
  for (uint64_t step : steps) {
    if (!usable.empty() && usable.back().step() <= floor) break;  // the agreed step is covered
    if (usable.size() >= kMaxPulledManifests || ++tried > kMaxTriedManifests) break;
    absl::StatusOr<store::RemoteManifest> m = ReadManifest(store, job, rank, step);
    if (!m.ok()) {
      NoteRemoteFailure(m.status(), absl::StrCat("reading the manifest of step ", step), caller.uid);
      if (Unusable(m.status())) continue;
      return give_up(m.status());
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
      const uint64_t n = v.record().file_bytes();
      CKPT_RETURN_IF_ERROR(quota_.ReserveVersion(quota_owner, n));
      if (absl::Status room = disk_.Reserve(n); !room.ok()) {
        quota_.ReleaseVersion(quota_owner, n);
        return room;
      }
      const std::string okey = remote::VersionObjectKey(job, rank, v.record().file());
      const VersionKey vk{job, rank, v.layer(), v.step()};
      absl::Status fetched;  // what the store said, apart from the local checks
      ok = store_->Adopt(vk, v.record(), [&](int fd) -> absl::StatusOr<uint64_t> {
        absl::StatusOr<uint64_t> got = store->GetToFile(okey, fd, n);
        fetched = got.status();
        return got;
      });
      if (!ok.ok()) {
        disk_.Release(n);
        quota_.ReleaseVersion(quota_owner, n);
        NoteRemoteFailure(ok, absl::StrCat("reading ", okey), caller.uid);
        // Unusable only when the object is missing or did not check; a
        // flaky store or a local error is no reason to give the step up.
        const bool damaged = fetched.ok() ? absl::IsDataLoss(ok) : absl::IsNotFound(fetched);
        if (!damaged) return give_up(ok);
        break;
      }
      have.insert(v.record().file());
      if (usable.empty()) owner = m->owner_uid();
      adopted.emplace_back(vk, v.record());
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
    return give_up(absl::DataLossError(
        absl::StrCat("job ", job, " rank ", rank,
                     ": every manifest in the remote tier is damaged or names an object that is "
                     "missing or damaged")));
  }
  const QuotaOwner quota_owner{owner, job};
  const uint64_t newest = usable.front().step();
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
  uint64_t event_bytes = 0;
  for (auto it = usable.rbegin(); it != usable.rend(); ++it) {
    events.emplace_back(it->step(), it->event());
    event_bytes += EventIndexBytes(it->event().aux().size());
  }
  CKPT_RETURN_IF_ERROR(index_->PutEvents(job, rank, events));
  quota_.Seed(quota_owner, 0, event_bytes);
  // The steps are durable here now. A version above the newest usable step
  // belongs to a step that is not restorable: left in the index, a later
  // plan could pick it up.
  cleanup.armed = false;
  {
    // What no usable step names (versions of a manifest that turned out
    // unusable) goes again.
    std::set<std::string> named;
    for (const store::RemoteManifest& m : usable) {
      for (const std::string& f : FilesOf(m)) named.insert(f);
    }
    adopted.erase(std::remove_if(adopted.begin(), adopted.end(),
                                 [&](const auto& a) { return named.count(a.second.file()) > 0; }),
                  adopted.end());
    pulled_bytes -= remove_adopted(0);
  }
  {
    // This node's next versions must not reuse a file name any node wrote
    // for the rank: generations continue above every one there.
    uint64_t highest = 0;
    absl::StatusOr<std::vector<remote::ObjectInfo>> versions =
        store->List(remote::RankPrefix(job, rank) + "v/");
    for (const remote::ObjectInfo& o : versions.ok() ? *versions : std::vector<remote::ObjectInfo>()) {
      std::string file;
      uint64_t gen = 0;
      if (remote::ParseVersionObjectKey(o.key, job, rank, &file) &&
          remote::GenerationOfFile(file, &gen)) {
        highest = std::max(highest, gen);
      }
    }
    for (const store::RemoteManifest& m : usable) {
      for (const store::RemoteVersion& v : m.versions()) {
        highest = std::max(highest, v.record().generation());
      }
    }
    CKPT_RETURN_IF_ERROR(index_->RaiseGeneration(highest));
  }
  {
    // The remote tier holds these steps already; any above them are
    // damaged and go (NoteRewind) before this node uploads anything.
    absl::MutexLock lock(&remote_mu_);
    RemoteRank& rr = remote_[key];
    rr.owner = owner;
    rr.local_step = std::max(rr.local_step, newest);
    rr.seeded = false;  // listed afresh by the uploader
    remote_error_ = absl::OkStatus();  // the store answered
  }
  if (steps.front() > newest) NoteRewind(job, rank, newest);
  CKPT_LOG(INFO) << "pulled job " << job << " rank " << rank << " from the remote tier ("
                 << store->Describe() << "): steps " << events.front().first << ".."
                 << events.back().first << ", " << pulled_bytes << " bytes in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::JobInfo>> Engine::RemoteJobs(const Caller& caller) {
  std::vector<v1::JobInfo> out;
  if (options_.remote == nullptr) return out;
  RemoteJobsCache cache;
  {
    absl::MutexLock lock(&remote_mu_);
    cache = remote_jobs_cache_;
  }
  if (absl::Now() - cache.at > kRemoteJobsCacheTtl) {
    CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                          options_.remote->List(remote::JobsPrefix()));
    cache.jobs.clear();
    for (const remote::ObjectInfo& o : objects) {
      std::string job;
      uint32_t rank = 0;
      uint64_t step = 0;
      if (!remote::ParseRankOfKey(o.key, &job, &rank) ||
          !remote::ParseManifestKey(o.key, job, rank, &step)) {
        continue;
      }
      uint64_t& n = cache.jobs[job].second[rank];
      n = std::max(n, step);
    }
    for (auto it = cache.jobs.begin(); it != cache.jobs.end();) {
      // The owner is in every manifest: the newest of the first rank says it.
      const auto& [rank, step] = *it->second.second.begin();
      absl::StatusOr<store::RemoteManifest> m = ReadManifest(options_.remote, it->first, rank, step);
      if (!m.ok()) {
        it = cache.jobs.erase(it);
        continue;
      }
      it->second.first = m->owner_uid();
      ++it;
    }
    cache.at = absl::Now();
    absl::MutexLock lock(&remote_mu_);
    remote_jobs_cache_ = cache;
  }
  for (const auto& [job, owner_ranks] : cache.jobs) {
    const auto& [owner, ranks] = owner_ranks;
    if (owner != caller.uid && !IsRoot(caller)) continue;
    v1::JobInfo& info = out.emplace_back();
    info.set_job_id(job);
    info.set_owner_uid(owner);
    for (const auto& [r, s] : ranks) {
      v1::RankInfo* ri = info.add_ranks();
      ri->set_rank(r);
      ri->set_remote_step(s);
    }
  }
  return out;
}

}  // namespace ckpt
