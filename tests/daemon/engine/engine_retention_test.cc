// A rank's history in the engine (engine_test_util.h): what GC keeps by age
// and by count and how its report adds up, DeleteJob removing a whole job,
// and index reads that do not grow with the history.
#include <fcntl.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/common/clock.h"
#include "daemon/engine/engine.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

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

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
