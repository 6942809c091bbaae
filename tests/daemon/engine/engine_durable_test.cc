// When a step becomes durable, and when it does not (engine_test_util.h):
// a failed fdatasync, a data file system below its free-space reserve, an
// index whose file system is full (ENOSPC from RocksDB), and the gauge of
// how far a rank is ahead of its job's agreed durable step.
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "base/status.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/engine/engine.h"
#include "daemon/io/file_system.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/fault_fs.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

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
}  // namespace engine_test
}  // namespace ckpt
