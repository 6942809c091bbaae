// The Trainer API against a real ckptd process: bad input gets a clear error,
// nothing is lost, the daemon survives and other jobs are undisturbed.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "ckpt/client.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "daemon/common/sync_point.h"
#include "daemon/policy/layercheck.h"
#include "tests/integration/daemon_process.h"

namespace ckpt {
namespace {

using testing::DaemonProcess;
using testing::MakeTempDir;

// A client with one region holding `layers` f32 layers of `floats` each.
struct TestRank {
  std::unique_ptr<Client> client;
  RankSpec spec;
  float* data = nullptr;
};

TestRank MakeRank(const std::string& socket, const std::string& job, int layers, uint64_t floats,
                  v1::PolicyKind policy = v1::POLICY_ALL,
                  OnDaemonLoss loss = OnDaemonLoss::kError) {
  TestRank r;
  ClientOptions o;
  o.socket_path = socket;
  o.on_daemon_loss = loss;
  // Zero: the first call after ckptd is back re-registers. The interval only
  // spaces out attempts while the daemon is still gone, which no test here
  // measures, and a non-zero one would make the daemon-loss test wait it out.
  o.reconnect_interval = absl::ZeroDuration();
  o.call_timeout = absl::Seconds(5);
  o.wait_timeout = absl::Seconds(20);
  r.client = std::move(Client::Connect(o).value());
  size_t region = r.client->AllocateRegion(layers * floats * 4).value();
  r.data = static_cast<float*>(r.client->RegionData(region));
  r.spec.job_id = job;
  r.spec.policy.set_kind(policy);
  for (int l = 0; l < layers; ++l) {
    LayerDesc ld;
    ld.name = absl::StrCat("layer", l);
    TensorDesc t;
    t.name = absl::StrCat("layer", l, ".w");
    t.shape = {floats};
    t.region = static_cast<uint32_t>(region);
    t.offset = l * floats * 4;
    ld.tensors.push_back(t);
    r.spec.layers.push_back(ld);
  }
  return r;
}

class DaemonApiTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags = {}, std::vector<std::string> env = {}) {
    root_ = MakeTempDir("ckpt-api-");
    ASSERT_FALSE(root_.empty());
    daemon_ = std::make_unique<DaemonProcess>(root_, std::move(flags), std::move(env));
    ASSERT_TRUE(daemon_->Start());
  }
  void TearDown() override {
    daemon_.reset();
    if (!root_.empty()) std::system(("rm -rf " + root_).c_str());
  }
  std::unique_ptr<v1::Trainer::Stub> RawStub() {
    return v1::Trainer::NewStub(
        grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<v1::Admin::Stub> AdminStub() {
    return v1::Admin::NewStub(
        grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
  }
  // Admin.Status works: the daemon is alive and serving.
  void ExpectAlive() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StatusReply reply;
    ASSERT_TRUE(AdminStub()->Status(&ctx, v1::StatusRequest(), &reply).ok());
    ASSERT_TRUE(daemon_->alive());
  }
  void CheckDaemonLossAndRecovery();
  std::string root_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(DaemonApiTest, InvalidJobIdsAreRejected) {
  StartDaemon();
  const std::vector<std::string> bad = {"",
                                        "..",
                                        ".",
                                        "a/b",
                                        "../etc",
                                        std::string(129, 'x'),
                                        "sp ace",
                                        "j\xc3\xb6"
                                        "b",
                                        std::string("nul\0x", 5)};
  for (const std::string& job : bad) {
    TestRank r = MakeRank(daemon_->socket(), job, 2, 256);
    absl::Status s = r.client->Register(r.spec);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << "job of " << job.size() << " bytes: " << s.code();
  }
  ExpectAlive();
}

TEST_F(DaemonApiTest, BadTensorTablesAreRejectedNamingTheTensor) {
  StartDaemon();
  struct Case {
    const char* what;
    std::function<void(RankSpec*)> mutate;
  };
  std::vector<Case> cases = {
      {"outside region", [](RankSpec* s) { s->layers[1].tensors[0].offset = 1 << 30; }},
      {"overlap", [](RankSpec* s) { s->layers[1].tensors[0].offset = 512; }},
      {"zero size", [](RankSpec* s) { s->layers[0].tensors[0].shape = {0}; }},
      {"absurd size", [](RankSpec* s) { s->layers[0].tensors[0].shape = {uint64_t{1} << 50}; }},
      {"bad region", [](RankSpec* s) { s->layers[0].tensors[0].region = 7; }},
      {"no layers", [](RankSpec* s) { s->layers.clear(); }},
      {"rank >= world", [](RankSpec* s) { s->rank = 3; }},
  };
  for (const Case& c : cases) {
    TestRank r = MakeRank(daemon_->socket(), "tables", 2, 1024);
    c.mutate(&r.spec);
    absl::Status s = r.client->Register(r.spec);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.what << ": " << s;
    if (std::string(c.what) == "outside region" || std::string(c.what) == "overlap") {
      EXPECT_NE(s.message().find("layer1.w"), absl::string_view::npos) << s;
    }
  }
  ExpectAlive();
}

TEST_F(DaemonApiTest, UnknownJobsAndEmptyHistoriesAreNotFound) {
  StartDaemon();
  TestRank r = MakeRank(daemon_->socket(), "fresh", 2, 256);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  EXPECT_TRUE(absl::IsNotFound(r.client->Restore().status()));
  EXPECT_TRUE(absl::IsNotFound(r.client->Plan().status()));

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StepDoneRequest req;
  req.set_job_id("nosuchjob");
  req.set_step(1);
  v1::StepDoneReply reply;
  EXPECT_EQ(RawStub()->StepDone(&ctx, req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  ExpectAlive();
}

TEST_F(DaemonApiTest, StaleGenerationIsFailedPrecondition) {
  StartDaemon();
  TestRank a = MakeRank(daemon_->socket(), "gen", 2, 256);
  ASSERT_TRUE(a.client->Register(a.spec).ok());
  const uint64_t old_gen = a.client->generation();
  TestRank b = MakeRank(daemon_->socket(), "gen", 2, 256);
  ASSERT_TRUE(b.client->Register(b.spec).ok());
  EXPECT_GT(b.client->generation(), old_gen);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StepDoneRequest req;
  req.set_job_id("gen");
  req.set_generation(old_gen);
  req.set_step(1);
  v1::StepDoneReply reply;
  EXPECT_EQ(RawStub()->StepDone(&ctx, req, &reply).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // The new registration is unaffected.
  ASSERT_TRUE(b.client->StepDone(1, 0.1).ok());
  EXPECT_EQ(b.client->WaitDurable(1).value(), 1u);
  ExpectAlive();
}

// Found by ckpt_stress: a restarted trainer that restored step t and asks
// whether t is durable (it is: it was restored from it) must hear so, not
// that the step was lost with an earlier registration.
TEST_F(DaemonApiTest, RestoredStepIsReportedDurable) {
  StartDaemon();
  TestRank a = MakeRank(daemon_->socket(), "restored", 2, 256);
  ASSERT_TRUE(a.client->Register(a.spec).ok());
  for (uint64_t t = 1; t <= 3; ++t) {
    if (t > 1) ASSERT_TRUE(a.client->WaitSnapshot(t - 1).ok());
    ASSERT_TRUE(a.client->StepDone(t, 0.1).ok());
  }
  ASSERT_EQ(a.client->WaitDurable(3).value(), 3u);
  TestRank b = MakeRank(daemon_->socket(), "restored", 2, 256);  // the restarted trainer
  ASSERT_TRUE(b.client->Register(b.spec).ok());
  ASSERT_EQ(b.client->Restore(0).value().plan().target_step(), 3u);
  absl::StatusOr<uint64_t> durable = b.client->WaitDurable(3);
  ASSERT_TRUE(durable.ok()) << durable.status();
  EXPECT_EQ(*durable, 3u);
  // A later step goes through the daemon as usual.
  ASSERT_TRUE(b.client->StepDone(4, 0.1).ok());
  EXPECT_EQ(b.client->WaitDurable(4).value(), 4u);
}

TEST_F(DaemonApiTest, OversizedMessagesAndAuxAreRejected) {
  StartDaemon({"--max_message_bytes=1048576", "--max_aux_bytes=65536"});
  TestRank r = MakeRank(daemon_->socket(), "big", 1, 256);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  absl::Status s = r.client->StepDone(1, 0.1, std::string(2 << 20, 'x'));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  s = r.client->StepDone(1, 0.1, std::string(100000, 'x'));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  ASSERT_TRUE(r.client->StepDone(1, 0.1, std::string(1000, 'x')).ok());
  EXPECT_EQ(r.client->WaitDurable(1).value(), 1u);
  ExpectAlive();
}

TEST_F(DaemonApiTest, StepsMustIncrease) {
  StartDaemon();
  TestRank r = MakeRank(daemon_->socket(), "order", 1, 256);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  ASSERT_TRUE(r.client->StepDone(5, 0.1).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(r.client->StepDone(5, 0.1)));
  EXPECT_TRUE(absl::IsFailedPrecondition(r.client->StepDone(3, 0.1)));
  EXPECT_TRUE(absl::IsFailedPrecondition(r.client->WaitSnapshot(9).status()));
  ExpectAlive();
}

TEST_F(DaemonApiTest, LayerLargerThanPoolIsRejected) {
  StartDaemon({"--staging_pool_bytes=2097152"});
  TestRank r = MakeRank(daemon_->socket(), "huge", 1, 1 << 20);  // 4 MiB layer, 2 MiB pool
  absl::Status s = r.client->Register(r.spec);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("staging"), absl::string_view::npos) << s;
  ExpectAlive();
}

// The API's side of a full staging pool (the races with the writers are in
// tests/daemon/engine/engine_snapshot_test.cc): 4 one-chunk layers meet a
// 2-chunk pool while ckptd's only writer is held at its delay point (the
// test releases it by creating a file), so step 1 hands layers 0 and 1 to
// the writer and skips exactly 2 layers. The skip reaches the client,
// WaitDurable and the admin Status, and the retry repairs it.
TEST_F(DaemonApiTest, FullPoolSkipIsReportedThroughTheApi) {
  if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no delay points";
  const std::string hold = MakeTempDir("ckpt-hold-");
  ASSERT_FALSE(hold.empty());
  const std::string release = hold + "/release";
  StartDaemon({"--staging_pool_bytes=2097152", "--admission_timeout_ms=100", "--writer_threads=1"},
              {"CKPT_DELAY_AT=writer.before_commit:60000", "CKPT_DELAY_UNTIL=" + release});
  // 512 KiB layers (1 chunk each); the explicit policy selects layers only at
  // step 1, so step 2 carries just the retries of skipped layers.
  TestRank r = MakeRank(daemon_->socket(), "full", 4, 128 << 10, v1::POLICY_EXPLICIT);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  ASSERT_TRUE(r.client->StepDone(1, 0.1, "", {0, 1, 2, 3}).ok());
  absl::StatusOr<SnapshotInfo> snap = r.client->WaitSnapshot(1);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->layers, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(snap->skipped, 2u);
  ASSERT_EQ(std::system(("touch " + release).c_str()), 0);
  // Not every selected layer became durable at step 1.
  EXPECT_TRUE(absl::IsAborted(r.client->WaitDurable(1).status()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusReply status;
  ASSERT_TRUE(AdminStub()->Status(&ctx, v1::StatusRequest(), &status).ok());
  EXPECT_EQ(status.snapshots_skipped(), 2u);
  // Step 1 is recorded, so its versions were written and the pool is free:
  // the skipped layers are retried at step 2 and fit.
  ASSERT_TRUE(r.client->StepDone(2, 0.1).ok());
  snap = r.client->WaitSnapshot(2);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->layers, (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(r.client->WaitDurable(2).value(), 2u);
  ExpectAlive();
  std::system(("rm -rf " + hold).c_str());
}

// A step larger than the whole staging pool is written whole: the first
// versions go to the writer while the rest wait for the room it gives back
// (the writer is not held here, and the admission timeout is long, so no
// layer may be skipped).
TEST_F(DaemonApiTest, StepLargerThanThePoolIsWrittenWhole) {
  StartDaemon(
      {"--staging_pool_bytes=2097152", "--admission_timeout_ms=60000", "--writer_threads=1"});
  TestRank r = MakeRank(daemon_->socket(), "big_step", 8, 128 << 10);  // 4 MiB a step, 2 MiB pool
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  for (uint64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(r.client->StepDone(step, 0.1).ok());
    absl::StatusOr<SnapshotInfo> snap = r.client->WaitSnapshot(step);
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_EQ(snap->layers, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(snap->skipped, 0u);
    EXPECT_EQ(r.client->WaitDurable(step).value(), step);
  }
  ExpectAlive();
}

TEST_F(DaemonApiTest, BadCallsDoNotDisturbAnotherJob) {
  StartDaemon();
  TestRank good = MakeRank(daemon_->socket(), "good", 3, 4096);
  ASSERT_TRUE(good.client->Register(good.spec).ok());
  std::thread noise([&] {
    for (int i = 0; i < 20; ++i) {
      TestRank bad = MakeRank(daemon_->socket(), i % 2 ? "../bad" : "bad", 2, 256);
      bad.spec.layers[1].tensors[0].offset = 100;  // overlaps layer 0
      EXPECT_FALSE(bad.client->Register(bad.spec).ok());
    }
  });
  for (uint64_t t = 1; t <= 30; ++t) {
    if (t > 1) {
      ASSERT_TRUE(good.client->WaitSnapshot(t - 1).ok());
    }
    for (int i = 0; i < 3 * 4096; ++i) good.data[i] += 1.0f;
    ASSERT_TRUE(good.client->StepDone(t, 0.1).ok());
  }
  noise.join();
  EXPECT_EQ(good.client->WaitDurable(30).value(), 30u);
  ExpectAlive();
}

// A strict rank fails with UNAVAILABLE while ckptd is gone, a lenient one
// trains on unprotected; both re-register by themselves once it is back.
void DaemonApiTest::CheckDaemonLossAndRecovery() {
  TestRank strict = MakeRank(daemon_->socket(), "strict", 1, 256);
  TestRank lenient = MakeRank(daemon_->socket(), "lenient", 1, 256, v1::POLICY_ALL,
                              OnDaemonLoss::kContinueUnprotected);
  ASSERT_TRUE(strict.client->Register(strict.spec).ok());
  ASSERT_TRUE(lenient.client->Register(lenient.spec).ok());
  ASSERT_TRUE(strict.client->StepDone(1, 0.1).ok());
  ASSERT_TRUE(lenient.client->StepDone(1, 0.1).ok());
  ASSERT_EQ(lenient.client->WaitDurable(1).value(), 1u);
  ASSERT_EQ(strict.client->WaitDurable(1).value(), 1u);

  daemon_->Kill();
  EXPECT_TRUE(absl::IsUnavailable(strict.client->StepDone(2, 0.1)));
  EXPECT_TRUE(lenient.client->StepDone(2, 0.1).ok());
  EXPECT_TRUE(lenient.client->unprotected());

  ASSERT_TRUE(daemon_->Start());
  // Both re-register by themselves and are protected again.
  ASSERT_TRUE(lenient.client->StepDone(3, 0.1).ok());
  EXPECT_FALSE(lenient.client->unprotected());
  EXPECT_EQ(lenient.client->WaitDurable(3).value(), 3u);
  ASSERT_TRUE(strict.client->StepDone(3, 0.1).ok());
  EXPECT_EQ(strict.client->WaitDurable(3).value(), 3u);
}

// The drift exchange of multi-rank LayerCheck can be the first call to meet
// a lost ckptd (it runs beside the forward pass): it fails, and a lenient
// rank is unprotected from then on (ckpt.torch then takes part in the
// all-reduce with zeros and trains on). It used to fail without noting the
// loss, so the rank raised and the other ranks waited for it.
TEST_F(DaemonApiTest, DriftExchangeNotesALostDaemon) {
  StartDaemon();
  TestRank lenient = MakeRank(daemon_->socket(), "exchange", 1, 256, v1::POLICY_LAYERCHECK,
                              OnDaemonLoss::kContinueUnprotected);
  lenient.spec.world_size = 2;
  lenient.spec.policy.set_optimizer(v1::OPTIMIZER_CLIENT);
  ASSERT_TRUE(lenient.client->Register(lenient.spec).ok());
  daemon_->Kill();
  EXPECT_FALSE(lenient.client->unprotected());
  EXPECT_FALSE(lenient.client->DriftPartials(1).ok());
  EXPECT_TRUE(lenient.client->unprotected());
  EXPECT_FALSE(lenient.client->SetGlobalDrift(1, {LayerSums{0, 1}}).ok());
  EXPECT_TRUE(lenient.client->unprotected());
}

TEST_F(DaemonApiTest, DaemonLossIsAnErrorOrUnprotectedAndRecovers) {
  StartDaemon();
  CheckDaemonLossAndRecovery();
}

// Regression: the client recognised a restarted ckptd by searching error
// messages for "is not registered"/"is stale". With every message reworded
// (test builds, CKPT_REWORD_ERRORS) the typed reasons alone must do it.
TEST_F(DaemonApiTest, DaemonLossIsRecognisedWhateverTheMessagesSay) {
  StartDaemon({}, {"CKPT_REWORD_ERRORS=1"});
  {
    // The hook is on: a refused call says nothing the client could search.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StepDoneRequest req;
    req.set_job_id("nobody");
    req.set_generation(1);
    req.set_step(1);
    v1::StepDoneReply reply;
    const grpc::Status s = RawStub()->StepDone(&ctx, req, &reply);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), "(message reworded for a test)");
    // The details have google.rpc.Status's shape: code, message, and the
    // reason packed in an Any.
    v1::RpcStatus details;
    ASSERT_TRUE(details.ParseFromString(s.error_details()));
    EXPECT_EQ(details.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
    EXPECT_EQ(details.message(), s.error_message());
    ASSERT_EQ(details.details_size(), 1);
    v1::ErrorInfo info;
    ASSERT_TRUE(details.details(0).UnpackTo(&info));
    EXPECT_EQ(info.reason(), v1::ERROR_REASON_NOT_REGISTERED);
  }
  CheckDaemonLossAndRecovery();
}

TEST_F(DaemonApiTest, SigtermStopsCleanly) {
  StartDaemon();
  TestRank r = MakeRank(daemon_->socket(), "term", 4, 64 << 10);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  for (uint64_t t = 1; t <= 20; ++t) {
    if (t > 1) {
      ASSERT_TRUE(r.client->WaitSnapshot(t - 1).ok());
    }
    ASSERT_TRUE(r.client->StepDone(t, 0.1).ok());
  }
  EXPECT_EQ(daemon_->Stop(), 0);
  ASSERT_TRUE(daemon_->Start());
  TestRank again = MakeRank(daemon_->socket(), "term", 4, 64 << 10);
  absl::Status reg = again.client->Register(again.spec);
  ASSERT_TRUE(reg.ok()) << reg;
  absl::StatusOr<v1::RestoreReply> restored = again.client->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_GE(restored->plan().target_step(), 1u);
  EXPECT_TRUE(restored->plan().complete());
}

// ---- LayerCheck through the daemon ----

TEST_F(DaemonApiTest, LayerCheckRegistrationNeedsAnOptimizerAndItsState) {
  StartDaemon();
  TestRank r = MakeRank(daemon_->socket(), "lc-bad", 2, 256, v1::POLICY_LAYERCHECK);
  absl::Status s = r.client->Register(r.spec);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  r.spec.policy.set_optimizer(v1::OPTIMIZER_ADAMW);  // but no exp_avg / exp_avg_sq tensors
  s = r.client->Register(r.spec);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("layer0.w"), absl::string_view::npos) << s;
  r.spec.policy.set_optimizer(v1::OPTIMIZER_CLIENT);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  // Client mode needs one drift entry per layer.
  Client::StepInfo info;
  info.step = 1;
  info.client_drift = {LayerSums{1, 1}};
  EXPECT_TRUE(absl::IsInvalidArgument(r.client->StepDone(info)));
  ExpectAlive();
}

// Two ranks whose local drift differs decide the same layers at every step,
// because each hands the daemon the all-reduced vector.
TEST_F(DaemonApiTest, RanksAgreeThroughTheGlobalDriftVector) {
  StartDaemon();
  constexpr int kLayers = 4;
  constexpr uint64_t kSteps = 40;
  TestRank ranks[2] = {MakeRank(daemon_->socket(), "mr", kLayers, 256, v1::POLICY_LAYERCHECK),
                       MakeRank(daemon_->socket(), "mr", kLayers, 256, v1::POLICY_LAYERCHECK)};
  for (uint32_t i = 0; i < 2; ++i) {
    ranks[i].spec.rank = i;
    ranks[i].spec.world_size = 2;
    ranks[i].spec.policy.set_optimizer(v1::OPTIMIZER_CLIENT);
    ranks[i].spec.policy.mutable_layercheck()->set_warmup(0);
    ranks[i].spec.policy.mutable_layercheck()->set_s_max(10);
    ASSERT_TRUE(ranks[i].client->Register(ranks[i].spec).ok());
  }
  // In-process all-reduce: both ranks add their vectors, then both read the sum.
  // The finished sum is kept apart from the running one: the rank that
  // completes a round may start the next (and reset `sum`) before the other
  // rank has woken up to read this round's result.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<double> sum, result;
  int arrived = 0, generation = 0;
  auto allreduce = [&](std::vector<double>* v) {
    std::unique_lock<std::mutex> lock(mu);
    const int gen = generation;
    if (arrived == 0) sum.assign(v->size(), 0.0);
    for (size_t i = 0; i < v->size(); ++i) sum[i] += (*v)[i];
    if (++arrived == 2) {
      arrived = 0;
      result = sum;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
    *v = result;
    return absl::OkStatus();
  };
  std::vector<std::vector<uint32_t>> chosen[2];
  auto run = [&](int i) {
    for (uint64_t t = 1; t <= kSteps; ++t) {
      Client::StepInfo info;
      info.step = t;
      info.lr = 1e-3;
      for (int l = 0; l < kLayers; ++l) {
        // Rank 0 sees layer 1 move, rank 1 sees layer 2 move; alone neither
        // crosses K0 = 1e-3 every step, together (dw2 adds up) they do.
        const double d = (l == 1 + i) ? 8e-4 : 1e-5;
        info.client_drift.push_back(LayerSums{d * d, 0.5});
      }
      ASSERT_TRUE(ranks[i].client->StepDone(info).ok());
      ASSERT_TRUE(ranks[i].client->ExchangeDrift(t, allreduce).ok());
      absl::StatusOr<SnapshotInfo> snap = ranks[i].client->WaitSnapshot(t);
      ASSERT_TRUE(snap.ok()) << snap.status();
      chosen[i].push_back(snap->layers);
    }
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  ASSERT_EQ(chosen[0].size(), kSteps);
  EXPECT_EQ(chosen[0], chosen[1]);
  // The daemon's decisions are the policy's pure function of the global
  // vector, and differ from what rank 0's local vector alone would give.
  LayerCheckConfig config;
  config.warmup = 0;
  config.s_max = 10;
  std::vector<LayerKind> kinds(kLayers, LayerKind::kBlock);
  LayerCheckPolicy global(config, kinds), local(config, kinds);
  bool differs = false;
  for (uint64_t t = 1; t <= kSteps; ++t) {
    std::vector<drift::LayerSums> g(kLayers), l0(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      for (int i = 0; i < 2; ++i) {
        const double d = (l == 1 + i) ? 8e-4 : 1e-5;
        g[l].dw2 += d * d;
        g[l].w2 += 0.5;
        if (i == 0) l0[l] = drift::LayerSums{d * d, 0.5};
      }
    }
    std::vector<uint32_t> want, want_local;
    std::vector<LayerDecision> dg = global.Decide(t, 1e-3, g, {});
    std::vector<LayerDecision> dl = local.Decide(t, 1e-3, l0, {});
    for (uint32_t l = 0; l < kLayers; ++l) {
      if (dg[l].reason != PersistReason::kNone) want.push_back(l);
      if (dl[l].reason != PersistReason::kNone) want_local.push_back(l);
    }
    EXPECT_EQ(chosen[0][t - 1], want) << "step " << t;
    differs |= want != want_local;
  }
  EXPECT_TRUE(differs) << "the test's drift should make local and global decisions differ";

  // SetGlobalDrift out of turn is refused.
  EXPECT_TRUE(absl::IsFailedPrecondition(
      ranks[0].client->SetGlobalDrift(kSteps, std::vector<LayerSums>(kLayers))));
  EXPECT_TRUE(absl::IsInvalidArgument(ranks[0].client->SetGlobalDrift(kSteps, {})));
  ExpectAlive();
}

// A data-parallel rank that writes layers no other rank holds (local_drift)
// decides from its own sums with world_size > 1: WaitSnapshot returns without
// any exchange, and the decisions are the policy's function of the rank's
// own vector.
TEST_F(DaemonApiTest, LocalDriftRankDecidesWithoutAnExchange) {
  StartDaemon();
  constexpr int kLayers = 3;
  constexpr uint64_t kSteps = 20;
  TestRank r = MakeRank(daemon_->socket(), "dp", kLayers, 256, v1::POLICY_LAYERCHECK);
  r.spec.rank = 1;
  r.spec.world_size = 4;
  r.spec.policy.set_optimizer(v1::OPTIMIZER_CLIENT);
  r.spec.policy.mutable_layercheck()->set_warmup(0);
  r.spec.policy.mutable_layercheck()->set_s_max(10);
  r.spec.policy.mutable_layercheck()->set_local_drift(true);
  ASSERT_TRUE(r.client->Register(r.spec).ok());
  LayerCheckConfig config;
  config.warmup = 0;
  config.s_max = 10;
  LayerCheckPolicy want_policy(config, std::vector<LayerKind>(kLayers, LayerKind::kBlock));
  for (uint64_t t = 1; t <= kSteps; ++t) {
    Client::StepInfo info;
    info.step = t;
    info.lr = 1e-3;
    std::vector<drift::LayerSums> sums;
    for (int l = 0; l < kLayers; ++l) {
      const double d = l == 1 ? 2e-3 : 1e-5;
      info.client_drift.push_back(LayerSums{d * d, 1.0});
      sums.push_back(drift::LayerSums{d * d, 1.0});
    }
    ASSERT_TRUE(r.client->StepDone(info).ok());
    absl::StatusOr<SnapshotInfo> snap = r.client->WaitSnapshot(t);
    ASSERT_TRUE(snap.ok()) << "step " << t << ": " << snap.status();
    std::vector<uint32_t> want;
    std::vector<LayerDecision> d = want_policy.Decide(t, 1e-3, sums, {});
    for (uint32_t l = 0; l < kLayers; ++l) {
      if (d[l].reason != PersistReason::kNone) want.push_back(l);
    }
    EXPECT_EQ(snap->layers, want) << "step " << t;
  }
  // Nothing waits for global sums, so none are taken.
  EXPECT_TRUE(absl::IsFailedPrecondition(
      r.client->SetGlobalDrift(kSteps, std::vector<LayerSums>(kLayers))));
  ExpectAlive();
}

// The standard health service answers SERVING, and reflection lists our
// services (both driven with raw bytes through a generic stub).
// Found by the fidelity experiment: after a composite restore LayerCheck
// started over (the first step persisted every layer, the reference learning
// rate was the restored step's). The buffers equal each layer's planned
// version, so it must continue from there, with the run's peak learning rate.
TEST_F(DaemonApiTest, LayerCheckContinuesAfterARestore) {
  StartDaemon();
  auto make = [this] {
    TestRank r = MakeRank(daemon_->socket(), "lc-resume", 3, 256);
    r.spec.policy.set_kind(v1::POLICY_LAYERCHECK);
    r.spec.policy.set_optimizer(v1::OPTIMIZER_CLIENT);
    r.spec.policy.mutable_layercheck()->set_warmup(0);
    r.spec.policy.mutable_layercheck()->set_k0(0.5);
    r.spec.policy.mutable_layercheck()->set_s_max(1000);
    return r;
  };
  // A warm-up to a peak of 1e-2 at step 5, then 1e-3: the restarted trainer
  // steps at 1e-3, and its threshold is k0 / 10 only if the peak is kept.
  auto step = [](TestRank& r, uint64_t t) {
    Client::StepInfo info;
    info.step = t;
    info.lr = t <= 5 ? 2e-3 * t : 1e-3;
    info.client_drift.assign(3, LayerSums{1e-6, 1.0});  // d = 1e-3 per step: far below
    return r.client->StepDone(info);
  };
  TestRank a = make();
  ASSERT_TRUE(a.client->Register(a.spec).ok());
  for (uint64_t t = 1; t <= 10; ++t) {
    if (t > 1) ASSERT_TRUE(a.client->WaitSnapshot(t - 1).ok());
    ASSERT_TRUE(step(a, t).ok());
  }
  EXPECT_TRUE(a.client->WaitSnapshot(10).value().layers.empty());
  ASSERT_EQ(a.client->WaitDurable(10).value(), 10u);

  TestRank b = make();  // the restarted trainer
  ASSERT_TRUE(b.client->Register(b.spec).ok());
  ASSERT_EQ(b.client->Restore(0).value().plan().target_step(), 10u);
  ASSERT_TRUE(step(b, 11).ok());
  absl::StatusOr<SnapshotInfo> snap = b.client->WaitSnapshot(11);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_TRUE(snap->layers.empty()) << snap->layers.size() << " layers persisted at step 11";
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::LayersRequest req;
  req.set_job_id("lc-resume");
  v1::LayersReply layers;
  ASSERT_TRUE(AdminStub()->Layers(&ctx, req, &layers).ok());
  for (const v1::LayerInfo& l : layers.layers()) {
    EXPECT_NEAR(l.threshold(), 0.05, 1e-12) << "layer " << l.layer();  // 0.5 * 1e-3 / 1e-2
    EXPECT_EQ(l.last_step(), 1u);
  }
}

TEST_F(DaemonApiTest, HealthAndReflectionAreServed) {
  StartDaemon();
  auto channel =
      grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::ByteBuffer request, response;  // HealthCheckRequest{service: ""} is empty
    grpc::Slice empty("");
    request = grpc::ByteBuffer(&empty, 1);
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    ASSERT_TRUE(status.ok()) << status.error_message();
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& sl : slices)
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::CompletionQueue cq;
    auto step = [&cq] {
      void* tag;
      bool ok = false;
      return cq.Next(&tag, &ok) && ok;
    };
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw = stub.PrepareCall(
        &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
    rw->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(step());
    grpc::Slice list("\x3a\x01*", 3);  // ServerReflectionRequest{list_services: "*"}
    grpc::ByteBuffer request(&list, 1);
    rw->Write(request, reinterpret_cast<void*>(2));
    ASSERT_TRUE(step());
    grpc::ByteBuffer response;
    rw->Read(&response, reinterpret_cast<void*>(3));
    ASSERT_TRUE(step());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& sl : slices)
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    EXPECT_NE(bytes.find("ckpt.v1.Trainer"), std::string::npos);
    EXPECT_NE(bytes.find("ckpt.v1.Admin"), std::string::npos);
    rw->WritesDone(reinterpret_cast<void*>(4));
    step();
    grpc::Status status;
    rw->Finish(&status, reinterpret_cast<void*>(5));
    step();
  }
  ExpectAlive();
}

}  // namespace
}  // namespace ckpt
