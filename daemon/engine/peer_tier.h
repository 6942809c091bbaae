// PeerTier: the peer tier (docs/peer.md) - every durable layer version of
// a job copied to F other nodes' ckptd, placed from the job's topology.
//
// One RemoteTier per peer node (peer_nodes), each over that node's
// PeerStore and with its own uploader threads, copies the jobs placed
// there; this component places each job (peer_placement.h) and answers
// for the tier as a whole:
//   - a step is peer-durable when every node placed for the job holds it
//     (WaitDurable and DurableStep: the least over them);
//   - a pull on a replacement node asks every peer node and starts at the
//     one that lists the newest step (the dead node's peers are not known
//     there; any of them may hold the rank);
//   - a repair takes the first peer node with an intact copy;
//   - owner records go to every peer node (a job's owner is one fact).
// A job's placement comes from its ranks' records in the index (the nodes
// the trainer reported at registration), so a restarted ckptd places it
// as before; a job with no topology is placed on the cluster's ring.
//
// State: the placements, guarded by mu_, a leaf: no child tier is called
// while it is held (the children call `copies` with their own mutex held).
// Thread-safety: thread-safe (DurableTier).
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/engine/durable_tier.h"
#include "daemon/engine/peer_placement.h"
#include "daemon/engine/remote_tier.h"

namespace ckpt {

// A peer node and the transport to its ckptd (not owned).
struct PeerTarget {
  PeerNodeInfo node;
  remote::RemoteStore* store = nullptr;
};

struct PeerTierOptions {
  // What each peer node's RemoteTier gets (threads, back-off, the cluster
  // key, retention); its store, metric label and job filter are set here.
  RemoteTierOptions tier{"peer", TierMetricIds::Peer("")};
  std::string self;       // this node's name
  std::string self_rack;  // "" = unknown
  uint32_t copies = 1;    // F: copies of each version on other nodes
  bool require_other_rack = false;
  std::vector<PeerTarget> peers;  // the cluster's ring, this node left out
};

class PeerTier final : public DurableTier {
 public:
  // REQUIRES: options.peers not empty, each with a store; options.tier.key
  // not null.
  PeerTier(PeerTierOptions options, RemoteTierDeps deps);
  ~PeerTier() override;
  PeerTier(const PeerTier&) = delete;
  PeerTier& operator=(const PeerTier&) = delete;

  const char* name() const override { return "peer"; }
  // Places every job the index holds, then starts each peer node's tier.
  void Start() override;
  void StopAndJoin() override;

  // Places the rank's job from `job_nodes` (a placement that changed is
  // logged; a node no longer placed stops copying the job).
  void OnRegister(const RankKey& rank, const std::vector<std::string>& job_nodes) override;
  void OnLocalEvents(const RankKey& rank, uid_t owner,
                     absl::Span<const LocalEvent> events) override;
  void OnRewind(const RankKey& rank, uint64_t step) override;
  void ForgetJob(const std::string& job) override;
  absl::StatusOr<uint64_t> WaitDurable(const RankKey& rank, uint64_t step,
                                       absl::Time deadline) override;
  uint64_t DurableStep(const RankKey& rank) override;
  std::set<uint64_t> DurableSteps(const RankKey& rank) override;
  LocalKeep KeepLocally(const RankKey& rank) override;
  absl::Status Pull(const std::string& job, uint32_t rank, const Caller& caller,
                    bool must_know) override;
  absl::StatusOr<uint64_t> NewestListedStep(const std::string& job, uint32_t rank,
                                            bool must_know) override;
  absl::StatusOr<bool> Repair(const VersionKey& key, const store::VersionRecord& rec,
                              uid_t owner) override;
  absl::StatusOr<std::vector<TierJob>> Jobs(const Caller& caller) override;
  absl::StatusOr<std::optional<uid_t>> JobOwner(const std::string& job, bool must_know) override;
  absl::Status ClaimJob(const std::string& job, uid_t owner, bool must_know) override;
  TierReport Report(const Caller& caller) override;
  void CollectMetrics() override;

  // The peer nodes `job` is placed on (names), for reports and tests.
  std::vector<std::string> PlacementOf(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Peer {
    PeerNodeInfo node;
    std::unique_ptr<RemoteTier> tier;
  };
  // The peers placed for `job` (placed from the cluster's ring when the job
  // has no placement yet).
  std::vector<RemoteTier*> Placed(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<size_t> PlacedLocked(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<size_t> Place(const std::vector<std::string>& job_nodes) const;
  // Hands `peers` (newly placed for `job`) each rank's newest local event.
  void TellNewest(const std::string& job, const std::vector<size_t>& peers)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether peer `i` copies the rank (each child tier's filter).
  bool Copies(size_t i, const RankKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<DurableTier*> All() const;

  const PeerTierOptions options_;
  const RemoteTierDeps deps_;
  std::vector<std::string> names_;  // "peer <node>": the tiers' names (reserved: never moved)
  std::vector<Peer> peers_;         // set in the constructor, then immutable
  PlacementInput base_;             // the cluster, this node, F

  absl::Mutex mu_;
  std::map<std::string, std::vector<size_t>> placed_ ABSL_GUARDED_BY(mu_);  // job -> peers_
};

}  // namespace ckpt
