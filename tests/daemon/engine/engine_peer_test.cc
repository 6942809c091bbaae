// The peer tier under the engine (engine_test_util.h): copies in several
// peer nodes, each a PosixStore in a temp directory behind a FaultyStore,
// placed from the job's topology: F copies on the next nodes of the job's
// ring, peer-durable only when every placed node holds the step, the
// placement kept across a restart, and a replacement node that finds the
// rank on whichever peer holds it.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/replica_store.h"
#include "daemon/remote/faulty_store.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_layout.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

class PeerTierTest : public EnginePipelineTest {
 protected:
  struct Node {
    std::string name, rack;
    std::unique_ptr<TempDir> dir;
    std::unique_ptr<remote::PosixStore> posix;
    std::unique_ptr<remote::FaultyStore> faulty;
  };
  // Nodes n1..n4 (n1, n2 in rack r1; n3, n4 in r2), each a directory.
  void SetUp() override {
    EnginePipelineTest::SetUp();
    for (int i = 1; i <= 4; ++i) {
      Node& n = nodes_.emplace_back();
      n.name = "n" + std::to_string(i);
      n.rack = i <= 2 ? "r1" : "r2";
      n.dir = std::make_unique<TempDir>();
      CKPT_ASSERT_OK_AND_ASSIGN(n.posix, remote::PosixStore::Open(n.dir->path()));
      n.faulty = std::make_unique<remote::FaultyStore>(n.posix.get());
    }
  }
  void TearDown() override {
    EnginePipelineTest::TearDown();  // the engine stops and goes before the stores
    nodes_.clear();
    stores_.clear();
  }
  // The engine of node `self` with F = `copies`; the other nodes are peers.
  EngineOptions On(const std::string& self, uint32_t copies) {
    EngineOptions o = OneWriter();
    o.node_name = self;
    o.peers.self = self;
    o.peers.copies = copies;
    o.peers.tier.key = &key_;
    o.peers.tier.retry_min = absl::Milliseconds(10);
    o.peers.tier.retry_max = absl::Milliseconds(50);
    for (Node& n : nodes_) {
      if (n.name == self) {
        o.peers.self_rack = n.rack;
        continue;
      }
      o.peers.peers.push_back(PeerTarget{PeerNodeInfo{n.name, n.rack}, n.faulty.get()});
    }
    return o;
  }
  Node* NodeNamed(const std::string& name) {
    for (Node& n : nodes_) {
      if (n.name == name) return &n;
    }
    return nullptr;
  }
  // The steps node `name` holds a manifest of for (job, rank 0).
  std::vector<uint64_t> ManifestsAt(const std::string& name, const std::string& job) {
    std::vector<uint64_t> steps;
    absl::StatusOr<std::vector<remote::ObjectInfo>> listed =
        NodeNamed(name)->posix->List(remote::ManifestPrefix(job, 0));
    EXPECT_TRUE(listed.ok()) << listed.status();
    for (const remote::ObjectInfo& o : listed.ok() ? *listed : std::vector<remote::ObjectInfo>()) {
      uint64_t step = 0;
      if (remote::ParseManifestKey(o.key, job, 0, &step)) steps.push_back(step);
    }
    return steps;
  }
  absl::StatusOr<uint64_t> WaitPeer(const TestRank& r, uint64_t step,
                                    absl::Duration timeout = kWait) {
    return engine_->WaitDurable(Ref(r), step, owner_, absl::Now() + timeout, "peer");
  }
  std::vector<std::string> PlacementShown(const std::string& job) {
    absl::StatusOr<v1::JobsReply> jobs = engine_->Jobs(owner_);
    EXPECT_TRUE(jobs.ok()) << jobs.status();
    if (!jobs.ok()) return {};
    for (const v1::JobInfo& j : jobs->jobs()) {
      if (j.job_id() == job) return {j.peer_nodes().begin(), j.peer_nodes().end()};
    }
    return {};
  }

  // A store of the test's own, kept until the engine is gone.
  template <typename S>
  S& Keep(std::unique_ptr<S> store) {
    S& ref = *store;
    stores_.push_back(std::move(store));
    return ref;
  }

  std::vector<Node> nodes_;
  std::vector<std::unique_ptr<remote::RemoteStore>> stores_;
  const remote::RemoteKey key_ = *remote::RemoteKey::FromSecret(std::string(32, 'k'));
};

// The job runs on n1, n3 and n4: n1's copies go to the next nodes of that
// ring (n3, n4), never to n2, which holds nothing of it but its owner
// record; ckptctl jobs shows where the copies go.
TEST_F(PeerTierTest, CopiesGoToTheNextNodesOfTheJobsRing) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 2), /*chunks=*/16));
  TestRank a = MakeRank("ring", 2);
  a.world_size = 3;
  a.job_nodes = {"n1", "n3", "n4"};
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t there, WaitPeer(a, 3));
  EXPECT_EQ(there, 3u);
  EXPECT_FALSE(ManifestsAt("n3", "ring").empty());
  EXPECT_FALSE(ManifestsAt("n4", "ring").empty());
  EXPECT_TRUE(ManifestsAt("n2", "ring").empty());
  EXPECT_EQ(PlacementShown("ring"), (std::vector<std::string>{"n3", "n4"}));
  // Without a topology the cluster's ring decides, racks first: n3 (r2),
  // then n2 (n1's own rack r1) before n4 (r2 holds a copy already).
  TestRank b = MakeRank("plain", 1);
  CKPT_ASSERT_OK(Register(&b).status());
  EXPECT_EQ(PlacementShown("plain"), (std::vector<std::string>{"n3", "n2"}));
}

// A step is peer-durable only once every placed node holds it: one node
// down holds the tier back (and its lag shows), and it catches up after.
TEST_F(PeerTierTest, PeerDurableMeansOnEveryPlacedNode) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 2), /*chunks=*/16));
  TestRank a = MakeRank("both", 2);
  a.world_size = 2;
  // The job's ring gives n2, but it shares n1's rack: the cluster's ring
  // gives n3 (rack r2) first, then n2.
  a.job_nodes = {"n1", "n2"};
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_EQ(PlacementShown("both"), (std::vector<std::string>{"n3", "n2"}));
  NodeNamed("n3")->faulty->set_down(true);
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  absl::StatusOr<uint64_t> held = WaitPeer(a, 2, absl::Milliseconds(300));
  CKPT_EXPECT_CODE(held.status(), kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(held.status().message(), "n3")) << held.status();
  // n2 got it meanwhile; the tier as a whole did not.
  for (absl::Time deadline = absl::Now() + kWait;
       ManifestsAt("n2", "both").empty() && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(5));  // a poll with a deadline
  }
  EXPECT_FALSE(ManifestsAt("n2", "both").empty());
  v1::StatusReply status = engine_->GetStatus(owner_);
  EXPECT_EQ(status.peer_lag_steps(), 2u);
  EXPECT_TRUE(absl::StrContains(status.peer_error(), "n3")) << status.peer_error();
  NodeNamed("n3")->faulty->set_down(false);
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t there, WaitPeer(a, 2));
  EXPECT_EQ(there, 2u);
  EXPECT_FALSE(ManifestsAt("n3", "both").empty());
}

// A restarted ckptd places the job as before (its topology is in the
// index with the rank), and a new registration that names other nodes
// moves the copies there: the new node gets the steps it lacks, the old
// one keeps what it has.
TEST_F(PeerTierTest, PlacementSurvivesARestartAndFollowsTheTopology) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 1), /*chunks=*/16));
  TestRank a = MakeRank("kept", 2);
  a.world_size = 2;
  a.job_nodes = {"n4", "n1"};
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_ASSERT_OK(WaitPeer(a, 1).status());
  engine_->Shutdown(absl::Seconds(10));
  engine_.reset();
  store_.reset();
  index_.reset();
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 1), /*chunks=*/16));
  EXPECT_EQ(PlacementShown("kept"), (std::vector<std::string>{"n4"}));
  a.job_nodes = {"n1", "n3"};
  CKPT_ASSERT_OK(Register(&a).status());
  EXPECT_EQ(PlacementShown("kept"), (std::vector<std::string>{"n3"}));
  // The newly placed node gets the job's newest step before the job writes
  // anything more (it once knew nothing of the rank: ABORTED).
  CKPT_ASSERT_OK(WaitPeer(a, 1).status());
  EXPECT_EQ(ManifestsAt("n3", "kept"), (std::vector<uint64_t>{1}));
  ASSERT_NO_FATAL_FAILURE(Train(a, 2, 2));
  CKPT_ASSERT_OK(WaitPeer(a, 2).status());
  EXPECT_EQ(ManifestsAt("n3", "kept"), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(ManifestsAt("n4", "kept"), (std::vector<uint64_t>{1}));
}

// Node n1 is lost. Its replacement, n2, does not know where n1 placed the
// job: it asks every peer node, pulls from one that holds the rank, and
// restores bit-exact; its own copies then go to its own placement.
TEST_F(PeerTierTest, AReplacementNodeFindsTheRankOnAnyPeer) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 1), /*chunks=*/16));
  TestRank a = MakeRank("lost", 2);
  a.world_size = 2;
  a.job_nodes = {"n1", "n4"};
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  CKPT_ASSERT_OK(WaitPeer(a, 3).status());
  ASSERT_TRUE(ManifestsAt("n2", "lost").empty());
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(On("n2", 1)));
  CKPT_ASSERT_OK_AND_ASSIGN(auto plan, engine_->Plan("lost", 0, 0, owner_));
  EXPECT_EQ(plan.target_step, 3u);
  WriteStep(a, 999);
  a.job_nodes = {"n2", "n4"};
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  EXPECT_TRUE(HoldsStep(a, 3));
  ASSERT_NO_FATAL_FAILURE(Train(a, 4, 4));
  CKPT_ASSERT_OK(WaitPeer(a, 4).status());
}

// A peer node that is down (the lost node itself, when it is listed) does
// not stop the plans of other jobs: a job no node holds is NOT_FOUND, not
// UNAVAILABLE, while another node answers; a job another node holds is
// found there. Only when no peer node answers is the tier's error given.
TEST_F(PeerTierTest, ANodeThatIsDownDoesNotStopPlans) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(On("n1", 1), /*chunks=*/16));
  TestRank a = MakeRank("held", 2);
  a.world_size = 2;
  a.job_nodes = {"n1", "n3"};
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  CKPT_ASSERT_OK(WaitPeer(a, 2).status());
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(On("n2", 1)));
  NodeNamed("n4")->faulty->set_down(true);
  CKPT_EXPECT_CODE(engine_->Plan("nowhere", 0, 0, owner_).status(), kNotFound);
  CKPT_ASSERT_OK_AND_ASSIGN(auto plan, engine_->Plan("held", 0, 0, owner_));
  EXPECT_EQ(plan.target_step, 2u);
  for (const char* n : {"n1", "n3"}) NodeNamed(n)->faulty->set_down(true);
  CKPT_EXPECT_CODE(engine_->Plan("nowhere-either", 0, 0, owner_).status(), kUnavailable);
}

// The peer's replica store as a RemoteStore, in-process: its owner-record
// and quota rules apply. `Replace` swaps in a fresh, empty store, as a peer
// whose disk was lost comes back.
class ReplicaAsStore final : public remote::RemoteStore {
 public:
  explicit ReplicaAsStore(const remote::RemoteKey* key) : key_(key) { Replace(); }
  void Replace() {
    peer::ReplicaStoreOptions o;
    dirs_.push_back(std::make_unique<TempDir>());
    o.dir = dirs_.back()->Join("replicas");
    o.memory_bytes = 0;
    o.key = key_;
    o.charges = &charges_;
    auto fresh = peer::ReplicaStore::Open(o);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    absl::MutexLock lock(&mu_);
    store_ = std::move(*fresh);
  }
  std::string Describe() const override { return "an in-process replica store"; }
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override {
    std::string bytes(size, '\0');
    if (pread(fd, bytes.data(), size, 0) != static_cast<ssize_t>(size)) {
      return absl::DataLossError("short read");
    }
    return Store()->Put("n1", key, bytes, false);
  }
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override {
    return Store()->Put("n1", key, data, if_absent);
  }
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max) override {
    CKPT_ASSIGN_OR_RETURN(std::string bytes, Store()->Get(key, max));
    if (pwrite(fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
      return absl::InternalError("short write");
    }
    return bytes.size();
  }
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max) override {
    return Store()->Get(key, max);
  }
  absl::StatusOr<std::vector<remote::ObjectInfo>> List(const std::string& prefix) override {
    return Store()->List(prefix);
  }
  absl::Status Delete(const std::string& key) override { return Store()->Delete(key); }

 private:
  struct AnyQuota final : peer::ReplicaCharges {
    absl::Status Reserve(uid_t, uint64_t, uint64_t) override { return absl::OkStatus(); }
    void Release(uid_t, uint64_t) override {}
    void Seed(uid_t, uint64_t) override {}
  };
  std::shared_ptr<peer::ReplicaStore> Store() {
    absl::MutexLock lock(&mu_);
    return store_;
  }
  const remote::RemoteKey* const key_;
  AnyQuota charges_;
  std::vector<std::unique_ptr<TempDir>> dirs_;
  absl::Mutex mu_;
  std::shared_ptr<peer::ReplicaStore> store_ ABSL_GUARDED_BY(mu_);
};

// A peer whose replicas were lost (its disk replaced; it refuses what this
// node sends as a job it holds no owner record of): the node lists it
// again, claims the job there and sends what it lacks, instead of failing
// every step from then on.
TEST_F(PeerTierTest, APeerThatLostItsReplicasIsFilledAgain) {
  // Held by the fixture: the engine's destructor still reaches its stores,
  // after this body has returned.
  ReplicaAsStore& peer = Keep(std::make_unique<ReplicaAsStore>(&key_));
  EngineOptions o = On("n1", 1);
  o.peers.peers = {PeerTarget{PeerNodeInfo{"n2", ""}, &peer}};
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("lost-peer", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  CKPT_ASSERT_OK(WaitPeer(a, 2).status());
  ASSERT_NO_FATAL_FAILURE(peer.Replace());
  ASSERT_NO_FATAL_FAILURE(Train(a, 3, 3));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t there, WaitPeer(a, 3));
  EXPECT_EQ(there, 3u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto listed, peer.List(remote::ManifestPrefix("lost-peer", 0)));
  EXPECT_EQ(listed.size(), 3u);  // every step it lacked, sent again, with its versions
  CKPT_ASSERT_OK_AND_ASSIGN(auto objects, peer.List(remote::RankPrefix("lost-peer", 0) + "v/"));
  EXPECT_EQ(objects.size(), 6u);
}

// A peer that takes objects as a peer's PeerStore does, from bytes filled
// in as they are sent (PutsFromMemory), into a node's directory; counts
// which way each version came. `hook` runs after the first piece of each
// filled object, on the uploading thread.
class FilledStore final : public remote::RemoteStore {
 public:
  explicit FilledStore(remote::RemoteStore* base) : base_(base) {}
  static constexpr size_t kPiece = 4096;

  bool PutsFromMemory() const override { return true; }
  absl::Status PutFilledObserved(const std::string& key, uint64_t size, const Filler& fill,
                                 const Observer& observe) override {
    std::string all, piece;
    for (uint64_t off = 0; off < size; off += piece.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, size - off));
      if (absl::Status s = fill(off, n, &piece); !s.ok()) {
        ++failed_;
        return s;
      }
      if (piece.size() != n) return absl::InternalError("a piece of another size");
      CKPT_RETURN_IF_ERROR(observe(piece));
      all += piece;
      if (off == 0) {
        std::function<void(const std::string&)> hook;
        {
          absl::MutexLock lock(&mu_);
          hook = hook_;
        }
        if (hook) hook(key);
      }
    }
    ++filled_;
    {
      absl::MutexLock lock(&mu_);
      stored_.insert(key);
    }
    return base_->PutBytes(key, all, false);
  }
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override {
    ++files_;
    return base_->PutFile(key, fd, size);
  }
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override {
    return base_->PutBytes(key, data, if_absent);
  }
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max) override {
    return base_->GetToFile(key, fd, max);
  }
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max) override {
    return base_->GetBytes(key, max);
  }
  absl::StatusOr<std::vector<remote::ObjectInfo>> List(const std::string& prefix) override {
    return base_->List(prefix);
  }
  absl::Status Delete(const std::string& key) override { return base_->Delete(key); }
  std::string Describe() const override { return "filled " + base_->Describe(); }

  void set_hook(std::function<void(const std::string& key)> hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }
  int filled() const { return filled_.load(); }
  int files() const { return files_.load(); }
  int failed() const { return failed_.load(); }  // fills that failed
  bool stored(const std::string& key) {
    absl::MutexLock lock(&mu_);
    return stored_.count(key) > 0;
  }

 private:
  remote::RemoteStore* const base_;
  std::atomic<int> filled_{0}, files_{0}, failed_{0};
  absl::Mutex mu_;
  std::function<void(const std::string&)> hook_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> stored_ ABSL_GUARDED_BY(mu_);  // filled objects
};

class PeerFromMemoryTest : public PeerTierTest {
 protected:
  // n1's engine with the memory tier on and n2 as its one peer, taking
  // objects through `peer_`; `adjust` changes the options first.
  void Start(const std::function<void(EngineOptions&)>& adjust = nullptr) {
    peer_ = &Keep(std::make_unique<FilledStore>(NodeNamed("n2")->posix.get()));
    EngineOptions o = On("n1", 1);
    o.peers.peers = {PeerTarget{PeerNodeInfo{"n2", "r1"}, peer_}};
    o.memory_tier_bytes = 8 * kChunk;
    o.metrics = &metrics_;
    if (adjust) adjust(o);
    ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  }
  // Rank 0's committed files of `job`, by name, with their bytes.
  std::map<std::string, std::string> LocalFiles(const std::string& job) {
    std::map<std::string, std::string> files;
    for (const auto& f :
         std::filesystem::directory_iterator(tmp_.Join("jobs/" + job + "/rank-00000000"))) {
      files[f.path().filename().string()] = ::ckpt::testing::ReadFile(f.path().string());
    }
    return files;
  }
  // Every file of `files` is on n2, byte for byte.
  void ExpectOnThePeer(const std::string& job, const std::map<std::string, std::string>& files) {
    for (const auto& [name, bytes] : files) {
      absl::StatusOr<std::string> there =
          NodeNamed("n2")->posix->GetBytes(remote::VersionObjectKey(job, 0, name), 1 << 30);
      ASSERT_TRUE(there.ok()) << name << ": " << there.status();
      EXPECT_TRUE(*there == bytes) << name << " differs on the peer";
    }
  }
  // The first filled object's send stops after its first piece
  // (first_piece_) until resume_.
  void PauseTheFirstSend() {
    peer_->set_hook([this](const std::string&) {
      if (paused_.exchange(true)) return;
      first_piece_.Notify();
      resume_.WaitForNotificationWithTimeout(kWait);
    });
  }
  // ckpt_peer_sent_from_memory_bytes_total.
  uint64_t SentFromMemory() {
    const std::string scrape = metrics_.Scrape();
    const std::string name = "\nckpt_peer_sent_from_memory_bytes_total ";
    const size_t at = scrape.find(name);
    EXPECT_NE(at, std::string::npos) << scrape;
    return at == std::string::npos ? 0 : std::stoull(scrape.substr(at + name.size()));
  }
  Metrics metrics_;  // outlives the engine, which TearDown stops first
  absl::Notification first_piece_, resume_;
  std::atomic<bool> paused_{false};
  FilledStore* peer_ = nullptr;
};

// A durable version the memory tier still holds goes to the peer from
// there, its file unread: the files are overwritten in place when the first
// byte is sent (the upload's open descriptors see that), and the peer gets
// the committed bytes, every one of them counted as sent from memory.
TEST_F(PeerFromMemoryTest, AVersionTheMemoryTierHoldsIsSentFromMemory) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::map<std::string, std::string> files;
  absl::Mutex mu;
  bool spoiled = false;
  peer_->set_hook([&](const std::string&) {
    absl::MutexLock lock(&mu);
    if (spoiled) return;
    files = LocalFiles("mem");
    for (const auto& [name, bytes] : files) {
      // Truncated and written again: the same file the upload has open.
      ::ckpt::testing::WriteFile(tmp_.Join("jobs/mem/rank-00000000/" + name),
                                 std::string(bytes.size(), 'z'));
    }
    spoiled = true;
  });
  TestRank a = MakeRank("mem", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_ASSERT_OK(WaitPeer(a, 1).status());
  EXPECT_EQ(peer_->filled(), 2) << "each layer's version through the filler";
  EXPECT_EQ(peer_->files(), 0);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(files.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(ExpectOnThePeer("mem", files));
  uint64_t bytes = 0;
  for (const auto& [name, b] : files) bytes += b.size();
  EXPECT_EQ(SentFromMemory(), bytes);
}

// An image the memory tier lets go while it is being sent (a newer version
// of the layer took its place, and its chunks went back to the pool, where
// they are overwritten) is not read again: the upload held it only while a
// piece was copied, and the rest of the version comes from its file.
TEST_F(PeerFromMemoryTest, AnImageLetGoMidSendIsFinishedFromItsFile) {
  ASSERT_NO_FATAL_FAILURE(Start());
  PauseTheFirstSend();
  TestRank a = MakeRank("evicted", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  ASSERT_TRUE(first_piece_.WaitForNotificationWithTimeout(kWait));
  std::map<std::string, std::string> step1 = LocalFiles("evicted");
  ASSERT_EQ(step1.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(Train(a, 2, 2));
  // Step 2's image took step 1's place, and step 1's chunk is back in the
  // pool: the paused upload does not hold it.
  EXPECT_EQ(pool_->bytes_in_use(), kChunk);
  {
    std::optional<StagingLease> free = pool_->TryAcquire(pool_->budget_bytes() - kChunk);
    ASSERT_TRUE(free.has_value());
    for (size_t i = 0; i < free->chunk_count(); ++i) {
      std::memset(free->chunk(i), 0xa5, free->chunk_bytes());
    }
  }
  resume_.Notify();
  CKPT_ASSERT_OK(WaitPeer(a, 2).status());
  const std::map<std::string, std::string> both = LocalFiles("evicted");
  ASSERT_NO_FATAL_FAILURE(ExpectOnThePeer("evicted", both));
  EXPECT_EQ(peer_->files(), 0);
  // Step 1's first piece from memory, the rest from its file; step 2's
  // version all from memory.
  uint64_t step2 = 0;
  for (const auto& [name, b] : both) step2 += step1.count(name) > 0 ? 0 : b.size();
  EXPECT_EQ(SentFromMemory(), FilledStore::kPiece + step2);
}

// A version sent from memory has its file opened while the rank's lease
// holds it: local GC may delete the file once the lease is gone, while the
// upload waits or sends, and a newer version may take the image's place.
// The upload then finishes from the open file; before, it opened the file
// only then, and failed as a lost local copy (DATA_LOSS), every time the
// uploader caught up on a step retention no longer kept.
TEST_F(PeerFromMemoryTest, AVersionGcDeletesMidSendIsFinishedFromItsOpenFile) {
  ASSERT_NO_FATAL_FAILURE(Start([](EngineOptions& o) {
    o.peers.tier.max_pending_events = 0;  // GC does not wait for the peer
    o.retention.keep_last_events = 1;
    o.retention.keep_every_steps = 0;
  }));
  PauseTheFirstSend();
  TestRank a = MakeRank("gc-mid-send", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  ASSERT_TRUE(first_piece_.WaitForNotificationWithTimeout(kWait));
  const std::map<std::string, std::string> step1 = LocalFiles("gc-mid-send");
  ASSERT_EQ(step1.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(Train(a, 2, 2));  // step 1's image goes
  v1::GcRequest gc;
  gc.set_job_id("gc-mid-send");
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply reply, engine_->Gc(gc, owner_));
  EXPECT_EQ(reply.versions_deleted(), 1u);
  EXPECT_EQ(LocalFiles("gc-mid-send").count(step1.begin()->first), 0u) << "step 1's file is gone";
  resume_.Notify();
  CKPT_ASSERT_OK(WaitPeer(a, 2).status());
  EXPECT_EQ(peer_->failed(), 0);
  EXPECT_TRUE(peer_->stored(remote::VersionObjectKey("gc-mid-send", 0, step1.begin()->first)))
      << "step 1's version reached the peer";
  EXPECT_EQ(peer_->files(), 0);
}

// Without the memory tier, versions go from their files.
TEST_F(PeerTierTest, WithoutTheMemoryTierVersionsGoFromTheirFiles) {
  FilledStore& peer = Keep(std::make_unique<FilledStore>(NodeNamed("n2")->posix.get()));
  EngineOptions o = On("n1", 1);
  o.peers.peers = {PeerTarget{PeerNodeInfo{"n2", "r1"}, &peer}};
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("files", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_ASSERT_OK(WaitPeer(a, 1).status());
  EXPECT_EQ(peer.filled(), 0);
  EXPECT_EQ(peer.files(), 2);
}

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
