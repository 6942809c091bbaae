// RemoteTier's pulls: a replacement node copies a rank's newest usable
// history from the remote tier into its local store.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/parallel.h"
#include "daemon/common/validate.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/engine/remote_tier_internal.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt {
namespace {

// Manifests a pull copies at most (the newest, and those down to the job's
// agreed step), and how many it reads looking for whole ones.
constexpr size_t kMaxPulledManifests = 64;
constexpr size_t kMaxTriedManifests = 256;

}  // namespace

struct RemoteTier::PullState {
  RankKey key;
  Caller caller;
  bool must_know = false;
  std::vector<uint64_t> steps;  // manifests listed there, newest first
  // Every version this pull put in the index, removed again unless a usable
  // step needs it: nothing of a failed pull stays.
  std::vector<std::pair<VersionKey, store::VersionRecord>> adopted;
  uid_t owner = 0;
  std::optional<uid_t> recorded_owner;        // the job's owner record there
  std::vector<store::RemoteManifest> usable;  // newest first
  // The newest manifest's versions whose objects are damaged (usable[0]
  // is then that manifest): marked lost when the pull publishes, so that a
  // restore of the newest remote-durable step refuses instead of quietly
  // giving an older one (recovery/plan.h).
  std::vector<std::pair<VersionKey, store::LostVersion>> lost;
  bool whole = false;          // usable.back() has every version
  std::set<std::string> have;  // files adopted
  uint64_t floor = 0;          // the agreed step the newest usable one names
  uint64_t pulled_bytes = 0;
  bool gave_up = false;  // GiveUp answered OK: nothing of the pull stays

  // What a pull that cannot finish does: an error for a caller that must
  // know, else a warning (the rank starts without a checkpoint).
  absl::Status GiveUp(const absl::Status& s) {
    gave_up = true;
    if (must_know) return s;
    CKPT_LOG(WARNING) << "could not look for a checkpoint of job " << key.first << " rank "
                      << key.second << " (" << s << "); registering without one";
    return absl::OkStatus();
  }
};

absl::StatusOr<uint64_t> RemoteTier::NewestListedStep(const std::string& job, uint32_t rank,
                                                      bool must_know) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  {
    absl::MutexLock lock(&mu_);
    if (!must_know && !error_.ok()) return 0;  // as Pull: Register does not wait for it
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> listed,
                        store_->List(remote::ManifestPrefix(job, rank)));
  uint64_t newest = 0;
  for (const remote::ObjectInfo& o : listed) {
    uint64_t step = 0;
    if (remote::ParseManifestKey(o.key, job, rank, &step)) newest = std::max(newest, step);
  }
  return newest;
}

absl::Status RemoteTier::Pull(const std::string& job, uint32_t rank, const Caller& caller,
                              bool must_know) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job));
  const RankKey key(job, rank);
  {
    absl::MutexLock lock(&mu_);
    // Register does not wait for a remote tier that is failing.
    if (!must_know && !error_.ok()) return absl::OkStatus();
    // One pull of a rank at a time; a second caller waits for the first.
    auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return pulling_.count(key) == 0 || stop_;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&free), options_.pull_wait)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", job, " rank ", rank, " is still being pulled from the ", name(), " tier"));
    }
    pulling_.insert(key);
  }
  absl::Status s = PullRank(key, caller, must_know);
  absl::MutexLock lock(&mu_);
  pulling_.erase(key);
  return s;
}

absl::Status RemoteTier::PullRank(const RankKey& key, const Caller& caller, bool must_know) {
  const auto& [job, rank] = key;
  CKPT_ASSIGN_OR_RETURN(auto local, deps_.index->EventAtOrBefore(job, rank, ~uint64_t{0}));
  if (local.has_value()) return absl::OkStatus();  // this node has the rank's history
  PullState pull;
  pull.key = key;
  pull.caller = caller;
  pull.must_know = must_know;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<remote::ObjectInfo>> listed =
      store_->List(remote::ManifestPrefix(job, rank));
  if (!listed.ok()) {
    NoteFailure(listed.status(), "listing manifests", caller.uid);
    return pull.GiveUp(absl::Status(
        listed.status().code(),
        absl::StrCat("cannot look for a checkpoint of job ", job, " in the ", name(), " tier (",
                     store_->Describe(), "): ", listed.status().message())));
  }
  for (const remote::ObjectInfo& o : *listed) {
    uint64_t step = 0;
    if (remote::ParseManifestKey(o.key, job, rank, &step)) pull.steps.push_back(step);
  }
  if (pull.steps.empty()) return absl::OkStatus();
  std::sort(pull.steps.rbegin(), pull.steps.rend());
  // The job's owner record, when there is one, decides who may pull it and
  // which manifests are of the job at all.
  absl::StatusOr<std::optional<uid_t>> recorded = JobOwner(job, must_know);
  if (!recorded.ok()) return pull.GiveUp(recorded.status());
  pull.recorded_owner = *recorded;
  if (pull.recorded_owner.has_value() && *pull.recorded_owner != caller.uid && !IsRoot(caller)) {
    return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
  }

  absl::Status s = AdoptUsable(&pull);
  const bool publish = s.ok() && !pull.gave_up && !pull.usable.empty();
  if (publish) s = PublishPulled(&pull);
  if (!publish || !s.ok()) {
    for (const auto& [vk, rec] : pull.adopted) {
      IgnoreError(deps_.history->RemoveVersion(pull.owner, vk, rec),
                  "a leftover is quarantined at the next start");
    }
    for (const auto& lost : pull.lost) {
      IgnoreError(deps_.index->DeleteLost(lost.first), "a lost record of a rank with no history");
    }
    return s;
  }
  const uint64_t newest = pull.usable.front().step();
  {
    // The remote tier holds these steps already; any above them are
    // damaged and go (OnRewind) before this node uploads anything.
    absl::MutexLock lock(&mu_);
    RankCopy& rc = ranks_[key];
    rc.owner = pull.owner;
    rc.local_step = std::max(rc.local_step, newest);
    rc.seeded = false;          // listed afresh by the uploader
    error_ = absl::OkStatus();  // the store answered
  }
  if (pull.steps.front() > newest) OnRewind(key, newest);
  CKPT_LOG(INFO) << "pulled job " << job << " rank " << rank << " from the " << name() << " tier ("
                 << store_->Describe() << "): steps " << pull.usable.back().step() << ".." << newest
                 << ", " << pull.pulled_bytes << " bytes in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";
  return absl::OkStatus();
}

absl::Status RemoteTier::AdoptUsable(PullState* pull) {
  const auto& [job, rank] = pull->key;
  // Newest first: the newest manifest whose objects all read back whole,
  // then (several ranks) those down to the agreed step it records, and one
  // at or below it, so every rank can restore the step the job agrees on.
  // A newest manifest with damaged objects is adopted all the same (its
  // intact versions, its damaged ones lost), and the search goes on for a
  // whole one at or below the floor, whose versions a restore that accepts
  // older ones (older_within) takes.
  size_t tried = 0;
  for (uint64_t step : pull->steps) {
    if (pull->whole && pull->usable.back().step() <= pull->floor) break;
    if (pull->usable.size() >= kMaxPulledManifests || ++tried > kMaxTriedManifests) break;
    absl::StatusOr<store::RemoteManifest> m = ReadManifest(job, rank, step);
    if (!m.ok()) {
      NoteFailure(m.status(), absl::StrCat("reading the manifest of step ", step),
                  pull->caller.uid);
      if (remote_tier::Unusable(m.status())) continue;
      return pull->GiveUp(m.status());
    }
    if (m->owner_uid() != pull->caller.uid && !IsRoot(pull->caller)) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job, " belongs to another user"));
    }
    if (!pull->usable.empty() && m->owner_uid() != pull->owner) continue;
    if (pull->recorded_owner.has_value() && m->owner_uid() != *pull->recorded_owner) {
      CKPT_LOG(WARNING) << name() << " tier: the manifest of step " << step << " of job " << job
                        << " rank " << rank << " names uid " << m->owner_uid()
                        << ", not the job's owner " << *pull->recorded_owner << "; not used";
      continue;
    }
    // The newest manifest is adopted with its damaged objects' versions
    // lost; an older one only whole (AdoptManifest stops at its first).
    const bool newest = pull->usable.empty();
    std::vector<std::pair<VersionKey, store::LostVersion>> damaged;
    CKPT_ASSIGN_OR_RETURN(const bool whole, AdoptManifest(pull, *m, newest ? &damaged : nullptr));
    if (pull->gave_up) return absl::OkStatus();
    if (!whole && !newest) continue;
    if (newest) {
      pull->owner = m->owner_uid();
      pull->floor = m->event().agreed_step() > 0 ? m->event().agreed_step() : step;
    }
    pull->whole = whole;
    for (auto& d : damaged) pull->lost.push_back(std::move(d));
    // What the uploading node had lost already, it lost here too.
    for (const store::RemoteVersion& v : m->versions()) {
      if (v.lost_step() == 0) continue;
      pull->lost.emplace_back(
          VersionKey{job, rank, v.layer(), v.lost_step()},
          LostRecord(store::VersionRecord(),
                     absl::StrCat("lost on the node that uploaded step ", m->step())));
    }
    pull->usable.push_back(*std::move(m));
  }
  if (pull->usable.empty()) {
    return pull->GiveUp(absl::DataLossError(absl::StrCat("job ", job, " rank ", rank,
                                                         ": no manifest in the ", name(),
                                                         " tier could be used (each is damaged, "
                                                         "unreadable or another user's)")));
  }
  return absl::OkStatus();
}

std::function<absl::StatusOr<uint64_t>(int fd)> RemoteTier::FetchObject(const std::string& okey,
                                                                        uint64_t bytes,
                                                                        const std::string& mac,
                                                                        absl::Status* fetched) {
  return [this, okey, bytes, mac, fetched](int fd) -> absl::StatusOr<uint64_t> {
    // Only what a ckptd of this cluster wrote: the MAC its manifest
    // records, over the bytes as they arrive.
    absl::StatusOr<remote::ObjectMac> check = remote::ObjectMac::ForCheck(*key_, mac);
    if (!check.ok()) {
      return absl::DataLossError(
          absl::StrCat("object ", okey, ": its manifest's MAC: ", check.status().message()));
    }
    absl::StatusOr<uint64_t> got =
        store_->GetToFileObserved(okey, fd, bytes, [&](std::string_view b) {
          check->Update(b);
          return absl::OkStatus();
        });
    *fetched = got.status();
    if (!got.ok()) return got;
    if (!check->Matches(mac)) {
      return absl::DataLossError(absl::StrCat(
          "object ", okey, " is not the one its manifest names (its MAC does not match)"));
    }
    return got;
  };
}

absl::StatusOr<bool> RemoteTier::Repair(const VersionKey& vk, const store::VersionRecord& rec,
                                        uid_t owner) {
  const RankKey key(vk.job, vk.rank);
  ObjectCopy copy;
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    if (rc == nullptr || rc->owner != owner) return false;
  }
  if (absl::Status s = SeedIfNeeded(key); !s.ok()) {
    if (absl::IsAborted(s)) return false;  // the job was deleted meanwhile
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    // Objects of a history that is not this node's are never trusted.
    if (rc == nullptr || !rc->blocked.empty()) return false;
    auto it = rc->objects.find(rec.file());
    if (it == rc->objects.end() || it->second.bytes != rec.file_bytes()) return false;
    copy = it->second;
  }
  const uint64_t n = rec.file_bytes();
  // The version's bytes are counted already; the copy needs the room.
  CKPT_RETURN_IF_ERROR(deps_.disk->Reserve(n));
  const std::string okey = remote::VersionObjectKey(vk.job, vk.rank, rec.file());
  absl::Status fetched;
  absl::Status ok =
      deps_.store->Replace(vk, rec, FetchObject(okey, n, copy.mac, &fetched),
                           absl::StrCat("damaged; replaced by the ", name(), " tier's copy"));
  deps_.disk->Release(n);
  if (ok.ok()) {
    if (Metrics* m = deps_.metrics)
      m->Inc(options_.metric_ids.pulled_bytes, static_cast<double>(n));
    return true;
  }
  NoteFailure(ok, absl::StrCat("reading ", okey), owner);
  // The remote copy is missing or is not that version: no intact copy here.
  if (absl::IsDataLoss(ok) || absl::IsNotFound(fetched)) {
    CKPT_LOG(WARNING) << name() << " tier: no intact copy of " << okey << ": " << ok;
    return false;
  }
  return ok;
}

absl::StatusOr<bool> RemoteTier::AdoptManifest(
    PullState* pull, const store::RemoteManifest& m,
    std::vector<std::pair<VersionKey, store::LostVersion>>* damaged) {
  // Named, not bound: C++17 lambdas (the workers below) cannot capture a
  // structured binding, and clang rejects it.
  const std::string& job = pull->key.first;
  const uint32_t rank = pull->key.second;
  const QuotaOwner quota_owner{m.owner_uid(), job};
  // The versions not here yet, their room reserved before anything moves.
  struct Fetch {
    const store::RemoteVersion* v;
    absl::Status fetched;  // what the store said, apart from the local checks
    absl::Status adopted;
  };
  std::vector<Fetch> fetches;
  std::set<std::string> listed;
  auto release = [&](const Fetch& f) {
    deps_.disk->Release(f.v->record().file_bytes());
    deps_.quota->ReleaseVersion(quota_owner, f.v->record().file_bytes());
  };
  for (const store::RemoteVersion& v : m.versions()) {
    if (pull->have.count(v.record().file()) > 0 || !listed.insert(v.record().file()).second) {
      continue;
    }
    const uint64_t n = v.record().file_bytes();
    absl::Status room = deps_.quota->ReserveVersion(quota_owner, n);
    if (room.ok()) {
      room = deps_.disk->Reserve(n);
      if (!room.ok()) deps_.quota->ReleaseVersion(quota_owner, n);
    }
    if (!room.ok()) {
      for (const Fetch& f : fetches) release(f);
      return room;
    }
    fetches.push_back(Fetch{&v, {}, {}});
  }
  // Fetched `upload_threads` at once, each checked before its record is
  // put (LayerStore::Adopt): a pull moves a step's versions side by side,
  // as the uploader does.
  RunOnThreads(fetches.size(), options_.upload_threads, [&](size_t i) {
    Fetch& f = fetches[i];
    const store::RemoteVersion& v = *f.v;
    const std::string okey = remote::VersionObjectKey(job, rank, v.record().file());
    f.adopted =
        deps_.store->Adopt(VersionKey{job, rank, v.layer(), v.step()}, v.record(),
                           FetchObject(okey, v.record().file_bytes(), v.object_mac(), &f.fetched));
  });
  // What came: every adopted version joins the pull (so a failed pull
  // removes it), then the failures in the manifest's order.
  for (const Fetch& f : fetches) {
    if (!f.adopted.ok()) continue;
    const store::RemoteVersion& v = *f.v;
    pull->have.insert(v.record().file());
    if (pull->usable.empty()) pull->owner = m.owner_uid();
    pull->adopted.emplace_back(VersionKey{job, rank, v.layer(), v.step()}, v.record());
    pull->pulled_bytes += v.record().file_bytes();
    if (Metrics* mm = deps_.metrics) {
      mm->Inc(options_.metric_ids.pulled_bytes, static_cast<double>(v.record().file_bytes()));
    }
  }
  bool whole = true;
  for (const Fetch& f : fetches) {
    if (f.adopted.ok()) continue;
    const store::RemoteVersion& v = *f.v;
    const std::string okey = remote::VersionObjectKey(job, rank, v.record().file());
    release(f);
    NoteFailure(f.adopted, absl::StrCat("reading ", okey), pull->caller.uid);
    // Unusable only when the object is missing or is not what ckptd wrote
    // (it did not check, or the store says it is not an object: a FIFO in
    // its place); a flaky store or a local error is no reason to give the
    // step up.
    const bool bad = f.fetched.ok() ? absl::IsDataLoss(f.adopted)
                                    : absl::IsNotFound(f.fetched) || absl::IsDataLoss(f.fetched);
    if (!bad) {
      for (const Fetch& later : fetches) {
        if (&later > &f && !later.adopted.ok()) release(later);
      }
      CKPT_RETURN_IF_ERROR(pull->GiveUp(f.adopted));  // OK: nothing of the pull stays
      return false;
    }
    CKPT_LOG(WARNING) << name() << " tier: step " << m.step() << " of job " << job << " rank "
                      << rank << " is not restorable whole from there: " << f.adopted;
    whole = false;
    if (damaged == nullptr) continue;
    damaged->emplace_back(
        VersionKey{job, rank, v.layer(), v.step()},
        LostRecord(v.record(), absl::StrCat("the ", name(), " tier's object is damaged: ",
                                            (f.fetched.ok() ? f.adopted : f.fetched).message())));
  }
  return whole;
}

absl::Status RemoteTier::PublishPulled(PullState* pull) {
  const auto& [job, rank] = pull->key;
  Index* const index = deps_.index;
  CKPT_RETURN_IF_ERROR(deps_.owners->Claim(job, pull->owner));
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index->GetRank(job, rank));
  uint64_t table_bytes = 0;  // what it counts for in the owner's index quota
  if (!table.has_value()) {
    CKPT_RETURN_IF_ERROR(index->PutRank(job, rank, pull->usable.front().table()));
    table_bytes = RankIndexBytes(pull->usable.front().table());
  }
  // The lost versions before the events: no plan sees the newest step
  // without them.
  for (const auto& [vk, lost] : pull->lost) {
    CKPT_RETURN_IF_ERROR(index->MarkLost(vk, lost));
    CKPT_LOG(ERROR) << name() << " tier: job " << job << " rank " << rank << " layer " << vk.layer
                    << " step " << vk.step << " is lost (" << lost.reason()
                    << "); a restore of a step that needs it refuses unless it accepts the "
                       "layer's previous version (older_within_steps)";
  }
  std::vector<std::pair<uint64_t, store::EventRecord>> events;
  uint64_t event_bytes = 0;
  for (auto it = pull->usable.rbegin(); it != pull->usable.rend(); ++it) {
    events.emplace_back(it->step(), it->event());
    event_bytes += EventIndexBytes(it->event().aux().size());
  }
  CKPT_RETURN_IF_ERROR(index->PutEvents(job, rank, events));
  deps_.quota->Seed(QuotaOwner{pull->owner, job}, 0, event_bytes + table_bytes);
  // The steps are durable here now. A version no usable step names (of a
  // manifest that turned out unusable) goes again: left in the index, a
  // later plan could pick it up.
  std::set<std::string> named;
  for (const store::RemoteManifest& m : pull->usable) {
    for (const std::string& f : remote_tier::FilesOf(m)) named.insert(f);
  }
  std::vector<std::pair<VersionKey, store::VersionRecord>> unnamed;
  for (auto& a : pull->adopted) {
    if (named.count(a.second.file()) == 0) unnamed.push_back(std::move(a));
  }
  pull->adopted.clear();  // what stays is the local history now
  for (const auto& [vk, rec] : unnamed) {
    IgnoreError(deps_.history->RemoveVersion(pull->owner, vk, rec),
                "a leftover is quarantined at the next start");
    pull->pulled_bytes -= rec.file_bytes();
  }
  return RaiseGenerations(pull);
}

absl::Status RemoteTier::RaiseGenerations(PullState* pull) {
  // This node's next versions must not reuse a file name any node wrote for
  // the rank: generations continue above every one there.
  const auto& [job, rank] = pull->key;
  uint64_t highest = 0;
  absl::StatusOr<std::vector<remote::ObjectInfo>> versions =
      store_->List(remote::RankPrefix(job, rank) + "v/");
  for (const remote::ObjectInfo& o :
       versions.ok() ? *versions : std::vector<remote::ObjectInfo>()) {
    std::string file;
    uint64_t gen = 0;
    if (remote::ParseVersionObjectKey(o.key, job, rank, &file) &&
        remote::GenerationOfFile(file, &gen)) {
      highest = std::max(highest, gen);
    }
  }
  for (const store::RemoteManifest& m : pull->usable) {
    for (const store::RemoteVersion& v : m.versions()) {
      highest = std::max(highest, v.record().generation());
    }
  }
  return deps_.index->RaiseGeneration(highest);
}

}  // namespace ckpt
