// GpuEngineFixture: an Engine over a real index, layer store and staging
// pool, with the fake CudaIpc (gpu_test_util.h) behind it — what the GPU
// engine tests share. GpuSyncFixture adds the sync points that order their
// races (skipped in a build without them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/io/file_system.h"
#include "daemon/metrics/metrics.h"
#include "gtest/gtest.h"
#include "tests/daemon/gpu/gpu_test_util.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace gpu_test {

// How long a sync point or an engine wait of a test may take.
inline constexpr absl::Duration kWait = absl::Seconds(30);

class GpuEngineFixture : public ::testing::Test {
 protected:
  // The staging pool, index and layer store (before StartEngine).
  void OpenStore() {
    pool_ = ::ckpt::testing::MakeTestPool(64 << 10, 64);
    ASSERT_NE(pool_, nullptr);
    CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index")));
    store_ = std::make_unique<LayerStore>(tmp_.path(), DefaultFileSystem(), index_.get(), true);
    CKPT_ASSERT_OK(store_->Init());
  }
  // One writer, pwrite, the fake CUDA and the metrics; tests add the rest.
  EngineOptions BaseOptions() {
    EngineOptions o;
    o.data_dir = tmp_.path();
    o.writer_threads = 1;
    o.io_backend = IoBackendKind::kPwrite;
    o.cuda_ipc = &ipc_;
    o.metrics = &metrics_;
    return o;
  }
  void StartEngine(const EngineOptions& o) {
    engine_ = std::make_unique<Engine>(o, index_.get(), store_.get(), pool_.get());
    CKPT_ASSERT_OK(engine_->Start());
  }
  void StopEngine() {
    if (engine_ != nullptr) engine_->Shutdown(absl::Seconds(5));
    engine_.reset();
  }
  absl::Status StepDone(const RankRef& rank, uint64_t step) {
    StepReport report;
    report.rank = rank;
    report.step = step;
    return engine_->StepDone(report, owner_);
  }

  ::ckpt::testing::TempDir tmp_;
  FakeCudaIpc ipc_;
  Metrics metrics_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
  std::unique_ptr<Engine> engine_;
  const Caller owner_{1000, 0};
};

class GpuSyncFixture : public GpuEngineFixture {
 protected:
  void SetUp() override {
    if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
    sp_->StartTest(kWait);
    OpenStore();
  }
  void TearDown() override {
    if (!kSyncPointsCompiled) return;
    EXPECT_EQ(sp_->timeouts(), 0u) << "a sync point wait reached its deadline";
    sp_->DisableProcessing();
    StopEngine();
    sp_->EndTest();
  }

  SyncPoint* const sp_ = SyncPoint::GetInstance();
};

}  // namespace gpu_test
}  // namespace ckpt
