#include "tests/daemon/engine/engine_test_util.h"

#include <fcntl.h>

#include <filesystem>
#include <fstream>
#include <ios>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/unique_fd.h"
#include "tests/lib/io_test_util.h"

namespace ckpt {
namespace engine_test {

using ::ckpt::testing::MakeTestPool;

void EnginePipelineTest::SetUp() {
  if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
  sp_->StartTest(kWait);
}

void EnginePipelineTest::TearDown() {
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

void EnginePipelineTest::StartEngine(EngineOptions options, size_t chunks, FileSystem* fs,
                                     rocksdb::Env* index_env) {
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

TestRank EnginePipelineTest::MakeRank(const std::string& job, uint32_t layers, PolicyKind policy) {
  TestRank r;
  r.job = job;
  r.layers = layers;
  r.policy = policy;
  absl::StatusOr<MemfdRegion> region = MemfdRegion::Create(job, layers * kLayerFloats * 4);
  EXPECT_TRUE(region.ok()) << region.status();
  if (region.ok()) r.region = std::move(*region);
  return r;
}

Registration EnginePipelineTest::RegistrationOf(const TestRank& r) {
  Registration req;
  req.job = r.job;
  req.world_size = r.world_size;
  req.job_nodes = r.job_nodes;
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

absl::StatusOr<Registered> EnginePipelineTest::Register(TestRank* r, Caller caller,
                                                        std::optional<uid_t> uid) {
  std::vector<UniqueFd> fds;
  fds.emplace_back(::fcntl(r->region.fd(), F_DUPFD_CLOEXEC, 0));
  caller.uid = uid.value_or(owner_.uid);
  absl::StatusOr<Registered> reply = engine_->Register(RegistrationOf(*r), std::move(fds), caller);
  if (reply.ok()) r->generation = reply->generation;
  return reply;
}

absl::Status EnginePipelineTest::StepDone(const TestRank& r, uint64_t step,
                                          const std::vector<uint32_t>& layers,
                                          std::optional<uint64_t> global_durable_step) {
  StepReport report;
  report.rank = Ref(r);
  report.step = step;
  report.lr = 0.1;
  report.layers = layers;
  report.global_durable_step = global_durable_step;
  return engine_->StepDone(report, owner_);
}

absl::Status EnginePipelineTest::StepDoneAs(uid_t uid, const TestRank& r, uint64_t step,
                                            size_t aux_bytes, const std::vector<uint32_t>& layers) {
  StepReport report;
  report.rank = Ref(r);
  report.step = step;
  report.lr = 0.1;
  report.layers = layers;
  report.aux.assign(aux_bytes, 'a');
  return engine_->StepDone(report, Caller{uid, 0});
}

std::vector<uint64_t> EnginePipelineTest::PlannedSteps(const CompositePlan& plan) {
  std::vector<uint64_t> steps;
  for (const PlannedLayer& lp : plan.layers) steps.push_back(lp.has_version ? lp.step : 0);
  return steps;
}

void EnginePipelineTest::ReplaceNode(EngineOptions options) {
  engine_->Shutdown(absl::Seconds(10));
  engine_.reset();
  store_.reset();
  index_.reset();
  std::filesystem::remove_all(tmp_.Join("index"));
  std::filesystem::remove_all(tmp_.Join("jobs"));
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
}

void EnginePipelineTest::WriteStep(TestRank& r, uint64_t step) {
  float* p = static_cast<float*>(r.region.data());
  for (uint64_t i = 0; i < r.layers * kLayerFloats; ++i) {
    p[i] = static_cast<float>(step * 1000003 + i);
  }
}

std::vector<store::VersionRecord> EnginePipelineTest::DamageTwoLayers(const std::string& job,
                                                                      uint64_t step) {
  std::vector<store::VersionRecord> recs;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    auto v = index_->VersionAtOrBefore(job, 0, layer, step);
    EXPECT_TRUE(v.ok() && v->has_value() && (*v)->first == step);
    if (!v.ok() || !v->has_value()) return recs;
    recs.push_back((*v)->second);
  }
  const std::filesystem::path dir =
      std::filesystem::path(tmp_.path()) / "jobs" / job / "rank-00000000";
  std::filesystem::resize_file(dir / recs[0].file(), recs[0].file_bytes() / 2);
  std::fstream f(dir / recs[1].file(), std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(recs[1].file_bytes() - 64);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x10));
  return recs;
}

bool EnginePipelineTest::HoldsStep(const TestRank& r, uint64_t step) {
  const float* p = static_cast<const float*>(r.region.data());
  for (uint64_t i = 0; i < r.layers * kLayerFloats; ++i) {
    if (p[i] != static_cast<float>(step * 1000003 + i)) return false;
  }
  return true;
}

void EnginePipelineTest::WriteStepsLargerThanThePool() {
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

}  // namespace engine_test
}  // namespace ckpt
