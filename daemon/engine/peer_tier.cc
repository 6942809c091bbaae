#include "daemon/engine/peer_tier.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"

namespace ckpt {

PeerTier::PeerTier(PeerTierOptions options, RemoteTierDeps deps)
    : options_(std::move(options)), deps_(deps) {
  base_.self = options_.self;
  base_.self_rack = options_.self_rack;
  base_.copies = options_.copies;
  base_.require_other_rack = options_.require_other_rack;
  peers_.reserve(options_.peers.size());
  names_.reserve(options_.peers.size());  // never moved: the tiers keep c_str()
  for (size_t i = 0; i < options_.peers.size(); ++i) {
    const PeerTarget& t = options_.peers[i];
    base_.cluster.push_back(t.node);
    names_.push_back(absl::StrCat("peer ", t.node.name));
    RemoteTierOptions o = options_.tier;
    o.name = names_.back().c_str();
    o.store = t.store;
    o.metric_ids = TierMetricIds::Peer(t.node.name);
    o.copies = [this, i](const RankKey& key) { return Copies(i, key); };
    peers_.push_back(Peer{t.node, std::make_unique<RemoteTier>(std::move(o), deps_)});
  }
}

PeerTier::~PeerTier() { StopAndJoin(); }

std::vector<size_t> PeerTier::Place(const std::vector<std::string>& job_nodes) const {
  PlacementInput in = base_;
  in.job_nodes = job_nodes;
  return PlacePeers(in);
}

std::vector<size_t> PeerTier::PlacedLocked(const std::string& job) {
  // A job placed at Start or registration has its entry; any other (a job
  // only asked about) is placed on the cluster's ring, not kept.
  auto it = placed_.find(job);
  return it != placed_.end() ? it->second : Place({});
}

std::vector<RemoteTier*> PeerTier::Placed(const std::string& job) {
  std::vector<size_t> idx;
  {
    absl::MutexLock lock(&mu_);
    idx = PlacedLocked(job);
  }
  std::vector<RemoteTier*> out;
  for (size_t i : idx) out.push_back(peers_[i].tier.get());
  return out;
}

std::vector<std::string> PeerTier::PlacementOf(const std::string& job) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (size_t i : PlacedLocked(job)) out.push_back(peers_[i].node.name);
  return out;
}

bool PeerTier::Copies(size_t i, const RankKey& key) {
  absl::MutexLock lock(&mu_);
  const std::vector<size_t> idx = PlacedLocked(key.first);
  return std::find(idx.begin(), idx.end(), i) != idx.end();
}

std::vector<DurableTier*> PeerTier::All() const {
  std::vector<DurableTier*> out;
  for (const Peer& p : peers_) out.push_back(p.tier.get());
  return out;
}

void PeerTier::Start() {
  // Every job's placement from its ranks' records (the nodes the trainer
  // reported), before a child lists the ranks it copies.
  Index* const index = deps_.index;
  absl::StatusOr<std::vector<std::string>> jobs = index->ListJobs();
  for (const std::string& job : jobs.ok() ? *jobs : std::vector<std::string>()) {
    std::vector<std::string> nodes;
    absl::StatusOr<std::vector<uint32_t>> ranks = index->ListRanks(job);
    for (uint32_t rank : ranks.ok() ? *ranks : std::vector<uint32_t>()) {
      absl::StatusOr<std::optional<store::RankRecord>> rec = index->GetRank(job, rank);
      if (rec.ok() && rec->has_value() && (*rec)->job_nodes_size() > 0) {
        nodes.assign((*rec)->job_nodes().begin(), (*rec)->job_nodes().end());
        break;
      }
    }
    std::vector<size_t> idx = Place(nodes);
    absl::MutexLock lock(&mu_);
    placed_[job] = std::move(idx);
  }
  for (Peer& p : peers_) p.tier->Start();
}

void PeerTier::StopAndJoin() {
  for (Peer& p : peers_) p.tier->StopAndJoin();
}

void PeerTier::OnRegister(const RankKey& rank, const std::vector<std::string>& job_nodes) {
  const std::vector<size_t> now = Place(job_nodes);
  std::vector<size_t> before;
  bool known = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = placed_.find(rank.first);
    known = it != placed_.end();
    if (known) before = it->second;
    if (known && before == now) return;
    placed_[rank.first] = now;
  }
  std::vector<std::string> names;
  for (size_t i : now) names.push_back(peers_[i].node.name);
  const std::string from =
      job_nodes.empty()
          ? std::string("the cluster's ring (the trainer named no nodes)")
          : absl::StrCat("the job's nodes (",
                         std::set<std::string>(job_nodes.begin(), job_nodes.end()).size(), " for ",
                         job_nodes.size(), " ranks)");
  if (now.size() < options_.copies) {
    CKPT_LOG(WARNING) << "peer tier: job " << rank.first << " gets " << now.size() << " of "
                      << options_.copies << " copies (on " << absl::StrJoin(names, ", ")
                      << "): peer_nodes offers no more nodes"
                      << (options_.require_other_rack ? " in other racks" : "");
  } else {
    CKPT_LOG(INFO) << "peer tier: job " << rank.first << " replicated to "
                   << absl::StrJoin(names, ", ") << ", placed from " << from;
  }
  // A node no longer placed stops copying the job; its copies there stay.
  for (size_t i : before) {
    if (std::find(now.begin(), now.end(), i) == now.end()) peers_[i].tier->ForgetJob(rank.first);
  }
  // A node newly placed learns the job's ranks now, with their newest
  // steps: it copies what it lacks, and WaitDurable finds the ranks there
  // before the job writes anything more.
  std::vector<size_t> added;
  for (size_t i : now) {
    if (!known || std::find(before.begin(), before.end(), i) == before.end()) added.push_back(i);
  }
  if (!added.empty()) TellNewest(rank.first, added);
}

void PeerTier::TellNewest(const std::string& job, const std::vector<size_t>& peers) {
  ForEachNewestRankEvent(deps_.index, job, [&](uint32_t rank, uid_t owner, uint64_t step) {
    const LocalEvent newest{step, 0};
    for (size_t i : peers) {
      peers_[i].tier->OnLocalEvents(RankKey(job, rank), owner, absl::MakeConstSpan(&newest, 1));
    }
  });
}

void PeerTier::OnLocalEvents(const RankKey& rank, uid_t owner,
                             absl::Span<const LocalEvent> events) {
  for (RemoteTier* t : Placed(rank.first)) t->OnLocalEvents(rank, owner, events);
}

void PeerTier::OnRewind(const RankKey& rank, uint64_t step) {
  for (RemoteTier* t : Placed(rank.first)) t->OnRewind(rank, step);
}

void PeerTier::ForgetJob(const std::string& job) {
  for (Peer& p : peers_) p.tier->ForgetJob(job);
  absl::MutexLock lock(&mu_);
  placed_.erase(job);
}

absl::StatusOr<uint64_t> PeerTier::WaitDurable(const RankKey& rank, uint64_t step,
                                               absl::Time deadline) {
  const std::vector<RemoteTier*> placed = Placed(rank.first);
  if (placed.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", rank.first, " has no peer node to be replicated to: peer_nodes names none ",
        "this node can use", options_.require_other_rack ? " in another rack" : ""));
  }
  // Peer-durable: on every node placed for the job.
  uint64_t least = ~uint64_t{0};
  for (RemoteTier* t : placed) {
    CKPT_ASSIGN_OR_RETURN(uint64_t there, t->WaitDurable(rank, step, deadline));
    least = std::min(least, there);
  }
  return least;
}

uint64_t PeerTier::DurableStep(const RankKey& rank) {
  const std::vector<RemoteTier*> placed = Placed(rank.first);
  if (placed.empty()) return 0;
  uint64_t least = ~uint64_t{0};
  for (RemoteTier* t : placed) least = std::min(least, t->DurableStep(rank));
  return least;
}

std::set<uint64_t> PeerTier::DurableSteps(const RankKey& rank) {
  const std::vector<RemoteTier*> placed = Placed(rank.first);
  std::set<uint64_t> out;
  for (size_t i = 0; i < placed.size(); ++i) {
    std::set<uint64_t> there = placed[i]->DurableSteps(rank);
    if (i == 0) {
      out = std::move(there);
      continue;
    }
    std::set<uint64_t> both;
    std::set_intersection(out.begin(), out.end(), there.begin(), there.end(),
                          std::inserter(both, both.begin()));
    out = std::move(both);
  }
  return out;
}

LocalKeep PeerTier::KeepLocally(const RankKey& rank) {
  const std::vector<RemoteTier*> placed = Placed(rank.first);
  if (placed.empty()) return LocalKeep{~uint64_t{0}, 0};
  LocalKeep keep{~uint64_t{0}, 0};
  for (RemoteTier* t : placed) {
    const LocalKeep k = t->KeepLocally(rank);
    keep.copied_step = std::min(keep.copied_step, k.copied_step);
    keep.max_pending = std::max(keep.max_pending, k.max_pending);
  }
  return keep;
}

absl::Status PeerTier::Pull(const std::string& job, uint32_t rank, const Caller& caller,
                            bool must_know) {
  // Any peer node may hold the rank: those of the node it ran on, which
  // this node does not know. Nodes that are down (the lost one itself,
  // when it is in peer_nodes) are passed over while another answers.
  return PullFromNewest(
      All(), job, rank, caller, must_know,
      [&]() -> absl::StatusOr<bool> {
        CKPT_ASSIGN_OR_RETURN(auto here, deps_.index->EventAtOrBefore(job, rank, ~uint64_t{0}));
        return here.has_value();
      },
      /*any_answer=*/true);
}

absl::StatusOr<uint64_t> PeerTier::NewestListedStep(const std::string& job, uint32_t rank,
                                                    bool must_know) {
  uint64_t newest = 0;
  absl::Status failed;
  size_t answered = 0;
  for (Peer& p : peers_) {
    absl::StatusOr<uint64_t> n = p.tier->NewestListedStep(job, rank, must_know);
    if (!n.ok()) {
      if (failed.ok()) failed = n.status();
      continue;
    }
    ++answered;
    newest = std::max(newest, *n);
  }
  if (answered == 0 && !failed.ok()) return failed;
  return newest;
}

absl::StatusOr<bool> PeerTier::Repair(const VersionKey& key, const store::VersionRecord& rec,
                                      uid_t owner) {
  // The nodes placed for the job first: they hold this node's versions.
  std::vector<RemoteTier*> order = Placed(key.job);
  for (Peer& p : peers_) {
    if (std::find(order.begin(), order.end(), p.tier.get()) == order.end()) {
      order.push_back(p.tier.get());
    }
  }
  absl::Status failed;
  for (RemoteTier* t : order) {
    absl::StatusOr<bool> done = t->Repair(key, rec, owner);
    if (done.ok() && *done) return true;
    if (!done.ok() && failed.ok()) failed = done.status();
  }
  if (!failed.ok()) return failed;
  return false;
}

absl::StatusOr<std::vector<TierJob>> PeerTier::Jobs(const Caller& caller) {
  std::map<std::string, TierJob> merged;
  absl::Status failed;
  size_t answered = 0;
  for (Peer& p : peers_) {
    absl::StatusOr<std::vector<TierJob>> jobs = p.tier->Jobs(caller);
    if (!jobs.ok()) {
      if (failed.ok()) failed = jobs.status();
      continue;
    }
    ++answered;
    for (TierJob& j : *jobs) {
      auto [it, fresh] = merged.emplace(j.job, j);
      if (fresh) continue;
      for (const auto& [r, step] : j.newest_step) {
        uint64_t& mine = it->second.newest_step[r];
        mine = std::max(mine, step);
      }
    }
  }
  if (answered == 0 && !failed.ok()) return failed;
  std::vector<TierJob> out;
  for (auto& [job, j] : merged) out.push_back(std::move(j));
  return out;
}

absl::StatusOr<std::optional<uid_t>> PeerTier::JobOwner(const std::string& job, bool must_know) {
  absl::Status failed;
  for (Peer& p : peers_) {
    absl::StatusOr<std::optional<uid_t>> owner = p.tier->JobOwner(job, must_know);
    if (absl::IsDataLoss(owner.status())) return owner.status();  // never trusted
    if (!owner.ok()) {
      if (failed.ok()) failed = owner.status();
      continue;
    }
    if (owner->has_value()) return owner;
  }
  if (!failed.ok()) return failed;
  return std::optional<uid_t>();
}

absl::Status PeerTier::ClaimJob(const std::string& job, uid_t owner, bool must_know) {
  // On every peer node: a job's owner is one fact wherever its copies go.
  absl::Status failed;
  for (Peer& p : peers_) {
    absl::Status s = p.tier->ClaimJob(job, owner, must_know);
    if (absl::IsPermissionDenied(s)) return s;
    if (!s.ok() && failed.ok()) failed = s;
  }
  return failed;
}

TierReport PeerTier::Report(const Caller& caller) {
  TierReport out;
  std::vector<std::string> names, errors;
  for (Peer& p : peers_) {
    TierReport r = p.tier->Report(caller);
    names.push_back(p.node.rack.empty() ? r.description
                                        : absl::StrCat(r.description, " (rack ", p.node.rack, ")"));
    out.lag.steps = std::max(out.lag.steps, r.lag.steps);
    out.lag.bytes = std::max(out.lag.bytes, r.lag.bytes);
    if (!r.error.empty()) errors.push_back(absl::StrCat(p.node.name, ": ", r.error));
  }
  // Every failing peer node's error: one that is down must not hide another.
  out.error = absl::StrJoin(errors, "; ");
  out.description =
      absl::StrCat(absl::StrJoin(names, ", "), "; ", options_.copies,
                   options_.copies == 1 ? " copy" : " copies", " of each version, placed per job");
  return out;
}

void PeerTier::CollectMetrics() {
  for (Peer& p : peers_) p.tier->CollectMetrics();
}

}  // namespace ckpt
