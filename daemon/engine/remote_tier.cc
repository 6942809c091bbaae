// RemoteTier: its state, what the engine tells it, and what it reports.
// The uploader is in remote_upload.cc, pulls in remote_pull.cc.
#include "daemon/engine/remote_tier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/engine/remote_tier_internal.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt {
namespace remote_tier {

const char* FailureLabel(const absl::Status& s) {
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

bool Unusable(const absl::Status& s) {
  return absl::IsDataLoss(s) || absl::IsNotFound(s) || absl::IsInvalidArgument(s);
}

std::vector<std::string> FilesOf(const store::RemoteManifest& m) {
  std::vector<std::string> files;
  for (const store::RemoteVersion& v : m.versions()) files.push_back(v.record().file());
  return files;
}

}  // namespace remote_tier

namespace {

// Newest pending events remembered per rank for the lag in bytes.
constexpr size_t kMaxPendingTracked = 100000;
// How long Jobs reuses a listing of the remote tier.
constexpr absl::Duration kJobsCacheTtl = absl::Seconds(30);

// The largest owner record ckptd reads.
constexpr uint64_t kMaxOwnerBytes = 4096;

}  // namespace

TierMetricIds TierMetricIds::Remote() {
  return {Counter::kRemoteUploadedVersions,
          Counter::kRemoteUploadedBytes,
          Counter::kRemoteManifests,
          Counter::kRemoteFailures,
          Counter::kRemotePulledBytes,
          Counter::kRemoteGcDeletedObjects,
          Gauge::kRemoteLagSteps,
          Gauge::kRemoteLagBytes,
          Gauge::kRemoteUp,
          Histogram::kRemoteUploadSeconds};
}

TierMetricIds TierMetricIds::Peer(std::string peer) {
  return {Counter::kPeerUploadedVersions,
          Counter::kPeerUploadedBytes,
          Counter::kPeerManifests,
          Counter::kPeerFailures,
          Counter::kPeerPulledBytes,
          Counter::kPeerGcDeletedObjects,
          Gauge::kPeerLagSteps,
          Gauge::kPeerLagBytes,
          Gauge::kPeerUp,
          Histogram::kPeerUploadSeconds,
          std::move(peer),
          Counter::kPeerSentFromMemoryBytes};
}

void TierMetricIds::Set(Metrics* m, Gauge g, double v) const {
  if (m == nullptr) return;
  if (gauge_label.empty()) {
    m->Set(g, v);
  } else {
    m->Set(g, gauge_label, v);
  }
}

RemoteTier::RemoteTier(RemoteTierOptions options, RemoteTierDeps deps)
    : options_(std::move(options)), deps_(deps), store_(options_.store), key_(options_.key) {}

absl::StatusOr<store::RemoteManifest> RemoteTier::ReadManifest(const std::string& job,
                                                               uint32_t rank, uint64_t step) {
  CKPT_ASSIGN_OR_RETURN(std::string bytes, store_->GetBytes(remote::ManifestKey(job, rank, step),
                                                            remote::kMaxManifestBytes));
  CKPT_ASSIGN_OR_RETURN(store::RemoteManifest m, remote::DecodeManifest(bytes, *key_));
  if (m.job_id() != job || m.rank() != rank || m.step() != step) {
    return absl::DataLossError(absl::StrCat("the manifest of step ", step, " names another step"));
  }
  return m;
}

absl::Status RemoteTier::FailingNow() {
  absl::MutexLock lock(&mu_);
  if (error_.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("the ", name(), " tier is failing: ", error_.message()));
}

absl::StatusOr<std::optional<uid_t>> RemoteTier::JobOwner(const std::string& job, bool must_know) {
  if (!must_know) CKPT_RETURN_IF_ERROR(FailingNow());
  absl::StatusOr<std::string> bytes = store_->GetBytes(remote::OwnerKey(job), kMaxOwnerBytes);
  if (absl::IsNotFound(bytes.status())) return std::optional<uid_t>();
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<store::RemoteJob> record = remote::DecodeOwner(*bytes, *key_);
  if (!record.ok() || record->job_id() != job) {
    return absl::DataLossError(
        absl::StrCat("the ", name(), " tier's owner record of job ", job, " is not authentic (",
                     record.ok() ? "it names another job" : record.status().message(),
                     "); ckptd does not use the job until an operator removes ",
                     remote::OwnerKey(job), " there"));
  }
  return std::optional<uid_t>(record->owner_uid());
}

absl::Status RemoteTier::ClaimJob(const std::string& job, uid_t owner, bool must_know) {
  if (!must_know) CKPT_RETURN_IF_ERROR(FailingNow());
  store::RemoteJob record;
  record.set_job_id(job);
  record.set_owner_uid(owner);
  record.set_created_unix_ms(absl::ToUnixMillis(deps_.clock->Now()));
  absl::Status put = store_->PutBytes(remote::OwnerKey(job), remote::EncodeOwner(record, *key_),
                                      /*if_absent=*/true);
  if (put.ok()) return put;
  if (absl::IsPermissionDenied(put)) {
    // The store refused ckptd itself (credentials, a peer's allow list):
    // not a statement about the job's owner.
    return absl::UnavailableError(
        absl::StrCat("the ", name(), " tier refused ckptd: ", put.message()));
  }
  if (!absl::IsAlreadyExists(put)) return put;
  CKPT_ASSIGN_OR_RETURN(std::optional<uid_t> there, JobOwner(job, /*must_know=*/true));
  if (there.has_value() && *there == owner) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("job ", job, " belongs to another user (in the ", name(), " tier)"));
}

RemoteTier::~RemoteTier() { StopAndJoin(); }

void RemoteTier::Start() {
  options_.metric_ids.Set(deps_.metrics, options_.metric_ids.up, 1);
  LoadRanks();  // before any call: WaitDurable finds every rank
  upload_thread_ = std::thread([this] { UploadLoop(); });
}

void RemoteTier::StopAndJoin() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    stopping_.store(true);
    WakeLocked();
  }
  // The workers check stopping_ before each call; the calls already made
  // end now.
  store_->CancelCalls();
  if (upload_thread_.joinable()) upload_thread_.join();
}

RemoteTier::RankCopy* RemoteTier::FindLocked(const RankKey& key) {
  auto it = ranks_.find(key);
  return it == ranks_.end() ? nullptr : &it->second;
}

void RemoteTier::NoteFailure(const absl::Status& s, const std::string& what, uid_t owner) {
  if (Metrics* m = deps_.metrics) {
    m->Inc(options_.metric_ids.failures, remote_tier::FailureLabel(s), 1);
    options_.metric_ids.Set(m, options_.metric_ids.up, 0);
  }
  absl::MutexLock lock(&mu_);
  if (error_.ok()) CKPT_LOG(WARNING) << name() << " tier: " << what << ": " << s;
  error_ = absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  error_uid_ = owner;
}

TierLag RemoteTier::LagOf(const uid_t* owner) {
  TierLag lag;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, rc] : ranks_) {
    if ((owner != nullptr && rc.owner != *owner) || !CopiesLocked(key)) continue;
    lag.steps = std::max(lag.steps, rc.local_step - std::min(rc.local_step, rc.remote_step));
    for (const auto& [step, b] : rc.pending) lag.bytes += b;
  }
  return lag;
}

bool RemoteTier::CopiesLocked(const RankKey& key) const {
  return !options_.copies || options_.copies(key);
}

void RemoteTier::OnLocalEvents(const RankKey& key, uid_t owner,
                               absl::Span<const LocalEvent> events) {
  if (events.empty()) return;
  absl::MutexLock lock(&mu_);
  if (!CopiesLocked(key)) return;
  RankCopy& rc = ranks_[key];
  if (rc.owner != owner) {
    // The id was deleted and made again by another uid: start over.
    rc = RankCopy();
    rc.owner = owner;
  }
  for (const LocalEvent& e : events) {
    rc.local_step = std::max(rc.local_step, e.step);
    if (e.step > rc.remote_step) rc.pending[e.step] = e.bytes;
  }
  while (rc.pending.size() > kMaxPendingTracked) rc.pending.erase(rc.pending.begin());
  WakeLocked();
}

void RemoteTier::OnRewind(const RankKey& key, uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (!CopiesLocked(key)) return;
  RankCopy& rc = ranks_[key];
  rc.discard_above = std::min(rc.discard_above.value_or(step), step);
  rc.local_step = step;
  // Until the manifests above it are gone, nothing above `step` counts as
  // remote-durable.
  rc.remote_step = 0;
  for (auto it = rc.manifests.begin(); it != rc.manifests.end() && it->first <= step; ++it) {
    rc.remote_step = it->first;
  }
  rc.pending.erase(rc.pending.upper_bound(step), rc.pending.end());
  // The rank's next steps reuse the file names of the discarded ones: those
  // objects are no longer trusted (they are uploaded again, over them).
  for (auto it = rc.objects.begin(); it != rc.objects.end();) {
    uint32_t layer = 0;
    uint64_t s = 0;
    if (ParseFileName(it->first, &layer, &s) && s > step) {
      rc.stray.insert(it->first);
      it = rc.objects.erase(it);
    } else {
      ++it;
    }
  }
  // Going back on purpose settles a history conflict (not another owner).
  if (rc.blocked.rfind("history:", 0) == 0) rc.blocked.clear();
  WakeLocked();
}

void RemoteTier::ForgetJob(const std::string& job) {
  // Its remote copy stays (docs/remote.md); this node stops uploading it.
  absl::MutexLock lock(&mu_);
  for (auto it = ranks_.lower_bound(RankKey(job, 0));
       it != ranks_.end() && it->first.first == job;) {
    it = ranks_.erase(it);
  }
  WakeLocked();
}

absl::StatusOr<uint64_t> RemoteTier::WaitDurable(const RankKey& key, uint64_t step,
                                                 absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // The rank's state exists once its first event is written; it goes only
  // with the job (ForgetJob), which ends the wait.
  auto there = [this, &key, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const RankCopy* rc = FindLocked(key);
    return stop_ || rc == nullptr || rc->remote_step >= step;
  };
  mu_.AwaitWithDeadline(absl::Condition(&there), deadline);
  const RankCopy* rc = FindLocked(key);
  if (rc == nullptr) return absl::AbortedError("the job was deleted");
  if (rc->remote_step < step) {
    if (stop_) return ShuttingDownError();
    return absl::DeadlineExceededError(
        absl::StrCat("step ", step, " is durable on this node but not yet in the ", name(), " tier",
                     error_.ok() ? "" : absl::StrCat(" (", error_.message(), ")")));
  }
  return rc->remote_step;
}

uint64_t RemoteTier::DurableStep(const RankKey& key) {
  absl::MutexLock lock(&mu_);
  const RankCopy* rc = FindLocked(key);
  return rc == nullptr ? 0 : rc->remote_step;
}

std::set<uint64_t> RemoteTier::DurableSteps(const RankKey& key) {
  std::set<uint64_t> steps;
  absl::MutexLock lock(&mu_);
  if (const RankCopy* rc = FindLocked(key); rc != nullptr) {
    for (const auto& [step, m] : rc->manifests) steps.insert(step);
  }
  return steps;
}

LocalKeep RemoteTier::KeepLocally(const RankKey& key) {
  // A rank the uploader has not listed yet counts as having nothing there.
  absl::MutexLock lock(&mu_);
  const RankCopy* rc = FindLocked(key);
  return LocalKeep{rc != nullptr && rc->seeded ? rc->remote_step : 0, options_.max_pending_events};
}

void RemoteTier::LoadRanks() {
  Index* const index = deps_.index;
  absl::StatusOr<std::vector<std::string>> jobs = index->ListJobs();
  for (const std::string& job : jobs.ok() ? *jobs : std::vector<std::string>()) {
    ForEachNewestRankEvent(index, job, [&](uint32_t rank, uid_t owner, uint64_t step) {
      absl::MutexLock lock(&mu_);
      if (!CopiesLocked(RankKey(job, rank))) return;
      RankCopy& rc = ranks_[RankKey(job, rank)];
      rc.owner = owner;
      rc.local_step = std::max(rc.local_step, step);
    });
  }
}

absl::StatusOr<std::vector<TierJob>> RemoteTier::Jobs(const Caller& caller) {
  JobsCache cache;
  {
    absl::MutexLock lock(&mu_);
    cache = jobs_cache_;
  }
  if (absl::Now() - cache.at > kJobsCacheTtl) {
    CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                          store_->List(remote::JobsPrefix()));
    std::map<std::string, TierJob> found;
    for (const remote::ObjectInfo& o : objects) {
      std::string job;
      uint32_t rank = 0;
      uint64_t step = 0;
      if (!remote::ParseRankOfKey(o.key, &job, &rank) ||
          !remote::ParseManifestKey(o.key, job, rank, &step)) {
        continue;
      }
      TierJob& tj = found[job];
      tj.job = job;
      uint64_t& n = tj.newest_step[rank];
      n = std::max(n, step);
    }
    cache.jobs.clear();
    for (auto& [job, tj] : found) {
      // The job's owner record says who it belongs to; a job without one
      // (its first upload failed before the record) by its newest manifest
      // of the first rank. Neither authentic: not listed.
      absl::StatusOr<std::optional<uid_t>> owner = JobOwner(job, /*must_know=*/true);
      if (!owner.ok()) continue;
      if (owner->has_value()) {
        tj.owner = **owner;
      } else {
        const auto& [rank, step] = *tj.newest_step.begin();
        absl::StatusOr<store::RemoteManifest> m = ReadManifest(job, rank, step);
        if (!m.ok()) continue;
        tj.owner = m->owner_uid();
      }
      cache.jobs.push_back(std::move(tj));
    }
    cache.at = absl::Now();
    absl::MutexLock lock(&mu_);
    jobs_cache_ = cache;
  }
  std::vector<TierJob> out;
  for (TierJob& tj : cache.jobs) {
    if (tj.owner == caller.uid || IsRoot(caller)) out.push_back(std::move(tj));
  }
  return out;
}

TierReport RemoteTier::Report(const Caller& caller) {
  const bool all = IsRoot(caller);
  TierReport r;
  r.description = store_->Describe();
  r.lag = LagOf(all ? nullptr : &caller.uid);
  absl::MutexLock lock(&mu_);
  // It may name a job: only its owner and root see it.
  if (!error_.ok()) {
    r.error = all || error_uid_ == caller.uid
                  ? std::string(error_.message())
                  : "another user's job failed to upload (root sees why)";
  }
  return r;
}

void RemoteTier::CollectMetrics() {
  Metrics* m = deps_.metrics;
  if (m == nullptr) return;
  const TierLag lag = LagOf(nullptr);
  options_.metric_ids.Set(m, options_.metric_ids.lag_steps, static_cast<double>(lag.steps));
  options_.metric_ids.Set(m, options_.metric_ids.lag_bytes, static_cast<double>(lag.bytes));
}

}  // namespace ckpt
