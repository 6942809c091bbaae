// The fixture of the engine_pipeline_test sources (engine_*_test.cc): the
// engine's per-step pipeline in this process, over a real Index, LayerStore
// and StagingPool and host memory in memfd regions. Races between the
// trainer's calls and the snapshot and writer threads are each ordered with
// sync points (daemon/common/sync_point.h) at the engine's named points
// ("snapshot.before_publish", "writer.before_commit") rather than with
// sleeps. Where a test waits for a state, it polls it with a deadline; no
// test asserts how long anything took.
//
// One fixture per test, used from the test's thread (the engine's own
// threads call nothing of it). Every test skips in a build without
// CKPT_KILL_POINTS, which has no sync points.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/region.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/io/file_system.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "gtest/gtest.h"
#include "rocksdb/env.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {

using ::ckpt::testing::TempDir;

inline constexpr uint64_t kChunk = 64 << 10;
// 32 KiB per layer: header and payload fit one chunk.
inline constexpr uint64_t kLayerFloats = 8 << 10;
inline constexpr absl::Duration kWait = absl::Seconds(30);

// A point the tests pass themselves: held by a dependency on
// "writer.before_commit", the writer commits nothing until the test passes it.
inline constexpr char kReleaseWriter[] = "PipelineTest:release_writer";

// A trainer rank in this process: one memfd region holding every layer.
struct TestRank {
  std::string job;
  uint32_t layers = 0;
  PolicyKind policy = PolicyKind::kAll;
  MemfdRegion region;
  uint64_t generation = 0;
  std::vector<bool> frozen;            // per layer (may be empty)
  uint32_t world_size = 1;             // it is rank 0 of them
  std::vector<std::string> job_nodes;  // the node of each rank, as a trainer reports it
};

class EnginePipelineTest : public ::testing::Test {
 protected:
  // Skips the test without sync points; else starts the sync point test.
  void SetUp() override;
  // Fails the test when a sync point wait reached its deadline, then stops
  // the engine and frees what StartEngine made, engine first.
  void TearDown() override;

  // Starts an engine over a fresh data directory and a pool of `chunks`
  // chunks of kChunk bytes. `options` gets the data directory, the pwrite
  // backend and one writer unless it sets otherwise. `fs` and `index_env`
  // (nullptr: RocksDB's default) must outlive the engine.
  void StartEngine(EngineOptions options, size_t chunks, FileSystem* fs = DefaultFileSystem(),
                   rocksdb::Env* index_env = nullptr);

  static EngineOptions OneWriter() {
    EngineOptions o;
    o.writer_threads = 1;
    return o;
  }

  // A rank of `layers` f32 layers of kLayerFloats each, in one region.
  static TestRank MakeRank(const std::string& job, uint32_t layers,
                           PolicyKind policy = PolicyKind::kAll);

  // The registration of `r` (rank 0 of its world size), one f32 tensor per
  // layer, laid out one after the other in region 0.
  static Registration RegistrationOf(const TestRank& r);

  // Registers `r` (handing over a duplicate of its region's fd) as `uid`
  // (default: owner_'s); on success `r` takes the new generation.
  absl::StatusOr<Registered> Register(TestRank* r, Caller caller = Caller(),
                                      std::optional<uid_t> uid = std::nullopt);

  // StepDone as owner_, with the explicit `layers` and the job's agreed
  // durable step, if given.
  absl::Status StepDone(const TestRank& r, uint64_t step, const std::vector<uint32_t>& layers = {},
                        std::optional<uint64_t> global_durable_step = std::nullopt);

  // StepDone as `uid` with an aux blob of `aux_bytes`.
  absl::Status StepDoneAs(uid_t uid, const TestRank& r, uint64_t step, size_t aux_bytes,
                          const std::vector<uint32_t>& layers = {});

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

  // The steps of the layers in `plan`, by layer (0 for a layer without a version).
  static std::vector<uint64_t> PlannedSteps(const CompositePlan& plan);

  // The node is lost: the engine stops and its whole data directory goes;
  // a fresh engine starts on an empty one with `options`.
  void ReplaceNode(EngineOptions options);

  // Fills every layer of `r` with values derived from `step`.
  static void WriteStep(TestRank& r, uint64_t step);
  // Whether every layer of `r` holds the values WriteStep(r, step) wrote.
  static bool HoldsStep(const TestRank& r, uint64_t step);

  // Steps `from`..`to` of `r`, each written, reported, snapshotted and
  // durable before the next.
  void Train(TestRank& r, uint64_t from, uint64_t to) {
    for (uint64_t t = from; t <= to; ++t) {
      WriteStep(r, t);
      CKPT_ASSERT_OK(StepDone(r, t));
      CKPT_ASSERT_OK(WaitSnapshot(r, t).status());
      CKPT_ASSERT_OK(WaitDurable(r, t).status());
    }
  }

  // Damages rank 0 of `job` at `step`, whose layers 0 and 1 each have a
  // version of that step: layer 0's file truncated to half, one payload bit
  // of layer 1's flipped. Returns the two records (fewer: a test failure).
  std::vector<store::VersionRecord> DamageTwoLayers(const std::string& job, uint64_t step);

  // Three steps of an 8-layer rank (policy all) on a 2-chunk pool: every
  // layer of every step is written, and a restore gives back step 3.
  // REQUIRES: StartEngine with a pool of 2 chunks.
  void WriteStepsLargerThanThePool();

  SyncPoint* const sp_ = SyncPoint::GetInstance();
  TempDir tmp_;
  std::unique_ptr<rocksdb::Env> index_env_;  // outlives index_ (TearDown resets it first)
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
  std::unique_ptr<Engine> engine_;
  const Caller owner_{1000, 0};
};

}  // namespace engine_test
}  // namespace ckpt
