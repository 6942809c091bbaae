// Per-user and per-job limits in the engine (engine_test_util.h): the caps
// on registrations, index bytes, disk bytes and steps in flight refuse only
// the user or job that reached them, with RESOURCE_EXHAUSTED (kQuota) naming
// the option.
#include <fcntl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

// Whether `s` is a quota's refusal: RESOURCE_EXHAUSTED (kQuota) naming `option`.
bool IsQuota(const absl::Status& s, absl::string_view option) {
  return absl::IsResourceExhausted(s) && ReasonOf(s) == ErrorReason::kQuota &&
         absl::StrContains(s.message(), option);
}

constexpr uid_t kUidA = 2001;
constexpr uid_t kUidB = 2002;

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

// What a first registration `req`'s table counts for in the index quota.
uint64_t TableBytes(const Registration& req) {
  store::RankRecord table;
  for (const LayerDesc& layer : req.layers) {
    *table.add_layers() = TableEntryOf(layer);
  }
  table.set_world_size(1);
  table.set_generation(1);  // one byte, as every generation below 128
  return RankIndexBytes(table);
}

// Regression: aux blobs went into the index with no bound, so one user could
// grow it without limit. Uid A floods 16 KiB aux blobs against an index quota
// of four steps' records: its fifth step is refused with RESOURCE_EXHAUSTED
// (kQuota, naming max_index_bytes_per_uid) and nothing of it is written;
// uid B, under the same quota, keeps every step durable meanwhile.
TEST_F(EnginePipelineTest, IndexQuotaOfOneUidLeavesAnotherUidsStepsDurable) {
  constexpr size_t kAux = 16 << 10;
  constexpr uint64_t kPerStep = kAux + kEventIndexOverhead + kVersionIndexBytes;  // 1 layer
  const uint64_t kTable = TableBytes(RegistrationOf(MakeRank("flood", 1)));  // charged at Register
  EngineOptions o = OneWriter();
  o.max_index_bytes_per_uid = 4 * kPerStep + kTable;
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
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, 4 * kPerStep + kTable);
  const absl::Status refused = StepDoneAs(kUidA, a, 5, kAux);
  EXPECT_TRUE(IsQuota(refused, "max_index_bytes_per_uid")) << refused;
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, 4 * kPerStep + kTable)
      << "nothing was charged";
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
  EXPECT_NE(scrape.find(absl::StrCat("ckpt_uid_index_limit_bytes ", 4 * kPerStep + kTable)),
            std::string::npos)
      << scrape;
}

// A rank's table is a record of the index like any other: its bytes count
// against its owner's index quota from Register on (a registration that
// would pass it is refused, naming the quota), a new table replaces the old
// one's charge, and deleting the job gives it back. A table past
// max_registration_table_bytes is refused before anything is written (two
// uncharged 59 MiB tables once slowed every other user's Register 40-fold).
TEST_F(EnginePipelineTest, RankTablesCountAgainstTheIndexQuota) {
  EngineOptions o = OneWriter();
  const uint64_t kTable = TableBytes(RegistrationOf(MakeRank("tables", 4)));
  o.max_index_bytes_per_uid = kTable + kTable / 2;
  o.limits.max_table_bytes = 4 * kTable;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank r = MakeRank("tables", 4);
  CKPT_ASSERT_OK(Register(&r, Caller(), kUidA).status());
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, kTable);
  CKPT_ASSERT_OK(Register(&r, Caller(), kUidA).status());  // the same rank again
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, kTable) << "the old table's charge went";
  TestRank second = MakeRank("tables-2", 4);
  const absl::StatusOr<Registered> over = Register(&second, Caller(), kUidA);
  EXPECT_TRUE(IsQuota(over.status(), "max_index_bytes_per_uid")) << over.status();
  CKPT_ASSERT_OK_AND_ASSIGN(auto none, index_->GetJob("tables-2"));
  EXPECT_FALSE(none.has_value()) << "a refused registration leaves no job";
  // Too large a table, whatever the quota.
  TestRank wide = MakeRank("wide", 4);
  Registration big = RegistrationOf(wide);
  for (size_t l = 0; l < big.layers.size(); ++l) {
    big.layers[l].name = std::string(1000, 'n') + std::to_string(l);
  }
  std::vector<UniqueFd> wide_fds;
  wide_fds.emplace_back(::dup(wide.region.fd()));
  absl::StatusOr<Registered> refused =
      engine_->Register(big, std::move(wide_fds), Caller{kUidB, 0});
  CKPT_EXPECT_CODE(refused, kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_registration_table_bytes"), std::string::npos)
      << refused.status();
  CKPT_ASSERT_OK(
      engine_->Unregister(Ref(r), /*drain=*/true, Caller{kUidA, 0}, absl::Now() + kWait));
  CKPT_ASSERT_OK(engine_->DeleteJob("tables", Caller{kUidA, 0}).status());
  EXPECT_EQ(engine_->quota_usage(kUidA).index_bytes, 0u) << "the deleted job's table went";
}

// A registration whose caller has stopped waiting ends there: nothing is
// written for it.
TEST_F(EnginePipelineTest, RegisterPastItsCallersDeadlineWritesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("late", 2);
  Registration req = RegistrationOf(r);
  req.deadline = absl::Now() - absl::Seconds(1);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::dup(r.region.fd()));
  CKPT_EXPECT_CODE(engine_->Register(req, std::move(fds), Caller{kUidA, 0}), kDeadlineExceeded);
  CKPT_ASSERT_OK_AND_ASSIGN(auto none, index_->GetJob("late"));
  EXPECT_FALSE(none.has_value());
  EXPECT_EQ(engine_->RanksHeld(), 0u);
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
  CKPT_ASSERT_OK(
      engine_->Unregister(Ref(b), /*drain=*/true, Caller{kUidA, 0}, absl::Now() + kWait));
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

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
