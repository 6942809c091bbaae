// The GPU handover without a GPU: GpuMemory and the engine's GPU path run on
// a fake CudaIpc whose "device memory" is host memory. Checks that bad
// handovers (forged handles, sizes and offsets past the allocation, another
// uid's job, a stale generation) fail with clear errors and leave nothing
// mapped, that snapshots read exactly the reported step once the trainer's
// event has completed, that no wait for the device blocks or lasts past its
// deadline, that restore writes back through the GPU copy path, and that
// mappings are closed on unregister, re-register, trainer exit and shutdown.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/gpu_uuid.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/io/file_system.h"
#include "daemon/rpc/convert.h"
#include "gtest/gtest.h"
#include "tests/daemon/gpu/gpu_engine_fixture.h"
#include "tests/daemon/gpu/gpu_test_util.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::gpu_test::FakeCudaIpc;
using ::ckpt::gpu_test::GpuEngineFixture;
using ::ckpt::gpu_test::GpuRequest;
using ::ckpt::gpu_test::Handle;
using ::ckpt::gpu_test::kEventId;
using ::ckpt::gpu_test::kFloats;
using ::ckpt::gpu_test::kLayers;
using ::ckpt::gpu_test::OpenTwo;
using ::ckpt::gpu_test::Reg;
using ::ckpt::gpu_test::TwoRegions;
using ::ckpt::gpu_test::Value;

// ---- CheckGpuHandover and GpuMemory::Open ----

TEST(GpuUuidTest, PrintedAsNvidiaSmiDoes) {
  const unsigned char bytes[16] = {0xce, 0x06, 0x88, 0xb6, 0xea, 0x84, 0x0d, 0xc3,
                                   0x52, 0xc6, 0x01, 0xfa, 0x24, 0x62, 0x8b, 0xf8};
  EXPECT_EQ(GpuUuidString(bytes), "GPU-ce0688b6-ea84-0dc3-52c6-01fa24628bf8");
  v1::GpuHandover h = TwoRegions();
  h.set_device_uuid(GpuUuidString(bytes));
  CKPT_EXPECT_OK(CheckGpuHandover(GpuHandoverOf(h), 0).status());
}

TEST(CheckGpuHandoverTest, MalformedHandoversAreRefusedBeforeAnyCudaCall) {
  CKPT_EXPECT_OK(CheckGpuHandover(GpuHandoverOf(TwoRegions()), 0).status());
  std::vector<std::pair<const char*, std::function<void(v1::GpuHandover*)>>> cases = {
      {"short handle", [](v1::GpuHandover* h) { h->mutable_regions(0)->set_ipc_handle("abc"); }},
      {"long handle",
       [](v1::GpuHandover* h) { h->mutable_regions(1)->set_ipc_handle(std::string(65, 'x')); }},
      {"no event", [](v1::GpuHandover* h) { h->clear_step_event(); }},
      {"zero size", [](v1::GpuHandover* h) { h->mutable_regions(0)->set_bytes(0); }},
      {"absurd size",
       [](v1::GpuHandover* h) { h->mutable_regions(0)->set_bytes(uint64_t{1} << 50); }},
      {"no regions", [](v1::GpuHandover* h) { h->clear_regions(); }},
      {"same handle twice",
       [](v1::GpuHandover* h) { h->mutable_regions(1)->set_ipc_handle(Handle(1)); }},
      {"bad uuid", [](v1::GpuHandover* h) { h->set_device_uuid("0"); }},
  };
  for (auto& [what, mutate] : cases) {
    v1::GpuHandover h = TwoRegions();
    mutate(&h);
    CKPT_EXPECT_CODE(CheckGpuHandover(GpuHandoverOf(h), 0).status(), kInvalidArgument) << what;
  }
}

TEST(GpuMemoryTest, OpensValidatesAndClosesEveryMapping) {
  FakeCudaIpc ipc;
  char* a = ipc.Allocate(1, 4096);
  ipc.Allocate(2, 8192 + 512);  // the driver may round an allocation up
  {
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m,
                              GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, &ipc));
    EXPECT_EQ(m->region_count(), 2u);
    EXPECT_EQ(m->region_size(1), 8192u);  // the declared size bounds every copy
    EXPECT_EQ(m->base(0), a);
    EXPECT_EQ(ipc.open_mappings(), 2);
    EXPECT_EQ(OpenGpuMappings().mappings, 2u);
    EXPECT_EQ(OpenGpuMappings().bytes, 4096u + 8192u);
    EXPECT_EQ(ipc.open_events(), 1);
    // Copies are checked against the declared regions.
    char buf[16];
    CKPT_EXPECT_OK(m->CopyOut(buf, a + 4096 - 16, 16));
    CKPT_EXPECT_CODE(m->CopyOut(buf, a + 4096 - 8, 16), kInternal);
    CKPT_EXPECT_CODE(m->CopyIn(m->base(1) + 8190, buf, 16), kInternal);
  }
  EXPECT_EQ(ipc.open_mappings(), 0);
  EXPECT_EQ(ipc.open_events(), 0);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
  EXPECT_EQ(OpenGpuMappings().bytes, 0u);
}

TEST(GpuMemoryTest, ForgedHandleFailsAndLeavesNothingOpen) {
  FakeCudaIpc ipc;
  ipc.Allocate(1, 4096);  // region 1's handle names no allocation
  absl::Status s = GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, &ipc).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("gpu region 1"), std::string::npos) << s;
  EXPECT_EQ(ipc.opens(), 1);  // region 0 was opened, and closed again
  EXPECT_EQ(ipc.open_mappings(), 0);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
}

TEST(GpuMemoryTest, DeclaredSizePastTheRealAllocationFails) {
  FakeCudaIpc ipc;
  ipc.Allocate(1, 4096);
  ipc.Allocate(2, 4096);  // declared 8192
  absl::Status s = GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, &ipc).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("declares 8192 bytes but its allocation has 4096"),
            std::string::npos)
      << s;
  EXPECT_EQ(ipc.open_mappings(), 0);
}

TEST(GpuMemoryTest, ForgedEventAndUnknownDeviceFail) {
  FakeCudaIpc ipc;
  ipc.Allocate(1, 4096);
  ipc.Allocate(2, 8192);
  v1::GpuHandover h = TwoRegions();
  h.set_step_event(Handle(5));
  CKPT_EXPECT_CODE(GpuMemory::Open(GpuHandoverOf(h), {}, &ipc).status(), kInvalidArgument);
  EXPECT_EQ(ipc.open_mappings(), 0);
  const int opens = ipc.opens();
  h = TwoRegions();
  h.set_device_uuid("GPU-00000000-0000-0000-0000-000000000000");
  CKPT_EXPECT_CODE(GpuMemory::Open(GpuHandoverOf(h), {}, &ipc).status(), kFailedPrecondition);
  EXPECT_EQ(ipc.opens(), opens);
}

// ---- Waiting for the device: never blocking, always bounded ----

GpuMemoryOptions ShortWaits() {
  GpuMemoryOptions o;
  o.copy_timeout = absl::Milliseconds(20);
  o.close_timeout = absl::Milliseconds(20);
  return o;
}

// Two regions opened with ShortWaits(), one copy out of the first enqueued,
// and a device that does not finish it.
absl::StatusOr<std::unique_ptr<GpuMemory>> OpenWithACopyThatNeverLands(FakeCudaIpc* ipc) {
  char* a = nullptr;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<GpuMemory> m, OpenTwo(ipc, ShortWaits(), &a));
  static char buf[16];  // outlives the copy, which may land after the caller's frame
  CKPT_RETURN_IF_ERROR(m->StepReady().status());
  CKPT_RETURN_IF_ERROR(m->CopyOut(buf, a, sizeof(buf)));
  ipc->SetStreamsDone(false);
  return m;
}

TEST(GpuMemoryWaitTest, StepReadyAsksForTheTrainersEventWithoutWaiting) {
  FakeCudaIpc ipc;
  char* a = nullptr;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenTwo(&ipc, {}, &a));
  ipc.SetEventDone(kEventId, false);  // the trainer's step still runs on its device
  CKPT_ASSERT_OK_AND_ASSIGN(bool ready, m->StepReady());
  EXPECT_FALSE(ready);
  CKPT_EXPECT_CODE(m->BeginSnapshot(), kFailedPrecondition);
  ipc.SetEventDone(kEventId, true);
  CKPT_ASSERT_OK_AND_ASSIGN(ready, m->StepReady());
  EXPECT_TRUE(ready);
  CKPT_EXPECT_OK(m->BeginSnapshot());
  char buf[16];
  CKPT_EXPECT_OK(m->CopyOut(buf, a, sizeof(buf)));
  CKPT_EXPECT_OK(m->FinishSnapshot());
  EXPECT_FALSE(m->CopiesInFlight());
}

// A wedged device: ckptd's own copies do not complete. FinishSnapshot and
// CopyIn give up at their deadline; no new snapshot starts while the late
// copies may still land; the memory is usable again once they have.
TEST(GpuMemoryWaitTest, CopiesPastTheirDeadlineFailAndHoldBackTheNextSnapshot) {
  FakeCudaIpc ipc;
  char* a = nullptr;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenTwo(&ipc, ShortWaits(), &a));
  CKPT_ASSERT_OK(m->StepReady().status());
  CKPT_ASSERT_OK(m->BeginSnapshot());
  char buf[16];
  CKPT_ASSERT_OK(m->CopyOut(buf, a, sizeof(buf)));
  ipc.SetStreamsDone(false);
  CKPT_EXPECT_CODE(m->FinishSnapshot(), kDeadlineExceeded);
  EXPECT_TRUE(m->CopiesInFlight());
  CKPT_EXPECT_CODE(m->StepReady().status(), kUnavailable);
  ipc.SetStreamsDone(true);
  CKPT_ASSERT_OK_AND_ASSIGN(bool ready, m->StepReady());
  EXPECT_TRUE(ready);
  EXPECT_FALSE(m->CopiesInFlight());
  // A restore's copy is bounded the same way.
  ipc.SetStreamsDone(false);
  CKPT_EXPECT_CODE(m->CopyIn(a, buf, sizeof(buf)), kDeadlineExceeded);
  ipc.SetStreamsDone(true);
  CKPT_EXPECT_OK(m->CopyIn(a, buf, sizeof(buf)));
  m.reset();
  EXPECT_EQ(ipc.open_mappings(), 0);
  EXPECT_EQ(ipc.open_streams(), 0);
}

// The destructor never hangs on a device that does not finish: after a copy
// deadline it does not wait at all, otherwise for close_timeout; then it
// leaves the mappings, event and stream open (counted as leaked) rather
// than close them under copies that may still run.
TEST(GpuMemoryWaitTest, ADeviceThatNeverFinishesLeaksTheMappingsRatherThanHang) {
  for (bool deadline_first : {true, false}) {
    FakeCudaIpc ipc;
    const GpuMappingStats before = OpenGpuMappings();
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenWithACopyThatNeverLands(&ipc));
    if (deadline_first) {
      CKPT_EXPECT_CODE(m->FinishSnapshot(), kDeadlineExceeded);
    }
    m.reset();
    EXPECT_EQ(ipc.open_mappings(), 2) << deadline_first;
    EXPECT_EQ(ipc.open_streams(), 1);
    EXPECT_EQ(ipc.open_events(), 1);
    EXPECT_EQ(OpenGpuMappings().mappings, before.mappings);
    EXPECT_EQ(OpenGpuMappings().leaked, before.leaked + 2);
  }
}

// Regression: once a copy had missed its deadline the destructor leaked the
// mappings without asking the device again, even when the copies had
// landed since. What was held until the copies land (staging) goes back
// with them, or is leaked with the mappings while they may still land.
TEST(GpuMemoryWaitTest, TheDestructorAsksOnceMoreAfterADeadline) {
  for (bool landed : {true, false}) {
    FakeCudaIpc ipc;
    const GpuMappingStats before = OpenGpuMappings();
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenWithACopyThatNeverLands(&ipc));
    CKPT_EXPECT_CODE(m->FinishSnapshot(), kDeadlineExceeded);
    bool given_back = false;
    m->HoldUntilCopiesLand(std::shared_ptr<const void>(new int(0), [&given_back](const void* p) {
      delete static_cast<const int*>(p);
      given_back = true;
    }));
    ipc.SetStreamsDone(landed);
    m.reset();
    EXPECT_EQ(given_back, landed);
    EXPECT_EQ(ipc.open_mappings(), landed ? 0 : 2) << landed;
    EXPECT_EQ(ipc.open_streams(), landed ? 0 : 1);
    EXPECT_EQ(OpenGpuMappings().leaked, before.leaked + (landed ? 0 : 2));
  }
}

// What is held until the copies land goes back once a poll sees them
// landed, not before.
TEST(GpuMemoryWaitTest, HeldStagingGoesBackOnceTheCopiesAreSeenLanded) {
  FakeCudaIpc ipc;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenWithACopyThatNeverLands(&ipc));
  CKPT_EXPECT_CODE(m->FinishSnapshot(), kDeadlineExceeded);
  std::weak_ptr<const void> held;
  {
    auto keep = std::make_shared<const int>(0);
    held = keep;
    m->HoldUntilCopiesLand(std::move(keep));
  }
  CKPT_EXPECT_CODE(m->StepReady().status(), kUnavailable);
  EXPECT_FALSE(held.expired()) << "the copies may still land";
  ipc.SetStreamsDone(true);
  CKPT_ASSERT_OK(m->StepReady().status());
  EXPECT_TRUE(held.expired());
}

// ckptd stopping ends a wait at once (CANCELLED); closing still waits,
// bounded, and closes everything once the copies have landed.
TEST(GpuMemoryWaitTest, StoppingCancelsAWaitAtOnce) {
  FakeCudaIpc ipc;
  char* a = nullptr;
  std::atomic<bool> stopping{true};
  GpuMemoryOptions o;
  o.copy_timeout = absl::Hours(1);
  o.cancel = &stopping;
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m, OpenTwo(&ipc, o, &a));
  char buf[16];
  CKPT_ASSERT_OK(m->StepReady().status());
  CKPT_ASSERT_OK(m->CopyOut(buf, a, sizeof(buf)));
  ipc.SetStreamsDone(false);
  CKPT_EXPECT_CODE(m->FinishSnapshot(), kCancelled);
  EXPECT_TRUE(m->CopiesInFlight());
  ipc.SetStreamsDone(true);
  m.reset();
  EXPECT_EQ(ipc.open_mappings(), 0);
  EXPECT_EQ(ipc.open_streams(), 0);
}

// ---- The engine's GPU path ----

// Three layers (gpu_test_util.h, GpuRequest) in allocations 1 and 2.
class GpuEngineTest : public GpuEngineFixture {
 protected:
  void SetUp() override {
    OpenStore();
    layer_[0] = ipc_.Allocate(1, 2 * kFloats * 4);
    layer_[1] = layer_[0] + kFloats * 4;
    layer_[2] = ipc_.Allocate(2, kFloats * 4);
    EngineOptions o = BaseOptions();
    o.trainer_watch_interval = absl::Milliseconds(20);
    StartEngine(o);
  }
  void TearDown() override { StopEngine(); }

  void Fill(uint64_t step) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto* f = reinterpret_cast<float*>(layer_[l]);
      for (uint64_t i = 0; i < kFloats; ++i) f[i] = Value(l, i, step);
    }
  }
  bool Holds(uint64_t step) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto* f = reinterpret_cast<float*>(layer_[l]);
      for (uint64_t i = 0; i < kFloats; ++i) {
        if (f[i] != Value(l, i, step)) return false;
      }
    }
    return true;
  }
  static RankRef Ref(uint64_t generation) { return RankRef{"gjob", 0, generation}; }
  static StepReport Report(uint64_t generation, uint64_t step) {
    StepReport report;
    report.rank = Ref(generation);
    report.step = step;
    return report;
  }

  // Reports `step` (the buffers already hold it) and waits for its snapshot.
  void Step(uint64_t gen, uint64_t step, const Caller& c) {
    CKPT_ASSERT_OK(engine_->StepDone(Report(gen, step), c));
    CKPT_ASSERT_OK(
        engine_->WaitSnapshot(Ref(gen), step, c, absl::Now() + absl::Seconds(10)).status());
  }

  char* layer_[kLayers] = {};
};

TEST_F(GpuEngineTest, SnapshotsReadTheReportedStepAndRestoreWritesBack) {
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, engine_->Register(Reg(GpuRequest("gjob")), {}, owner_));
  EXPECT_EQ(ipc_.open_mappings(), 2);  // three layers, two allocations
  for (uint64_t step = 1; step <= 3; ++step) {
    Fill(step);
    Step(reg.generation, step, owner_);
    // Mutate at once after the fence, as a trainer does.
    Fill(step + 100);
  }
  EXPECT_EQ(ipc_.event_waits(), 3);
  CKPT_ASSERT_OK(
      engine_->WaitDurable(Ref(reg.generation), 3, owner_, absl::Now() + absl::Seconds(10))
          .status());
  // A new process of the same trainer: re-register (the old mappings close),
  // restore into the GPU buffers.
  CKPT_ASSERT_OK_AND_ASSIGN(Registered again,
                            engine_->Register(Reg(GpuRequest("gjob")), {}, owner_));
  EXPECT_EQ(ipc_.open_mappings(), 2);
  Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(again.generation), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  EXPECT_EQ(restored.bytes, kLayers * kFloats * 4);
  EXPECT_TRUE(Holds(3)) << "restore must write exactly step 3, never the mutation after its fence";
  CKPT_ASSERT_OK(engine_->Unregister(Ref(again.generation), /*drain=*/false, owner_,
                                     absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(ipc_.open_mappings(), 0);
  EXPECT_EQ(ipc_.open_events(), 0);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
}

// As ckpt.dcp's GpuStore registers CUDA tensors: policy EXPLICIT, each
// step naming the layers whose bytes changed. Only those are copied off
// the device and written; a restore takes every other layer's older
// version, and a step that names none is durable with nothing written.
TEST_F(GpuEngineTest, ExplicitStepsCopyAndWriteOnlyTheLayersTheyName) {
  v1::RegisterRequest req = GpuRequest("gjob");
  req.mutable_policy()->set_kind(v1::POLICY_EXPLICIT);
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, engine_->Register(Reg(req), {}, owner_));
  Fill(1);
  StepReport all = Report(reg.generation, 1);
  all.layers = {0, 1, 2};
  CKPT_ASSERT_OK(engine_->StepDone(all, owner_));
  CKPT_ASSERT_OK(
      engine_->WaitDurable(Ref(reg.generation), 1, owner_, absl::Now() + absl::Seconds(10))
          .status());
  // Step 2 changes layer 1 only; the others keep step 1's bytes.
  auto* f = reinterpret_cast<float*>(layer_[1]);
  for (uint64_t i = 0; i < kFloats; ++i) f[i] = Value(1, i, 2);
  const uint64_t copied_before = ipc_.bytes_to_host();
  StepReport one = Report(reg.generation, 2);
  one.layers = {1};
  CKPT_ASSERT_OK(engine_->StepDone(one, owner_));
  CKPT_ASSERT_OK_AND_ASSIGN(
      SnapshotTaken snap,
      engine_->WaitSnapshot(Ref(reg.generation), 2, owner_, absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(snap.layers, std::vector<uint32_t>{1});
  EXPECT_EQ(snap.skipped, 0u);
  EXPECT_EQ(ipc_.bytes_to_host() - copied_before, kFloats * 4) << "one layer copied off the device";
  StepReport none = Report(reg.generation, 3);
  CKPT_ASSERT_OK(engine_->StepDone(none, owner_));
  CKPT_ASSERT_OK(
      engine_->WaitDurable(Ref(reg.generation), 3, owner_, absl::Now() + absl::Seconds(10))
          .status());
  EXPECT_EQ(ipc_.bytes_to_host() - copied_before, kFloats * 4)
      << "a step naming no layer copies nothing";
  for (uint32_t l = 0; l < kLayers; ++l) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("gjob", 0, l, 3));
    ASSERT_TRUE(v.has_value()) << l;
    EXPECT_EQ(v->first, l == 1 ? 2u : 1u) << "layer " << l;
  }
  Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(reg.generation), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto* got = reinterpret_cast<float*>(layer_[l]);
    for (uint64_t i = 0; i < kFloats; ++i) {
      ASSERT_EQ(got[i], Value(l, i, l == 1 ? 2 : 1)) << "layer " << l << " float " << i;
    }
  }
}

TEST_F(GpuEngineTest, FailedCopyDropsTheWholeStepAndItIsRetried) {
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, engine_->Register(Reg(GpuRequest("gjob")), {}, owner_));
  Fill(1);
  ipc_.fail_copies = true;
  CKPT_ASSERT_OK(engine_->StepDone(Report(reg.generation, 1), owner_));
  CKPT_ASSERT_OK_AND_ASSIGN(
      SnapshotTaken snap,
      engine_->WaitSnapshot(Ref(reg.generation), 1, owner_, absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(snap.layers.size(), 0u);  // no partial step
  EXPECT_EQ(snap.skipped, kLayers);
  CKPT_EXPECT_CODE(
      engine_->WaitDurable(Ref(reg.generation), 1, owner_, absl::Now() + absl::Seconds(10))
          .status(),
      kAborted);
  ipc_.fail_copies = false;
  Fill(2);
  Step(reg.generation, 2, owner_);  // every layer is retried
  CKPT_ASSERT_OK(
      engine_->WaitDurable(Ref(reg.generation), 2, owner_, absl::Now() + absl::Seconds(10))
          .status());
  Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(reg.generation), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(Holds(2));
}

TEST_F(GpuEngineTest, AnotherUidsJobIsRefusedBeforeAnythingIsOpened) {
  CKPT_ASSERT_OK(engine_->Register(Reg(GpuRequest("gjob")), {}, owner_).status());
  const int opens = ipc_.opens();
  CKPT_EXPECT_CODE(engine_->Register(Reg(GpuRequest("gjob")), {}, Caller{1001, 0}).status(),
                   kPermissionDenied);
  EXPECT_EQ(ipc_.opens(), opens);
  EXPECT_EQ(ipc_.open_mappings(), 2);  // the owner's registration is untouched
}

TEST_F(GpuEngineTest, TensorsPastTheDeclaredAllocationOpenNothing) {
  v1::RegisterRequest req = GpuRequest("gjob");
  req.mutable_layers(2)->mutable_tensors(0)->set_offset(8);  // 8 bytes past region 1's end
  absl::Status s = engine_->Register(Reg(req), {}, owner_).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("lies outside region 1"), std::string::npos) << s;
  EXPECT_EQ(ipc_.opens(), 0);
  // Declared larger than the allocation really is: opened, found out, closed.
  req = GpuRequest("gjob");
  req.mutable_gpu()->mutable_regions(1)->set_bytes(kFloats * 4 + 4096);
  CKPT_EXPECT_CODE(engine_->Register(Reg(req), {}, owner_).status(), kInvalidArgument);
  EXPECT_EQ(ipc_.open_mappings(), 0);
}

TEST_F(GpuEngineTest, HostAndGpuRegionsDoNotMix) {
  v1::RegisterRequest req = GpuRequest("gjob");
  req.set_handover_token("0123456789abcdef");
  CKPT_EXPECT_CODE(engine_->Register(Reg(req), {}, owner_).status(), kInvalidArgument);
  EXPECT_EQ(ipc_.opens(), 0);
}

TEST_F(GpuEngineTest, StaleGenerationIsRefusedAfterReRegistration) {
  CKPT_ASSERT_OK_AND_ASSIGN(Registered first,
                            engine_->Register(Reg(GpuRequest("gjob")), {}, owner_));
  CKPT_ASSERT_OK_AND_ASSIGN(Registered second,
                            engine_->Register(Reg(GpuRequest("gjob")), {}, owner_));
  EXPECT_EQ(ipc_.open_mappings(), 2);  // the first registration's were closed
  absl::Status s = engine_->StepDone(Report(first.generation, 1), owner_);
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("stale"), std::string::npos) << s;
  CKPT_EXPECT_OK(engine_->StepDone(Report(second.generation, 1), owner_));
}

TEST_F(GpuEngineTest, TrainerExitClosesItsMappings) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const Caller trainer{1000, child};
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg,
                            engine_->Register(Reg(GpuRequest("gjob")), {}, trainer));
  Fill(1);
  Step(reg.generation, 1, trainer);
  EXPECT_EQ(ipc_.open_mappings(), 2);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ipc_.open_mappings() != 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(ipc_.open_mappings(), 0);
  EXPECT_EQ(ipc_.open_events(), 0);
  absl::Status s = engine_->StepDone(Report(reg.generation, 2), trainer);
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("trainer process exited"), std::string::npos) << s;
  // What was acknowledged before the exit stays restorable.
  CKPT_EXPECT_OK(
      engine_->WaitDurable(Ref(reg.generation), 1, trainer, absl::Now() + absl::Seconds(10))
          .status());
}

TEST_F(GpuEngineTest, ShutdownClosesEveryMapping) {
  CKPT_ASSERT_OK(engine_->Register(Reg(GpuRequest("gjob")), {}, owner_).status());
  EXPECT_EQ(ipc_.open_mappings(), 2);
  engine_->Shutdown(absl::Seconds(5));
  EXPECT_EQ(ipc_.open_mappings(), 0);
}

TEST_F(GpuEngineTest, RealCudaWithoutAMatchingDeviceIsAClearError) {
  // The engine's own CudaIpc: on a machine without a GPU (or without this
  // UUID) registration fails before opening anything.
  EngineOptions o;
  o.data_dir = tmp_.path();
  o.io_backend = IoBackendKind::kPwrite;
  Engine engine(o, index_.get(), store_.get(), pool_.get());
  CKPT_ASSERT_OK(engine.Start());
  absl::Status s = engine.Register(Reg(GpuRequest("other")), {}, owner_).status();
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
  engine.Shutdown(absl::Seconds(1));
}

}  // namespace
}  // namespace ckpt
