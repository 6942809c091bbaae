// GPU ranks whose device does not finish, on the fake CudaIpc: a trainer
// hung in a kernel or killed with work queued (its step event never
// completes), and a wedged device (ckptd's own copies never complete). The
// snapshot thread (one, the default) must go on serving the other ranks,
// give the stuck step up at its deadline, when its fence is abandoned or
// when the rank is released (every selected layer retried, the step not
// durable), and never hold up shutdown. Races are ordered with sync points
// and the engine's simulated clock, never with sleeps.
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/clock.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/io/file_system.h"
#include "daemon/metrics/metrics.h"
#include "gtest/gtest.h"
#include "tests/daemon/gpu/gpu_engine_fixture.h"
#include "tests/daemon/gpu/gpu_test_util.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace gpu_test {
namespace {

constexpr uint64_t kStuckFirst = 1;  // handle ids of the stuck rank's allocations
constexpr uint64_t kStuckEvent = 901;
constexpr uint64_t kLiveFirst = 11;
constexpr uint64_t kLiveEvent = 902;
// Passed each time the snapshot thread finds a step's event pending and
// puts the rank back to be polled again.
constexpr char kStepPending[] = "snapshot.step_pending";

struct GpuRank {
  std::string job;
  uint64_t first_id = 0;
  uint64_t event_id = 0;
  uint64_t generation = 0;
  GpuLayers mem;
};

class GpuWaitTest : public GpuSyncFixture {
 protected:
  void SetUp() override {
    GpuSyncFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    stuck_ = GpuRank{"stuck", kStuckFirst, kStuckEvent};
    live_ = GpuRank{"live", kLiveFirst, kLiveEvent};
    for (GpuRank* r : {&stuck_, &live_}) {
      r->mem.Allocate(&ipc_, r->first_id);
      ipc_.AddEvent(r->event_id);
    }
  }
  // One snapshot thread (the default) for both ranks; `gpu_wait_timeout`
  // bounds the wait for a step's event (on the simulated clock) and for
  // ckptd's own copies (in real time).
  void StartEngine(absl::Duration gpu_wait_timeout, int snapshot_threads = 1) {
    EngineOptions o = BaseOptions();
    o.snapshot_threads = snapshot_threads;
    o.clock = &clock_;
    o.gpu_wait_timeout = gpu_wait_timeout;
    GpuSyncFixture::StartEngine(o);
    for (GpuRank* r : {&stuck_, &live_}) {
      CKPT_ASSERT_OK_AND_ASSIGN(
          Registered reg,
          engine_->Register(Reg(GpuRequest(r->job, r->first_id, r->event_id)), {}, owner_));
      r->generation = reg.generation;
    }
  }

  static RankRef Ref(const GpuRank& r) { return RankRef{r.job, 0, r.generation}; }
  absl::Status StepDone(const GpuRank& r, uint64_t step) {
    return GpuSyncFixture::StepDone(Ref(r), step);
  }
  absl::StatusOr<SnapshotTaken> WaitSnapshot(const GpuRank& r, uint64_t step,
                                             absl::Duration timeout = kWait) {
    return engine_->WaitSnapshot(Ref(r), step, owner_, absl::Now() + timeout);
  }
  absl::StatusOr<uint64_t> WaitDurable(const GpuRank& r, uint64_t step) {
    return engine_->WaitDurable(Ref(r), step, owner_, absl::Now() + kWait);
  }
  // The scrape holds ckpt_gpu_waits_abandoned_total{reason} == n.
  bool Abandoned(const std::string& reason, int n) {
    const std::string line =
        "ckpt_gpu_waits_abandoned_total{reason=\"" + reason + "\"} " + std::to_string(n);
    return metrics_.Scrape().find(line) != std::string::npos;
  }
  // Steps 1..n of the live rank: each snapshot reads the reported step,
  // each step becomes durable.
  void LiveSteps(uint64_t first, uint64_t last) {
    for (uint64_t t = first; t <= last; ++t) {
      live_.mem.Fill(t);
      CKPT_ASSERT_OK(StepDone(live_, t));
      CKPT_ASSERT_OK_AND_ASSIGN(SnapshotTaken snap, WaitSnapshot(live_, t));
      EXPECT_EQ(snap.layers, (std::vector<uint32_t>{0, 1, 2})) << "step " << t;
      live_.mem.Fill(t + 100);  // the trainer mutates at once after its fence
      CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(live_, t));
      EXPECT_EQ(durable, t);
    }
  }

  SimulatedClock clock_{absl::Now()};
  GpuRank stuck_, live_;
};

// Regression: the only snapshot thread blocked in cudaStreamSynchronize on
// the event of a trainer hung in a kernel, and no rank of the node got a
// snapshot any more.
TEST_F(GpuWaitTest, OtherRanksKeepGettingSnapshotsWhileOneTrainerIsStuck) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Hours(1)));
  ipc_.SetEventDone(kStuckEvent, false);
  stuck_.mem.Fill(1);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  // The snapshot thread has found the stuck step's event pending (twice:
  // it polls it again while it serves the live rank).
  ASSERT_TRUE(sp_->WaitForPasses(kStepPending, 2, absl::Now() + kWait));
  ASSERT_NO_FATAL_FAILURE(LiveSteps(1, 3));
  live_.mem.Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(live_), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  EXPECT_TRUE(live_.mem.Holds(3));
  // Nothing of the stuck step was taken meanwhile.
  CKPT_EXPECT_CODE(WaitSnapshot(stuck_, 1, absl::ZeroDuration()).status(), kDeadlineExceeded);
}

// The stuck step is given up once its deadline (gpu_wait_timeout from the
// first poll) has passed: no layer of it is taken, it is not durable, and
// every layer is in the next step, which is durable once the device has
// finished.
TEST_F(GpuWaitTest, StuckStepIsAbandonedAtItsDeadlineAndALaterStepIsDurable) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Seconds(60)));
  ipc_.SetEventDone(kStuckEvent, false);
  stuck_.mem.Fill(1);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  ASSERT_TRUE(sp_->WaitForPasses(kStepPending, 1, absl::Now() + kWait));
  clock_.Advance(absl::Seconds(61));
  CKPT_ASSERT_OK_AND_ASSIGN(SnapshotTaken snap, WaitSnapshot(stuck_, 1));
  EXPECT_TRUE(snap.layers.empty());
  EXPECT_EQ(snap.skipped, kLayers);
  CKPT_EXPECT_CODE(WaitDurable(stuck_, 1).status(), kAborted);
  EXPECT_TRUE(Abandoned("deadline", 1)) << metrics_.Scrape();

  ipc_.SetEventDone(kStuckEvent, true);  // the kernel finished after all
  stuck_.mem.Fill(2);
  CKPT_ASSERT_OK(StepDone(stuck_, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(snap, WaitSnapshot(stuck_, 2));
  EXPECT_EQ(snap.layers, (std::vector<uint32_t>{0, 1, 2})) << "every layer is retried";
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(stuck_, 2));
  EXPECT_EQ(durable, 2u);
  stuck_.mem.Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(stuck_), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(stuck_.mem.Holds(2));
}

// A fence that gave up (WaitSnapshot past its deadline) gives the stuck step
// up too, long before gpu_wait_timeout: the trainer went on without it.
TEST_F(GpuWaitTest, AbandonedFenceGivesTheStuckStepUp) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Hours(1)));
  ipc_.SetEventDone(kStuckEvent, false);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  CKPT_EXPECT_CODE(WaitSnapshot(stuck_, 1, absl::Milliseconds(50)).status(), kDeadlineExceeded);
  CKPT_EXPECT_CODE(WaitDurable(stuck_, 1).status(), kAborted);
  EXPECT_TRUE(Abandoned("fence", 1)) << metrics_.Scrape();
  ASSERT_NO_FATAL_FAILURE(LiveSteps(1, 1));
}

// Releasing the rank (ckptctl release; also a trainer's exit or a new
// registration) gives its stuck step up at once, and the release's drain
// does not wait for the device.
TEST_F(GpuWaitTest, ReleasedRankGivesItsStuckStepUp) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Hours(1)));
  ipc_.SetEventDone(kStuckEvent, false);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  ASSERT_TRUE(sp_->WaitForPasses(kStepPending, 1, absl::Now() + kWait));
  CKPT_ASSERT_OK(engine_->ReleaseRank(stuck_.job, 0, owner_).status());
  EXPECT_TRUE(Abandoned("released", 1)) << metrics_.Scrape();
  EXPECT_EQ(ipc_.open_mappings(), 2) << "only the live rank's mappings are left";
  ASSERT_NO_FATAL_FAILURE(LiveSteps(1, 1));
}

// Regression: Shutdown joined the snapshot thread, which waited forever on
// the event of a trainer hung in a kernel.
TEST_F(GpuWaitTest, ShutdownReturnsPromptlyWhileAnEventNeverCompletes) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Hours(1)));
  ipc_.SetEventDone(kStuckEvent, false);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  ASSERT_TRUE(sp_->WaitForPasses(kStepPending, 1, absl::Now() + kWait));
  absl::Notification stopped;
  std::thread stopper([this, &stopped] {
    engine_->Shutdown(absl::Seconds(5));
    stopped.Notify();
  });
  EXPECT_TRUE(stopped.WaitForNotificationWithTimeout(kWait)) << "Shutdown waited on the event";
  ipc_.SetEventDone(kStuckEvent,
                    true);  // lets a hung Shutdown end, so that the test can
  stopper.join();
  EXPECT_EQ(ipc_.open_mappings(), 0);
  EXPECT_EQ(ipc_.open_streams(), 0);
  EXPECT_EQ(ipc_.open_events(), 0);
}

// A wedged device: ckptd's own copies do not complete. The snapshot gives
// up at gpu_wait_timeout (real time here), the step is not durable, and the
// staging memory the copies were writing into stays out of the pool (a late
// copy could still land in it). Once the device answers again, the next
// step is durable.
TEST_F(GpuWaitTest, CopiesThatNeverCompleteFailTheStepAndTheLayersAreRetried) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Milliseconds(100)));
  ipc_.SetStreamsDone(false);
  live_.mem.Fill(1);
  CKPT_ASSERT_OK(StepDone(live_, 1));
  CKPT_ASSERT_OK_AND_ASSIGN(SnapshotTaken snap, WaitSnapshot(live_, 1));
  EXPECT_TRUE(snap.layers.empty());
  EXPECT_EQ(snap.skipped, kLayers);
  CKPT_EXPECT_CODE(WaitDurable(live_, 1).status(), kAborted);
  EXPECT_TRUE(Abandoned("copies", 1)) << metrics_.Scrape();
  EXPECT_GT(engine_->GetStatus().pool_bytes_in_use(), 0u) << "the copies' staging is withheld";
  ipc_.SetStreamsDone(true);
  ASSERT_NO_FATAL_FAILURE(LiveSteps(2, 2));
}

// Regression: after one copy deadline every later step, refused while the
// late copies may still land, "withheld" an empty staging set: a false
// "0 bytes" ERROR and one more ckpt_gpu_waits_abandoned_total{copies}.
// And the withheld staging stayed out of the pool until ckptd restarted:
// it goes back once the device is seen idle.
TEST_F(GpuWaitTest, WithheldStagingIsCountedOnceAndGoesBackOnceTheDeviceIsIdle) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Milliseconds(100)));
  ipc_.SetStreamsDone(false);
  live_.mem.Fill(1);
  CKPT_ASSERT_OK(StepDone(live_, 1));
  CKPT_EXPECT_CODE(WaitDurable(live_, 1).status(), kAborted);
  EXPECT_GT(engine_->GetStatus().pool_bytes_in_use(), 0u);
  for (uint64_t t = 2; t <= 3; ++t) {  // refused: the late copies may still land
    CKPT_ASSERT_OK(StepDone(live_, t));
    CKPT_EXPECT_CODE(WaitDurable(live_, t).status(), kAborted);
  }
  EXPECT_TRUE(Abandoned("copies", 1)) << metrics_.Scrape();
  EXPECT_GT(engine_->GetStatus().pool_bytes_in_use(), 0u);
  ipc_.SetStreamsDone(true);
  ASSERT_NO_FATAL_FAILURE(LiveSteps(4, 4));
  EXPECT_EQ(engine_->GetStatus().pool_bytes_in_use(), 0u) << "the withheld staging is back";
}

// A restore whose copies to the device do not complete keeps its source
// staging out of the pool while they may still read it (another job's
// bytes could otherwise be copied into this trainer's GPU memory); it goes
// back once the device is seen idle.
TEST_F(GpuWaitTest, ARestoreWhoseCopiesNeverCompleteWithholdsItsStaging) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Milliseconds(100)));
  ASSERT_NO_FATAL_FAILURE(LiveSteps(1, 1));
  ASSERT_EQ(engine_->GetStatus().pool_bytes_in_use(), 0u);
  ipc_.SetStreamsDone(false);
  CKPT_EXPECT_CODE(engine_->Restore(Ref(live_), 0, owner_).status(), kDeadlineExceeded);
  EXPECT_GT(engine_->GetStatus().pool_bytes_in_use(), 0u) << "the restore's staging is withheld";
  ipc_.SetStreamsDone(true);
  ASSERT_NO_FATAL_FAILURE(LiveSteps(2, 2));
  EXPECT_EQ(engine_->GetStatus().pool_bytes_in_use(), 0u);
}

// Regression (snapshot_threads > 1): an idle snapshot thread slept until a
// deadline fixed when its wait began, so a rank another thread parked for
// its next poll waited until that busy thread was done.
TEST_F(GpuWaitTest, AParkedRankWakesAnIdleSnapshotThread) {
  // The thread that parks the stuck rank is held right after parking it.
  sp_->LoadDependency({{"test.parker_released", kStepPending}});
  ASSERT_NO_FATAL_FAILURE(StartEngine(absl::Hours(1), /*snapshot_threads=*/2));
  ASSERT_TRUE(sp_->WaitForPasses("snapshot.idle", 2, absl::Now() + kWait));  // both asleep
  ipc_.SetEventPendingFor(kStuckEvent, 1);  // done from the second query on
  stuck_.mem.Fill(1);
  CKPT_ASSERT_OK(StepDone(stuck_, 1));
  ASSERT_TRUE(sp_->WaitForArrivals(kStepPending, 1, absl::Now() + kWait));
  // The other thread polls it again and snapshots it.
  const absl::StatusOr<SnapshotTaken> snap = WaitSnapshot(stuck_, 1, absl::Seconds(10));
  CKPT_SYNC_POINT("test.parker_released");
  CKPT_ASSERT_OK(snap.status());
  EXPECT_EQ(snap->layers, (std::vector<uint32_t>{0, 1, 2}));
}

}  // namespace
}  // namespace gpu_test
}  // namespace ckpt
