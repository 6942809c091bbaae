// RemoteTier: write-behind of every locally durable step to an object store
// or a shared directory (daemon/remote/), remote retention, and pulling a
// rank's history onto a replacement node (docs/remote.md).
//
// One uploader thread walks the ranks round-robin. For a rank whose newest
// local event is above its newest manifest, it takes the oldest such event;
// under the rank's lease (local GC keeps off meanwhile) it plans the step and
// opens the local files of the plan's versions the remote tier does not
// hold yet, then lets the lease go and uploads them (`upload_threads` at
// once) from the open descriptors, then writes the step's manifest: the step
// is remote-durable once the manifest exists. A failure backs the rank off
// (retry_min doubling to retry_max) and the same step is tried again;
// training and local checkpoints never wait for any of it.
//
// State: per rank, what the remote tier holds (manifests, trusted and stray
// objects), how far it trails, and why it is blocked; guarded by mu_, a
// leaf: nothing of the engine is called while it is held.
// Thread-safety: thread-safe (DurableTier).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/common/clock.h"
#include "daemon/engine/disk_budget.h"
#include "daemon/engine/durable_tier.h"
#include "daemon/engine/history.h"
#include "daemon/engine/job_owners.h"
#include "daemon/engine/leases.h"
#include "daemon/engine/quota.h"
#include "daemon/metrics/metrics.h"
#include "daemon/remote/remote_auth.h"
#include "daemon/remote/remote_store.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/retention.h"

namespace ckpt {

class VersionSource;  // daemon/recovery/restore.h

// The metrics a tier reports under (its own families: ckpt_remote_* or
// ckpt_peer_*).
struct TierMetricIds {
  Counter uploaded_versions, uploaded_bytes, manifests, failures, pulled_bytes, gc_deleted;
  Gauge lag_steps, lag_bytes, up;
  Histogram upload_seconds;
  // Non-empty: the gauges are labelled with it (the peer tier's, per peer
  // node: ckpt_peer_up{peer="node-13"}).
  std::string gauge_label;
  // Bytes sent from the memory tier (uploaded_bytes counts them too), for
  // a tier whose store PutsFromMemory.
  std::optional<Counter> from_memory_bytes;
  static TierMetricIds Remote();
  static TierMetricIds Peer(std::string peer);
  // Sets gauge `g` (labelled when gauge_label is set).
  void Set(Metrics* m, Gauge g, double v) const;
};

struct RemoteTierOptions {
  // "remote" (an object store or a shared directory) or "peer" (a peer
  // node's ckptd, daemon/peer/, one RemoteTier per peer node under a
  // PeerTier): the tier's name in WaitDurable, the logs and reports;
  // `metric_ids` its metric families.
  const char* name = "remote";
  TierMetricIds metric_ids = TierMetricIds::Remote();
  remote::RemoteStore* store = nullptr;  // null = no such tier; not owned
  // The cluster key every manifest, object and owner record is signed with
  // (remote_auth.h); not owned. REQUIRED with a store.
  const remote::RemoteKey* key = nullptr;
  unsigned upload_threads = 4;  // versions uploaded at once
  // Per rank, the oldest events not yet uploaded that local GC keeps.
  uint32_t max_pending_events = 64;
  // The back-off after a failure: doubles from the first value up to the
  // second.
  absl::Duration retry_min = absl::Seconds(1);
  absl::Duration retry_max = absl::Seconds(30);
  // How long a pull waits for another pull of the same rank (the engine
  // sets it to its restore_timeout).
  absl::Duration pull_wait = absl::Minutes(30);
  // Applied to the remote copies as well (the engine sets its own).
  RetentionPolicy retention;
  // The ranks this tier copies; null = every rank. A peer tier's tier per
  // peer node copies the jobs placed there (peer_tier.h). Called with the
  // tier's mutex held: it must not block or call back into the tier.
  std::function<bool(const RankKey&)> copies;
};

// The parts of the engine the tier reads and writes; none owned, all
// outliving the tier. `metrics` may be null.
struct RemoteTierDeps {
  Index* index = nullptr;
  LayerStore* store = nullptr;
  LeaseTable* leases = nullptr;
  QuotaTable* quota = nullptr;
  DiskBudget* disk = nullptr;
  LocalHistory* history = nullptr;
  JobOwners* owners = nullptr;
  Metrics* metrics = nullptr;
  Clock* clock = nullptr;
  // The memory tier, or null: a version it still holds goes to a store
  // that PutsFromMemory from there, its file unread (remote_upload.cc).
  VersionSource* images = nullptr;
};

class RemoteTier final : public DurableTier {
 public:
  // REQUIRES: options.store and options.key are not null.
  RemoteTier(RemoteTierOptions options, RemoteTierDeps deps);
  ~RemoteTier() override;
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  const char* name() const override { return options_.name; }
  // Learns every rank the index holds (so WaitDurable finds them all), then
  // starts the uploader.
  void Start() override;
  // After the engine's writers: the uploader stops before its next object.
  void StopAndJoin() override;

  void OnLocalEvents(const RankKey& rank, uid_t owner,
                     absl::Span<const LocalEvent> events) override;
  void OnRewind(const RankKey& rank, uint64_t step) override;
  void ForgetJob(const std::string& job) override;
  absl::StatusOr<uint64_t> WaitDurable(const RankKey& rank, uint64_t step,
                                       absl::Time deadline) override;
  uint64_t DurableStep(const RankKey& rank) override;
  std::set<uint64_t> DurableSteps(const RankKey& rank) override;
  LocalKeep KeepLocally(const RankKey& rank) override;
  // Copies the newest manifest whose objects all read back whole (and,
  // several ranks, those down to the job's agreed step it records) with
  // every version they name (LayerStore::Adopt). A missing or damaged
  // manifest or object makes its step unusable and an older one is tried;
  // nothing of a failed pull stays in the index. Without `must_know`
  // (Register) the tier is skipped at once while its last operation failed.
  absl::Status Pull(const std::string& job, uint32_t rank, const Caller& caller,
                    bool must_know) override;
  absl::StatusOr<uint64_t> NewestListedStep(const std::string& job, uint32_t rank,
                                            bool must_know) override;
  // The version's object, when a manifest or this node's upload vouches
  // for it and its rank's history here is this node's (remote_pull.cc).
  absl::StatusOr<bool> Repair(const VersionKey& key, const store::VersionRecord& rec,
                              uid_t owner) override;
  absl::StatusOr<std::vector<TierJob>> Jobs(const Caller& caller) override;
  absl::StatusOr<std::optional<uid_t>> JobOwner(const std::string& job, bool must_know) override;
  absl::Status ClaimJob(const std::string& job, uid_t owner, bool must_know) override;
  TierReport Report(const Caller& caller) override;
  void CollectMetrics() override;

 private:
  // A version object there.
  struct ObjectCopy {
    uint64_t bytes = 0;
    std::string mac;  // its MAC under the cluster key, as manifests record it
  };
  // What the tier knows of one rank.
  struct RankCopy {
    uid_t owner = 0;
    uint64_t local_step = 0;   // newest local checkpoint event
    uint64_t remote_step = 0;  // newest manifest in the remote tier
    bool seeded = false;       // objects and manifests listed from the store
    // Version objects known whole there: named by a manifest that reads
    // back, or uploaded by this node since (file -> its size and MAC). Names
    // repeat across histories of a rank, so a listed object that no manifest
    // names is never trusted: it is uploaded again (over it) when needed.
    std::map<std::string, ObjectCopy> objects;
    std::set<std::string> stray;  // listed, not trusted; remote GC may delete them
    struct Manifest {
      int64_t unix_ms = 0;
      uint64_t agreed_step = 0;
      std::vector<std::string> files;  // the version objects it names
    };
    std::map<uint64_t, Manifest> manifests;
    std::map<uint64_t, uint64_t> pending;  // local events not uploaded: step -> bytes
    // The rank went back: manifests above this step belong to a discarded
    // history and are deleted before anything is uploaded.
    std::optional<uint64_t> discard_above;
    // Why this node neither uploads nor deletes anything of the rank (empty:
    // it does): the remote tier holds it for another uid, or holds another
    // history of it than this node's (started without restoring from it).
    std::string blocked;
    absl::Time retry_at = absl::InfinitePast();
    absl::Duration backoff = absl::ZeroDuration();
  };
  // One upload turn of a rank: the step, its manifest and the files to send.
  struct Upload {
    store::VersionRecord rec;
    // The version's image in the memory tier, while the tier keeps it (an
    // upload never keeps it there: snapshots may need the room).
    std::weak_ptr<const StagingLease> image;
    UniqueFd fd;      // its file, opened under the rank's lease: sent when the image is gone
    int version = 0;  // its entry in the manifest, which gets its MAC
    std::string mac;  // computed before it is sent
  };
  struct UploadTurn {
    uint64_t step = 0;
    uint64_t newest_local = 0;
    store::RemoteManifest manifest;
    std::vector<Upload> uploads;
  };
  // What a pull found usable and adopted so far (remote_pull.cc).
  struct PullState;
  // A LayerStore fill that reads the object `okey` (`bytes` long) into its
  // file and checks it carries `mac`; `fetched` gets what the store said.
  std::function<absl::StatusOr<uint64_t>(int fd)> FetchObject(const std::string& okey,
                                                              uint64_t bytes,
                                                              const std::string& mac,
                                                              absl::Status* fetched);

  // ---- uploader (remote_upload.cc) ----
  void UploadLoop();
  // The next rank due for a turn, round-robin after `last`; false when none
  // is due (then it waited, bounded, for a change).
  bool NextDue(RankKey* last, uid_t* owner) ABSL_LOCKS_EXCLUDED(mu_);
  // One turn: the rank's oldest local event above its remote step.
  absl::Status UploadNext(const RankKey& key);
  // Lists the rank's objects and manifests when not done yet, and checks
  // that the remote history is this node's.
  absl::Status SeedIfNeeded(const RankKey& key);
  // Before a rank's first upload: the job's owner record names the rank's
  // owner (created when missing); the reason to block it otherwise.
  absl::StatusOr<std::string> CheckOwnerRecord(const RankKey& key, uid_t owner);
  absl::Status Seed(const RankKey& key, RankCopy* out);
  absl::StatusOr<std::string> CheckHistory(const RankKey& key);
  // Deletes the manifests of a discarded history.
  absl::Status DeleteDiscarded(const RankKey& key, uint64_t above);
  // Under the rank's lease: the step to upload, its manifest, and the
  // local files the remote tier lacks, opened. step 0: nothing to do.
  absl::StatusOr<UploadTurn> PlanTurn(const RankKey& key, uid_t owner, uint64_t remote_step,
                                      const std::map<std::string, ObjectCopy>& objects);
  absl::Status UploadObjects(const RankKey& key, UploadTurn* turn);
  // The upload of one version: its file opened, and its image in the
  // memory tier found where the store can send from memory.
  absl::StatusOr<Upload> PrepareUpload(const VersionKey& key, const store::VersionRecord& rec);
  // The manifest last, with a conditional create.
  absl::Status PutManifest(const RankKey& key, uid_t owner, const UploadTurn& turn,
                           const std::string& encoded);
  // Deletes the copies retention no longer keeps (remote_gc.cc).
  absl::Status RemoteGc(const RankKey& key);
  // The rank's back-off after a failed turn (or its reset after a good one).
  void NoteTurn(const RankKey& key, const absl::Status& s);

  // ---- pulls (remote_pull.cc) ----
  absl::Status PullRank(const RankKey& key, const Caller& caller, bool must_know);
  absl::Status AdoptUsable(PullState* pull);
  // Adopts the versions of `m`; true when every object was whole. A missing
  // or damaged object (not what ckptd wrote) ends it with false, or, with
  // `damaged`, is added there as lost and the rest adopted.
  absl::StatusOr<bool> AdoptManifest(
      PullState* pull, const store::RemoteManifest& m,
      std::vector<std::pair<VersionKey, store::LostVersion>>* damaged);
  absl::Status PublishPulled(PullState* pull);
  absl::Status RaiseGenerations(PullState* pull);

  // ---- state (remote_tier.cc) ----
  // Counts and records a failed remote operation; `owner` is the uid whose
  // job it concerns (the error is shown to that uid and root only).
  void NoteFailure(const absl::Status& s, const std::string& what, uid_t owner = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  TierLag LagOf(const uid_t* owner) ABSL_LOCKS_EXCLUDED(mu_);
  // The ranks the index holds, with their newest event and owner.
  void LoadRanks() ABSL_LOCKS_EXCLUDED(mu_);
  // The manifest of (job, rank, step), authenticated and checked to name
  // that step.
  absl::StatusOr<store::RemoteManifest> ReadManifest(const std::string& job, uint32_t rank,
                                                     uint64_t step);
  // UNAVAILABLE while the last remote operation failed (callers that need
  // not wait for the store).
  absl::Status FailingNow() ABSL_LOCKS_EXCLUDED(mu_);
  // The rank's state, or null when the job was deleted meanwhile.
  RankCopy* FindLocked(const RankKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether this tier copies the rank (options_.copies).
  bool CopiesLocked(const RankKey& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++wakeups_; }

  const RemoteTierOptions options_;
  const RemoteTierDeps deps_;
  remote::RemoteStore* const store_;
  const remote::RemoteKey* const key_;

  absl::Mutex mu_;
  // Bumped on new local events, a rewind and stopping: the uploader waits for
  // a change (an absl::Condition, not a CondVar: TSan's view of Debian's
  // uninstrumented absl follows Lock/Unlock/Await only).
  uint64_t wakeups_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<RankKey, RankCopy> ranks_ ABSL_GUARDED_BY(mu_);
  std::set<RankKey> pulling_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  uid_t error_uid_ ABSL_GUARDED_BY(mu_) = 0;  // whose job it concerns
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // mirrors stop_ for the upload workers
  // Jobs' listing of the remote tier, kept for a while (each listing reads
  // every key under jobs/).
  struct JobsCache {
    absl::Time at = absl::InfinitePast();
    std::vector<TierJob> jobs;
  };
  JobsCache jobs_cache_ ABSL_GUARDED_BY(mu_);
  std::thread upload_thread_;
};

}  // namespace ckpt
