// The snapshot in the per-step pipeline (engine_test_util.h): what a step's
// snapshot takes from the trainer's buffers and hands to the writers when
// the staging pool is full or smaller than the step, a snapshot whose fence
// the trainer gave up on, and frozen layers, written once.
#include <cstdint>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

// Held by a dependency on "snapshot.before_publish" until the fence has given up.
constexpr char kFenceAbandoned[] = "PipelineTest:fence_abandoned";

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
  EXPECT_EQ(snap.layers, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(snap.skipped, 2u);
  EXPECT_EQ(engine_->GetStatus().snapshots_skipped(), 2u);
  CKPT_SYNC_POINT(kReleaseWriter);
  // Not every selected layer became durable at step 1; once step 1 is
  // recorded its chunks are back in the pool.
  CKPT_EXPECT_CODE(WaitDurable(r, 1).status(), kAborted);
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 2));
  EXPECT_EQ(snap.layers, (std::vector<uint32_t>{2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);

  // From here the writer commits nothing until the test says so.
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  CKPT_ASSERT_OK(StepDone(r, 3, {0, 1, 2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(r, 3));
  EXPECT_EQ(snap.layers, (std::vector<uint32_t>{0, 1}));
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
  EXPECT_EQ(snap.layers, (std::vector<uint32_t>{2, 3}));
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

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
