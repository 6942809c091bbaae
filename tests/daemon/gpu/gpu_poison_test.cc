// A poisoned CUDA context, on the fake CudaIpc: one sticky error (an
// illegal address in one of ckptd's copies) makes every later call on that
// device fail until ckptd restarts. ckptd must say so: the device is marked
// poisoned, every rank on it is released with that reason, registrations
// on it are refused naming the device and the cure (restart ckptd), and the
// status and a gauge show it.
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/gpu/gpu_health.h"
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

TEST(GpuStickyErrorTest, TheStickyCodesOfCuda13AreKnown) {
  for (int sticky : {700, 702, 710, 714, 715, 716, 717, 718, 719, 214, 220, 226, 721, 999}) {
    EXPECT_TRUE(IsStickyCudaErrorCode(sticky)) << sticky;
  }
  // Out of memory, an invalid value, not ready, an invalid handle: the
  // context stays usable.
  for (int plain : {0, 1, 2, 400, 600, 801}) EXPECT_FALSE(IsStickyCudaErrorCode(plain)) << plain;
  const absl::Status s = MarkStickyCudaError(absl::InternalError("cudaMemcpyAsync: illegal"));
  EXPECT_TRUE(IsStickyCudaError(s));
  EXPECT_EQ(s.message(), "cudaMemcpyAsync: illegal");
  EXPECT_FALSE(IsStickyCudaError(absl::InternalError("cudaMemcpyAsync: illegal")));
  EXPECT_TRUE(MarkStickyCudaError(absl::OkStatus()).ok());
}

TEST(GpuStickyErrorTest, AStickyCopyPoisonsTheDeviceAndNothingOpensOnItAgain) {
  FakeCudaIpc ipc;
  GpuHealth health;
  GpuMemoryOptions o;
  o.health = &health;
  o.close_timeout = absl::Milliseconds(20);
  char* a = nullptr;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenTwo(&ipc, o, &a));
  CKPT_ASSERT_OK(m->StepReady().status());
  ipc.Poison();
  char buf[16];
  EXPECT_FALSE(m->CopyOut(buf, a, sizeof(buf)).ok());
  EXPECT_TRUE(health.IsPoisoned(0));
  ExpectPoisonReason(m->StepReady().status());
  m.reset();
  const int opens = ipc.opens();
  const absl::Status s = GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, &ipc, o).status();
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("restart ckptd"), std::string::npos) << s;
  EXPECT_EQ(ipc.opens(), opens) << "nothing is opened on a poisoned device";
  ASSERT_EQ(health.Poisoned().size(), 1u);
  EXPECT_EQ(health.Poisoned()[0].uuid, kUuid);
  EXPECT_NE(health.Poisoned()[0].error.find("illegal memory access"), std::string::npos);
}

// Regression (a cross-tenant denial of service): a trainer's forged or
// stale handle failing with a code classified sticky (cudaErrorUnknown)
// marked the device poisoned for every user until ckptd restarted. Only a
// probe on ckptd's own resources that fails too confirms it; otherwise the
// registration alone fails.
TEST(GpuStickyErrorTest, ATrainersHandleFailingStickyPoisonsOnlyWhenTheProbeFailsToo) {
  for (bool probe_fails : {false, true}) {
    FakeCudaIpc ipc;
    GpuHealth health;
    ipc.Allocate(1, 4096);
    ipc.Allocate(2, 8192);
    ipc.SetHandleSticky(2);
    ipc.SetProbeFails(probe_fails);
    GpuMemoryOptions o;
    o.health = &health;
    const absl::Status s = GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, &ipc, o).status();
    CKPT_EXPECT_CODE(s, kInvalidArgument) << probe_fails;
    EXPECT_EQ(ipc.probes(), 1) << probe_fails;
    EXPECT_EQ(health.IsPoisoned(0), probe_fails);
    EXPECT_EQ(ipc.open_mappings(), 0);
  }
}

// The same for the trainer's step event: its query failing sticky fails
// that step only, unless the probe fails too.
TEST(GpuStickyErrorTest, ATrainersEventFailingStickyPoisonsOnlyWhenTheProbeFailsToo) {
  for (bool probe_fails : {false, true}) {
    FakeCudaIpc ipc;
    GpuHealth health;
    GpuMemoryOptions o;
    o.health = &health;
    o.close_timeout = absl::Milliseconds(20);
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenTwo(&ipc, o));
    ipc.SetEventSticky(kEventId);
    ipc.SetProbeFails(probe_fails);
    const absl::Status s = m->StepReady().status();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(std::string(s.message()).find("cudaEventQuery"), std::string::npos) << s;
    EXPECT_EQ(health.IsPoisoned(0), probe_fails);
    EXPECT_EQ(m->CheckUsable().code(),
              probe_fails ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kOk);
  }
}

class GpuPoisonTest : public GpuSyncFixture {
 protected:
  void SetUp() override {
    GpuSyncFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    a_.Allocate(&ipc_, 1);
    b_.Allocate(&ipc_, 11);
    EngineOptions o = BaseOptions();
    o.gpu_wait_timeout = absl::Seconds(1);
    StartEngine(o);
    c_.Allocate(&ipc_, 21);
    CKPT_ASSERT_OK_AND_ASSIGN(Registered ra,
                              engine_->Register(Reg(GpuRequest("a", 1)), {}, owner_));
    CKPT_ASSERT_OK_AND_ASSIGN(Registered rb,
                              engine_->Register(Reg(GpuRequest("b", 11)), {}, owner_));
    gen_a_ = ra.generation;
    gen_b_ = rb.generation;
  }
  absl::Status StepDone(const std::string& job, uint64_t gen, uint64_t step) {
    return GpuSyncFixture::StepDone(RankRef{job, 0, gen}, step);
  }
  absl::StatusOr<uint64_t> WaitDurable(const std::string& job, uint64_t gen, uint64_t step) {
    return engine_->WaitDurable(RankRef{job, 0, gen}, step, owner_, absl::Now() + kWait);
  }
  // Steps 1 of a and b, durable.
  void FirstSteps() {
    for (const auto& [job, gen] : {std::pair<std::string, uint64_t>{"a", gen_a_}, {"b", gen_b_}}) {
      CKPT_ASSERT_OK(StepDone(job, gen, 1));
      CKPT_ASSERT_OK(WaitDurable(job, gen, 1).status());
    }
    // And the snapshot thread is done with them.
    ASSERT_TRUE(sp_->WaitForPasses("snapshot.after_publish", 2, absl::Now() + kWait));
  }

  GpuLayers a_, b_, c_;
  uint64_t gen_a_ = 0, gen_b_ = 0;
};

// One illegal access in a copy of rank a poisons ckptd's context on the
// device: a's step fails, and both ranks on that device lose their memory
// with the reason, which their next StepDone reports; registering again is
// refused before anything is opened; the status and the gauge name it.
// What was durable before stays restorable (the plan of step 1).
TEST_F(GpuPoisonTest, AStickyErrorFailsEveryRankOnTheDeviceUntilRestart) {
  for (const auto& [job, gen] : {std::pair<std::string, uint64_t>{"a", gen_a_}, {"b", gen_b_}}) {
    CKPT_ASSERT_OK(StepDone(job, gen, 1));
    CKPT_ASSERT_OK(WaitDurable(job, gen, 1).status());
  }
  ipc_.Poison();
  CKPT_ASSERT_OK(StepDone("a", gen_a_, 2));
  ASSERT_TRUE(sp_->WaitForPasses("engine.poisoned_gpu_ranks_released", 1, absl::Now() + kWait));
  CKPT_EXPECT_CODE(WaitDurable("a", gen_a_, 2).status(), kAborted);
  for (const auto& [job, gen] : {std::pair<std::string, uint64_t>{"a", gen_a_}, {"b", gen_b_}}) {
    const absl::Status s = StepDone(job, gen, 3);
    CKPT_EXPECT_CODE(s, kFailedPrecondition) << job;
    EXPECT_NE(std::string(s.message()).find(kUuid), std::string::npos) << s;
    EXPECT_NE(std::string(s.message()).find("restart ckptd"), std::string::npos) << s;
  }
  const int opens = ipc_.opens();
  const absl::Status again = engine_->Register(Reg(GpuRequest("b", 11)), {}, owner_).status();
  CKPT_EXPECT_CODE(again, kFailedPrecondition);
  EXPECT_NE(std::string(again.message()).find(kUuid), std::string::npos) << again;
  EXPECT_NE(std::string(again.message()).find("restart ckptd"), std::string::npos) << again;
  EXPECT_EQ(ipc_.opens(), opens);
  const v1::StatusReply status = engine_->GetStatus(owner_);
  ASSERT_EQ(status.gpu_poisoned_size(), 1);
  EXPECT_NE(status.gpu_poisoned(0).find(kUuid), std::string::npos) << status.gpu_poisoned(0);
  engine_->CollectMetrics();  // what the scrape hook of ckptd does
  EXPECT_NE(metrics_.Scrape().find("ckpt_gpu_devices_poisoned 1"), std::string::npos);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, engine_->Plan("b", 0, 0, owner_));
  EXPECT_EQ(plan.target_step, 1u);
}

// The engine's side of the probe: rank a's event query failing with a
// sticky code while ckptd's context is fine fails a's step only; b, and
// new registrations, go on.
TEST_F(GpuPoisonTest, ATrainersStickyEventFailsOnlyItsOwnStep) {
  ASSERT_NO_FATAL_FAILURE(FirstSteps());
  // a and b shared the default event: b registers again with its own.
  ipc_.AddEvent(5);
  CKPT_ASSERT_OK_AND_ASSIGN(Registered rb,
                            engine_->Register(Reg(GpuRequest("b", 11, 5)), {}, owner_));
  gen_b_ = rb.generation;
  ipc_.SetEventSticky(kEventId);
  CKPT_ASSERT_OK(StepDone("a", gen_a_, 2));
  CKPT_EXPECT_CODE(WaitDurable("a", gen_a_, 2).status(), kAborted);
  CKPT_ASSERT_OK(StepDone("b", gen_b_, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable("b", gen_b_, 2));
  EXPECT_EQ(durable, 2u);
  CKPT_EXPECT_OK(StepDone("a", gen_a_, 3)) << "a's memory is not released";
  EXPECT_EQ(engine_->GetStatus(owner_).gpu_poisoned_size(), 0);
  CKPT_EXPECT_OK(engine_->Register(Reg(GpuRequest("c", 21, 5)), {}, owner_).status());
}

// Regression: a registration whose memory opened before another rank
// poisoned the device, and that was published after the poisoned ranks
// were released, kept a rank on the poisoned device for good.
TEST_F(GpuPoisonTest, ARegistrationPublishedAfterThePoisonReleaseIsRefused) {
  ASSERT_NO_FATAL_FAILURE(FirstSteps());
  sp_->LoadDependency({{"engine.poisoned_gpu_ranks_released", "engine.register.before_publish"}});
  absl::Status registered;
  std::thread registering([this, &registered] {
    registered = engine_->Register(Reg(GpuRequest("c", 21)), {}, owner_).status();
  });
  ASSERT_TRUE(sp_->WaitForArrivals("engine.register.before_publish", 1, absl::Now() + kWait));
  ipc_.Poison();
  CKPT_ASSERT_OK(StepDone("a", gen_a_, 2));
  registering.join();
  ExpectPoisonReason(registered);
}

// A restore on a poisoned device fails with the reason, before it copies
// anything (here b's memory is not released yet).
TEST_F(GpuPoisonTest, ARestoreOnAPoisonedDeviceFailsWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(FirstSteps());
  sp_->LoadDependency({{"test.restored", "engine.release_poisoned_gpu_ranks"}});
  ipc_.Poison();
  CKPT_ASSERT_OK(StepDone("a", gen_a_, 2));
  ASSERT_TRUE(sp_->WaitForArrivals("engine.release_poisoned_gpu_ranks", 1, absl::Now() + kWait));
  ExpectPoisonReason(engine_->Restore(RankRef{"b", 0, gen_b_}, 0, owner_).status());
  CKPT_SYNC_POINT("test.restored");
}

}  // namespace
}  // namespace gpu_test
}  // namespace ckpt
