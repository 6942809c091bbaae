// The engine's per-step pipeline in this process, over a real Index,
// LayerStore and StagingPool and host memory in memfd regions: races between
// the trainer's calls and the snapshot and writer threads, each ordered with
// sync points (daemon/common/sync_point.h) at the engine's named points
// ("snapshot.before_publish", "writer.before_commit") rather than with sleeps.
// Where a test waits for a state, it polls it with a deadline; no test
// asserts how long anything took.
#include <fcntl.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "base/region.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/common/clock.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/io/file_system.h"
#include "daemon/remote/faulty_store.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_layout.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "gtest/gtest.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "daemon/metrics/metrics.h"
#include "tests/lib/fault_fs.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::MakeTestPool;
using ::ckpt::testing::TempDir;

constexpr uint64_t kChunk = 64 << 10;
// 32 KiB per layer: header and payload fit one chunk.
constexpr uint64_t kLayerFloats = 8 << 10;
constexpr absl::Duration kWait = absl::Seconds(30);

// Names of the points the tests themselves pass.
constexpr char kReleaseWriter[] = "PipelineTest:release_writer";
constexpr char kFenceAbandoned[] = "PipelineTest:fence_abandoned";

// A trainer rank in this process: one memfd region holding every layer.
struct TestRank {
  std::string job;
  uint32_t layers = 0;
  PolicyKind policy = PolicyKind::kAll;
  MemfdRegion region;
  uint64_t generation = 0;
  std::vector<bool> frozen;  // per layer (may be empty)
};

class EnginePipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
    sp_->StartTest(kWait);
  }

  void TearDown() override {
    if (!kSyncPointsCompiled) return;
    // A miss means a thread gave up waiting at a point: the ordering the test
    // wanted did not happen, whatever its assertions said.
    EXPECT_EQ(sp_->timeouts(), 0u) << "a sync point wait reached its deadline";
    sp_->DisableProcessing();  // releases any thread still parked at a point
    if (engine_ != nullptr) engine_->Shutdown(absl::Seconds(10));
    engine_.reset();
    store_.reset();
    index_.reset();
    pool_.reset();
    sp_->EndTest();
  }

  // Starts an engine over a fresh data directory and a pool of `chunks`
  // chunks of kChunk bytes. `options` gets the data directory, the pwrite
  // backend and one writer unless it sets otherwise.
  void StartEngine(EngineOptions options, size_t chunks, FileSystem* fs = DefaultFileSystem(),
                   rocksdb::Env* index_env = nullptr) {
    pool_ = MakeTestPool(kChunk, chunks);
    ASSERT_NE(pool_, nullptr);
    CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index"), index_env));
    store_ = std::make_unique<LayerStore>(tmp_.path(), fs, index_.get(),
                                          /*use_direct_io=*/false);
    CKPT_ASSERT_OK(store_->Init());
    options.data_dir = tmp_.path();
    options.io_backend = IoBackendKind::kPwrite;
    engine_ = std::make_unique<Engine>(options, index_.get(), store_.get(), pool_.get());
    CKPT_ASSERT_OK(engine_->Start());
  }

  static EngineOptions OneWriter() {
    EngineOptions o;
    o.writer_threads = 1;
    return o;
  }

  // A rank of `layers` f32 layers of kLayerFloats each, in one region.
  static TestRank MakeRank(const std::string& job, uint32_t layers,
                           PolicyKind policy = PolicyKind::kAll) {
    TestRank r;
    r.job = job;
    r.layers = layers;
    r.policy = policy;
    absl::StatusOr<MemfdRegion> region = MemfdRegion::Create(job, layers * kLayerFloats * 4);
    EXPECT_TRUE(region.ok()) << region.status();
    if (region.ok()) r.region = std::move(*region);
    return r;
  }

  static Registration RegistrationOf(const TestRank& r) {
    Registration req;
    req.job = r.job;
    req.world_size = 1;
    req.policy.selection.kind = r.policy;
    for (uint32_t l = 0; l < r.layers; ++l) {
      LayerDesc& layer = req.layers.emplace_back();
      layer.id = l;
      layer.name = absl::StrCat("layer", l);
      layer.frozen = l < r.frozen.size() && r.frozen[l];
      TensorDesc& t = layer.tensors.emplace_back();
      t.name = absl::StrCat("layer", l, ".w");
      t.dtype = DType::kF32;
      t.shape = {kLayerFloats};
      t.nbytes = kLayerFloats * 4;
      t.region = 0;
      t.offset = l * kLayerFloats * 4;
    }
    return req;
  }

  // Registers `r` (handing over a duplicate of its region's fd); on success
  // `r` takes the new generation.
  absl::StatusOr<Registered> Register(TestRank* r, Caller caller = Caller(),
                                      std::optional<uid_t> uid = std::nullopt) {
    std::vector<UniqueFd> fds;
    fds.emplace_back(::fcntl(r->region.fd(), F_DUPFD_CLOEXEC, 0));
    caller.uid = uid.value_or(owner_.uid);
    absl::StatusOr<Registered> reply = engine_->Register(RegistrationOf(*r), std::move(fds), caller);
    if (reply.ok()) r->generation = reply->generation;
    return reply;
  }

  absl::Status StepDone(const TestRank& r, uint64_t step, const std::vector<uint32_t>& layers = {},
                        std::optional<uint64_t> global_durable_step = std::nullopt) {
    StepReport report;
    report.rank = Ref(r);
    report.step = step;
    report.lr = 0.1;
    report.layers = layers;
    report.global_durable_step = global_durable_step;
    return engine_->StepDone(report, owner_);
  }

  // StepDone as `uid` with an aux blob of `aux_bytes`.
  absl::Status StepDoneAs(uid_t uid, const TestRank& r, uint64_t step, size_t aux_bytes,
                          const std::vector<uint32_t>& layers = {}) {
    StepReport report;
    report.rank = Ref(r);
    report.step = step;
    report.lr = 0.1;
    report.layers = layers;
    report.aux.assign(aux_bytes, 'a');
    return engine_->StepDone(report, Caller{uid, 0});
  }

  absl::StatusOr<uint64_t> WaitDurableAs(uid_t uid, const TestRank& r, uint64_t step) {
    return engine_->WaitDurable(Ref(r), step, Caller{uid, 0}, absl::Now() + kWait);
  }

  static RankRef Ref(const TestRank& r) { return RankRef{r.job, 0, r.generation}; }

  absl::StatusOr<SnapshotTaken> WaitSnapshot(const TestRank& r, uint64_t step,
                                             absl::Duration timeout = kWait) {
    return engine_->WaitSnapshot(Ref(r), step, owner_, absl::Now() + timeout);
  }

  absl::StatusOr<uint64_t> WaitDurable(const TestRank& r, uint64_t step) {
    return engine_->WaitDurable(Ref(r), step, owner_, absl::Now() + kWait);
  }

  absl::StatusOr<CompositePlan> Plan(const TestRank& r, uint64_t step) {
    return engine_->Plan(r.job, 0, step, owner_);
  }

  // The steps of the layers in `plan`, by layer.
  static std::vector<uint64_t> PlannedSteps(const CompositePlan& plan) {
    std::vector<uint64_t> steps;
    for (const PlannedLayer& lp : plan.layers) steps.push_back(lp.has_version ? lp.step : 0);
    return steps;
  }

  // The node is lost: the engine stops and its whole data directory goes;
  // a fresh engine starts on an empty one with `options`.
  void ReplaceNode(EngineOptions options) {
    engine_->Shutdown(absl::Seconds(10));
    engine_.reset();
    store_.reset();
    index_.reset();
    std::filesystem::remove_all(tmp_.Join("index"));
    std::filesystem::remove_all(tmp_.Join("jobs"));
    ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
  }

  // Fills every layer of `r` with values derived from `step`.
  static void WriteStep(TestRank& r, uint64_t step) {
    float* p = static_cast<float*>(r.region.data());
    for (uint64_t i = 0; i < r.layers * kLayerFloats; ++i) {
      p[i] = static_cast<float>(step * 1000003 + i);
    }
  }
  static bool HoldsStep(const TestRank& r, uint64_t step) {
    const float* p = static_cast<const float*>(r.region.data());
    for (uint64_t i = 0; i < r.layers * kLayerFloats; ++i) {
      if (p[i] != static_cast<float>(step * 1000003 + i)) return false;
    }
    return true;
  }

  // Three steps of an 8-layer rank (policy all) on a 2-chunk pool: every
  // layer of every step is written, and a restore gives back step 3.
  void WriteStepsLargerThanThePool() {
    TestRank r = MakeRank("big_step", 8);
    CKPT_ASSERT_OK(Register(&r).status());
    for (uint64_t t = 1; t <= 3; ++t) {
      WriteStep(r, t);
      CKPT_ASSERT_OK(StepDone(r, t));
      CKPT_ASSERT_OK_AND_ASSIGN(SnapshotTaken snap, WaitSnapshot(r, t));
      EXPECT_EQ(snap.layers, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7})) << "step " << t;
      EXPECT_EQ(snap.skipped, 0u);
      CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, t));
      EXPECT_EQ(durable, t);
    }
    EXPECT_EQ(engine_->GetStatus().snapshots_skipped(), 0u);
    CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 3));
    EXPECT_TRUE(plan.complete);
    EXPECT_EQ(PlannedSteps(plan), std::vector<uint64_t>(8, 3));
    // What was written is each layer's bytes at step 3.
    WriteStep(r, 99);
    CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(r), 3, owner_));
    EXPECT_EQ(restored.plan.target_step, 3u);
    EXPECT_TRUE(HoldsStep(r, 3));
  }

  SyncPoint* const sp_ = SyncPoint::GetInstance();
  TempDir tmp_;
  std::unique_ptr<rocksdb::Env> index_env_;  // outlives index_ (TearDown resets it first)
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
  std::unique_ptr<Engine> engine_;
  const Caller owner_{1000, 0};
};

// A 2-chunk pool with the writer held: a snapshot of 4 one-chunk layers
// hands its first two to the writer, waits (bounded) for room, skips what
// does not fit and counts it; a skipped layer is selected again at the next
// step, skipped again while the held writer keeps the pool full, and
// persisted once the writer has freed it.
TEST_F(EnginePipelineTest, FullPoolSkipsAndCountsThenRetries) {
  EngineOptions o = OneWriter();
  o.admission_timeout = absl::Milliseconds(50);
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/2));
  // The explicit policy selects layers only when asked, so a step without a
  // list carries just the layers that must be retried.
  TestRank r = MakeRank("full", 4, PolicyKind::kExplicit);
  CKPT_ASSERT_OK(Register(&r).status());

  // Steps 1 and 2 persist every layer once, so that later only a skip can
  // bring a layer back. The writer commits nothing of step 1 until the test
  // says so: layers 0 and 1 take the pool and 2 and 3 find no room.
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  CKPT_ASSERT_OK(StepDone(r, 1, {0, 1, 2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(SnapshotTaken snap, WaitSnapshot(r, 1));
  EXPECT_EQ(snap.layers,
            (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(snap.skipped, 2u);
  EXPECT_EQ(engine_->GetStatus().snapshots_skipped(), 2u);
  CKPT_SYNC_POINT(kReleaseWriter);
  // Not every selected layer became durable at step 1; once step 1 is
  // recorded its chunks are back in the pool.
  CKPT_EXPECT_CODE(WaitDurable(r, 1).status(), kAborted);
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 2));
  EXPECT_EQ(snap.layers,
            (std::vector<uint32_t>{2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);

  // From here the writer commits nothing until the test says so.
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  CKPT_ASSERT_OK(StepDone(r, 3, {0, 1, 2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 3));
  EXPECT_EQ(snap.layers,
            (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(snap.skipped, 2u);
  v1::StatusReply status = engine_->GetStatus();
  EXPECT_EQ(status.snapshots_skipped(), 4u);
  EXPECT_EQ(status.pool_bytes_in_use(), status.pool_bytes()) << "step 3's versions hold the pool";
  const uint64_t committed = status.versions_committed();

  // Step 4 selects the skipped layers again, for no other reason; the pool
  // is still full, so they are skipped again.
  CKPT_ASSERT_OK(StepDone(r, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 4));
  EXPECT_TRUE(snap.layers.empty());
  EXPECT_EQ(snap.skipped, 2u);
  status = engine_->GetStatus();
  EXPECT_EQ(status.snapshots_skipped(), 6u);
  EXPECT_EQ(status.versions_committed(), committed) << "the writer was held";

  CKPT_SYNC_POINT(kReleaseWriter);
  CKPT_EXPECT_CODE(WaitDurable(r, 3).status(), kAborted);
  CKPT_EXPECT_CODE(WaitDurable(r, 4).status(), kAborted);
  EXPECT_EQ(engine_->GetStatus().pool_bytes_in_use(), 0u);
  CKPT_ASSERT_OK(StepDone(r, 5));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 5));
  EXPECT_EQ(snap.layers,
            (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(snap.skipped, 0u);
  CKPT_ASSERT_OK_AND_ASSIGN(durable, WaitDurable(r, 5));
  EXPECT_EQ(durable, 5u);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 5));
  EXPECT_TRUE(plan.complete);
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{3, 3, 5, 5}));
  EXPECT_EQ(engine_->GetStatus().snapshots_skipped(), 6u);
}

// Regression: a step larger than the staging pool was never written whole.
// A snapshot held every version's chunks until it had copied the whole step,
// so with 8 one-chunk layers and a 2-chunk pool the last 6 waited for room
// that only the step's own writes could free, and were skipped at every
// step (WaitDurable: ABORTED, or the fence ran into the trainer's deadline
// with a long admission timeout). Now the versions copied so far go to the
// writers when the pool has no free room, and the snapshot waits for them:
// every step is written whole, however long the admission timeout.
TEST_F(EnginePipelineTest, StepLargerThanThePoolIsWrittenWhole) {
  EngineOptions o = OneWriter();
  o.admission_timeout = kWait;  // a skip would show as a fence past its deadline
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/2));
  ASSERT_NO_FATAL_FAILURE(WriteStepsLargerThanThePool());
}

// The same with a memory tier as large as the pool: every version a writer
// finishes is kept there, so the room the snapshot waits for is the tier's
// to give back. The pool asked the tier for room once, when the wait began,
// and a step still skipped layers at every step.
TEST_F(EnginePipelineTest, StepLargerThanThePoolIsWrittenWholeWithTheMemoryTier) {
  EngineOptions o = OneWriter();
  o.admission_timeout = kWait;
  o.memory_tier_bytes = 2 * kChunk;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/2));
  ASSERT_NO_FATAL_FAILURE(WriteStepsLargerThanThePool());
}

// Regression: a step can be durable before the snapshot worker that took it
// has finished (the worker records the event itself when nothing was left
// to write, and a writer can finish a step's last version first), and a
// Restore in that moment was refused with "steps are still being
// snapshotted", although every reported step was taken. The worker is held
// after step 1 is durable; Restore waits for it instead of failing.
TEST_F(EnginePipelineTest, RestoreWaitsForTheWorkerOfATakenStep) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  constexpr char kRestoreWaiting[] = "PipelineTest:restore_waiting";
  TestRank r = MakeRank("settling", 2, PolicyKind::kExplicit);
  CKPT_ASSERT_OK(Register(&r).status());
  WriteStep(r, 1);
  CKPT_ASSERT_OK(StepDone(r, 1, {0, 1}));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  // Step 1's worker is past the point before the point starts to hold.
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.after_publish", 1, absl::Now() + kWait));
  // Step 2 selects nothing: its snapshot records the event itself, and the
  // worker then stops at the point until Restore is waiting for it.
  sp_->LoadDependency({{kRestoreWaiting, "snapshot.after_publish"}});
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);
  WriteStep(r, 99);
  absl::StatusOr<Restored> restored;
  std::thread restorer([&] { restored = engine_->Restore(Ref(r), 1, owner_); });
  EXPECT_TRUE(sp_->WaitForArrivals("restore.wait_snapshot_idle", 1, absl::Now() + kWait));
  CKPT_SYNC_POINT(kRestoreWaiting);
  restorer.join();
  CKPT_ASSERT_OK(restored.status());
  EXPECT_EQ(restored->plan.target_step, 1u);
  EXPECT_TRUE(HoldsStep(r, 1));
}

// Regression: a snapshot still being copied when its WaitSnapshot gave up
// used to be committed anyway, although the trainer had moved on and could
// have changed the buffers mid-copy. It must be discarded and retried.
TEST_F(EnginePipelineTest, SnapshotFinishingAfterItsFenceWasAbandonedIsDiscarded) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  // Step 1's snapshot is held after its copy until the fence has given up.
  sp_->LoadDependency({{kFenceAbandoned, "snapshot.before_publish"}});
  TestRank r = MakeRank("late", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.before_publish", 1, absl::Now() + kWait));
  CKPT_EXPECT_CODE(WaitSnapshot(r, 1, absl::Milliseconds(50)).status(), kDeadlineExceeded);
  CKPT_SYNC_POINT(kFenceAbandoned);
  // The trainer went on without the fence; step 1's copy must not count.
  CKPT_EXPECT_CODE(WaitDurable(r, 1).status(), kAborted);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 1));
  EXPECT_FALSE(plan.complete);
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{0, 0})) << "nothing of step 1 is durable";
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 0u);
  // The layers are retried at the next step.
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK(WaitSnapshot(r, 2).status());
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);
  CKPT_ASSERT_OK_AND_ASSIGN(plan, Plan(r, 2));
  EXPECT_TRUE(plan.complete);
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{2, 2}));
}

// Regression: Unregister without drain used to forget the rank while its
// staged versions were still being written, so a new registration did not
// wait for them and both wrote the same keys.
TEST_F(EnginePipelineTest, UnregisterWithoutDrainIsDrainedByTheNextRegistration) {
  // A short drain bound: a registration that finds the old one still writing
  // gives up with UNAVAILABLE instead of waiting.
  EngineOptions o = OneWriter();
  o.drain_timeout = absl::Milliseconds(100);
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  TestRank a = MakeRank("undrained", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 3; ++t) {
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitSnapshot(a, t).status());
  }
  CKPT_ASSERT_OK(engine_->Unregister(Ref(a), /*drain=*/false, owner_, absl::Now() + kWait));

  // The 6 staged versions are still unwritten (the writer is held): the new
  // registration must not start over them.
  TestRank b = MakeRank("undrained", 2);
  CKPT_EXPECT_CODE(Register(&b).status(), kUnavailable);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 0u);

  // Once the writer goes on, a registration retried until the old one has
  // drained sees every staged step of it durable.
  CKPT_SYNC_POINT(kReleaseWriter);
  absl::StatusOr<Registered> reg = Register(&b);
  for (const absl::Time deadline = absl::Now() + kWait;
       absl::IsUnavailable(reg.status()) && absl::Now() < deadline;) {
    reg = Register(&b);
  }
  CKPT_ASSERT_OK(reg.status());
  EXPECT_EQ(reg->latest_durable_step, 3u);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 6u);
  CKPT_EXPECT_CODE(StepDone(b, 3), kFailedPrecondition);
  CKPT_EXPECT_OK(StepDone(b, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(b, 4));
  EXPECT_EQ(durable, 4u);
}

// An unregistered rank is forgotten once nothing of it is left to write:
// when it is idle at once, else when its last staged version is written
// (it stayed in the engine's table, and in every walk over it, for good).
TEST_F(EnginePipelineTest, UnregisterWithoutDrainForgetsTheRankOnceItsVersionsAreWritten) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  // The snapshot thread may still be finishing a durable step's snapshot
  // (it forgets the rank then): wait for the count, bounded.
  auto held_becomes = [this](size_t n) {
    for (const absl::Time deadline = absl::Now() + kWait;
         engine_->RanksHeld() != n && absl::Now() < deadline;) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return engine_->RanksHeld();
  };
  TestRank idle = MakeRank("idle", 2);
  CKPT_ASSERT_OK(Register(&idle).status());
  CKPT_ASSERT_OK(StepDone(idle, 1));
  CKPT_ASSERT_OK(WaitSnapshot(idle, 1).status());
  CKPT_ASSERT_OK(WaitDurable(idle, 1).status());
  EXPECT_EQ(engine_->RanksHeld(), 1u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(idle), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(held_becomes(0), 0u);

  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  TestRank busy = MakeRank("busy", 2);
  CKPT_ASSERT_OK(Register(&busy).status());
  CKPT_ASSERT_OK(StepDone(busy, 1));
  CKPT_ASSERT_OK(WaitSnapshot(busy, 1).status());
  CKPT_ASSERT_OK(engine_->Unregister(Ref(busy), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(engine_->RanksHeld(), 1u);  // its 2 versions are held back
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 2u);  // the idle rank's
  CKPT_SYNC_POINT(kReleaseWriter);
  EXPECT_EQ(held_becomes(0), 0u);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 4u);
  // Its step became durable meanwhile: a new registration finds it.
  TestRank again = MakeRank("busy", 2);
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, Register(&again));
  EXPECT_EQ(reg.latest_durable_step, 1u);
}

// Retention by age reads the engine's clock: with the test's clock, events
// age by hours without anyone waiting, and GC keeps exactly what the policy
// says at each moment.
TEST_F(EnginePipelineTest, RetentionByAgeFollowsTheEnginesClock) {
  SimulatedClock clock(absl::FromUnixSeconds(1700000000));
  EngineOptions options = OneWriter();
  options.clock = &clock;
  options.gc_interval = absl::ZeroDuration();  // GC only when asked
  options.retention.keep_last_events = 1;
  options.retention.keep_every_steps = 0;
  options.retention.keep_hours = 1;
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
  TestRank r = MakeRank("aging", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  for (uint64_t t = 1; t <= 3; ++t) {
    CKPT_ASSERT_OK(StepDone(r, t));
    CKPT_ASSERT_OK(WaitSnapshot(r, t).status());
    CKPT_ASSERT_OK(WaitDurable(r, t).status());
  }
  v1::GcRequest gc;
  gc.set_job_id(r.job);
  // Every event is younger than an hour: all three stay restorable.
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply young, engine_->Gc(gc, owner_));
  EXPECT_EQ(young.events_deleted(), 0u);
  EXPECT_EQ(young.versions_deleted(), 0u);
  CKPT_EXPECT_OK(Plan(r, 1).status());

  // Two hours later only the newest event is kept.
  clock.Advance(absl::Hours(2));
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply old, engine_->Gc(gc, owner_));
  EXPECT_EQ(old.events_deleted(), 2u);
  EXPECT_EQ(old.versions_deleted(), 4u);  // steps 1 and 2 of both layers
  CKPT_EXPECT_CODE(Plan(r, 1).status(), kNotFound);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan latest, Plan(r, 3));
  EXPECT_EQ(PlannedSteps(latest), (std::vector<uint64_t>{3, 3}));
}

// A failed fdatasync (on the fault-injecting file system) fails that version
// only: the step is not durable, the layer is retried and the next step is;
// the failure is counted under the reason the commit path tagged it with
// (ErrorReason::kFsync), and the failed sync is never retried.
TEST_F(EnginePipelineTest, FailedSyncFailsTheVersionIsCountedAsFsyncAndIsRetried) {
  ::ckpt::testing::FaultFileSystem fs(DefaultFileSystem(), tmp_.Join("grave"), /*seed=*/7);
  Metrics metrics;
  EngineOptions options = OneWriter();
  options.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16, &fs));
  TestRank r = MakeRank("fsync", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  fs.FailNth(::ckpt::testing::FaultClass::kSync, 1, EIO);  // the next fdatasync fails
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitSnapshot(r, 1).status());
  CKPT_EXPECT_CODE(WaitDurable(r, 1).status(), kAborted);
  const std::string scrape = metrics.Scrape();
  EXPECT_NE(scrape.find("ckpt_errors_total{kind=\"fsync\"} 1"), std::string::npos) << scrape;
  EXPECT_EQ(scrape.find("ckpt_errors_total{kind=\"write\"} 1"), std::string::npos) << scrape;
  EXPECT_EQ(fs.sync_retries_after_failure(), 0u);

  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 2));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{2, 2}));
}

// Regression: during a shutdown (systemctl stop) StepDone was refused as
// UNAVAILABLE, but the fence for that step then failed with
// FAILED_PRECONDITION ("never reported"), which the client does not take for
// the loss of ckptd, so a trainer set to continue unprotected died. Held
// right after the engine starts stopping, every call of the registration
// must carry kShuttingDown.
TEST_F(EnginePipelineTest, EveryCallDuringShutdownSaysShuttingDown) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("stopping", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitSnapshot(r, 1).status());
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());

  constexpr char kChecked[] = "PipelineTest:checked_during_shutdown";
  sp_->LoadDependency({{kChecked, "engine.shutdown.stopping"}});
  std::thread stopper([this] { engine_->Shutdown(absl::Seconds(10)); });
  ASSERT_TRUE(sp_->WaitForArrivals("engine.shutdown.stopping", 1, absl::Now() + kWait));
  auto shutting_down = [](const absl::Status& s) {
    return ReasonOf(s) == ErrorReason::kShuttingDown;
  };
  const absl::Status step = StepDone(r, 2);
  EXPECT_TRUE(absl::IsUnavailable(step) && shutting_down(step)) << step;
  const absl::Status fence = WaitSnapshot(r, 2).status();  // step 2 was never reported
  EXPECT_TRUE(shutting_down(fence)) << fence;
  const absl::Status durable = WaitDurable(r, 1).status();
  EXPECT_TRUE(shutting_down(durable)) << durable;
  CKPT_SYNC_POINT(kChecked);
  stopper.join();
}

// How many mappings of the memfd named `name` this process holds.
int MemfdMappings(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:" + name + " ") != std::string::npos) ++n;
  }
  return n;
}

// Regression: a host trainer that exited stayed registered and its memfd
// regions stayed mapped in ckptd until the rank registered again. The
// registering process is now watched for host ranks too.
TEST_F(EnginePipelineTest, HostMemoryIsReleasedWhenTheTrainerProcessExits) {
  EngineOptions options = OneWriter();
  options.trainer_watch_interval = absl::Milliseconds(10);
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
  TestRank r = MakeRank("exiting", 2);
  const pid_t trainer = ::fork();
  ASSERT_GE(trainer, 0);
  if (trainer == 0) {
    ::pause();  // the "trainer": lives until the test kills it
    ::_exit(0);
  }
  Caller caller;
  caller.pid = trainer;
  CKPT_ASSERT_OK(Register(&r, caller).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  EXPECT_EQ(MemfdMappings("exiting"), 2);  // the test's and the engine's

  ASSERT_EQ(::kill(trainer, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(trainer, &status, 0), trainer);
  const absl::Time deadline = absl::Now() + kWait;
  while (MemfdMappings("exiting") != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // a poll with a deadline
  }
  EXPECT_EQ(MemfdMappings("exiting"), 1) << "the engine still maps the exited trainer's region";
  const absl::Status s = StepDone(r, 2);
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("trainer process exited"), std::string::npos) << s;
  // What was durable before the exit stays restorable.
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 1));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{1, 1}));
}

// Regression: a failed registration still created the job, so the first uid
// to use an id owned it forever even when its registration was refused
// (job-id squatting).
TEST_F(EnginePipelineTest, ARefusedRegistrationCreatesNoJob) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("contested", 2, PolicyKind::kLayerCheck);  // no optimizer: refused
  const absl::Status refused = Register(&r).status();
  CKPT_ASSERT_CODE(refused, kInvalidArgument);
  Caller root;
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply jobs, engine_->Jobs(root));
  EXPECT_EQ(jobs.jobs_size(), 0);
  // Another user can now take the id.
  Caller other;
  other.uid = owner_.uid + 1;
  TestRank mine = MakeRank("contested", 2);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::fcntl(mine.region.fd(), F_DUPFD_CLOEXEC, 0));
  CKPT_ASSERT_OK(engine_->Register(RegistrationOf(mine), std::move(fds), other).status());
  CKPT_ASSERT_OK_AND_ASSIGN(jobs, engine_->Jobs(root));
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).owner_uid(), other.uid);
  // And the first user is now refused.
  CKPT_EXPECT_CODE(Register(&r).status(), kPermissionDenied);
}

// Another user's job must read exactly like a job that does not exist:
// NOT_FOUND with the same words, for the admin queries and the per-step
// calls alike, so no uid learns which job ids are in use.
TEST_F(EnginePipelineTest, AnotherUsersJobReadsLikeAMissingOne) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("hidden", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  const Caller other{owner_.uid + 1, 0};
  auto words = [](const absl::Status& s, const std::string& job) {
    std::string m(s.message());
    const size_t at = m.find(job);
    if (at != std::string::npos) m.replace(at, job.size(), "JOB");
    return m;
  };
  const absl::Status theirs = engine_->Plan("hidden", 0, 0, other).status();
  const absl::Status missing = engine_->Plan("nosuchjob", 0, 0, other).status();
  CKPT_EXPECT_CODE(theirs, kNotFound);
  CKPT_EXPECT_CODE(missing, kNotFound);
  EXPECT_EQ(words(theirs, "hidden"), words(missing, "nosuchjob"));
  CKPT_EXPECT_CODE(engine_->DeleteJob("hidden", other).status(), kNotFound);
  CKPT_EXPECT_CODE(engine_->ReleaseRank("hidden", 0, other).status(), kNotFound);
  StepReport report;
  report.rank = Ref(r);
  report.step = 2;
  const absl::Status step = engine_->StepDone(report, other);
  CKPT_EXPECT_CODE(step, kNotFound);
  EXPECT_EQ(ReasonOf(step), ErrorReason::kNotRegistered);
  // Status counts only the caller's own jobs and trainers.
  EXPECT_EQ(engine_->GetStatus(other).jobs(), 0u);
  EXPECT_EQ(engine_->GetStatus(other).registered_ranks(), 0u);
  EXPECT_EQ(engine_->GetStatus(owner_).jobs(), 1u);
  EXPECT_EQ(engine_->GetStatus(owner_).registered_ranks(), 1u);
  EXPECT_EQ(engine_->GetStatus(Caller{0, 0}).jobs(), 1u);  // root: every job
  // The owner still sees it all.
  CKPT_EXPECT_OK(engine_->Plan("hidden", 0, 0, owner_).status());
}

// Regression: registrations had no per-uid bound, so one user could map
// memory and hold descriptors for any number of ranks. The cap counts the
// user's live registrations; re-registering a rank replaces it, and other
// users are unaffected.
TEST_F(EnginePipelineTest, RegistrationsPerUidAreCapped) {
  EngineOptions o = OneWriter();
  o.max_registrations_per_uid = 2;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("cap-a", 1), b = MakeRank("cap-b", 1), c = MakeRank("cap-c", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(Register(&b).status());
  const absl::Status third = Register(&c).status();
  CKPT_EXPECT_CODE(third, kResourceExhausted);
  EXPECT_EQ(ReasonOf(third), ErrorReason::kQuota);
  EXPECT_NE(std::string(third.message()).find("max_registrations_per_uid"), std::string::npos);
  CKPT_EXPECT_OK(Register(&a).status());  // the same rank again: not a third
  // Another user registers under its own bound.
  const Caller other{owner_.uid + 1, 0};
  TestRank theirs = MakeRank("cap-other", 1);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::fcntl(theirs.region.fd(), F_DUPFD_CLOEXEC, 0));
  CKPT_EXPECT_OK(engine_->Register(RegistrationOf(theirs), std::move(fds), other).status());
  // Released, a slot comes back.
  CKPT_ASSERT_OK(engine_->ReleaseRank("cap-b", 0, owner_).status());
  CKPT_EXPECT_OK(Register(&c).status());
}

// ReleaseRank ends a registration without its generation (an operator's
// `ckptctl release`): what was staged is written first, later calls of the
// registration find it gone, and it can be released only once.
TEST_F(EnginePipelineTest, ReleaseRankEndsTheRegistrationAfterItsStagedVersions) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("released", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  // The writer holds step 1 (staged, not yet committed) until the release
  // has ended the registration and is draining it.
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"},
                       {"engine.release_rank.drain", kReleaseWriter}});
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitSnapshot(r, 1).status());
  absl::StatusOr<uint64_t> gen;
  std::thread release([&] { gen = engine_->ReleaseRank("released", 0, owner_); });
  CKPT_SYNC_POINT(kReleaseWriter);
  release.join();
  sp_->LoadDependency({});
  CKPT_ASSERT_OK(gen.status());
  EXPECT_EQ(*gen, r.generation);
  // Step 1 was written before the registration ended.
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 1));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{1, 1}));
  const absl::Status gone = StepDone(r, 2);
  CKPT_EXPECT_CODE(gone, kNotFound);
  EXPECT_EQ(ReasonOf(gone), ErrorReason::kNotRegistered);
  CKPT_EXPECT_CODE(engine_->ReleaseRank("released", 0, owner_).status(), kNotFound);
  Caller root;
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply jobs, engine_->Jobs(root));
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_FALSE(jobs.jobs(0).ranks(0).registered());
  // The trainer registers again and goes on.
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK(WaitDurable(r, 2).status());
}

// DeleteJob removes every version file, event and record of the job and
// frees its id; it refuses while a trainer holds a rank.
TEST_F(EnginePipelineTest, DeleteJobRemovesTheWholeHistoryAndFreesTheId) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("doomed", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  for (uint64_t step = 1; step <= 3; ++step) CKPT_ASSERT_OK(StepDone(r, step));
  CKPT_ASSERT_OK(WaitDurable(r, 3).status());
  CKPT_EXPECT_CODE(engine_->DeleteJob("doomed", owner_).status(), kFailedPrecondition);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(r), /*drain=*/true, owner_, absl::Now() + kWait));
  const std::string rank_dir = store_->RankDirPath("doomed", 0);
  ASSERT_TRUE(std::filesystem::exists(rank_dir));
  const uint64_t disk_before = engine_->disk_bytes_used();
  ASSERT_GT(engine_->quota_usage(owner_.uid).file_bytes, 0u);
  CKPT_ASSERT_OK_AND_ASSIGN(JobDeleted deleted, engine_->DeleteJob("doomed", owner_));
  // Everything the job held is given back to its owner's quota.
  EXPECT_EQ(engine_->quota_usage(owner_.uid).file_bytes, 0u);
  EXPECT_EQ(engine_->quota_usage(owner_.uid).index_bytes, 0u);
  EXPECT_EQ(deleted.ranks, 1u);
  EXPECT_EQ(deleted.versions, 6u);  // 2 layers x 3 steps
  EXPECT_EQ(deleted.events, 3u);
  EXPECT_EQ(engine_->disk_bytes_used(), disk_before - deleted.bytes);
  EXPECT_FALSE(std::filesystem::exists(rank_dir));
  EXPECT_FALSE(std::filesystem::exists(tmp_.Join("jobs/doomed")));
  CKPT_EXPECT_CODE(Plan(r, 0).status(), kNotFound);
  CKPT_ASSERT_OK_AND_ASSIGN(std::optional<store::JobRecord> rec, index_->GetJob("doomed"));
  EXPECT_FALSE(rec.has_value());
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> ranks, index_->ListRanks("doomed"));
  EXPECT_TRUE(ranks.empty());
  // The id is free: another user takes it, with no history.
  const Caller other{owner_.uid + 1, 0};
  TestRank theirs = MakeRank("doomed", 2);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::fcntl(theirs.region.fd(), F_DUPFD_CLOEXEC, 0));
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg,
                            engine_->Register(RegistrationOf(theirs), std::move(fds), other));
  EXPECT_EQ(reg.latest_durable_step, 0u);
}

// The owner's quotas in force for this test: what a uid's usage reached.
bool IsQuota(const absl::Status& s, absl::string_view option) {
  return absl::IsResourceExhausted(s) && ReasonOf(s) == ErrorReason::kQuota &&
         absl::StrContains(s.message(), option);
}

constexpr uid_t kUidA = 2001;
constexpr uid_t kUidB = 2002;

// Regression: aux blobs went into the index with no bound, so one user could
// grow it without limit. Uid A floods 16 KiB aux blobs against an index quota
// of four steps' records: its fifth step is refused with RESOURCE_EXHAUSTED
// (kQuota, naming max_index_bytes_per_uid) and nothing of it is written;
// uid B, under the same quota, keeps every step durable meanwhile.
TEST_F(EnginePipelineTest, IndexQuotaOfOneUidLeavesAnotherUidsStepsDurable) {
  constexpr size_t kAux = 16 << 10;
  constexpr uint64_t kPerStep = kAux + kEventIndexOverhead + kVersionIndexBytes;  // 1 layer
  EngineOptions o = OneWriter();
  o.max_index_bytes_per_uid = 4 * kPerStep;
  o.max_disk_bytes_per_uid = uint64_t{1} << 40;
  Metrics metrics;
  o.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("flood", 1);
  TestRank b = MakeRank("victim", 1);
  CKPT_ASSERT_OK(Register(&a, Caller(), kUidA).status());
  CKPT_ASSERT_OK(Register(&b, Caller(), kUidB).status());
  for (uint64_t t = 1; t <= 4; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidA, a, t, kAux));
    CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidA, a, t));
    EXPECT_EQ(durable, t);
  }
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, 4 * kPerStep);
  const absl::Status refused = StepDoneAs(kUidA, a, 5, kAux);
  EXPECT_TRUE(IsQuota(refused, "max_index_bytes_per_uid")) << refused;
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, 4 * kPerStep) << "nothing was charged";
  // A small aux blob does not fit either: the quota is full.
  EXPECT_TRUE(IsQuota(StepDoneAs(kUidA, a, 5, 0), "max_index_bytes_per_uid"));

  for (uint64_t t = 1; t <= 4; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidB, b, t, kAux));
    CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidB, b, t));
    EXPECT_EQ(durable, t) << "uid B's step " << t;
  }
  CKPT_ASSERT_OK_AND_ASSIGN(auto last_a, index_->EventAtOrBefore("flood", 0, ~uint64_t{0}));
  ASSERT_TRUE(last_a.has_value());
  EXPECT_EQ(last_a->first, 4u) << "uid A's index holds four events";
  CKPT_ASSERT_OK_AND_ASSIGN(auto last_b, index_->EventAtOrBefore("victim", 0, ~uint64_t{0}));
  ASSERT_TRUE(last_b.has_value());
  EXPECT_EQ(last_b->first, 4u);
  const std::string scrape = (engine_->CollectMetrics(), metrics.Scrape());
  EXPECT_NE(scrape.find("ckpt_quota_refused_total{kind=\"index\"} 2"), std::string::npos) << scrape;
  EXPECT_NE(scrape.find(absl::StrCat("ckpt_uid_index_limit_bytes ", 4 * kPerStep)),
            std::string::npos) << scrape;
}

// The disk quota counts layer files too: uid A's third version passes it and
// fails with kQuota (the previous version stays, the step is not durable),
// while uid B's versions under the same quota are all written.
TEST_F(EnginePipelineTest, DiskQuotaFailsOnlyThatUsersVersions) {
  EngineOptions o = OneWriter();
  o.max_disk_bytes_per_uid = 100 << 10;  // two 1-layer steps of ~34 KiB, not three
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("big", 1);
  TestRank b = MakeRank("small", 1);
  CKPT_ASSERT_OK(Register(&a, Caller(), kUidA).status());
  CKPT_ASSERT_OK(Register(&b, Caller(), kUidB).status());
  for (uint64_t t = 1; t <= 2; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidA, a, t, 0));
    CKPT_ASSERT_OK(WaitDurableAs(kUidA, a, t).status());
  }
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 3, 0));
  CKPT_EXPECT_CODE(WaitDurableAs(kUidA, a, 3).status(), kAborted);
  const QuotaTable::Usage ua = engine_->quota_usage(kUidA);
  EXPECT_LE(ua.file_bytes + ua.index_bytes, uint64_t{100} << 10);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, engine_->Plan("big", 0, 3, Caller{kUidA, 0}));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{2})) << "the previous version stays";
  for (uint64_t t = 1; t <= 2; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidB, b, t, 0));
    CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidB, b, t));
    EXPECT_EQ(durable, t);
  }
}

// max_disk_bytes_per_job: one job of a user passes its own quota while the
// same user's other job, under the same per-uid quota, keeps writing; GC
// gives the job's bytes back, after which it writes again.
TEST_F(EnginePipelineTest, JobDiskQuotaFailsOnlyThatJobsVersions) {
  EngineOptions o = OneWriter();
  o.max_disk_bytes_per_job = 100 << 10;  // two 1-layer steps of ~34 KiB, not three
  o.max_disk_bytes_per_uid = uint64_t{1} << 40;
  o.retention.keep_last_events = 1;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("one", 1);
  TestRank b = MakeRank("two", 1);
  CKPT_ASSERT_OK(Register(&a, Caller(), kUidA).status());
  CKPT_ASSERT_OK(Register(&b, Caller(), kUidA).status());
  for (uint64_t t = 1; t <= 2; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidA, a, t, 0));
    CKPT_ASSERT_OK(WaitDurableAs(kUidA, a, t).status());
  }
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 3, 0));
  const absl::Status third = WaitDurableAs(kUidA, a, 3).status();
  CKPT_EXPECT_CODE(third, kAborted);
  const QuotaTable::Usage job = engine_->job_quota_usage("one");
  EXPECT_LE(job.file_bytes + job.index_bytes, uint64_t{100} << 10);
  EXPECT_GT(job.file_bytes, 0u);
  for (uint64_t t = 1; t <= 2; ++t) {
    CKPT_ASSERT_OK(StepDoneAs(kUidA, b, t, 0));
    CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidA, b, t));
    EXPECT_EQ(durable, t) << "the other job of the same uid, step " << t;
  }
  // GC keeps one event of job "one": its bytes come back, and it writes again.
  v1::GcRequest gc;
  gc.set_job_id("one");
  CKPT_ASSERT_OK(engine_->Gc(gc, Caller{kUidA, 0}).status());
  EXPECT_LT(engine_->job_quota_usage("one").file_bytes, job.file_bytes);
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 4, 0));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidA, a, 4));
  EXPECT_EQ(durable, 4u);
}

// A frozen layer (weights that do not train) is written at the first step
// and never again under policy all; the plan takes it from that step with
// staleness 0. After a re-registration that does not restore, the first step
// writes it once more (the trainer's bytes are unknown to ckptd); after one
// that restores, not at all.
TEST_F(EnginePipelineTest, FrozenLayersAreWrittenOncePerRegistration) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("lora", 3);
  a.frozen = {false, true, false};
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 5; ++t) {
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
  }
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(a, 0));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{5, 1, 5}));
  EXPECT_EQ(plan.layers[1].staleness, 0u) << "a frozen layer is never stale";
  EXPECT_EQ(plan.max_staleness, 0u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("lora", 0, 1, 5));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first, 1u);

  CKPT_ASSERT_OK(Register(&a).status());  // a new process, no restore
  CKPT_ASSERT_OK(StepDone(a, 6));
  CKPT_ASSERT_OK(WaitDurable(a, 6).status());
  CKPT_ASSERT_OK(StepDone(a, 7));
  CKPT_ASSERT_OK(WaitDurable(a, 7).status());
  CKPT_ASSERT_OK_AND_ASSIGN(plan, Plan(a, 0));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{7, 6, 7}));

  CKPT_ASSERT_OK(Register(&a).status());  // a new process that restores
  CKPT_ASSERT_OK(engine_->Restore(Ref(a), 0, owner_).status());
  CKPT_ASSERT_OK(StepDone(a, 8));
  CKPT_ASSERT_OK(WaitDurable(a, 8).status());
  CKPT_ASSERT_OK_AND_ASSIGN(plan, Plan(a, 0));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{8, 6, 8}));
}

// Restore with discard_later: the rank goes back to step 3 of 5 (another
// rank of its job, or the job's agreed durable step, is there); its later
// versions and events are deleted, and training goes on at step 4. Without
// it, step 4 is refused (steps only increase).
TEST_F(EnginePipelineTest, RestoreCanDiscardTheRanksLaterSteps) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("behind", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 5; ++t) {
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
  }
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(engine_->Restore(Ref(a), 3, owner_).status());
  CKPT_EXPECT_CODE(StepDone(a, 4), kFailedPrecondition);

  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored,
                            engine_->Restore(Ref(a), 3, owner_, /*discard_later=*/true));
  EXPECT_EQ(restored.plan.target_step, 3u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto last, index_->EventAtOrBefore("behind", 0, ~uint64_t{0}));
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->first, 3u) << "the events of steps 4 and 5 are gone";
  for (uint32_t layer = 0; layer < 2; ++layer) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("behind", 0, layer, ~uint64_t{0}));
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->first, 3u) << "layer " << layer;
  }
  CKPT_ASSERT_OK(StepDone(a, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(a, 4));
  EXPECT_EQ(durable, 4u);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(a, 0));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{4, 4}));
}

// Regression: a rank's StepDone queue had no bound, so a trainer that never
// waited for its snapshots held unbounded aux blobs in ckptd's memory. With
// the snapshot worker held, rank a queues two steps and its third is refused
// (max_queued_steps_per_rank); the uid's second rank, registered then, is
// refused once the uid has four steps in flight (max_queued_steps_per_uid);
// another uid is not affected; and every admitted step becomes durable once
// the worker goes on.
TEST_F(EnginePipelineTest, QueuedStepsBoundRefusesWithResourceExhausted) {
  EngineOptions o = OneWriter();
  o.max_queued_steps_per_rank = 2;
  o.max_queued_steps_per_uid = 4;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  constexpr char kReleaseSnapshot[] = "PipelineTest:release_snapshot";
  TestRank a = MakeRank("queue_a", 1);
  TestRank b = MakeRank("queue_b", 1);
  TestRank c = MakeRank("queue_c", 1);
  // a is the uid's only rank while it queues: the uid's whole budget is its
  // share (QueuedStepsAreSharedByTheUidsRanks covers two ranks at once).
  CKPT_ASSERT_OK(Register(&a, Caller(), kUidA).status());
  CKPT_ASSERT_OK(Register(&c, Caller(), kUidB).status());
  sp_->LoadDependency({{kReleaseSnapshot, "snapshot.before_publish"}});
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 1, 1024));
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.before_publish", 1, absl::Now() + kWait));
  // Step 1 is in the (held) worker; steps 2 and 3 wait in the queue.
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 2, 1024));
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 3, 1024));
  const absl::Status rank_full = StepDoneAs(kUidA, a, 4, 1024);
  EXPECT_TRUE(IsQuota(rank_full, "max_queued_steps_per_rank")) << rank_full;
  CKPT_ASSERT_OK(Register(&b, Caller(), kUidA).status());
  CKPT_ASSERT_OK(StepDoneAs(kUidA, b, 1, 1024));  // the uid's fourth step in flight
  const absl::Status uid_full = StepDoneAs(kUidA, b, 2, 1024);
  EXPECT_TRUE(IsQuota(uid_full, "max_queued_steps_per_uid")) << uid_full;
  EXPECT_EQ(engine_->quota_usage(kUidA).queued_steps, 4u);
  CKPT_ASSERT_OK(StepDoneAs(kUidB, c, 1, 1024));  // another user is not affected

  CKPT_SYNC_POINT(kReleaseSnapshot);
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurableAs(kUidA, a, 3));
  EXPECT_EQ(durable, 3u);
  CKPT_ASSERT_OK(WaitDurableAs(kUidA, b, 1).status());
  CKPT_ASSERT_OK(WaitDurableAs(kUidB, c, 1).status());
  EXPECT_EQ(engine_->quota_usage(kUidA).queued_steps, 0u);
  // The refused step may be sent again now.
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 4, 1024));
  CKPT_ASSERT_OK(WaitDurableAs(kUidA, a, 4).status());
}

// Regression: ckptd kept an open descriptor of every rank directory it had
// ever written, so a long-lived node's descriptors grew with every job it
// served (846 after 846 ranks had come and gone, docs/scaling.md). A rank's
// goes when its registration ends, and comes back when it writes again.
TEST_F(EnginePipelineTest, RankDirectoryDescriptorGoesWithTheRegistration) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("dirs_a", 1);
  TestRank b = MakeRank("dirs_b", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(Register(&b).status());
  for (TestRank* r : {&a, &b}) {
    WriteStep(*r, 1);
    CKPT_ASSERT_OK(StepDone(*r, 1));
    CKPT_ASSERT_OK(WaitDurable(*r, 1).status());
  }
  EXPECT_EQ(store_->open_rank_dirs(), 2u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(a), /*drain=*/true, owner_, absl::Now() + kWait));
  EXPECT_EQ(store_->open_rank_dirs(), 1u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(b), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(store_->open_rank_dirs(), 0u);
  // Registered again, the rank writes into its directory as before.
  CKPT_ASSERT_OK(Register(&a).status());
  WriteStep(a, 2);
  CKPT_ASSERT_OK(StepDone(a, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(a, 2));
  EXPECT_EQ(durable, 2u);
  EXPECT_EQ(store_->open_rank_dirs(), 1u);
  WriteStep(a, 0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 2, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(HoldsStep(a, 2));
}

// Regression: the uid's bound on steps in flight was first come, first
// served, so under a disk that could not keep up the ranks that got ahead
// held the uid's whole budget and the others were refused at every step
// (docs/scaling.md: 64 ranks, the slowest 24x behind the fastest). The
// uid's registered ranks now share it: with the snapshot worker held and a
// budget of 4 for two ranks, a is refused at 2 steps in flight (its share),
// b still gets its 2, and once b unregisters a's share is the whole budget.
TEST_F(EnginePipelineTest, QueuedStepsAreSharedByTheUidsRanks) {
  EngineOptions o = OneWriter();
  o.max_queued_steps_per_uid = 4;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  constexpr char kReleaseSnapshot[] = "PipelineTest:release_snapshot";
  TestRank a = MakeRank("share_a", 1);
  TestRank b = MakeRank("share_b", 1);
  CKPT_ASSERT_OK(Register(&a, Caller(), kUidA).status());
  CKPT_ASSERT_OK(Register(&b, Caller(), kUidA).status());
  sp_->LoadDependency({{kReleaseSnapshot, "snapshot.before_publish"}});
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 1, 0));
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.before_publish", 1, absl::Now() + kWait));
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 2, 0));
  const absl::Status a_full = StepDoneAs(kUidA, a, 3, 0);
  EXPECT_TRUE(IsQuota(a_full, "its share of max_queued_steps_per_uid")) << a_full;
  // Under first come, first served a would have taken 4 and b none.
  CKPT_ASSERT_OK(StepDoneAs(kUidA, b, 1, 0));
  CKPT_ASSERT_OK(StepDoneAs(kUidA, b, 2, 0));
  const absl::Status b_full = StepDoneAs(kUidA, b, 3, 0);
  EXPECT_TRUE(IsQuota(b_full, "its share of max_queued_steps_per_uid")) << b_full;
  EXPECT_EQ(engine_->quota_usage(kUidA).queued_steps, 4u);

  CKPT_SYNC_POINT(kReleaseSnapshot);
  CKPT_ASSERT_OK(WaitDurableAs(kUidA, a, 2).status());
  CKPT_ASSERT_OK(WaitDurableAs(kUidA, b, 2).status());
  CKPT_ASSERT_OK(engine_->Unregister(Ref(b), /*drain=*/true, Caller{kUidA, 0},
                                     absl::Now() + kWait));
  // Alone again, a may have the uid's four steps in flight. The worker is
  // held once more so that none of them finishes meanwhile.
  sp_->LoadDependency({{kReleaseSnapshot, "snapshot.before_publish"}});
  CKPT_ASSERT_OK(StepDoneAs(kUidA, a, 3, 0));
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.before_publish", 1, absl::Now() + kWait));
  for (uint64_t step = 4; step <= 6; ++step) CKPT_ASSERT_OK(StepDoneAs(kUidA, a, step, 0));
  const absl::Status uid_full = StepDoneAs(kUidA, a, 7, 0);
  EXPECT_TRUE(IsQuota(uid_full, "max_queued_steps_per_uid")) << uid_full;
  CKPT_SYNC_POINT(kReleaseSnapshot);
  CKPT_ASSERT_OK(WaitDurableAs(kUidA, a, 6).status());
}

// What the index is asked for must not grow with the rank's history
// (docs/scaling.md): with 2 layers and 160 steps behind it, a step still
// reads what a step reads at the start; a plan, `ckptctl layers` and `jobs`
// read O(layers) entries; and a restore with discard_later reads O(layers)
// plus what it discards. Before: Layers and Jobs read every version, and
// discard_later read the whole history (480 entries here, 3 million at a
// million versions).
TEST_F(EnginePipelineTest, IndexReadsDoNotGrowWithTheHistory) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("long", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  auto step_reads = [&](uint64_t t) -> uint64_t {
    const uint64_t before = index_->entries_read();
    if (t > 1) {
      EXPECT_TRUE(WaitSnapshot(r, t - 1).ok());
    }
    WriteStep(r, t);
    EXPECT_TRUE(StepDone(r, t).ok());
    EXPECT_TRUE(WaitDurable(r, t).ok());
    return index_->entries_read() - before;
  };
  step_reads(1);
  const uint64_t early = step_reads(2);
  constexpr uint64_t kSteps = 160;
  for (uint64_t t = 3; t < kSteps; ++t) step_reads(t);
  EXPECT_EQ(step_reads(kSteps), early) << "what one step reads depends on the history";

  auto reads = [&](const std::function<void()>& fn) {
    const uint64_t before = index_->entries_read();
    fn();
    return index_->entries_read() - before;
  };
  const uint64_t plan = reads([&] {
    CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan p, Plan(r, 0));
    EXPECT_EQ(p.target_step, kSteps);
  });
  EXPECT_LE(plan, 8u);
  const uint64_t layers = reads([&] {
    v1::LayersRequest req;
    req.set_job_id(r.job);
    CKPT_ASSERT_OK_AND_ASSIGN(v1::LayersReply reply, engine_->Layers(req, owner_));
    ASSERT_EQ(reply.layers_size(), 2);
    for (const v1::LayerInfo& li : reply.layers()) {
      EXPECT_EQ(li.versions(), kSteps);
      EXPECT_EQ(li.last_step(), kSteps);
    }
  });
  EXPECT_LE(layers, 12u);
  const uint64_t jobs = reads([&] {
    CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply reply, engine_->Jobs(owner_));
    ASSERT_EQ(reply.jobs_size(), 1);
    EXPECT_EQ(reply.jobs(0).versions(), 2 * kSteps);
  });
  EXPECT_LE(jobs, 8u);
  const uint64_t restore = reads([&] {
    CKPT_ASSERT_OK_AND_ASSIGN(Restored restored,
                              engine_->Restore(Ref(r), 0, owner_, /*discard_later=*/true));
    EXPECT_EQ(restored.plan.target_step, kSteps);
    EXPECT_TRUE(HoldsStep(r, kSteps));
  });
  EXPECT_LE(restore, 24u);
  // Going back 5 steps discards 10 versions and 5 events, and reads about
  // that many entries more.
  const uint64_t back = reads([&] {
    CKPT_ASSERT_OK_AND_ASSIGN(Restored restored,
                              engine_->Restore(Ref(r), kSteps - 5, owner_, /*discard_later=*/true));
    EXPECT_EQ(restored.plan.target_step, kSteps - 5);
  });
  EXPECT_LE(back, 24u + 3 * 15);
  EXPECT_EQ(index_->VersionsOf(r.job, 0).total.versions, 2 * (kSteps - 5));
  CKPT_ASSERT_OK_AND_ASSIGN(auto last, index_->EventAtOrBefore(r.job, 0, ~uint64_t{0}));
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->first, kSteps - 5);
}

// GC's report adds up: what it keeps and what it deletes are every version
// the rank had, in number and bytes, in a dry run and in the real one, and
// the bytes kept are what the index holds afterwards. (It searched the list
// of deletions once per version: O(versions x deletions), over 600 s at a
// million versions; now one pass and one lookup per deletion, and it reads
// each index entry of the rank once.)
TEST_F(EnginePipelineTest, GcAccountsForEveryVersionOnce) {
  EngineOptions options = OneWriter();
  options.gc_interval = absl::ZeroDuration();
  options.retention.keep_last_events = 3;
  options.retention.keep_every_steps = 0;
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
  TestRank r = MakeRank("gc_sums", 2, PolicyKind::kExplicit);
  CKPT_ASSERT_OK(Register(&r).status());
  constexpr uint64_t kSteps = 30;
  for (uint64_t t = 1; t <= kSteps; ++t) {
    // Layer 0 every step, layer 1 every third: plans reach back.
    std::vector<uint32_t> layers = {0};
    if (t % 3 == 0) layers.push_back(1);
    CKPT_ASSERT_OK(StepDone(r, t, layers));
    CKPT_ASSERT_OK(WaitSnapshot(r, t).status());
    CKPT_ASSERT_OK(WaitDurable(r, t).status());
  }
  const Index::RankVersions before = index_->VersionsOf(r.job, 0);
  ASSERT_EQ(before.total.versions, kSteps + kSteps / 3 + 1);  // step 1 writes layer 1 too
  v1::GcRequest gc;
  gc.set_job_id(r.job);
  gc.set_dry_run(true);
  const uint64_t read_before = index_->entries_read();
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply dry, engine_->Gc(gc, owner_));
  EXPECT_LE(index_->entries_read() - read_before, before.total.versions + kSteps + 8);
  EXPECT_EQ(dry.versions_kept() + dry.versions_deleted(), before.total.versions);
  EXPECT_EQ(dry.bytes_kept() + dry.bytes_deleted(), before.total.file_bytes);
  // Kept: steps 28..30 of layer 0, and layer 1's step 27 (the newest at or
  // below every retained target) and step 30.
  EXPECT_EQ(dry.versions_kept(), 5u);
  EXPECT_EQ(dry.events_deleted(), kSteps - 3);
  gc.set_dry_run(false);
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GcReply real, engine_->Gc(gc, owner_));
  EXPECT_EQ(real.versions_kept(), dry.versions_kept());
  EXPECT_EQ(real.versions_deleted(), dry.versions_deleted());
  EXPECT_EQ(real.bytes_kept(), dry.bytes_kept());
  EXPECT_EQ(real.bytes_deleted(), dry.bytes_deleted());
  const Index::RankVersions after = index_->VersionsOf(r.job, 0);
  EXPECT_EQ(after.total.versions, real.versions_kept());
  EXPECT_EQ(after.total.file_bytes, real.bytes_kept());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 28));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{28, 27}));
}

// Regression: the free-space reserve guarded layer files only, so events with
// their aux blobs were written into a full file system. With the data file
// system reporting 8 MiB free (below a quarter of the 64 MiB reserve) a
// step's event is refused with RESOURCE_EXHAUSTED (kDiskFull) and not
// written; the step after space returns is durable.
TEST_F(EnginePipelineTest, IndexReserveRefusesEventsWithoutWritingThem) {
  ::ckpt::testing::FaultFileSystem fs(DefaultFileSystem(), tmp_.Join("grave"), /*seed=*/11);
  Metrics metrics;
  EngineOptions o = OneWriter();
  o.metrics = &metrics;
  o.min_free_disk_bytes = 64 << 20;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16, &fs));
  fs.SetFreeBytes(uint64_t{1} << 40);
  // The explicit policy: a step without a layer list writes only its event.
  TestRank r = MakeRank("reserve", 1, PolicyKind::kExplicit);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDoneAs(owner_.uid, r, 1, 4096, {0}));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());

  fs.SetFreeBytes(8 << 20);
  CKPT_ASSERT_OK(StepDoneAs(owner_.uid, r, 2, 4096));
  const absl::Status refused = WaitDurable(r, 2).status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused) && ReasonOf(refused) == ErrorReason::kDiskFull)
      << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "min_free_disk_bytes")) << refused;
  CKPT_ASSERT_OK_AND_ASSIGN(auto last, index_->EventAtOrBefore("reserve", 0, ~uint64_t{0}));
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->first, 1u) << "step 2's event must not be in the index";
  EXPECT_EQ(engine_->quota_usage(owner_.uid).queued_steps, 0u);
  const std::string scrape = metrics.Scrape();
  EXPECT_NE(scrape.find("ckpt_events_failed_total 1"), std::string::npos) << scrape;

  fs.SetFreeBytes(std::nullopt);
  CKPT_ASSERT_OK(StepDoneAs(owner_.uid, r, 3, 4096));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 3));
  EXPECT_EQ(durable, 3u);
}

// A RocksDB file system that fails, while armed, every append and every new
// file with NoSpace: the index's file system is full.
class FullRocksFs : public rocksdb::FileSystemWrapper {
 public:
  explicit FullRocksFs(std::atomic<bool>* full)
      : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()), full_(full) {}
  const char* Name() const override { return "FullRocksFs"; }

  rocksdb::IOStatus NewWritableFile(const std::string& name, const rocksdb::FileOptions& opts,
                                    std::unique_ptr<rocksdb::FSWritableFile>* result,
                                    rocksdb::IODebugContext* dbg) override {
    if (full_->load()) return rocksdb::IOStatus::NoSpace("test: file system full");
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s = target()->NewWritableFile(name, opts, &file, dbg);
    if (s.ok()) result->reset(new File(std::move(file), full_));
    return s;
  }

 private:
  class File : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile>&& f, std::atomic<bool>* full)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(f)), full_(full) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (full_->load()) return rocksdb::IOStatus::NoSpace("test: file system full");
      return FSWritableFileOwnerWrapper::Append(data, o, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& v,
                             rocksdb::IODebugContext* dbg) override {
      if (full_->load()) return rocksdb::IOStatus::NoSpace("test: file system full");
      return FSWritableFileOwnerWrapper::Append(data, o, v, dbg);
    }

   private:
    std::atomic<bool>* full_;
  };

  std::atomic<bool>* full_;
};

// ckpt_global_durable_lag_steps: a rank's newest step minus the step its
// job's ranks last agreed is durable everywhere (reported with StepDone);
// ranks that report none (or 0, none agreed yet) do not count, and a report
// above the step is refused.
TEST_F(EnginePipelineTest, GlobalDurableLagGauge) {
  Metrics metrics;
  EngineOptions o = OneWriter();
  o.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank alone = MakeRank("lag_alone", 1), agreed = MakeRank("lag_agreed", 1);
  CKPT_ASSERT_OK(Register(&alone).status());
  CKPT_ASSERT_OK(Register(&agreed).status());
  auto step = [this](const TestRank& r, uint64_t t, std::optional<uint64_t> global) {
    return StepDone(r, t, {}, global);
  };
  auto lag = [this, &metrics] {
    engine_->CollectMetrics();
    const std::string text = metrics.Scrape();
    const std::string key = "\nckpt_global_durable_lag_steps ";
    const size_t at = text.find(key);
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + key.size()));
  };
  for (uint64_t t = 1; t <= 30; ++t) CKPT_ASSERT_OK(step(alone, t, std::nullopt));
  EXPECT_EQ(lag(), 0) << "a rank that reports no agreed step is not lagging";
  for (uint64_t t = 1; t <= 9; ++t) CKPT_ASSERT_OK(step(agreed, t, 0));
  EXPECT_EQ(lag(), 0) << "0 is none agreed yet";
  for (uint64_t t = 10; t <= 12; ++t) CKPT_ASSERT_OK(step(agreed, t, 10));
  EXPECT_EQ(lag(), 2);
  for (uint64_t t = 13; t <= 20; ++t) CKPT_ASSERT_OK(step(agreed, t, 10));
  EXPECT_EQ(lag(), 10) << "the agreed step stopped advancing";
  EXPECT_TRUE(absl::IsInvalidArgument(step(agreed, 21, 22)));
  CKPT_ASSERT_OK(step(agreed, 21, 20));
  EXPECT_EQ(lag(), 1);
  // The engine goes before `metrics`, which its writers update.
  CKPT_ASSERT_OK(WaitDurable(alone, 30).status());
  CKPT_ASSERT_OK(WaitDurable(agreed, 21).status());
  engine_.reset();
}

// Regression: on a full file system RocksDB's own writes failed, Debian's
// librocksdb (built with assertions) aborted ckptd on the next write of its
// info log, and a failed event write stopped the rank's durability for
// good. Now: the failing steps are reported (not durable), reads go on
// (plan, history, verify), the index reports itself degraded, and once
// space returns the next write reopens it and steps are durable again.
TEST_F(EnginePipelineTest, EnospcFromTheIndexDoesNotCrashAndRecovers) {
  std::atomic<bool> full{false};
  auto rocks_fs = std::make_shared<FullRocksFs>(&full);
  index_env_ = rocksdb::NewCompositeEnv(rocks_fs);
  Metrics metrics;
  EngineOptions o = OneWriter();
  o.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16, DefaultFileSystem(), index_env_.get()));
  TestRank r = MakeRank("nospc_index", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());

  full = true;
  for (uint64_t t = 2; t <= 4; ++t) {
    CKPT_ASSERT_OK(StepDone(r, t));
    const absl::Status s = WaitDurable(r, t).status();
    EXPECT_FALSE(s.ok()) << "step " << t << " cannot be durable on a full index";
  }
  EXPECT_TRUE(index_->degraded());
  EXPECT_GE(index_->write_failures(), 1u);
  engine_->CollectMetrics();
  EXPECT_NE(metrics.Scrape().find("ckpt_index_degraded 1"), std::string::npos);
  // Reads are served meanwhile.
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 0));
  EXPECT_EQ(plan.target_step, 1u);
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{1, 1}));
  v1::VerifyRequest verify;
  verify.set_job_id(r.job);
  CKPT_ASSERT_OK_AND_ASSIGN(v1::VerifyReply checked, engine_->Verify(verify, owner_));
  EXPECT_EQ(checked.failures_size(), 0);

  full = false;
  CKPT_ASSERT_OK(StepDone(r, 5));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 5));
  EXPECT_EQ(durable, 5u);
  EXPECT_FALSE(index_->degraded());
  EXPECT_EQ(index_->recoveries(), 1u);
  engine_->CollectMetrics();
  EXPECT_NE(metrics.Scrape().find("ckpt_index_degraded 0"), std::string::npos);
  CKPT_ASSERT_OK_AND_ASSIGN(plan, Plan(r, 5));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{5, 5}));
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
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
    faulty_.reset();
    posix_.reset();
  }
  EngineOptions WithRemote() {
    EngineOptions o = OneWriter();
    o.remote = faulty_.get();
    o.remote_key = &key_;
    o.remote_retry_min = absl::Milliseconds(10);
    o.remote_retry_max = absl::Milliseconds(50);
    return o;
  }
  absl::StatusOr<uint64_t> WaitRemote(const TestRank& r, uint64_t step,
                                      absl::Duration timeout = kWait) {
    return engine_->WaitDurable(Ref(r), step, owner_, absl::Now() + timeout, "remote");
  }
  // Trains `r` through steps [from, to], each durable locally.
  void Train(TestRank& r, uint64_t from, uint64_t to) {
    for (uint64_t t = from; t <= to; ++t) {
      WriteStep(r, t);
      CKPT_ASSERT_OK(StepDone(r, t));
      CKPT_ASSERT_OK(WaitSnapshot(r, t).status());
      CKPT_ASSERT_OK(WaitDurable(r, t).status());
    }
  }

  TempDir remote_dir_;
  std::unique_ptr<remote::PosixStore> posix_;
  const remote::RemoteKey key_ = *remote::RemoteKey::FromSecret(std::string(32, 'k'));
  std::unique_ptr<remote::FaultyStore> faulty_;
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

// A damaged object is detected on the pull and never served: the newest
// manifest that reads back whole is restored instead.
TEST_F(RemoteTierTest, DamagedRemoteObjectFallsBackToAnOlderWholeStep) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(WithRemote(), /*chunks=*/16));
  TestRank a = MakeRank("bitrot", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  CKPT_ASSERT_OK(WaitRemote(a, 3).status());
  // Flip one payload byte of a version of step 3.
  CKPT_ASSERT_OK_AND_ASSIGN(auto objects, posix_->List(remote::RankPrefix("bitrot", 0) + "v/"));
  std::string victim;
  for (const remote::ObjectInfo& o : objects) {
    if (absl::StrContains(o.key, "-S0000000000000003-")) victim = o.key;
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(remote_dir_.Join(victim), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8192 + 100);
    f.put('\x7f');
  }
  ASSERT_NO_FATAL_FAILURE(ReplaceNode(WithRemote()));
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(HoldsStep(a, 2));
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
    CKPT_ASSERT_OK(index_->ForEachVersion("halfway", 0, -1, [&](const VersionKey&,
                                                                 const store::VersionRecord&) {
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
}  // namespace ckpt

namespace ckpt {
namespace {

// A trainer crash: the rank registers again and restores. With the memory
// tier on, the plan's versions come from memory with every checksum checked:
// the layer files are deleted first, so a read of the disk would fail.
TEST_F(EnginePipelineTest, MemoryTierServesARestoreWithoutTheDisk) {
  EngineOptions o = OneWriter();
  o.memory_tier_bytes = 8 * kChunk;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("crashy", 3);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 3; ++t) {
    WriteStep(a, t);
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
  }
  for (const auto& f : std::filesystem::directory_iterator(tmp_.Join("jobs/crashy/rank-00000000"))) {
    std::filesystem::remove(f.path());
  }
  WriteStep(a, 77);  // the new trainer's fresh memory
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  EXPECT_EQ(restored.memory_bytes, restored.bytes);
  EXPECT_TRUE(HoldsStep(a, 3));
}

// A tier as large as the whole pool: snapshots, and restores that read the
// disk, take room back from it (before, only snapshots did, and a restore
// of an older step waited out its deadline); layers it still holds come
// from memory, the rest from the disk, both byte-exact.
TEST_F(EnginePipelineTest, MemoryTierWithinItsBudgetAndYieldingToSnapshots) {
  EngineOptions o = OneWriter();
  o.memory_tier_bytes = 4 * kChunk;
  o.restore_timeout = absl::Seconds(5);
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/4));
  TestRank a = MakeRank("partial", 4);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 4; ++t) {
    WriteStep(a, t);
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
    // Every step's four layers were admitted although the tier held the
    // whole pool: it gave it back.
    CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(a, t));
    EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{t, t, t, t}));
  }
  EXPECT_EQ(pool_->bytes_in_use(), 4 * kChunk) << "the tier holds step 4";
  // An older step: every layer from the disk, through a full pool.
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored older, engine_->Restore(Ref(a), 2, owner_));
  EXPECT_EQ(older.memory_bytes, 0u);
  EXPECT_TRUE(HoldsStep(a, 2));
  // The newest step: what the tier kept from memory, the rest from disk.
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_GT(restored.memory_bytes, 0u);
  EXPECT_LT(restored.memory_bytes, restored.bytes);
  EXPECT_TRUE(HoldsStep(a, 4));
}

}  // namespace
}  // namespace ckpt
