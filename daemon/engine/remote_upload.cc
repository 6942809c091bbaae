// RemoteTier's uploader: one turn per due rank, round-robin; each turn
// uploads one step (its versions the remote tier lacks, then its manifest)
// and applies remote retention.
#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/parallel.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/image_or_file.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/engine/remote_tier_internal.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"
#include "daemon/remote/remote_layout.h"
#include "daemon/store/layer_store.h"

namespace ckpt {
namespace {

using remote_tier::FilesOf;
using remote_tier::Unusable;

std::string RankName(const RankKey& key) {
  return absl::StrCat("job ", key.first, " rank ", key.second);
}

// A rank ForgetJob dropped ends the turn: it is not brought back.
absl::Status Gone(const RankKey& key) {
  return absl::AbortedError(absl::StrCat(RankName(key), " was deleted"));
}

}  // namespace

void RemoteTier::UploadLoop() {
  RankKey last;
  for (;;) {
    uid_t owner = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (!NextDue(&last, &owner)) continue;
    absl::Status s = UploadNext(last);
    if (s.ok()) s = RemoteGc(last);
    if (absl::IsCancelled(s)) return;  // stopping
    if (absl::IsAborted(s)) continue;  // the job was deleted meanwhile
    NoteTurn(last, s);
    if (!s.ok()) NoteFailure(s, absl::StrCat("uploading ", RankName(last)), owner);
  }
}

bool RemoteTier::NextDue(RankKey* last, uid_t* owner) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  auto due = [&](const RankKey& key, const RankCopy& rc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return rc.blocked.empty() && now >= rc.retry_at &&
           (!rc.seeded || rc.discard_above.has_value() || rc.local_step > rc.remote_step) &&
           CopiesLocked(key);
  };
  // Round-robin from the rank after the last one served.
  for (auto it = ranks_.upper_bound(*last); it != ranks_.end(); ++it) {
    if (due(it->first, it->second)) {
      *last = it->first, *owner = it->second.owner;
      return true;
    }
  }
  for (auto it = ranks_.begin(); it != ranks_.end() && it->first <= *last; ++it) {
    if (due(it->first, it->second)) {
      *last = it->first, *owner = it->second.owner;
      return true;
    }
  }
  const uint64_t seen = wakeups_;
  auto woken = [this, seen]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || wakeups_ != seen; };
  // Bounded: a rank's back-off ends without a wake-up.
  mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Milliseconds(500));
  return false;
}

void RemoteTier::NoteTurn(const RankKey& key, const absl::Status& s) {
  absl::MutexLock lock(&mu_);
  RankCopy* rc = FindLocked(key);
  if (rc == nullptr) return;
  if (s.ok()) {
    rc->backoff = absl::ZeroDuration();
    rc->retry_at = absl::InfinitePast();
    return;
  }
  rc->backoff = rc->backoff == absl::ZeroDuration() ? options_.retry_min
                                                    : std::min(rc->backoff * 2, options_.retry_max);
  rc->retry_at = absl::Now() + rc->backoff;
  // The store refused what this node thought it could take (a peer whose
  // replicas were lost with its disk has no owner record of the job any
  // more, nor the objects this node counted on): the next turn lists it
  // again and claims the job there before anything else.
  if (absl::IsFailedPrecondition(s) && rc->blocked.empty()) rc->seeded = false;
}

absl::Status RemoteTier::Seed(const RankKey& key, RankCopy* out) {
  const auto& [job, rank] = key;
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> objects,
                        store_->List(remote::RankPrefix(job, rank)));
  std::map<std::string, uint64_t> listed;   // version objects there -> bytes
  std::map<std::string, std::string> macs;  // version objects a manifest names -> their MAC
  for (const remote::ObjectInfo& o : objects) {
    std::string file;
    uint64_t step = 0;
    if (remote::ParseVersionObjectKey(o.key, job, rank, &file)) {
      listed[file] = o.size;
      continue;
    }
    if (!remote::ParseManifestKey(o.key, job, rank, &step)) continue;
    absl::StatusOr<store::RemoteManifest> m = ReadManifest(job, rank, step);
    if (!m.ok()) {
      if (!Unusable(m.status())) return m.status();
      // A damaged manifest does not make its step remote-durable; the
      // step is uploaded again if it is still local.
      CKPT_LOG(WARNING) << name() << " tier: manifest " << o.key << " is unusable: " << m.status();
      if (Metrics* mm = deps_.metrics) mm->Inc(options_.metric_ids.failures, "corrupt", 1);
      continue;
    }
    if (m->owner_uid() != out->owner) {
      out->blocked =
          absl::StrCat("owner: the ", name(), " tier holds ", RankName(key), " for another user");
    }
    out->manifests[step] =
        RankCopy::Manifest{m->event().unix_ms(), m->event().agreed_step(), FilesOf(*m)};
    for (const store::RemoteVersion& v : m->versions()) macs[v.record().file()] = v.object_mac();
  }
  // Trusted: what an authentic manifest names, with the MAC it records.
  for (const auto& [file, size] : listed) {
    auto named = macs.find(file);
    if (named != macs.end()) {
      out->objects[file] = ObjectCopy{size, named->second};
    } else {
      out->stray.insert(file);
    }
  }
  out->remote_step = out->manifests.empty() ? 0 : out->manifests.rbegin()->first;
  out->seeded = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> RemoteTier::CheckHistory(const RankKey& key) {
  const auto& [job, rank] = key;
  Index* const index = deps_.index;
  uint64_t newest = 0;
  std::vector<std::string> files;
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    if (rc == nullptr || rc->manifests.empty()) return std::string();
    newest = rc->manifests.rbegin()->first;
    files = rc->manifests.rbegin()->second.files;
  }
  CKPT_ASSIGN_OR_RETURN(auto local, index->EventAtOrBefore(job, rank, ~uint64_t{0}));
  const uint64_t local_head = local.has_value() ? local->first : 0;
  if (newest > local_head) {
    return absl::StrCat(
        "history: the ", name(), " tier holds ", RankName(key), " up to step ", newest,
        ", this node only up to ", local_head,
        " (started without restoring from it?); restore from it, or delete it there");
  }
  // Where this node still has the step, its plan must name the same files.
  CKPT_ASSIGN_OR_RETURN(auto at, index->EventAtOrBefore(job, rank, newest));
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index->GetRank(job, rank));
  if (!at.has_value() || at->first != newest || !table.has_value()) return std::string();
  // A layer whose version of that step was lost here is not compared: the
  // manifest names the damaged object, or the previous version (lost_step).
  CKPT_ASSIGN_OR_RETURN(const Index::LostMap lost, index->LostVersions(job, rank));
  std::set<uint32_t> skip;
  std::vector<std::string> local_files;
  for (const store::LayerSpec& layer : table->layers()) {
    CKPT_ASSIGN_OR_RETURN(auto v, index->VersionAtOrBefore(job, rank, layer.id(), newest));
    if (LostNeeded(lost, layer.id(), newest,
                   v.has_value() ? std::optional(v->first) : std::nullopt) != nullptr) {
      skip.insert(layer.id());
    } else if (v.has_value()) {
      local_files.push_back(v->second.file());
    }
  }
  files.erase(std::remove_if(files.begin(), files.end(),
                             [&skip](const std::string& f) {
                               uint32_t layer;
                               uint64_t step;
                               return ParseFileName(f, &layer, &step) && skip.count(layer) > 0;
                             }),
              files.end());
  std::sort(local_files.begin(), local_files.end());
  std::sort(files.begin(), files.end());
  if (local_files != files) {
    return absl::StrCat("history: the ", name(), " tier's step ", newest, " of ", RankName(key),
                        " is of another history than this node's; restore from it, or delete it "
                        "there");
  }
  return std::string();
}

absl::StatusOr<std::string> RemoteTier::CheckOwnerRecord(const RankKey& key, uid_t owner) {
  absl::Status claimed = ClaimJob(key.first, owner, /*must_know=*/true);
  if (claimed.ok()) return std::string();
  if (absl::IsPermissionDenied(claimed)) {
    return absl::StrCat("owner: the ", name(), " tier holds job ", key.first, " for another user");
  }
  return claimed;
}

absl::Status RemoteTier::SeedIfNeeded(const RankKey& key) {
  RankCopy fresh;
  std::optional<uint64_t> discard_above;
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    if (rc->seeded) return absl::OkStatus();
    fresh.owner = rc->owner;
    discard_above = rc->discard_above;
  }
  CKPT_RETURN_IF_ERROR(Seed(key, &fresh));
  // The job's owner is one fact for every node: claimed before anything of
  // it is uploaded, and this node uploads nothing of another user's job.
  if (fresh.blocked.empty()) {
    CKPT_ASSIGN_OR_RETURN(std::string other, CheckOwnerRecord(key, fresh.owner));
    fresh.blocked = other;
  }
  {
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    rc->objects = std::move(fresh.objects);
    rc->stray = std::move(fresh.stray);
    rc->manifests = std::move(fresh.manifests);
    rc->blocked = fresh.blocked;
    rc->seeded = true;
    error_ = absl::OkStatus();  // the store answered
  }
  if (discard_above.has_value()) return absl::OkStatus();
  CKPT_ASSIGN_OR_RETURN(std::string conflict, CheckHistory(key));
  if (!conflict.empty()) {
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc != nullptr && rc->blocked.empty()) rc->blocked = conflict;
  }
  return absl::OkStatus();
}

absl::Status RemoteTier::DeleteDiscarded(const RankKey& key, uint64_t above) {
  // A replacement node must never restore a step this rank went back before.
  std::vector<uint64_t> stale;
  {
    absl::MutexLock lock(&mu_);
    const RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    for (const auto& [s, m] : rc->manifests) {
      if (s > above) stale.push_back(s);
    }
  }
  for (uint64_t s : stale) {
    CKPT_RETURN_IF_ERROR(store_->Delete(remote::ManifestKey(key.first, key.second, s)));
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    rc->manifests.erase(s);
  }
  if (!stale.empty()) {
    CKPT_LOG(WARNING) << name() << " tier: " << RankName(key) << " went back to step " << above
                      << "; deleted the manifests of " << stale.size()
                      << " later steps of the discarded history";
  }
  absl::MutexLock lock(&mu_);
  RankCopy* rc = FindLocked(key);
  if (rc == nullptr) return Gone(key);
  if (rc->discard_above == above) rc->discard_above.reset();
  return absl::OkStatus();
}

absl::StatusOr<RemoteTier::UploadTurn> RemoteTier::PlanTurn(
    const RankKey& key, uid_t owner, uint64_t remote_step,
    const std::map<std::string, ObjectCopy>& objects) {
  const auto& [job, rank] = key;
  Index* const index = deps_.index;
  UploadTurn turn;
  CKPT_RETURN_IF_ERROR(deps_.leases->Acquire(key, absl::Now() + remote_tier::kLeaseWait));
  ScopedLease lease(deps_.leases, key);
  // The oldest event above the remote step; when more than
  // max_pending_events wait (a long outage), the newest instead (several
  // ranks: the newest at or below the job's agreed step, which every rank
  // has), so catching up costs one step, not the backlog. Steps and agreed
  // steps only: the chosen event (with its aux blob) is read once below.
  std::vector<std::pair<uint64_t, uint64_t>> pending;  // step, agreed step
  CKPT_RETURN_IF_ERROR(index->ForEachEvent(job, rank, /*newest_first=*/false,
                                           [&](uint64_t s, const store::EventRecord& e) {
                                             turn.newest_local = s;
                                             if (s > remote_step)
                                               pending.emplace_back(s, e.agreed_step());
                                             return true;
                                           }));
  if (pending.empty()) {
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    rc->local_step = turn.newest_local;
    rc->pending.clear();
    return turn;  // step 0: nothing to upload
  }
  turn.step = pending.front().first;
  if (pending.size() > options_.max_pending_events) {
    const uint64_t agreed = pending.back().second;
    for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
      if (agreed == 0 || it->first <= agreed) {
        turn.step = std::max(turn.step, it->first);
        break;
      }
    }
    if (turn.step != pending.front().first) {
      CKPT_LOG(INFO) << name() << " tier: " << RankName(key) << " is " << pending.size()
                     << " steps behind; uploading step " << turn.step
                     << " and skipping the steps before it";
    }
  }
  CKPT_ASSIGN_OR_RETURN(auto event, index->EventAtOrBefore(job, rank, turn.step));
  if (!event.has_value() || event->first != turn.step) return Gone(key);
  CKPT_ASSIGN_OR_RETURN(std::optional<store::RankRecord> table, index->GetRank(job, rank));
  if (!table.has_value()) return Gone(key);
  store::RemoteManifest& manifest = turn.manifest;
  manifest.set_job_id(job);
  manifest.set_rank(rank);
  manifest.set_step(turn.step);
  manifest.set_owner_uid(owner);
  *manifest.mutable_event() = std::move(event->second);
  *manifest.mutable_table() = *table;
  // A layer whose version of the step was lost here: its previous version,
  // marked, so a replacement node refuses the step as this one does.
  // (One a restore accepted is this node's history now: not marked.)
  CKPT_ASSIGN_OR_RETURN(Index::LostMap lost, index->LostVersions(job, rank));
  DropAccepted(&lost);
  for (const store::LayerSpec& layer : table->layers()) {
    CKPT_ASSIGN_OR_RETURN(auto v, index->VersionAtOrBefore(job, rank, layer.id(), turn.step));
    if (!v.has_value()) continue;
    store::RemoteVersion* rv = manifest.add_versions();
    rv->set_layer(layer.id());
    rv->set_step(v->first);
    if (const auto* gone = LostNeeded(lost, layer.id(), turn.step, v->first)) {
      rv->set_lost_step(gone->first.second);
    }
    *rv->mutable_record() = v->second;
    if (auto there = objects.find(v->second.file()); there != objects.end()) {
      rv->set_object_mac(there->second.mac);
      continue;
    }
    // A placeholder of the MAC's size until the upload computes it, so the
    // manifest's size is known before anything is sent.
    rv->set_object_mac(std::string(remote::ObjectMac::kObjectMacBytes, '\0'));
    CKPT_ASSIGN_OR_RETURN(Upload up,
                          PrepareUpload(VersionKey{job, rank, layer.id(), v->first}, v->second));
    up.version = manifest.versions_size() - 1;
    turn.uploads.push_back(std::move(up));
  }
  return turn;
}

absl::StatusOr<RemoteTier::Upload> RemoteTier::PrepareUpload(const VersionKey& key,
                                                             const store::VersionRecord& rec) {
  // The file is opened under the lease even when the memory tier holds the
  // version: local GC may delete it once the lease is gone, and the image
  // may go before the upload is done with it.
  absl::StatusOr<UniqueFd> fd = deps_.store->OpenCommitted(key, rec);
  if (!fd.ok()) {
    if (Metrics* m = deps_.metrics) m->Inc(options_.metric_ids.failures, "local", 1);
    return absl::Status(fd.status().code(), absl::StrCat("the local copy of ", rec.file(), ": ",
                                                         fd.status().message()));
  }
  Upload up{rec, {}, *std::move(fd), 0, {}};
  if (deps_.images != nullptr && store_->PutsFromMemory()) {
    // Sent from memory only if its header still checks (which covers its
    // size), as a restore would take it; its tensors are checked where it
    // is restored.
    std::shared_ptr<const StagingLease> image = deps_.images->FindImage(key, rec);
    if (image != nullptr && CheckImageHeader(key, rec, LeaseImage(*image)).ok()) {
      up.image = image;
    }
  }
  return up;
}

absl::Status RemoteTier::UploadObjects(const RankKey& key, UploadTurn* turn) {
  // Named, not bound: the workers below capture them.
  const std::string& job = key.first;
  const uint32_t rank = key.second;
  absl::Mutex err_mu;
  absl::Status first_error;
  // After the first failure the rest are skipped.
  RunOnThreads(turn->uploads.size(), options_.upload_threads, [&](size_t i) {
    {
      absl::MutexLock l(&err_mu);
      if (!first_error.ok()) return;
    }
    absl::Status s =
        stopping_.load() ? absl::CancelledError("ckptd is stopping") : absl::OkStatus();
    Upload& u = turn->uploads[i];
    if (s.ok()) {
      // The MAC of what is sent, taken as it is sent.
      absl::StatusOr<remote::ObjectMac> mac = remote::ObjectMac::Begin(*key_);
      s = mac.status();
      if (s.ok()) {
        CKPT_SYNC_POINT("remote.before_put_version");
        const std::string okey = remote::VersionObjectKey(job, rank, u.rec.file());
        auto observe = [&](std::string_view b) {
          mac->Update(b);
          return absl::OkStatus();
        };
        if (!u.image.expired()) {
          ImageOrFile bytes(u.image, u.fd.get());
          s = store_->PutFilledObserved(
              okey, u.rec.file_bytes(),
              [&bytes](uint64_t off, size_t n, std::string* out) {
                return bytes.Fill(off, n, out);
              },
              observe);
          if (Metrics* m = deps_.metrics;
              m != nullptr && s.ok() && options_.metric_ids.from_memory_bytes.has_value()) {
            m->Inc(*options_.metric_ids.from_memory_bytes,
                   static_cast<double>(bytes.from_memory()));
          }
        } else {
          s = store_->PutFileObserved(okey, u.fd.get(), u.rec.file_bytes(), observe);
        }
      }
      if (s.ok()) {
        u.mac = mac->Finish();
        if (u.mac.empty()) s = absl::InternalError("OpenSSL failed in an object's MAC");
      }
    }
    if (!s.ok()) {
      absl::MutexLock l(&err_mu);
      if (first_error.ok()) first_error = s;
      return;
    }
    if (Metrics* m = deps_.metrics) {
      m->Inc(options_.metric_ids.uploaded_versions);
      m->Inc(options_.metric_ids.uploaded_bytes, static_cast<double>(u.rec.file_bytes()));
    }
    absl::MutexLock lock(&mu_);
    if (RankCopy* rc = FindLocked(key); rc != nullptr) {
      rc->objects[u.rec.file()] = ObjectCopy{u.rec.file_bytes(), u.mac};
      rc->stray.erase(u.rec.file());
    }
  });
  if (first_error.ok()) {
    for (const Upload& u : turn->uploads) {
      turn->manifest.mutable_versions(u.version)->set_object_mac(u.mac);
    }
  }
  turn->uploads.clear();  // the descriptors
  return first_error;
}

absl::Status RemoteTier::PutManifest(const RankKey& key, uid_t owner, const UploadTurn& turn,
                                     const std::string& encoded) {
  const std::string mkey = remote::ManifestKey(key.first, key.second, turn.step);
  CKPT_SYNC_POINT("remote.before_put_manifest");
  absl::Status put = store_->PutBytes(mkey, encoded, /*if_absent=*/true);
  if (!absl::IsAlreadyExists(put)) return put;
  // Written before ckptd restarted (the same records: kept), or left by a
  // history this rank went back before (replaced). Another user's, or one
  // that cannot be read right now, is never replaced.
  absl::StatusOr<store::RemoteManifest> old = ReadManifest(key.first, key.second, turn.step);
  if (!old.ok() && !Unusable(old.status())) return old.status();
  if (old.ok() && old->owner_uid() != owner) {
    absl::MutexLock lock(&mu_);
    if (RankCopy* rc = FindLocked(key); rc != nullptr) {
      rc->blocked =
          absl::StrCat("owner: the ", name(), " tier holds ", RankName(key), " for another user");
    }
    return absl::FailedPreconditionError(
        absl::StrCat("the ", name(), " tier holds ", RankName(key), " for another user"));
  }
  auto records = [](const store::RemoteManifest& m) {
    std::string out;
    for (const store::RemoteVersion& v : m.versions()) out += v.SerializeAsString();
    return out;
  };
  if (old.ok() && records(*old) == records(turn.manifest)) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(store_->PutBytes(mkey, encoded, /*if_absent=*/false));
  CKPT_LOG(WARNING) << name() << " tier: replaced the manifest of " << RankName(key) << " step "
                    << turn.step << " (it named other versions)";
  return absl::OkStatus();
}

absl::Status RemoteTier::UploadNext(const RankKey& key) {
  CKPT_RETURN_IF_ERROR(SeedIfNeeded(key));
  uid_t owner = 0;
  uint64_t remote_step = 0;
  std::optional<uint64_t> discard_above;
  std::map<std::string, ObjectCopy> objects;
  {
    absl::MutexLock lock(&mu_);
    RankCopy* rc = FindLocked(key);
    if (rc == nullptr) return Gone(key);
    if (!rc->blocked.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(rc->blocked.substr(rc->blocked.find(':') + 2),
                       "; this node neither uploads nor deletes anything of it"));
    }
    rc->remote_step = 0;
    for (const auto& [s, m] : rc->manifests) {
      if (!rc->discard_above.has_value() || s <= *rc->discard_above) rc->remote_step = s;
    }
    rc->pending.erase(rc->pending.begin(), rc->pending.upper_bound(rc->remote_step));
    owner = rc->owner;
    remote_step = rc->remote_step;
    discard_above = rc->discard_above;
    objects = rc->objects;
  }
  if (discard_above.has_value()) CKPT_RETURN_IF_ERROR(DeleteDiscarded(key, *discard_above));
  CKPT_ASSIGN_OR_RETURN(UploadTurn turn, PlanTurn(key, owner, remote_step, objects));
  if (turn.step == 0) return absl::OkStatus();
  // The lease is gone: local GC may run while the bytes travel (the open
  // descriptors keep them readable, the memory tier's images or not).
  const uint64_t manifest_bytes = 8 + remote::RemoteKey::kMacBytes + turn.manifest.ByteSizeLong();
  if (manifest_bytes > remote::kMaxManifestBytes) {
    // It could never be read back; refuse it here rather than wedge a pull.
    if (Metrics* m = deps_.metrics) m->Inc(options_.metric_ids.failures, "local", 1);
    return absl::FailedPreconditionError(absl::StrCat(
        "the manifest of step ", turn.step, " would be ", manifest_bytes, " bytes, more than the ",
        remote::kMaxManifestBytes, " a pull reads (a smaller aux blob or fewer layers)"));
  }
  const absl::Time start = absl::Now();
  CKPT_RETURN_IF_ERROR(UploadObjects(key, &turn));
  const std::string encoded = remote::EncodeManifest(turn.manifest, *key_);
  CKPT_RETURN_IF_ERROR(PutManifest(key, owner, turn, encoded));
  if (Metrics* m = deps_.metrics) {
    m->Inc(options_.metric_ids.manifests);
    m->Observe(options_.metric_ids.upload_seconds, absl::ToDoubleSeconds(absl::Now() - start));
    options_.metric_ids.Set(m, options_.metric_ids.up, 1);
  }
  absl::MutexLock lock(&mu_);
  RankCopy* rc = FindLocked(key);
  if (rc == nullptr) return Gone(key);
  rc->manifests[turn.step] = RankCopy::Manifest{
      turn.manifest.event().unix_ms(), turn.manifest.event().agreed_step(), FilesOf(turn.manifest)};
  // A rewind that came meanwhile deletes this manifest first (next turn).
  if (!rc->discard_above.has_value() || turn.step <= *rc->discard_above) {
    rc->remote_step = std::max(rc->remote_step, turn.step);
  }
  rc->local_step = std::max(rc->local_step, turn.newest_local);
  rc->pending.erase(rc->pending.begin(), rc->pending.upper_bound(rc->remote_step));
  error_ = absl::OkStatus();
  WakeLocked();
  return absl::OkStatus();
}

}  // namespace ckpt
