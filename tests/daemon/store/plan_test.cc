// Tests of daemon/recovery/plan: composite plans and restore.
#include "daemon/recovery/plan.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/restore.h"
#include "daemon/shm/rank_memory.h"
#include "gtest/gtest.h"
#include "tests/daemon/store/store_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;
using store_test::MakeTestPool;
using store_test::Staged;
using store_test::StageVersion;
using store_test::TensorName;

const char kJob[] = "job-plan";

// Layer l has tensors of these sizes.
const std::vector<std::vector<uint64_t>> kLayerSizes = {{1000, 24}, {5000}, {300, 300, 7}};

// The pwrite backend, saying it overlaps or not as told: over one that
// overlaps, a restore holds each version until its next read, as over
// io_uring, in a fixed order (an overlapped read's work runs first, then the
// reads). `before_read` (if set) runs as each read call begins, with its
// number, 0 first, and `log` (if set) records where each begins and ends.
class TestBackend final : public IoBackend {
 public:
  explicit TestBackend(bool overlaps = true, std::function<void(int)> before_read = nullptr,
                       std::vector<std::string>* log = nullptr)
      : base_(MakePwriteBackend()),
        overlaps_(overlaps),
        before_read_(std::move(before_read)),
        log_(log) {}
  const char* Name() const override { return "test"; }
  bool Overlaps() const override { return overlaps_; }
  void Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) override {
    reading_ = direction == IoDirection::kRead;
    if (reading_) {
      if (before_read_) before_read_(reads_);
      ++reads_;
      if (log_ != nullptr) log_->push_back("read");
    }
    base_->Submit(direction, fd, segments);
  }
  absl::Status Wait() override {
    absl::Status s = base_->Wait();
    if (reading_ && log_ != nullptr) log_->push_back("read done");
    return s;
  }

 private:
  const std::unique_ptr<IoBackend> base_;
  const bool overlaps_;
  const std::function<void(int)> before_read_;
  std::vector<std::string>* const log_;
  int reads_ = 0;
  bool reading_ = false;
};

// A rank's memory for a restore to write into: host memory copied on the
// CPU ("host"), or memory a DMA engine would fill ("cuda"), one copy at a
// time. `on_copy` (if set) sees every piece before it is copied.
class TestMemory final : public RankMemory {
 public:
  explicit TestMemory(const char* kind,
                      std::function<void(char*, const void*, uint64_t)> on_copy = nullptr)
      : kind_(kind), on_copy_(std::move(on_copy)) {}
  const char* kind() const override { return kind_; }
  size_t region_count() const override { return 0; }
  uint64_t region_size(size_t) const override { return 0; }
  char* base(size_t) const override { return nullptr; }
  absl::Status BeginSnapshot() override { return absl::OkStatus(); }
  absl::Status CopyOut(void*, const char*, uint64_t) override { return absl::OkStatus(); }
  absl::Status FinishSnapshot() override { return absl::OkStatus(); }
  absl::Status CopyIn(char* dst, const void* src, uint64_t n) override {
    if (on_copy_) on_copy_(dst, src, n);
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }

 private:
  const char* const kind_;
  const std::function<void(char*, const void*, uint64_t)> on_copy_;
};

// An in-memory source answering from a function.
class FunctionSource final : public VersionSource {
 public:
  using Fn = std::function<std::shared_ptr<const StagingLease>(const VersionKey&)>;
  explicit FunctionSource(Fn fn) : fn_(std::move(fn)) {}
  std::shared_ptr<const StagingLease> FindImage(const VersionKey& key,
                                                const store::VersionRecord&) override {
    return fn_(key);
  }

 private:
  const Fn fn_;
};

// Where each (layer, tensor) of `out` goes, for every layer up to the
// largest in it.
RestoreTarget TargetOf(std::map<std::pair<uint32_t, uint32_t>, std::string>* out,
                       RankMemory* memory = nullptr) {
  RestoreTarget target;
  target.memory = memory;
  for (auto& [where, bytes] : *out) {
    const auto [layer, tensor] = where;
    if (target.tensors.size() <= layer) target.tensors.resize(layer + 1);
    if (target.tensors[layer].size() <= tensor) target.tensors[layer].resize(tensor + 1);
    target.tensors[layer][tensor] = bytes.data();
  }
  return target;
}

// One tensor per layer, layer l into out[l].
RestoreTarget TargetOfLayers(std::vector<std::string>* out, RankMemory* memory = nullptr) {
  RestoreTarget target;
  target.memory = memory;
  for (std::string& bytes : *out) target.tensors.push_back({bytes.data()});
  return target;
}

class PlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io_ = std::make_unique<TestBackend>();
    io2_ = std::make_unique<TestBackend>();
    pool_ = MakeTestPool(8192, 64);
    ASSERT_NE(pool_, nullptr);
    CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index")));
    store_ = std::make_unique<LayerStore>(tmp_.path(), DefaultFileSystem(), index_.get(), true);
    CKPT_ASSERT_OK(store_->Init());
    for (size_t l = 0; l < kLayerSizes.size(); ++l) {
      store::LayerSpec* spec = table_.add_layers();
      spec->set_id(static_cast<uint32_t>(l));
      spec->set_name(absl::StrCat("layer", l));
      for (size_t i = 0; i < kLayerSizes[l].size(); ++i) {
        store::TensorSpec* t = spec->add_tensors();
        t->set_name(TensorName(i));
        t->set_dtype(store::DTYPE_U8);
        t->add_shape(kLayerSizes[l][i]);
        t->set_nbytes(kLayerSizes[l][i]);
      }
    }
    table_.set_world_size(1);
  }

  // Commits layer `layer` at `step`; remembers its bytes and payload size.
  void CommitVersion(uint32_t layer, uint64_t step) {
    Staged s;
    const VersionKey key{kJob, 0, layer, step};
    ASSERT_NO_FATAL_FAILURE(
        StageVersion(pool_.get(), key, 1, kLayerSizes[layer], layer * 1000 + step, &s));
    CKPT_ASSERT_OK_AND_ASSIGN(store::VersionRecord rec, store_->Commit(&s.version, io_.get()));
    data_[{layer, step}] = s.data;
    payload_[{layer, step}] = rec.payload_bytes();
    files_[{layer, step}] = rec.file();
  }

  void PutEvent(uint64_t step) {
    store::EventRecord e;
    e.set_aux(absl::StrCat("aux", step));
    CKPT_ASSERT_OK(index_->PutEvent(kJob, 0, step, e));
  }

  // Versions: layer 0 at 10, 20, 30; layer 1 at 10, 25; layer 2 at 30 only.
  void CommitHistory() {
    for (auto [layer, step] : std::vector<std::pair<uint32_t, uint64_t>>{
             {0, 10}, {1, 10}, {0, 20}, {1, 25}, {0, 30}, {2, 30}}) {
      ASSERT_NO_FATAL_FAILURE(CommitVersion(layer, step));
    }
    for (uint64_t step : {10u, 20u, 25u, 30u}) ASSERT_NO_FATAL_FAILURE(PutEvent(step));
  }

  // What a restore reads from: the store through `readers` (default: both
  // test backends), and `in_memory` first.
  RecoverySources Sources(std::vector<IoBackend*> readers = {},
                          absl::Duration timeout = absl::Seconds(30),
                          VersionSource* in_memory = nullptr) {
    RecoverySources sources;
    sources.index = index_.get();
    sources.store = store_.get();
    sources.pool = pool_.get();
    sources.readers = readers.empty() ? std::vector<IoBackend*>{io_.get(), io2_.get()} : readers;
    if (in_memory != nullptr) sources.in_memory.push_back(in_memory);
    sources.timeout = timeout;
    return sources;
  }

  absl::StatusOr<RestoreStats> Restore(const CompositePlan& plan, const store::RankRecord& table,
                                       std::map<std::pair<uint32_t, uint32_t>, std::string>* out,
                                       VersionSource* in_memory = nullptr) {
    for (const store::LayerSpec& l : table.layers()) {
      for (int i = 0; i < l.tensors_size(); ++i) {
        (*out)[{l.id(), static_cast<uint32_t>(i)}] = std::string(l.tensors(i).nbytes(), '\0');
      }
    }
    return RestoreInto(plan, table, TargetOf(out), Sources({}, absl::Seconds(30), in_memory));
  }

  // `layers` layers of one 5000-byte tensor each, committed at step 10:
  // every plan of step 10 reads `layers` files.
  void CommitWide(uint32_t layers, store::RankRecord* table) {
    for (uint32_t l = 0; l < layers; ++l) {
      Staged st;
      const VersionKey key{kJob, 0, l, 10};
      ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), key, 1, {5000}, l * 7 + 1, &st));
      CKPT_ASSERT_OK_AND_ASSIGN(store::VersionRecord rec, store_->Commit(&st.version, io_.get()));
      data_[{l, 10}] = st.data;
      files_[{l, 10}] = rec.file();
      store::LayerSpec* spec = table->add_layers();
      spec->set_id(l);
      spec->set_name(absl::StrCat("layer", l));
      store::TensorSpec* t = spec->add_tensors();
      t->set_name(TensorName(0));
      t->set_dtype(store::DTYPE_U8);
      t->add_shape(5000);
      t->set_nbytes(5000);
    }
    table->set_world_size(1);
    ASSERT_NO_FATAL_FAILURE(PutEvent(10));
  }

  // The committed image of layer `layer` at step 10, read from disk into
  // `images`, as the memory tier would hold it.
  void LoadImage(uint32_t layer, StagingPool* images,
                 std::map<uint32_t, std::shared_ptr<const StagingLease>>* memory) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto rec, index_->VersionAtOrBefore(kJob, 0, layer, 10));
    ASSERT_TRUE(rec.has_value());
    CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion v,
                              store_->Read(VersionKey{kJob, 0, layer, 10}, rec->second, io_.get(),
                                           images, absl::Now() + absl::Seconds(5)));
    (*memory)[layer] = std::make_shared<const StagingLease>(std::move(v.lease));
  }

  std::string FilePath(uint32_t layer, uint64_t step) {
    return absl::StrCat(tmp_.path(), "/jobs/", kJob, "/rank-00000000/", files_[{layer, step}]);
  }

  // XORs byte `offset` of the file of (layer, step) with `mask`.
  void FlipByte(uint32_t layer, uint64_t step, uint64_t offset, char mask) {
    std::string file = ::ckpt::testing::ReadFile(FilePath(layer, step));
    ASSERT_LT(offset, file.size());
    file[offset] = static_cast<char>(file[offset] ^ mask);
    ::ckpt::testing::WriteFile(FilePath(layer, step), file);
  }

  TempDir tmp_;
  std::unique_ptr<IoBackend> io_;
  std::unique_ptr<IoBackend> io2_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
  store::RankRecord table_;
  std::map<std::pair<uint32_t, uint64_t>, std::vector<std::string>> data_;
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> payload_;
  std::map<std::pair<uint32_t, uint64_t>, std::string> files_;
};

TEST_F(PlanTest, NoEventsIsNotFound) {
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), kJob, 0, 0, table_), kNotFound);
  ASSERT_NO_FATAL_FAILURE(CommitVersion(0, 10));
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), kJob, 0, 0, table_), kNotFound);
  ASSERT_NO_FATAL_FAILURE(PutEvent(10));
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), kJob, 0, 9, table_), kNotFound);
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), kJob, 1, 0, table_), kNotFound);
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), "job-plan2", 0, 0, table_), kNotFound);
}

TEST_F(PlanTest, LatestPlanPicksNewestVersionPerLayer) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table_));
  EXPECT_EQ(plan.job, kJob);
  EXPECT_EQ(plan.rank, 0u);
  EXPECT_EQ(plan.target_step, 30u);
  EXPECT_EQ(plan.aux, "aux30");
  EXPECT_TRUE(plan.complete);
  ASSERT_EQ(plan.layers.size(), 3u);
  const std::vector<uint64_t> want_step = {30, 25, 30};
  double weighted = 0, total = 0;
  uint64_t total_bytes = 0;
  for (int l = 0; l < 3; ++l) {
    const PlannedLayer& lp = plan.layers[l];
    EXPECT_EQ(lp.layer, static_cast<uint32_t>(l));
    EXPECT_EQ(lp.name, absl::StrCat("layer", l));
    EXPECT_TRUE(lp.has_version);
    EXPECT_EQ(lp.step, want_step[l]) << l;
    EXPECT_EQ(lp.staleness, 30 - want_step[l]) << l;
    const uint64_t bytes = payload_[{static_cast<uint32_t>(l), want_step[l]}];
    EXPECT_EQ(lp.bytes, bytes);
    EXPECT_EQ(lp.file, (files_[{static_cast<uint32_t>(l), want_step[l]}]));
    weighted += static_cast<double>(bytes) * static_cast<double>(30 - want_step[l]);
    total += static_cast<double>(bytes);
    total_bytes += bytes;
  }
  EXPECT_EQ(plan.total_bytes, total_bytes);
  EXPECT_EQ(plan.max_staleness, 5u);
  EXPECT_GT(plan.size_weighted_staleness, 0.0);
  EXPECT_DOUBLE_EQ(plan.size_weighted_staleness, weighted / total);
}

TEST_F(PlanTest, OlderTargetIsIncompleteWhenALayerHasNoVersion) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 20, table_));
  EXPECT_EQ(plan.target_step, 20u);
  EXPECT_EQ(plan.aux, "aux20");
  EXPECT_FALSE(plan.complete);
  ASSERT_EQ(plan.layers.size(), 3u);
  EXPECT_EQ(plan.layers[0].step, 20u);
  EXPECT_EQ(plan.layers[0].staleness, 0u);
  EXPECT_EQ(plan.layers[1].step, 10u);
  EXPECT_EQ(plan.layers[1].staleness, 10u);
  EXPECT_FALSE(plan.layers[2].has_version);
  EXPECT_EQ(plan.max_staleness, 10u);
  const double b0 = static_cast<double>(payload_[{0, 20}]);
  const double b1 = static_cast<double>(payload_[{1, 10}]);
  EXPECT_DOUBLE_EQ(plan.size_weighted_staleness, (b1 * 10) / (b0 + b1));
  EXPECT_EQ(plan.total_bytes, (payload_[{0, 20}] + payload_[{1, 10}]));
}

// A lost version (Index::MarkLost) refuses each plan that would otherwise
// quietly take its layer's previous version, across a reopen of the index;
// older_within takes that version when it is close enough to the target.
TEST_F(PlanTest, ALostVersionRefusesThePlansThatNeedIt) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  store::LostVersion lost;
  lost.set_reason("damaged: checksum mismatch");
  CKPT_ASSERT_OK(index_->MarkLost(VersionKey{kJob, 0, 1, 25}, lost));
  CKPT_ASSERT_OK(index_->MarkLost(VersionKey{kJob, 0, 0, 20}, lost));
  EXPECT_EQ(index_->VersionsOf(kJob, 0).total.versions, 4u) << "counted as they go";
  store_.reset();
  index_.reset();
  CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index")));
  EXPECT_EQ(index_->VersionsOf(kJob, 0).total.versions, 4u)
      << "and recounted: their records are gone";

  absl::StatusOr<CompositePlan> at30 = BuildPlan(index_.get(), kJob, 0, 30, table_);
  ASSERT_TRUE(absl::IsDataLoss(at30.status())) << at30.status();
  EXPECT_EQ(ReasonOf(at30.status()), ErrorReason::kLostVersion);
  EXPECT_TRUE(absl::StrContains(at30.status().message(),
                                "layer 1 'layer1' lost its version of step 25 (damaged: "
                                "checksum mismatch); its previous is step 10, 20 steps before"))
      << at30.status();
  EXPECT_FALSE(absl::StrContains(at30.status().message(), "layer 0"))
      << "layer 0's step 30 is newer than its lost version";
  CKPT_EXPECT_CODE(BuildPlan(index_.get(), kJob, 0, 30, table_, 19), kDataLoss);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan older, BuildPlan(index_.get(), kJob, 0, 30, table_, 20));
  EXPECT_EQ(older.layers[0].step, 30u);
  EXPECT_EQ(older.layers[0].lost_step, 0u);
  EXPECT_EQ(older.layers[1].step, 10u);
  EXPECT_EQ(older.layers[1].lost_step, 25u);
  EXPECT_EQ(older.layers[1].staleness, 20u);

  // Step 25 needs layer 0's lost step 20; step 10 needs neither.
  absl::StatusOr<CompositePlan> at25 = BuildPlan(index_.get(), kJob, 0, 25, table_);
  EXPECT_TRUE(absl::StrContains(at25.status().message(),
                                "layer 0 'layer0' lost its version of "
                                "step 20"))
      << at25.status();
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan at10, BuildPlan(index_.get(), kJob, 0, 10, table_));
  EXPECT_EQ(at10.layers[1].lost_step, 0u);

  // Found again (ckptctl repair puts the record back and forgets the loss).
  CKPT_ASSERT_OK(index_->DeleteLost(VersionKey{kJob, 0, 1, 25}));
  CKPT_ASSERT_OK(index_->DeleteLost(VersionKey{kJob, 0, 0, 20}));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plain, BuildPlan(index_.get(), kJob, 0, 30, table_));
  EXPECT_EQ(plain.layers[1].step, 10u);
}

// A target must be a durable step (one with a checkpoint event): step 27 has
// none, so it is not restorable and the error names the nearest earlier one.
TEST_F(PlanTest, TargetBetweenEventsIsNotRestorable) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  absl::StatusOr<CompositePlan> plan = BuildPlan(index_.get(), kJob, 0, 27, table_);
  ASSERT_TRUE(absl::IsNotFound(plan.status())) << plan.status();
  EXPECT_NE(plan.status().message().find("25"), absl::string_view::npos) << plan.status();
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan at25, BuildPlan(index_.get(), kJob, 0, 25, table_));
  EXPECT_EQ(at25.target_step, 25u);
  EXPECT_EQ(at25.aux, "aux25");
  EXPECT_EQ(at25.layers[0].step, 20u);
  EXPECT_EQ(at25.layers[0].staleness, 5u);
  EXPECT_EQ(at25.layers[1].step, 25u);
  EXPECT_EQ(at25.layers[1].staleness, 0u);
  EXPECT_FALSE(at25.complete);
}

TEST_F(PlanTest, RestoreStopsWhenCancelled) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table_));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  for (const store::LayerSpec& l : table_.layers()) {
    for (int i = 0; i < l.tensors_size(); ++i) {
      out[{l.id(), static_cast<uint32_t>(i)}] = std::string(l.tensors(i).nbytes(), '\0');
    }
  }
  plan.complete = true;  // reach the per-layer loop
  const std::atomic<bool> cancelled{true};
  RecoverySources sources = Sources();
  sources.cancelled = &cancelled;
  absl::StatusOr<RestoreStats> stats = RestoreInto(plan, table_, TargetOf(&out), sources);
  EXPECT_TRUE(absl::IsCancelled(stats.status())) << stats.status();
}

TEST_F(PlanTest, RestoreCopiesThePlannedBytes) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table_));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  CKPT_ASSERT_OK_AND_ASSIGN(RestoreStats stats, Restore(plan, table_, &out));
  uint64_t bytes = 0;
  for (const PlannedLayer& lp : plan.layers) {
    const std::vector<std::string>& want = data_[{lp.layer, lp.step}];
    ASSERT_EQ(want.size(), kLayerSizes[lp.layer].size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE((out[{lp.layer, static_cast<uint32_t>(i)}]) == want[i])
          << "layer " << lp.layer << " tensor " << i;
      bytes += want[i].size();
    }
  }
  EXPECT_EQ(stats.bytes, bytes);
  EXPECT_EQ(pool_->bytes_in_use(), 0u);
}

TEST_F(PlanTest, RestoreRefusesIncompletePlan) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 20, table_));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  CKPT_EXPECT_CODE(Restore(plan, table_, &out), kFailedPrecondition);
}

TEST_F(PlanTest, RestoreRefusesMismatchedDestinationTable) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table_));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;

  store::RankRecord bigger = table_;
  bigger.mutable_layers(1)->mutable_tensors(0)->set_nbytes(5001);
  CKPT_EXPECT_CODE(Restore(plan, bigger, &out), kFailedPrecondition);

  store::RankRecord smaller = table_;
  smaller.mutable_layers(2)->mutable_tensors(2)->set_nbytes(6);
  CKPT_EXPECT_CODE(Restore(plan, smaller, &out), kFailedPrecondition);

  store::RankRecord dtype = table_;
  dtype.mutable_layers(0)->mutable_tensors(1)->set_dtype(store::DTYPE_F32);
  CKPT_EXPECT_CODE(Restore(plan, dtype, &out), kFailedPrecondition);

  store::RankRecord renamed = table_;
  renamed.mutable_layers(0)->mutable_tensors(0)->set_name("other");
  CKPT_EXPECT_CODE(Restore(plan, renamed, &out), kFailedPrecondition);

  store::RankRecord extra = table_;
  store::TensorSpec* t = extra.mutable_layers(1)->add_tensors();
  t->set_name("extra");
  t->set_dtype(store::DTYPE_U8);
  t->set_nbytes(4);
  CKPT_EXPECT_CODE(Restore(plan, extra, &out), kFailedPrecondition);
  EXPECT_EQ(pool_->bytes_in_use(), 0u);
}

TEST_F(PlanTest, RestoreFailsClosedOnCorruption) {
  ASSERT_NO_FATAL_FAILURE(CommitHistory());
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table_));
  // Corrupt the last byte of layer 1's (step 25) payload.
  ASSERT_NO_FATAL_FAILURE(FlipByte(1, 25, 4096 + 4999, 1));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  absl::StatusOr<RestoreStats> stats = Restore(plan, table_, &out);
  CKPT_EXPECT_CODE(stats, kDataLoss);
  EXPECT_NE(stats.status().message().find("layer 1"), absl::string_view::npos) << stats.status();
}

// Two readers and a pool with room for one version at a time: versions take
// their leases in plan order, and a thread finishes the version it holds
// before it waits for room, so the oldest is never starved by a later one (a
// deadlock would end at the 30 s deadline).
TEST_F(PlanTest, RestoreWithTwoReadersNeedsRoomForOneVersionOnly) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(12, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  ASSERT_EQ(plan.layers.size(), 12u);
  pool_ = MakeTestPool(8192, 2);  // one file: 4096 header + 5000 payload
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  CKPT_ASSERT_OK_AND_ASSIGN(RestoreStats stats, Restore(plan, table, &out));
  EXPECT_EQ(stats.bytes, 12u * 5000u);
  for (uint32_t l = 0; l < 12; ++l) EXPECT_TRUE((out[{l, 0}] == data_[{l, 10}][0])) << l;
  EXPECT_EQ(pool_->bytes_in_use(), 0u);

  // One reader, which would hold the version it copies out while it reads
  // the next: with no room for both it copies first.
  for (auto& [where, bytes] : out) bytes.assign(bytes.size(), '\0');
  CKPT_ASSERT_OK_AND_ASSIGN(stats, RestoreInto(plan, table, TargetOf(&out), Sources({io_.get()})));
  EXPECT_EQ(stats.bytes, 12u * 5000u);
  for (uint32_t l = 0; l < 12; ++l) EXPECT_TRUE((out[{l, 0}] == data_[{l, 10}][0])) << l;
  EXPECT_EQ(pool_->bytes_in_use(), 0u);
}

// Versions served from memory take their turn too (else the disk version
// after one would wait for a turn that never comes).
TEST_F(PlanTest, RestoreMixesMemoryAndDiskVersions) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(9, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  // Even layers from memory: their committed images, read from disk now.
  std::unique_ptr<StagingPool> images = MakeTestPool(8192, 18);  // nine images
  std::map<uint32_t, std::shared_ptr<const StagingLease>> memory;
  for (uint32_t l = 0; l < 9; l += 2) ASSERT_NO_FATAL_FAILURE(LoadImage(l, images.get(), &memory));
  pool_ = MakeTestPool(8192, 2);
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  FunctionSource some([&memory](const VersionKey& key) {
    auto it = memory.find(key.layer);
    return it == memory.end() ? nullptr : it->second;
  });
  CKPT_ASSERT_OK_AND_ASSIGN(RestoreStats stats, Restore(plan, table, &out, &some));
  EXPECT_EQ(stats.memory_layers, 5u);
  EXPECT_EQ(stats.memory_bytes, 5u * 5000u);
  EXPECT_EQ(stats.bytes, 9u * 5000u);
  for (uint32_t l = 0; l < 9; ++l) EXPECT_TRUE((out[{l, 0}] == data_[{l, 10}][0])) << l;
  // Four versions were read: the time with a read under way is some of the
  // restore's; with every version in memory it is none.
  EXPECT_GT(stats.reading_seconds, 0);
  EXPECT_LE(stats.reading_seconds, stats.seconds);
  for (uint32_t l = 1; l < 9; l += 2) ASSERT_NO_FATAL_FAILURE(LoadImage(l, images.get(), &memory));
  FunctionSource all([&memory](const VersionKey& key) { return memory.at(key.layer); });
  CKPT_ASSERT_OK_AND_ASSIGN(stats, Restore(plan, table, &out, &all));
  EXPECT_EQ(stats.memory_layers, 9u);
  EXPECT_EQ(stats.reading_seconds, 0);
}

// An in-memory source that drops what a restore tells it did not check.
class DroppingSource final : public VersionSource {
 public:
  explicit DroppingSource(std::map<uint32_t, std::shared_ptr<const StagingLease>>* images)
      : images_(images) {}
  std::shared_ptr<const StagingLease> FindImage(const VersionKey& key,
                                                const store::VersionRecord&) override {
    absl::MutexLock lock(&mu_);
    auto it = images_->find(key.layer);
    return it == images_->end() ? nullptr : it->second;
  }
  void Drop(const VersionKey& key, const store::VersionRecord&) override {
    absl::MutexLock lock(&mu_);
    images_->erase(key.layer);
    dropped_.push_back(key.layer);
  }
  std::vector<uint32_t> dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }

 private:
  absl::Mutex mu_;
  std::map<uint32_t, std::shared_ptr<const StagingLease>>* const images_ ABSL_PT_GUARDED_BY(mu_);
  std::vector<uint32_t> dropped_ ABSL_GUARDED_BY(mu_);
};

// A memory image is checked as its tensors are copied out (on the restore's
// threads), not whole before: one whose payload is damaged under an intact
// header fails the restore naming its layer, without blaming the disk, and
// is dropped from its source; the next restore reads that version from disk.
TEST_F(PlanTest, ADamagedMemoryImageIsDroppedAndReadFromDiskNextTime) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(4, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  std::unique_ptr<StagingPool> images = MakeTestPool(8192, 8);
  std::map<uint32_t, std::shared_ptr<const StagingLease>> memory;
  for (uint32_t l = 0; l < 4; ++l) ASSERT_NO_FATAL_FAILURE(LoadImage(l, images.get(), &memory));
  // Payload byte 17 of layer 2's tensor (the payload starts at 4096).
  memory[2]->chunk(0)[4096 + 17] ^= 0x40;
  DroppingSource tier(&memory);
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  for (const store::LayerSpec& l : table.layers()) out[{l.id(), 0}] = std::string(5000, '\0');
  std::vector<VersionKey> damaged, damaged_images;
  absl::StatusOr<RestoreStats> stats =
      RestoreInto(plan, table, TargetOf(&out), Sources({}, absl::Seconds(30), &tier), &damaged,
                  &damaged_images);
  CKPT_EXPECT_CODE(stats, kDataLoss);
  EXPECT_NE(stats.status().message().find("layer 2"), absl::string_view::npos) << stats.status();
  EXPECT_TRUE(damaged.empty());
  ASSERT_EQ(damaged_images.size(), 1u);
  EXPECT_EQ(damaged_images[0].layer, 2u);
  EXPECT_EQ(tier.dropped(), std::vector<uint32_t>{2});
  CKPT_ASSERT_OK_AND_ASSIGN(RestoreStats again, RestoreInto(plan, table, TargetOf(&out),
                                                            Sources({}, absl::Seconds(30), &tier)));
  EXPECT_EQ(again.memory_layers, 3u);
  for (uint32_t l = 0; l < 4; ++l) EXPECT_TRUE((out[{l, 0}] == data_[{l, 10}][0])) << l;
}

// The error is the first failing version in plan order, whichever thread
// found which first: layer 3 does not check (found by the copier), layer 4's
// file is gone (found by a reader, possibly earlier).
TEST_F(PlanTest, RestoreReportsTheFirstFailureInPlanOrder) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(8, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  ASSERT_NO_FATAL_FAILURE(FlipByte(3, 10, 4096 + 17, 0x40));
  ASSERT_EQ(::unlink(FilePath(4, 10).c_str()), 0);
  for (int i = 0; i < 20; ++i) {
    std::map<std::pair<uint32_t, uint32_t>, std::string> out;
    absl::StatusOr<RestoreStats> stats = Restore(plan, table, &out);
    CKPT_EXPECT_CODE(stats, kDataLoss);
    EXPECT_NE(stats.status().message().find("layer 3"), absl::string_view::npos) << stats.status();
    EXPECT_EQ(pool_->bytes_in_use(), 0u);
    // Layers before the failure arrived.
    for (uint32_t l = 0; l < 3; ++l) EXPECT_TRUE((out[{l, 0}] == data_[{l, 10}][0])) << l;
  }
}

// A version whose record vanished (ABORTED: plan again) before a corrupt
// one is what the restore reports, however the two threads interleave.
TEST_F(PlanTest, RestoreReportsAVanishedVersionBeforeALaterCorruptOne) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(8, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  CKPT_ASSERT_OK(index_->DeleteVersion(VersionKey{kJob, 0, 2, 10}));
  ASSERT_NO_FATAL_FAILURE(FlipByte(5, 10, 4096 + 3, 0x01));
  for (int i = 0; i < 20; ++i) {
    std::map<std::pair<uint32_t, uint32_t>, std::string> out;
    absl::StatusOr<RestoreStats> stats = Restore(plan, table, &out);
    CKPT_EXPECT_CODE(stats, kAborted);
    EXPECT_NE(stats.status().message().find("layer 2"), absl::string_view::npos) << stats.status();
    EXPECT_EQ(pool_->bytes_in_use(), 0u);
  }
}

// A restore that cannot get staging room gives up at its deadline, holding
// nothing.
TEST_F(PlanTest, RestoreGivesUpAtItsDeadlineWhenThePoolHasNoRoom) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(4, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  pool_ = MakeTestPool(8192, 2);  // room for one file
  CKPT_ASSERT_OK_AND_ASSIGN(StagingLease held, pool_->Acquire(8192, absl::InfiniteFuture()));
  std::map<std::pair<uint32_t, uint32_t>, std::string> out;
  for (uint32_t l = 0; l < 4; ++l) out[{l, 0}] = std::string(5000, '\0');
  absl::StatusOr<RestoreStats> stats =
      RestoreInto(plan, table, TargetOf(&out), Sources({}, absl::Milliseconds(200)));
  CKPT_EXPECT_CODE(stats, kDeadlineExceeded);
  EXPECT_EQ(pool_->bytes_in_use(), 8192u);  // the lease held here, nothing else
}

// A restore thread checks and copies out the version it read while its next
// version's reads are in flight, so the disk is not idle during copies; the
// last version is copied after its read. Over a backend that cannot overlap
// (pwrite) each version is copied out as soon as it is read, holding one
// lease.
TEST_F(PlanTest, RestoreCopiesAVersionOutWhileTheNextIsRead) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(3, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  for (bool overlaps : {true, false}) {
    std::vector<std::string> log;  // one restore thread: no lock
    TestBackend io(overlaps, nullptr, &log);
    std::vector<std::string> out(3, std::string(5000, '\0'));
    TestMemory memory("host", [&](char* dst, const void*, uint64_t) {
      // A tensor's first piece starts where its layer goes.
      for (size_t l = 0; l < out.size(); ++l) {
        if (out[l].data() == dst) log.push_back(absl::StrCat("copy ", l));
      }
    });
    CKPT_ASSERT_OK_AND_ASSIGN(
        RestoreStats stats,
        RestoreInto(plan, table, TargetOfLayers(&out, &memory), Sources({&io})));
    EXPECT_EQ(stats.bytes, 3u * 5000u);
    const std::vector<std::string> want =
        overlaps
            ? std::vector<std::string>{"read", "read done", "read",      "copy 0", "read done",
                                       "read", "copy 1",    "read done", "copy 2"}
            : std::vector<std::string>{"read",   "read done", "copy 0",    "read",  "read done",
                                       "copy 1", "read",      "read done", "copy 2"};
    EXPECT_EQ(log, want) << "overlaps " << overlaps;
    for (uint32_t l = 0; l < 3; ++l) EXPECT_TRUE((out[l] == data_[{l, 10}][0])) << l;
    EXPECT_EQ(pool_->bytes_in_use(), 0u);
  }
}

// Room for two versions, two threads: thread 0 holds version 0 while thread
// 1 reads version 1, so version 2 finds no free room. Thread 0 copies
// version 0 out, and that is room enough: it reads version 2 at once rather
// than waiting for thread 1's version 1 (which left the disk idle during
// thread 1's copy of it). Thread 1's read of version 1 waits, bounded, for
// thread 0's read of version 2 to begin.
TEST_F(PlanTest, RestoreReadsOnIntoTheRoomItsOwnCopyGaveBack) {
  store::RankRecord table;
  ASSERT_NO_FATAL_FAILURE(CommitWide(3, &table));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  pool_ = MakeTestPool(8192, 4);  // two files of 4096 header + 5000 payload
  absl::Notification one_reading, two_reading;
  bool one_gave_up = false;
  // Thread 0 (io[0]) reads versions 0 and 2, thread 1 (io[1]) version 1.
  bool zero_gave_up = false;
  TestBackend zero(true, [&](int n) {
    if (n == 0) zero_gave_up = !one_reading.WaitForNotificationWithTimeout(absl::Seconds(10));
    if (n == 1) two_reading.Notify();
  });
  TestBackend one(true, [&](int n) {
    if (n != 0) return;
    one_reading.Notify();
    one_gave_up = !two_reading.WaitForNotificationWithTimeout(absl::Seconds(10));
  });
  std::vector<std::string> out(3, std::string(5000, '\0'));
  CKPT_ASSERT_OK_AND_ASSIGN(
      RestoreStats stats,
      RestoreInto(plan, table, TargetOfLayers(&out), Sources({&zero, &one}, absl::Seconds(60))));
  EXPECT_FALSE(zero_gave_up) << "version 1 was not read while version 0 was";
  EXPECT_FALSE(one_gave_up) << "version 2 was not read while version 1 was";
  EXPECT_EQ(stats.bytes, 3u * 5000u);
  for (uint32_t l = 0; l < 3; ++l) EXPECT_TRUE((out[l] == data_[{l, 10}][0])) << l;
  EXPECT_EQ(pool_->bytes_in_use(), 0u);
}

// A version read from disk is checksummed and copied a piece at a time: at
// most 256 KiB when the CPU copies (the piece is still in its cache), a
// staging chunk when a DMA engine would. Either way every byte arrives, and
// a flipped byte deep inside a tensor that spans several pieces and chunks
// is DATA_LOSS naming the layer and the tensor.
TEST_F(PlanTest, RestoreChecksumsWhatItCopiesPieceByPiece) {
  pool_ = MakeTestPool(1 << 20, 16);
  const std::vector<uint64_t> sizes = {(700 << 10) + 3, (2 << 20) + 100};
  store::RankRecord table;
  store::LayerSpec* spec = table.add_layers();
  spec->set_id(0);
  spec->set_name("layer0");
  for (size_t i = 0; i < sizes.size(); ++i) {
    store::TensorSpec* t = spec->add_tensors();
    t->set_name(TensorName(i));
    t->set_dtype(store::DTYPE_U8);
    t->add_shape(sizes[i]);
    t->set_nbytes(sizes[i]);
  }
  table.set_world_size(1);
  Staged st;
  ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), VersionKey{kJob, 0, 0, 10}, 1, sizes, 7, &st));
  CKPT_ASSERT_OK_AND_ASSIGN(store::VersionRecord rec, store_->Commit(&st.version, io_.get()));
  files_[{0, 10}] = rec.file();
  ASSERT_NO_FATAL_FAILURE(PutEvent(10));
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, BuildPlan(index_.get(), kJob, 0, 0, table));
  const uint64_t staged = pool_->bytes_in_use();  // `st` keeps its lease

  for (bool cpu : {true, false}) {
    std::vector<std::string> out = {std::string(sizes[0], '\0'), std::string(sizes[1], '\0')};
    uint64_t largest = 0, pieces = 0;
    absl::Mutex mu;  // host copies run on several threads
    TestMemory memory(cpu ? "host" : "cuda", [&](char*, const void*, uint64_t n) {
      absl::MutexLock lock(&mu);
      largest = std::max(largest, n);
      ++pieces;
    });
    RestoreTarget target;
    target.memory = &memory;
    target.tensors = {{out[0].data(), out[1].data()}};
    CKPT_ASSERT_OK_AND_ASSIGN(RestoreStats stats, RestoreInto(plan, table, target, Sources()));
    EXPECT_EQ(stats.bytes, sizes[0] + sizes[1]);
    EXPECT_TRUE(out[0] == st.data[0] && out[1] == st.data[1]) << "cpu " << cpu;
    if (cpu) {
      EXPECT_EQ(largest, uint64_t{256} << 10);
      EXPECT_GE(pieces, 12u);  // 3 + 9 pieces of at most 256 KiB
    } else {
      EXPECT_GT(largest, uint64_t{256} << 10);
      EXPECT_LE(largest, uint64_t{1} << 20);
    }
  }

  // Tensor 1 starts 64-byte aligned after tensor 0 in the payload (after a
  // 4096-byte header); flip a byte 1.5 MiB into it.
  ASSERT_NO_FATAL_FAILURE(FlipByte(0, 10, 4096 + AlignUp(sizes[0], 64) + (3 << 19), 0x10));
  for (bool cpu : {true, false}) {
    std::vector<std::string> out = {std::string(sizes[0], '\0'), std::string(sizes[1], '\0')};
    TestMemory memory(cpu ? "host" : "cuda");
    RestoreTarget target;
    target.memory = &memory;
    target.tensors = {{out[0].data(), out[1].data()}};
    absl::StatusOr<RestoreStats> stats = RestoreInto(plan, table, target, Sources());
    CKPT_EXPECT_CODE(stats, kDataLoss);
    EXPECT_NE(stats.status().message().find("layer 0"), absl::string_view::npos) << stats.status();
    EXPECT_NE(stats.status().message().find(TensorName(1)), absl::string_view::npos)
        << stats.status();
    EXPECT_TRUE(out[0] == st.data[0]);  // the tensor before it verified and arrived
    EXPECT_EQ(pool_->bytes_in_use(), staged);
  }
}

}  // namespace
}  // namespace ckpt
