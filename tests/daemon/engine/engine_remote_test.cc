// The remote tier under the engine (engine_test_util.h), over a PosixStore
// in a temp directory behind a FaultyStore: a replacement node restoring
// from it, outages, damaged objects, the order of manifests and objects,
// going back, and histories that are not the rank's own.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <ios>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/metrics.h"
#include "daemon/remote/faulty_store.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_layout.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

class RemoteTierTest : public EnginePipelineTest {
 protected:
  void SetUp() override {
    EnginePipelineTest::SetUp();
    CKPT_ASSERT_OK_AND_ASSIGN(posix_, remote::PosixStore::Open(remote_dir_.path()));
    faulty_ = std::make_unique<remote::FaultyStore>(posix_.get());
  }
  void TearDown() override {
    EnginePipelineTest::TearDown();  // the engine stops before the stores go
    peer_.reset();
    peer_posix_.reset();
    faulty_.reset();
    posix_.reset();
  }
  EngineOptions WithRemote() {
    EngineOptions o = OneWriter();
    o.remote.store = faulty_.get();
    o.remote.key = &key_;
    o.remote.retry_min = absl::Milliseconds(10);
    o.remote.retry_max = absl::Milliseconds(50);
    return o;
  }
  absl::StatusOr<uint64_t> WaitRemote(const TestRank& r, uint64_t step,
                                      absl::Duration timeout = kWait) {
    return engine_->WaitDurable(Ref(r), step, owner_, absl::Now() + timeout, "remote");
  }
  // A replacement node with `o`: its plan for `r` names `step`, and `r`
  // (registered holding other bytes) restores that step bit-exact.
  void RestoreOnReplacement(const EngineOptions& o, TestRank* r, uint64_t step) {
    ASSERT_NO_FATAL_FAILURE(ReplaceNode(o));
    CKPT_ASSERT_OK_AND_ASSIGN(auto plan, engine_->Plan(r->job, 0, 0, owner_));
    EXPECT_EQ(plan.target_step, step);
    WriteStep(*r, 999);
    CKPT_ASSERT_OK(Register(r).status());
    CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(*r), 0, owner_));
    EXPECT_EQ(restored.plan.target_step, step);
    EXPECT_TRUE(HoldsStep(*r, step)) << "restored bytes differ from step " << step << "'s";
  }
  TempDir remote_dir_;
  std::unique_ptr<remote::PosixStore> posix_;
  const remote::RemoteKey key_ = *remote::RemoteKey::FromSecret(std::string(32, 'k'));
  std::unique_ptr<remote::FaultyStore> faulty_;
  // A test's peer tier, when it has one (outlives the engine like the rest).
  TempDir peer_dir_;
  std::unique_ptr<remote::PosixStore> peer_posix_;
  std::unique_ptr<remote::RemoteStore> peer_;
};

// Node loss: every step goes to the remote tier; the data directory is
// deleted; a fresh engine on an empty one pulls the job when the rank
// registers and restores the newest remote-durable step bit-exact.
TEST_F(RemoteTierTest, ReplacementNodeRestoresTheNewestRemoteDurableStep) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("lost", 3);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t remote_step, WaitRemote(a, 4));
  EXPECT_EQ(remote_step, 4u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto manifests, posix_->List(remote::ManifestPrefix("lost", 0)));
  EXPECT_FALSE(manifests.empty());

  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  // Another uid neither sees nor pulls it, and leaves nothing behind.
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply others, engine_->Jobs(Caller{2000, 0}));
  EXPECT_EQ(others.jobs_size(), 0);
  CKPT_EXPECT_CODE(engine_->Plan("lost", 0, 0, Caller{2000, 0}).status(), kNotFound);
  CKPT_ASSERT_OK_AND_ASSIGN(auto job_record, index_->GetJob("lost"));
  EXPECT_FALSE(job_record.has_value());
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply jobs_before, engine_->Jobs(owner_));
  ASSERT_EQ(jobs_before.jobs_size(), 1) << "the job is listed from the remote tier";
  EXPECT_EQ(jobs_before.jobs(0).ranks(0).remote_step(), 4u);
  WriteStep(a, 999);  // what a fresh trainer holds
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 4u);
  EXPECT_TRUE(HoldsStep(a, 4)) << "restored bytes differ from step 4's";
  // Training goes on from there and keeps uploading.
  ASSERT_NO_FATAL_FAILURE(Train(a, 5, 6));
  CKPT_ASSERT_OK_AND_ASSIGN(remote_step, WaitRemote(a, 6));
  EXPECT_EQ(remote_step, 6u);
}

// A tier that answers nothing, like a peer lost with the node it served.
class DownStore final : public remote::RemoteStore {
 public:
  std::string Describe() const override { return "down"; }
  absl::Status PutFile(const std::string&, int, uint64_t) override { return Down(); }
  absl::Status PutBytes(const std::string&, std::string_view, bool) override { return Down(); }
  absl::StatusOr<uint64_t> GetToFile(const std::string&, int, uint64_t) override { return Down(); }
  absl::StatusOr<std::string> GetBytes(const std::string&, uint64_t) override { return Down(); }
  absl::StatusOr<std::vector<remote::ObjectInfo>> List(const std::string&) override {
    return Down();
  }
  absl::Status Delete(const std::string&) override { return Down(); }

 private:
  static absl::Status Down() { return absl::UnavailableError("the peer is down"); }
};

// The peer tier is asked first; when it cannot be read, a plan on a
// replacement node comes from the remote tier instead of failing.
TEST_F(RemoteTierTest, APeerThatIsDownLeavesThePullToTheRemoteTier) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("both", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  CKPT_ASSERT_OK(WaitRemote(a, 3).status());
  peer_ = std::make_unique<DownStore>();
  EngineOptions o = WithRemote();
  o.peer.store = peer_.get();
  o.peer.key = &key_;
  ASSERT_NO_FATAL_FAILURE(RestoreOnReplacement(o, &a, 3));
}

// A peer that was down while the job went on is behind the remote tier:
// the replacement node restores the remote tier's newer step (not the
// peer's older one, which would also leave the remote tier refusing this
// node's history), and both tiers go on from there.
TEST_F(RemoteTierTest, APeerBehindTheRemoteTierLeavesThePullToIt) {
  CKPT_ASSERT_OK_AND_ASSIGN(peer_posix_, remote::PosixStore::Open(peer_dir_.path()));
  auto faulty_peer = std::make_unique<remote::FaultyStore>(peer_posix_.get());
  remote::FaultyStore& peer = *faulty_peer;
  peer_ = std::move(faulty_peer);
  EngineOptions o = WithRemote();
  o.peer.store = &peer;
  o.peer.key = &key_;
  o.peer.retry_min = o.remote.retry_min;
  o.peer.retry_max = o.remote.retry_max;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("ahead", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  CKPT_ASSERT_OK(engine_->WaitDurable(Ref(a), 2, owner_, absl::Now() + kWait, "peer").status());
  peer.set_down(true);
  ASSERT_NO_FATAL_FAILURE(Train(a, 3, 4));
  CKPT_ASSERT_OK(WaitRemote(a, 4).status());
  peer.set_down(false);

  ASSERT_NO_FATAL_FAILURE(RestoreOnReplacement(o, &a, 4));
  ASSERT_NO_FATAL_FAILURE(Train(a, 5, 5));
  CKPT_ASSERT_OK(WaitRemote(a, 5).status());
  CKPT_ASSERT_OK(engine_->WaitDurable(Ref(a), 5, owner_, absl::Now() + kWait, "peer").status());
}

// The remote tier down: local checkpoints go on, WaitDurable(remote) times
// out naming the failure, GC keeps the steps not uploaded yet, and every
// step is uploaded once the store is back.
TEST_F(RemoteTierTest, RemoteOutageNeverStopsTrainingAndCatchesUp) {
  EngineOptions o = WithRemote();
  o.retention.keep_last_events = 1;
  o.retention.keep_every_steps = 0;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("outage", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  faulty_->set_down(true);
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 6));
  absl::StatusOr<uint64_t> r = WaitRemote(a, 6, absl::Milliseconds(300));
  CKPT_EXPECT_CODE(r.status(), kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "down")) << r.status();
  v1::GcRequest gc;
  gc.set_job_id("outage");
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply reply, engine_->Gc(gc, owner_));
  EXPECT_EQ(reply.events_deleted(), 0u) << "events not uploaded yet are kept";
  EXPECT_EQ(engine_->GetStatus(owner_).remote_lag_steps(), 6u);
  faulty_->set_down(false);
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t remote_step, WaitRemote(a, 6));
  EXPECT_EQ(remote_step, 6u);
  EXPECT_EQ(engine_->GetStatus(owner_).remote_lag_steps(), 0u);
  // Once uploaded, local retention applies again.
  CKPT_ASSERT_OK_AND_ASSIGN(reply, engine_->Gc(gc, owner_));
  EXPECT_EQ(reply.events_deleted(), 5u);
  // Remote retention too (it runs right after the upload): one manifest is
  // left, and the objects it names.
  std::vector<remote::ObjectInfo> manifests, objects;
  for (absl::Time deadline = absl::Now() + kWait; absl::Now() < deadline;) {
    CKPT_ASSERT_OK_AND_ASSIGN(manifests, posix_->List(remote::ManifestPrefix("outage", 0)));
    CKPT_ASSERT_OK_AND_ASSIGN(objects, posix_->List(remote::RankPrefix("outage", 0) + "v/"));
    if (manifests.size() == 1 && objects.size() == 2) break;
    absl::SleepFor(absl::Milliseconds(5));  // a poll with a deadline
  }
  EXPECT_EQ(manifests.size(), 1u);
  EXPECT_EQ(objects.size(), 2u);
}

// A damaged object is detected on the pull and never served. The newest
// step is pulled all the same, the damaged object's version lost: a restore
// of it is refused (it once gave the older whole step unasked), a restore
// that accepts older versions takes the layer's from the newest whole step
// below, and the older step restores as it was.
TEST_F(RemoteTierTest, DamagedRemoteObjectIsRefusedUnlessOlderIsAsked) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("bitrot", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  CKPT_ASSERT_OK(WaitRemote(a, 3).status());
  // Flip one payload byte of layer 1's version of step 3.
  CKPT_ASSERT_OK_AND_ASSIGN(auto objects, posix_->List(remote::RankPrefix("bitrot", 0) + "v/"));
  std::string victim;
  for (const remote::ObjectInfo& o : objects) {
    if (absl::StrContains(o.key, "L00000001-S0000000000000003-")) victim = o.key;
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(remote_dir_.Join(victim), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8192 + 100);
    f.put('\x7f');
  }
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  CKPT_ASSERT_OK(Register(&a).status());
  absl::StatusOr<Restored> refused = engine_->Restore(Ref(a), 0, owner_);
  EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kLostVersion) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "layer 1 'layer1' lost its version of step 3 (the remote tier's "
                                "object is damaged"))
      << refused.status();
  CKPT_ASSERT_OK_AND_ASSIGN(Restored older,
                            engine_->Restore(Ref(a), 0, owner_, false, /*older_within=*/1));
  EXPECT_EQ(older.plan.target_step, 3u);
  EXPECT_EQ(PlannedSteps(older.plan), (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(older.plan.layers[1].lost_step, 3u);
  // Training goes on, and so do the uploads (the remote step 3 names the
  // damaged object, this node's the previous version: the same history).
  ASSERT_NO_FATAL_FAILURE(Train(a, 4, 4));
  CKPT_ASSERT_OK(WaitRemote(a, 4).status());
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored two, engine_->Restore(Ref(a), 2, owner_));
  EXPECT_TRUE(HoldsStep(a, 2));
}

// A version damaged on disk is taken from the remote tier's copy of that
// same version: the restore gives the newest step whole, not the layers'
// previous versions, and says where they came from; the damaged files are
// kept in quarantine/ and the quota is unchanged.
TEST_F(RemoteTierTest, ADamagedLocalVersionIsReplacedByTheRemoteCopyOfIt) {
  EngineOptions o = WithRemote();
  Metrics metrics;
  o.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("rot", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  CKPT_ASSERT_OK(WaitRemote(a, 2).status());
  const uint64_t used = engine_->quota_usage(owner_.uid).file_bytes;
  const std::vector<store::VersionRecord> recs = DamageTwoLayers("rot", 2);
  ASSERT_EQ(recs.size(), 2u);
  WriteStep(a, 99);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_EQ(PlannedSteps(restored.plan), (std::vector<uint64_t>{2, 2}));
  EXPECT_TRUE(HoldsStep(a, 2)) << "restored bytes differ from step 2's";
  EXPECT_EQ(restored.repaired_from,
            (std::map<uint32_t, std::string>{{0, "remote"}, {1, "remote"}}));
  const std::filesystem::path root(tmp_.path());
  for (const store::VersionRecord& rec : recs) {
    EXPECT_TRUE(std::filesystem::exists(root / "quarantine/rot/rank-00000000" / rec.file()));
    EXPECT_EQ(std::filesystem::file_size(root / "jobs/rot/rank-00000000" / rec.file()),
              rec.file_bytes());
  }
  EXPECT_EQ(engine_->quota_usage(owner_.uid).file_bytes, used);
  const std::string scrape = metrics.Scrape();
  EXPECT_NE(scrape.find("\nckpt_versions_repaired_total{tier=\"remote\"} 2\n"), std::string::npos)
      << scrape;
  EXPECT_EQ(scrape.find("\nckpt_versions_quarantined_total 1"), std::string::npos);
  // The repaired files serve the next restore too, from disk.
  WriteStep(a, 99);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored again, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_TRUE(again.repaired_from.empty());
  EXPECT_TRUE(HoldsStep(a, 2));
}

// When the remote copy of a damaged version is damaged as well, that layer
// falls back to its previous version (never the damaged bytes), and the
// other layer is still repaired.
// With no intact copy of a version anywhere, the restore is refused (it
// once fell back to the layer's previous version unasked); asked to, it
// takes that version and says so per layer.
TEST_F(RemoteTierTest, ADamagedVersionWithADamagedRemoteCopyIsRefusedUnlessOlderIsAsked) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("rot2", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  CKPT_ASSERT_OK(WaitRemote(a, 2).status());
  const std::vector<store::VersionRecord> recs = DamageTwoLayers("rot2", 2);
  ASSERT_EQ(recs.size(), 2u);
  {
    std::fstream f(remote_dir_.Join(remote::VersionObjectKey("rot2", 0, recs[1].file())),
                   std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekp(8192 + 100);
    f.put('\x7f');
  }
  WriteStep(a, 99);
  CKPT_ASSERT_OK(Register(&a).status());
  absl::StatusOr<Restored> refused = engine_->Restore(Ref(a), 0, owner_);
  EXPECT_TRUE(absl::IsDataLoss(refused.status())) << refused.status();
  EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kLostVersion);
  EXPECT_TRUE(
      absl::StrContains(refused.status().message(), "layer 1 'layer1' lost its version of step 2"))
      << refused.status();
  CKPT_ASSERT_OK_AND_ASSIGN(auto v0, index_->VersionAtOrBefore("rot2", 0, 0, 2));
  ASSERT_TRUE(v0.has_value());
  EXPECT_EQ(v0->first, 2u) << "layer 0's remote copy took the damaged file's place";
  CKPT_ASSERT_OK_AND_ASSIGN(auto v1, index_->VersionAtOrBefore("rot2", 0, 1, 2));
  ASSERT_TRUE(v1.has_value());
  EXPECT_EQ(v1->first, 1u) << "the damaged version left the history";
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored,
                            engine_->Restore(Ref(a), 0, owner_, false, /*older_within=*/1));
  EXPECT_EQ(PlannedSteps(restored.plan), (std::vector<uint64_t>{2, 1}));
  EXPECT_EQ(restored.plan.layers[0].lost_step, 0u);
  EXPECT_EQ(restored.plan.layers[1].lost_step, 2u);
}

// A manifest is written only after every version it names.
TEST_F(RemoteTierTest, ManifestFollowsItsObjects) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("order", 3);
  std::atomic<int> puts{0};
  std::atomic<bool> manifest_before_all{false};
  faulty_->set_before_put([&](const std::string& key) {
    if (absl::StrContains(key, "/m/") && puts.load() < 3) manifest_before_all = true;
    if (absl::StrContains(key, "/v/")) ++puts;
  });
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_ASSERT_OK(WaitRemote(a, 1).status());
  EXPECT_FALSE(manifest_before_all.load());
  EXPECT_EQ(puts.load(), 3);
}

// Regression: a rank that went back (a restore discarding later steps) kept
// its higher remote step, so its new steps were never uploaded, WaitDurable
// (remote) answered at once, and a replacement node restored the discarded
// history. Now the manifests above the restored step go first.
TEST_F(RemoteTierTest, GoingBackDeletesTheDiscardedHistoryInTheRemoteTier) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("rewind", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 6));
  CKPT_ASSERT_OK(WaitRemote(a, 6).status());
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(engine_->Restore(Ref(a), 3, owner_, /*discard_later=*/true).status());
  // A new history from step 4 on (other bytes than the first one's).
  ASSERT_NO_FATAL_FAILURE(Train(a, 104, 104));
  absl::StatusOr<uint64_t> early = WaitRemote(a, 4, absl::Milliseconds(1));
  if (early.ok()) {
    EXPECT_NE(*early, 6u) << "the discarded step 6 does not count";
  }
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t remote_step, WaitRemote(a, 104));
  EXPECT_EQ(remote_step, 104u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto manifests, posix_->List(remote::ManifestPrefix("rewind", 0)));
  std::vector<std::string> names;
  for (const auto& m : manifests) names.push_back(m.key.substr(m.key.size() - 4));
  EXPECT_EQ(names, (std::vector<std::string>{"0001", "0002", "0003", "0104"}));
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 104u);
  EXPECT_TRUE(HoldsStep(a, 104));
}

// Regression: going back without registering again keeps the rank's
// generation, so its new steps reuse the file names of the discarded ones;
// the remote tier took those objects as already there and the new
// manifests named the old bytes. Now they are uploaded again, over them.
TEST_F(RemoteTierTest, GoingBackOnTheSameGenerationUploadsTheNewBytes) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("samegen", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 5));
  CKPT_ASSERT_OK(WaitRemote(a, 5).status());
  CKPT_ASSERT_OK(engine_->Restore(Ref(a), 3, owner_, /*discard_later=*/true).status());
  for (uint64_t t = 4; t <= 5; ++t) {  // steps 4 and 5 again, with other bytes
    WriteStep(a, t + 1000);
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
  }
  CKPT_ASSERT_OK(WaitRemote(a, 5).status());
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 5u);
  EXPECT_TRUE(HoldsStep(a, 1005)) << "the bytes of the new step 5, not the discarded one's";
}

// A rank that registered while the remote tier was down and started over
// must not take the remote tier's older history for its own: it uploads
// nothing there and says why.
TEST_F(RemoteTierTest, AnotherHistoryInTheRemoteTierIsNeitherOverwrittenNorTrusted) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("twice", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 6));
  CKPT_ASSERT_OK(WaitRemote(a, 6).status());
  faulty_->set_down(true);
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  CKPT_ASSERT_OK(Register(&a).status());  // could not pull: starts over
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  faulty_->set_down(false);
  absl::StatusOr<uint64_t> r = WaitRemote(a, 2, absl::Seconds(2));
  CKPT_EXPECT_CODE(r.status(), kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(engine_->GetStatus(owner_).remote_error(), "up to step 6"))
      << engine_->GetStatus(owner_).remote_error();
  CKPT_ASSERT_OK_AND_ASSIGN(auto manifests, posix_->List(remote::ManifestPrefix("twice", 0)));
  EXPECT_EQ(manifests.size(), 6u) << "the remote history is untouched";
}

// Regression: with the remote tier down, Register of a new job failed (it
// had to list the remote tier first). Now the job registers and trains; only
// a restore, which must know whether a checkpoint exists there, fails.
TEST_F(RemoteTierTest, RemoteDownNewJobsTrainAndRestoreSaysItCannotTell) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  faulty_->set_down(true);
  TestRank a = MakeRank("fresh", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 2));
  TestRank b = MakeRank("elsewhere", 2);
  CKPT_ASSERT_OK(Register(&b).status());
  CKPT_EXPECT_CODE(engine_->Restore(Ref(b), 0, owner_).status(), kUnavailable);
  faulty_->set_down(false);
  CKPT_EXPECT_CODE(engine_->Restore(Ref(b), 0, owner_).status(), kNotFound);  // truly none
}

// Regression: a pull that failed half-way left the versions it had put in
// the index (without events), charged to the owner's quota and the disk.
TEST_F(RemoteTierTest, AFailedPullLeavesNothingBehind) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("halfway", 3);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_ASSERT_OK(WaitRemote(a, 1).status());
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  auto expect_nothing_left = [&] {
    uint64_t versions = 0;
    CKPT_ASSERT_OK(index_->ForEachVersion("halfway", 0, -1,
                                          [&](const VersionKey&, const store::VersionRecord&) {
                                            ++versions;
                                            return true;
                                          }));
    EXPECT_EQ(versions, 0u);
    EXPECT_EQ(engine_->disk_bytes_used(), 0u);
    EXPECT_EQ(engine_->job_quota_usage("halfway").file_bytes, 0u);
  };
  // The second object of the pull fails: Register goes on without it...
  faulty_->FailGetAfter(1, absl::UnavailableError("the store went away (injected)"));
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(expect_nothing_left());
  // ...and a restore, which must know, says so.
  faulty_->FailGetAfter(1, absl::UnavailableError("the store went away (injected)"));
  CKPT_EXPECT_CODE(engine_->Restore(Ref(a), 0, owner_).status(), kUnavailable);
  ASSERT_NO_FATAL_FAILURE(expect_nothing_left());
  // The store back, the same restore succeeds.
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 1u);
}

TEST_F(RemoteTierTest, WaitForRemoteWithoutARemoteTierIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("plain", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 1));
  CKPT_EXPECT_CODE(WaitRemote(a, 1).status(), kFailedPrecondition);
}

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
