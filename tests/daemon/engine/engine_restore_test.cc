// Restore in the engine (engine_test_util.h): while a taken step's snapshot
// worker is still finishing, going back with discard_later, the memory
// tier serving a restore without the disk, within its budget, and exports
// into a reader's region.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/export_region.h"
#include "base/region.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "daemon/metrics/metrics.h"
#include "daemon/recovery/export.h"
#include "daemon/store/index.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

// Regression: a step can be durable before the snapshot worker that took it
// has finished (the worker records the event itself when nothing was left
// to write, and a writer can finish a step's last version first), and a
// Restore in that moment was refused with "steps are still being
// snapshotted", although every reported step was taken. The worker is held
// after step 1 is durable; Restore waits for it instead of failing.
TEST_F(EnginePipelineTest, RestoreWaitsForTheWorkerOfATakenStep) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  constexpr char kRestoreWaiting[] = "PipelineTest:restore_waiting";
  TestRank r = MakeRank("settling", 2, PolicyKind::kExplicit);
  CKPT_ASSERT_OK(Register(&r).status());
  WriteStep(r, 1);
  CKPT_ASSERT_OK(StepDone(r, 1, {0, 1}));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  // Step 1's worker is past the point before the point starts to hold.
  ASSERT_TRUE(sp_->WaitForArrivals("snapshot.after_publish", 1, absl::Now() + kWait));
  // Step 2 selects nothing: its snapshot records the event itself, and the
  // worker then stops at the point until Restore is waiting for it.
  sp_->LoadDependency({{kRestoreWaiting, "snapshot.after_publish"}});
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(r, 2));
  EXPECT_EQ(durable, 2u);
  WriteStep(r, 99);
  absl::StatusOr<Restored> restored;
  std::thread restorer([&] { restored = engine_->Restore(Ref(r), 1, owner_); });
  EXPECT_TRUE(sp_->WaitForArrivals("restore.wait_snapshot_idle", 1, absl::Now() + kWait));
  CKPT_SYNC_POINT(kRestoreWaiting);
  restorer.join();
  CKPT_ASSERT_OK(restored.status());
  EXPECT_EQ(restored->plan.target_step, 1u);
  EXPECT_TRUE(HoldsStep(r, 1));
}

// Restore with discard_later: the rank goes back to step 3 of 5 (another
// rank of its job, or the job's agreed durable step, is there); its later
// versions and events are deleted, and training goes on at step 4. Without
// it, step 4 is refused (steps only increase).
TEST_F(EnginePipelineTest, RestoreCanDiscardTheRanksLaterSteps) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("behind", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 5; ++t) {
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
  }
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(engine_->Restore(Ref(a), 3, owner_).status());
  CKPT_EXPECT_CODE(StepDone(a, 4), kFailedPrecondition);

  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored,
                            engine_->Restore(Ref(a), 3, owner_, /*discard_later=*/true));
  EXPECT_EQ(restored.plan.target_step, 3u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto last, index_->EventAtOrBefore("behind", 0, ~uint64_t{0}));
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->first, 3u) << "the events of steps 4 and 5 are gone";
  for (uint32_t layer = 0; layer < 2; ++layer) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("behind", 0, layer, ~uint64_t{0}));
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->first, 3u) << "layer " << layer;
  }
  CKPT_ASSERT_OK(StepDone(a, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(a, 4));
  EXPECT_EQ(durable, 4u);
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(a, 0));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{4, 4}));
}

// A trainer crash: the rank registers again and restores. With the memory
// tier on, the plan's versions come from memory with every checksum checked:
// the layer files are deleted first, so a read of the disk would fail.
TEST_F(EnginePipelineTest, MemoryTierServesARestoreWithoutTheDisk) {
  EngineOptions o = OneWriter();
  o.memory_tier_bytes = 8 * kChunk;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank a = MakeRank("crashy", 3);
  CKPT_ASSERT_OK(Register(&a).status());
  ASSERT_NO_FATAL_FAILURE(Train(a, 1, 3));
  for (const auto& f :
       std::filesystem::directory_iterator(tmp_.Join("jobs/crashy/rank-00000000"))) {
    std::filesystem::remove(f.path());
  }
  WriteStep(a, 77);  // the new trainer's fresh memory
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 3u);
  EXPECT_EQ(restored.memory_bytes, restored.bytes);
  EXPECT_EQ(restored.from_memory, std::vector<bool>(3, true)) << "each layer's source";
  EXPECT_TRUE(HoldsStep(a, 3));
}

// A tier as large as the whole pool: snapshots, and restores that read the
// disk, take room back from it (before, only snapshots did, and a restore
// of an older step waited out its deadline); layers it still holds come
// from memory, the rest from the disk, both byte-exact.
TEST_F(EnginePipelineTest, MemoryTierWithinItsBudgetAndYieldingToSnapshots) {
  EngineOptions o = OneWriter();
  o.memory_tier_bytes = 4 * kChunk;
  o.restore_timeout = absl::Seconds(5);
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/4));
  TestRank a = MakeRank("partial", 4);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 4; ++t) {
    WriteStep(a, t);
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitDurable(a, t).status());
    // Every step's four layers were admitted although the tier held the
    // whole pool: it gave it back.
    CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(a, t));
    EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{t, t, t, t}));
  }
  EXPECT_EQ(pool_->bytes_in_use(), 4 * kChunk) << "the tier holds step 4";
  // An older step: every layer from the disk, through a full pool.
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored older, engine_->Restore(Ref(a), 2, owner_));
  EXPECT_EQ(older.memory_bytes, 0u);
  EXPECT_EQ(older.from_memory, std::vector<bool>(4, false));
  EXPECT_TRUE(HoldsStep(a, 2));
  // The newest step: what the tier kept from memory, the rest from disk.
  WriteStep(a, 0);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 0, owner_));
  EXPECT_GT(restored.memory_bytes, 0u);
  EXPECT_LT(restored.memory_bytes, restored.bytes);
  uint64_t memory_layers = 0;
  for (bool m : restored.from_memory) memory_layers += m;
  EXPECT_EQ(restored.from_memory.size(), 4u);
  EXPECT_EQ(memory_layers * kLayerFloats * 4, restored.memory_bytes)
      << "the layers marked as from memory are those whose bytes came from it";
  EXPECT_TRUE(HoldsStep(a, 4));
}

// After a clean stop the start-up check looks files up by name only, so a
// newest version truncated (or with a flipped bit) while ckptd was stopped
// is found by the restore. With no intact copy in any tier the version is
// marked lost (its file to quarantine/, its bytes off the quota), and the
// restore is refused, naming the layers: it once fell back to the layers'
// previous versions unasked, and a retry still does unless the index keeps
// the loss. Asked to (older_within), a restore takes those versions and
// says so per layer; a restore that took them accepts the loss.
TEST_F(EnginePipelineTest, RestoreRefusesAVersionDamagedOnDiskUnlessOlderIsAsked) {
  EngineOptions o = OneWriter();
  Metrics metrics;
  o.metrics = &metrics;
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank r = MakeRank("damaged", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  ASSERT_NO_FATAL_FAILURE(Train(r, 1, 3));
  const uint64_t used = engine_->quota_usage(owner_.uid).file_bytes;
  // Step 2's layer 0 truncated, its layer 1 with one payload bit flipped.
  const std::vector<store::VersionRecord> recs = DamageTwoLayers("damaged", 2);
  ASSERT_EQ(recs.size(), 2u);
  const std::filesystem::path dir =
      std::filesystem::path(tmp_.path()) / "jobs/damaged/rank-00000000";
  WriteStep(r, 99);
  CKPT_ASSERT_OK(Register(&r).status());
  // The restore stops at layer 0's damage, and so does the next one.
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<Restored> refused = engine_->Restore(Ref(r), 2, owner_);
    EXPECT_TRUE(absl::IsDataLoss(refused.status())) << attempt << ": " << refused.status();
    EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kLostVersion) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                  "layer 0 'layer0' lost its version of step 2 (damaged: "))
        << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "its previous is step 1"))
        << refused.status();
  }
  // Layer 0's damage at least was found (the two readers may have found
  // layer 1's as well): what was found is in quarantine and off the quota.
  uint64_t found = 0, found_bytes = 0;
  for (const store::VersionRecord& rec : recs) {
    const bool moved = std::filesystem::exists(std::filesystem::path(tmp_.path()) /
                                               "quarantine/damaged/rank-00000000" / rec.file());
    EXPECT_NE(moved, std::filesystem::exists(dir / rec.file())) << rec.file();
    found += moved;
    found_bytes += moved ? rec.file_bytes() : 0;
  }
  EXPECT_TRUE(std::filesystem::exists(dir.parent_path().parent_path().parent_path() /
                                      "quarantine/damaged/rank-00000000" / recs[0].file()));
  EXPECT_EQ(engine_->quota_usage(owner_.uid).file_bytes, used - found_bytes);
  const std::string scrape = metrics.Scrape();
  EXPECT_NE(scrape.find(absl::StrCat("\nckpt_versions_quarantined_total ", found, "\n")),
            std::string::npos);
  EXPECT_NE(scrape.find("\nckpt_lost_version_restores_total{outcome=\"refused\"} 2\n"),
            std::string::npos)
      << scrape;
  // The newest step does not need the lost versions: it restores as ever.
  CKPT_ASSERT_OK_AND_ASSIGN(Restored newest, engine_->Restore(Ref(r), 0, owner_));
  EXPECT_EQ(PlannedSteps(newest.plan), (std::vector<uint64_t>{3, 3}));
  // Asked for, without discarding step 3 (which needs layer 0's step 2 as
  // well): taken and reported, and still lost for the next plan.
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored kept, engine_->Restore(Ref(r), 2, owner_, false, 1));
  EXPECT_EQ(kept.plan.layers[0].lost_step, 2u);
  CKPT_ASSERT_OK_AND_ASSIGN(const Index::LostMap still, index_->LostVersions("damaged", 0));
  for (const auto& [layer_step, rec] : still) EXPECT_FALSE(rec.accepted()) << layer_step.first;
  EXPECT_EQ(ReasonOf(engine_->Restore(Ref(r), 2, owner_).status()), ErrorReason::kLostVersion);
  // Asked for, with discard_later: training goes on from step 2.
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored older, engine_->Restore(Ref(r), 2, owner_,
                                                             /*discard_later=*/true,
                                                             /*older_within=*/1));
  EXPECT_EQ(PlannedSteps(older.plan), (std::vector<uint64_t>{1, 1}));
  for (const PlannedLayer& lp : older.plan.layers) EXPECT_EQ(lp.lost_step, 2u) << lp.layer;
  EXPECT_TRUE(HoldsStep(r, 1));
  for (const store::VersionRecord& rec : recs) {
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(tmp_.path()) /
                                        "quarantine/damaged/rank-00000000" / rec.file()))
        << rec.file();
    EXPECT_FALSE(std::filesystem::exists(dir / rec.file()));
  }
  const std::string after = metrics.Scrape();
  EXPECT_NE(after.find("\nckpt_versions_quarantined_total 2\n"), std::string::npos);
  EXPECT_NE(after.find("\nckpt_lost_version_restores_total{outcome=\"older\"} 2\n"),
            std::string::npos);
  // Training went on from step 2 with those versions: the losses are
  // accepted, and no plan refuses for them.
  CKPT_ASSERT_OK_AND_ASSIGN(const Index::LostMap lost, index_->LostVersions("damaged", 0));
  EXPECT_EQ(lost.size(), 2u);
  for (const auto& [layer_step, rec] : lost) EXPECT_TRUE(rec.accepted()) << layer_step.first;
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored again, engine_->Restore(Ref(r), 0, owner_));
  EXPECT_EQ(again.plan.target_step, 2u);
  EXPECT_EQ(PlannedSteps(again.plan), (std::vector<uint64_t>{1, 1}));
}

// older_within bounds how much older than the target the version taken
// for a lost one may be.
TEST_F(EnginePipelineTest, OlderWithinBoundsTheVersionTakenForALostOne) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("bounded", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  ASSERT_NO_FATAL_FAILURE(Train(r, 1, 3));
  // Layer 0's versions of steps 2 and 3 truncated.
  for (uint64_t t = 2; t <= 3; ++t) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("bounded", 0, 0, t));
    ASSERT_TRUE(v.has_value());
    std::filesystem::resize_file(
        std::filesystem::path(tmp_.path()) / "jobs/bounded/rank-00000000" / v->second.file(),
        v->second.file_bytes() / 2);
  }
  WriteStep(r, 99);
  CKPT_ASSERT_OK(Register(&r).status());
  // Within 1 step: step 3 is found damaged, step 2 taken and found damaged,
  // and step 1 is 2 steps older than the target.
  absl::StatusOr<Restored> one = engine_->Restore(Ref(r), 3, owner_, false, 1);
  EXPECT_EQ(ReasonOf(one.status()), ErrorReason::kLostVersion) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "its previous is step 1, 2 steps before"))
      << one.status();
  CKPT_ASSERT_OK_AND_ASSIGN(Restored two, engine_->Restore(Ref(r), 3, owner_, false, 2));
  EXPECT_EQ(PlannedSteps(two.plan), (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(two.plan.layers[0].lost_step, 3u);
  EXPECT_EQ(two.plan.layers[1].lost_step, 0u);
  // Step 3 is the newest: training goes on from it, and both of layer 0's
  // losses are accepted (the step's plan takes step 1 from now on).
  CKPT_ASSERT_OK_AND_ASSIGN(const Index::LostMap lost, index_->LostVersions("bounded", 0));
  EXPECT_EQ(lost.size(), 2u);
  for (const auto& [layer_step, rec] : lost) EXPECT_TRUE(rec.accepted()) << layer_step.second;
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Restored again, engine_->Restore(Ref(r), 3, owner_));
  EXPECT_EQ(PlannedSteps(again.plan), (std::vector<uint64_t>{1, 3}));
}

// What an export hands over: each header, and the bytes of its data
// chunks, or of its region's window (copied out, then acked, as a reader
// does; with `ack` false, never acked).
struct Exported {
  explicit Exported(const MemfdRegion* region = nullptr, bool ack = true)
      : region(region), ack(ack) {}
  const MemfdRegion* region;
  bool ack;
  std::vector<v1::ExportHeader> headers;
  std::string bytes;
  int batches = 0;
  ExportSink Sink() {
    return [this](const v1::ExportChunk& c) {
      if (c.has_header()) {
        headers.push_back(c.header());
      } else if (c.payload_case() == v1::ExportChunk::kRegionBytes) {
        ++batches;
        bytes.append(static_cast<const char*>(region->data()) + kExportRegionControlBytes,
                     c.region_bytes());
        if (ack) BumpExportAck(region->data());
      } else {
        bytes.append(c.data());
      }
      return true;
    };
  }
};

// A populated region of `window` bytes behind its control page, and a
// duplicate of its descriptor, as the handover passes it.
MemfdRegion WindowOf(uint64_t window) {
  MemfdRegion r = MemfdRegion::Create("export", kExportRegionControlBytes + window,
                                      /*open_to_seals=*/true)
                      .value();
  std::memset(r.data(), 0, r.size());
  return r;
}
UniqueFd Dup(const MemfdRegion& region) { return UniqueFd(::dup(region.fd())); }

// An export through a region the reader handed over (ExportRequest.
// region_token) hands over exactly the bytes the stream carries, and streams
// none: in one batch when the window holds them all, in several when it
// holds some layers, each written once the reader took the one before. A
// window smaller than a layer, one that cannot be sealed against holes, or
// whose pages its owner did not populate, gets the stream instead.
TEST_F(EnginePipelineTest, ExportThroughARegionHandsOverWhatItWouldStream) {
  EngineOptions o = OneWriter();
  Metrics metrics;
  o.metrics = &metrics;
  o.memory_tier_bytes = 2 * kChunk;  // some versions from memory, some from disk
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank r = MakeRank("exported", 5);
  CKPT_ASSERT_OK(Register(&r).status());
  ASSERT_NO_FATAL_FAILURE(Train(r, 1, 3));
  v1::ExportRequest req;
  req.set_job_id("exported");
  Exported streamed;
  CKPT_ASSERT_OK(engine_->Export(req, owner_, streamed.Sink()));
  ASSERT_EQ(streamed.headers.size(), 1u);
  const uint64_t layer = kLayerFloats * sizeof(float);
  const uint64_t total = streamed.headers[0].total_bytes();
  EXPECT_FALSE(streamed.headers[0].in_region());
  ASSERT_EQ(total, 5 * layer);
  ASSERT_EQ(streamed.bytes.size(), total);

  for (const auto& [window, batches] :
       std::vector<std::pair<uint64_t, int>>{{total, 1}, {2 * layer, 3}, {layer, 5}}) {
    MemfdRegion region = WindowOf(window);
    Exported through(&region);
    CKPT_ASSERT_OK(engine_->Export(req, owner_, through.Sink(), Dup(region)));
    ASSERT_EQ(through.headers.size(), 1u);
    EXPECT_TRUE(through.headers[0].in_region()) << window;
    EXPECT_EQ(through.batches, batches) << window;
    EXPECT_EQ(through.bytes, streamed.bytes) << window;
  }

  MemfdRegion small = WindowOf(layer / 2);
  Exported fallback(&small);
  CKPT_ASSERT_OK(engine_->Export(req, owner_, fallback.Sink(), Dup(small)));
  ASSERT_EQ(fallback.headers.size(), 1u);
  EXPECT_FALSE(fallback.headers[0].in_region());
  EXPECT_EQ(fallback.bytes, streamed.bytes);

  // Pages ckptd would fault in would be its memory, charged to it for as
  // long as the reader keeps the memfd. A region written through is sealed
  // against holes first (punched after the check, they would be faulted in
  // again); one that cannot be sealed, or that its owner did not populate,
  // gets the stream, and none of its pages is touched.
  {
    MemfdRegion used = WindowOf(total);
    Exported through(&used);
    CKPT_ASSERT_OK(engine_->Export(req, owner_, through.Sink(), Dup(used)));
    EXPECT_TRUE(through.headers.at(0).in_region());
    EXPECT_NE(::fallocate(used.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
    EXPECT_EQ(errno, EPERM) << "the region is sealed against holes";
    CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion closed,
                              MemfdRegion::Create("closed", kExportRegionControlBytes + total));
    std::memset(closed.data(), 0, closed.size());
    Exported sealed;
    CKPT_ASSERT_OK(engine_->Export(req, owner_, sealed.Sink(), Dup(closed)));
    EXPECT_FALSE(sealed.headers.at(0).in_region()) << "a region closed to seals";
    EXPECT_EQ(sealed.bytes, streamed.bytes);
  }
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion fresh,
                            MemfdRegion::Create("fresh", kExportRegionControlBytes + total,
                                                /*open_to_seals=*/true));
  Exported unpopulated;
  CKPT_ASSERT_OK(engine_->Export(req, owner_, unpopulated.Sink(), Dup(fresh)));
  ASSERT_EQ(unpopulated.headers.size(), 1u);
  EXPECT_FALSE(unpopulated.headers[0].in_region());
  EXPECT_EQ(unpopulated.bytes, streamed.bytes);
  std::vector<unsigned char> resident(fresh.size() / static_cast<size_t>(::getpagesize()));
  ASSERT_EQ(::mincore(fresh.data(), fresh.size(), resident.data()), 0);
  for (size_t i = 0; i < resident.size(); ++i) EXPECT_EQ(resident[i] & 1, 0) << "page " << i;

  // Four exports went through a window, four were streamed.
  const std::string scrape = metrics.Scrape();
  for (const char* path : {"window", "stream"}) {
    EXPECT_NE(scrape.find(absl::StrCat("\nckpt_exported_bytes_total{path=\"", path, "\"} ",
                                       4 * total, "\n")),
              std::string::npos)
        << path << "\n"
        << scrape;
  }
}

// Through a region as through the stream, a damaged version fails the
// export (its bytes are never handed over as good); a descriptor that is not
// a memfd sealed against shrinking is refused before anything is read; and
// a reader that never takes a batch holds the export only until the
// restore deadline, its window never overwritten.
TEST_F(EnginePipelineTest, ExportThroughARegionFailsClosed) {
  EngineOptions o = OneWriter();
  o.restore_timeout = absl::Seconds(2);  // each layer read, and the wait for each ack
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  TestRank r = MakeRank("spoilt", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  ASSERT_NO_FATAL_FAILURE(Train(r, 1, 2));
  v1::ExportRequest req;
  req.set_job_id("spoilt");
  const uint64_t layer = kLayerFloats * sizeof(float);

  UniqueFd unsealed(::memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_TRUE(unsealed.valid());
  ASSERT_EQ(::ftruncate(unsealed.get(), static_cast<off_t>(kExportRegionControlBytes + 2 * layer)),
            0);
  Exported refused;
  CKPT_EXPECT_CODE(engine_->Export(req, owner_, refused.Sink(), std::move(unsealed)),
                   kInvalidArgument);
  EXPECT_TRUE(refused.headers.empty());

  MemfdRegion region = WindowOf(layer);
  Exported stalled(&region, /*ack=*/false);
  CKPT_EXPECT_CODE(engine_->Export(req, owner_, stalled.Sink(), Dup(region)), kDeadlineExceeded);
  EXPECT_EQ(stalled.batches, 1);
  ASSERT_EQ(stalled.bytes.size(), layer);
  EXPECT_EQ(
      std::string_view(static_cast<const char*>(region.data()) + kExportRegionControlBytes, layer),
      stalled.bytes)
      << "the first batch stays until the reader takes it";

  ASSERT_EQ(DamageTwoLayers("spoilt", 2).size(), 2u);
  MemfdRegion again = WindowOf(2 * layer);
  Exported damaged(&again);
  const absl::Status s = engine_->Export(req, owner_, damaged.Sink(), Dup(again));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  ASSERT_EQ(damaged.headers.size(), 1u);
  EXPECT_TRUE(damaged.headers[0].in_region());
  EXPECT_EQ(damaged.batches, 0) << "no batch of a damaged version is announced";
}

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
