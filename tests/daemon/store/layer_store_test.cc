// Tests of daemon/store/layer_store: the commit protocol, verified reads and
// start-up reconciliation, over both io backends.
#include "daemon/store/layer_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/store/publisher.h"
#include "daemon/store/repair.h"
#include "gtest/gtest.h"
#include "tests/daemon/store/store_test_util.h"
#include "tests/lib/fault_fs.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {

namespace {

using ::ckpt::testing::BackendParamName;
using ::ckpt::testing::FaultClass;
using ::ckpt::testing::FaultFileSystem;

using ::ckpt::testing::PathExists;
using ::ckpt::testing::TempDir;
using ::ckpt::testing::WriteFile;
using store_test::ImageBytes;
using store_test::MakeTestPool;
using store_test::Staged;
using store_test::StageVersion;

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return names;
  absl::StatusOr<std::vector<std::string>> got = DefaultFileSystem()->List(fd.get());
  if (got.ok()) names = *got;
  std::sort(names.begin(), names.end());
  return names;
}

// Flips one byte of `path` at `offset` in place.
void FlipByte(const std::string& path, uint64_t offset) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  char c;
  ASSERT_EQ(::pread(fd.get(), &c, 1, static_cast<off_t>(offset)), 1);
  c = static_cast<char>(c ^ 0x20);
  ASSERT_EQ(::pwrite(fd.get(), &c, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(::fsync(fd.get()), 0);
}

class LayerStoreTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<IoBackend>> io = MakeIoBackend(GetParam(), 8);
    if (GetParam() == IoBackendKind::kUring && absl::IsUnavailable(io.status())) {
      GTEST_SKIP() << "io_uring unavailable here: " << io.status();
    }
    CKPT_ASSERT_OK(io);
    io_ = std::move(io).value();
    pool_ = MakeTestPool(8192, 64);
    ASSERT_NE(pool_, nullptr);
    CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index")));
    ASSERT_NO_FATAL_FAILURE(NewStore());
  }

  // A fresh LayerStore over the same directory and index (a daemon restart).
  void NewStore() {
    store_ = std::make_unique<LayerStore>(tmp_.path(), fs_, index_.get(),
                                          /*use_direct_io=*/true);
    CKPT_ASSERT_OK(store_->Init());
  }

  std::string RankDir(const std::string& job, uint32_t rank) const {
    return absl::StrFormat("%s/jobs/%s/rank-%08x", tmp_.path(), job, rank);
  }
  std::string FilePath(const VersionKey& key, const store::VersionRecord& rec) const {
    return RankDir(key.job, key.rank) + "/" + rec.file();
  }

  // Stages and commits one version; the staged bytes stay in `out`.
  void Commit(const VersionKey& key, uint64_t generation, const std::vector<uint64_t>& sizes,
              uint64_t seed, Staged* out, store::VersionRecord* rec) {
    ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), key, generation, sizes, seed, out));
    CKPT_ASSERT_OK_AND_ASSIGN(*rec, store_->Commit(&out->version, io_.get()));
  }

  absl::StatusOr<LoadedVersion> Read(const VersionKey& key, const store::VersionRecord& rec) {
    return store_->Read(key, rec, io_.get(), pool_.get(), absl::Now() + absl::Seconds(30));
  }

  void ExpectNoTempFiles(const std::string& dir) {
    for (const std::string& name : ListDir(dir)) {
      EXPECT_FALSE(absl::StartsWith(name, "tmp.")) << name << " left in " << dir;
    }
  }

  TempDir tmp_;
  FileSystem* fs_ = DefaultFileSystem();
  std::unique_ptr<IoBackend> io_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<LayerStore> store_;
};

TEST_P(LayerStoreTest, CommitThenReadReturnsTheSameBytes) {
  const VersionKey key{"job-a", 0, 2, 100};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 7, {5000, 1, 70000, 4096}, 11, &s, &rec));
  const VersionLayout layout = s.version.layout;

  EXPECT_EQ(rec.file(), LayerStore::FileName(key, 7));
  EXPECT_EQ(rec.file_bytes(), layout.file_bytes);
  EXPECT_EQ(rec.payload_bytes(), layout.payload_bytes);
  EXPECT_EQ(rec.generation(), 7u);
  EXPECT_TRUE(store_->direct_io());

  // The file is in place, whole, and no temp file remains.
  const std::string dir = RankDir(key.job, key.rank);
  struct stat st;
  ASSERT_EQ(::stat(FilePath(key, rec).c_str(), &st), 0) << FilePath(key, rec);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), layout.file_bytes);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{rec.file()});
  ExpectNoTempFiles(dir);

  // The index names it.
  CKPT_ASSERT_OK_AND_ASSIGN(auto indexed, index_->VersionAtOrBefore(key.job, 0, 2, 100));
  ASSERT_TRUE(indexed.has_value());
  EXPECT_EQ(indexed->first, 100u);
  EXPECT_EQ(indexed->second.SerializeAsString(), rec.SerializeAsString());

  // Read verifies and returns the staged bytes.
  s.version.lease = StagingLease();  // return the staging chunks first
  CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion loaded, Read(key, rec));
  const store::LayerFileHeader& h = loaded.decoded.header;
  EXPECT_EQ(h.job_id(), key.job);
  EXPECT_EQ(h.rank(), key.rank);
  EXPECT_EQ(h.layer(), key.layer);
  EXPECT_EQ(h.step(), key.step);
  EXPECT_EQ(h.generation(), 7u);
  EXPECT_GT(h.created_unix_ms(), 0);
  ASSERT_EQ(h.tensors_size(), 4);
  for (int i = 0; i < h.tensors_size(); ++i) {
    const store::TensorEntry& t = h.tensors(i);
    EXPECT_TRUE(ImageBytes(loaded.lease, loaded.decoded.layout.header_bytes + t.offset(),
                           t.nbytes()) == s.data[static_cast<size_t>(i)])
        << t.name();
  }
}

TEST_P(LayerStoreTest, CorruptPayloadByteIsDataLoss) {
  const VersionKey key{"job-a", 1, 0, 5};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 1, {3000, 9000}, 12, &s, &rec));
  const store::TensorEntry t = s.version.header.tensors(1);
  ASSERT_NO_FATAL_FAILURE(
      FlipByte(FilePath(key, rec), s.version.layout.header_bytes + t.offset() + 1234));
  absl::StatusOr<LoadedVersion> loaded = Read(key, rec);
  CKPT_EXPECT_CODE(loaded, kDataLoss);
  EXPECT_NE(loaded.status().message().find(t.name()), absl::string_view::npos) << loaded.status();
}

TEST_P(LayerStoreTest, CorruptHeaderByteIsDataLoss) {
  const VersionKey key{"job-a", 1, 0, 5};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 1, {3000}, 13, &s, &rec));
  for (uint64_t off : {uint64_t{3}, uint64_t{30}, kPrefixBytes + 5}) {
    ASSERT_NO_FATAL_FAILURE(FlipByte(FilePath(key, rec), off));
    CKPT_EXPECT_CODE(Read(key, rec), kDataLoss) << "byte " << off;
    ASSERT_NO_FATAL_FAILURE(FlipByte(FilePath(key, rec), off));
  }
  CKPT_EXPECT_OK(Read(key, rec));
}

TEST_P(LayerStoreTest, TruncatedOrMissingFileIsDataLoss) {
  const VersionKey key{"job-a", 0, 3, 9};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 1, {20000}, 14, &s, &rec));
  const std::string path = FilePath(key, rec);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(rec.file_bytes() - 4096)), 0);
  CKPT_EXPECT_CODE(Read(key, rec), kDataLoss);
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  CKPT_EXPECT_CODE(Read(key, rec), kDataLoss);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  CKPT_EXPECT_CODE(Read(key, rec), kDataLoss);
}

TEST_P(LayerStoreTest, FileMustMatchItsRecord) {
  const VersionKey k1{"job-a", 0, 0, 1};
  const VersionKey k2{"job-a", 0, 0, 2};
  Staged s1, s2;
  store::VersionRecord r1, r2;
  ASSERT_NO_FATAL_FAILURE(Commit(k1, 1, {4000}, 15, &s1, &r1));
  ASSERT_NO_FATAL_FAILURE(Commit(k2, 1, {4000}, 16, &s2, &r2));
  ASSERT_EQ(r1.file_bytes(), r2.file_bytes());
  CKPT_EXPECT_CODE(Read(k2, r1), kDataLoss);  // step 1's file under step 2's key
  store::VersionRecord other = r2;
  other.set_header_xxh3(r1.header_xxh3());
  CKPT_EXPECT_CODE(Read(k2, other), kDataLoss);
  CKPT_EXPECT_OK(Read(k1, r1));
  CKPT_EXPECT_OK(Read(k2, r2));
}

TEST_P(LayerStoreTest, FailedCommitLeavesNoTraceAndKeepsThePreviousVersion) {
  const VersionKey key{"job-a", 0, 0, 1};
  Staged s1, s2;
  store::VersionRecord r1;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 4, {4000}, 17, &s1, &r1));
  // Same key and generation: the final name exists, the rename must fail.
  ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), key, 4, {4000}, 18, &s2));
  CKPT_EXPECT_CODE(store_->Commit(&s2.version, io_.get()), kAlreadyExists);
  EXPECT_EQ(ListDir(RankDir(key.job, key.rank)), std::vector<std::string>{r1.file()});
  CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion loaded, Read(key, r1));
  const store::TensorEntry& t = loaded.decoded.header.tensors(0);
  EXPECT_TRUE(ImageBytes(loaded.lease, loaded.decoded.layout.header_bytes + t.offset(),
                         t.nbytes()) == s1.data[0]);
}

TEST_P(LayerStoreTest, CommitRefusesBadJobIds) {
  for (const std::string& job : {std::string("../evil"), std::string(".."), std::string("a/b")}) {
    Staged s;
    ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), VersionKey{job, 0, 0, 1}, 1, {100}, 19, &s));
    CKPT_EXPECT_CODE(store_->Commit(&s.version, io_.get()), kInvalidArgument) << job;
  }
  EXPECT_FALSE(PathExists(tmp_.Join("evil")));
  EXPECT_EQ(ListDir(tmp_.Join("jobs")), std::vector<std::string>{});
}

TEST_P(LayerStoreTest, RemoveDeletesRecordThenFile) {
  const VersionKey key{"job-a", 0, 0, 1};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 1, {100}, 20, &s, &rec));
  CKPT_ASSERT_OK(store_->Remove(key, rec));
  EXPECT_FALSE(PathExists(FilePath(key, rec)));
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore(key.job, 0, 0, 1));
  EXPECT_FALSE(v.has_value());
  CKPT_EXPECT_OK(store_->Remove(key, rec));  // already gone: fine
}

// Regression: a header body ending right at a 4096 boundary once the commit
// filled in checksums and the creation time used to outgrow its planned size.
TEST_P(LayerStoreTest, HeaderThatFillsItsPlannedSizeCommits) {
  const VersionKey key{"job-a", 0, 0, 77};
  // Find the layer-name length at which the planned header grows past 4096.
  size_t edge = 0;
  for (size_t len = 1; len < 4096 && edge == 0; ++len) {
    store::LayerFileHeader h = store_test::MakeHeader(key, 3, {256});
    h.set_layer_name(std::string(len, 'n'));
    CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout layout, PlanLayout(&h));
    if (layout.header_bytes > 4096) edge = len;
  }
  ASSERT_GT(edge, 16u);
  for (size_t len = edge - 16; len <= edge + 16; ++len) {
    Staged s;
    ASSERT_NO_FATAL_FAILURE(
        StageVersion(pool_.get(), key, 3, {256}, 21, &s, std::string(len, 'n')));
    absl::StatusOr<store::VersionRecord> rec = store_->Commit(&s.version, io_.get());
    CKPT_ASSERT_OK(rec) << "layer name of " << len << " bytes";
    CKPT_EXPECT_OK(Read(key, *rec));
    CKPT_ASSERT_OK(store_->Remove(key, *rec));
  }
}

TEST_P(LayerStoreTest, ReconcileCleansUpAndKeepsCommittedVersions) {
  const std::string job = "job-r";
  Staged good_s, late_s, gone_s, short_s, noevent_s;
  store::VersionRecord good, late, gone, short_rec, noevent;
  // Rank 0: a committed version covered by an event, one after the last event,
  // one whose file was deleted.
  ASSERT_NO_FATAL_FAILURE(Commit({job, 0, 0, 1}, 1, {5000}, 30, &good_s, &good));
  ASSERT_NO_FATAL_FAILURE(Commit({job, 0, 0, 5}, 1, {5000}, 31, &late_s, &late));
  ASSERT_NO_FATAL_FAILURE(Commit({job, 0, 1, 1}, 1, {5000}, 32, &gone_s, &gone));
  CKPT_ASSERT_OK(index_->PutEvent(job, 0, 1, store::EventRecord()));
  ASSERT_EQ(::unlink(FilePath({job, 0, 1, 1}, gone).c_str()), 0);
  // Rank 1: a covered version whose file lost its tail.
  ASSERT_NO_FATAL_FAILURE(Commit({job, 1, 0, 2}, 1, {5000}, 33, &short_s, &short_rec));
  CKPT_ASSERT_OK(index_->PutEvent(job, 1, 2, store::EventRecord()));
  ASSERT_EQ(::truncate(FilePath({job, 1, 0, 2}, short_rec).c_str(), 4096), 0);
  // Rank 2: a version but no event at all.
  ASSERT_NO_FATAL_FAILURE(Commit({job, 2, 0, 3}, 1, {5000}, 34, &noevent_s, &noevent));

  const std::string dir0 = RankDir(job, 0);
  WriteFile(dir0 + "/tmp." + LayerStore::FileName({job, 0, 0, 9}, 1) + ".00000000deadbeef", "half");
  const std::string orphan = LayerStore::FileName({job, 0, 2, 1}, 9);
  WriteFile(dir0 + "/" + orphan, std::string(8192, 'o'));
  WriteFile(dir0 + "/notes.txt", "not ours");

  ASSERT_NO_FATAL_FAILURE(NewStore());  // as after a restart
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport report, store_->Reconcile());
  EXPECT_EQ(report.temp_files_removed, 1u);
  EXPECT_EQ(report.orphan_files_quarantined, 1u);
  EXPECT_EQ(report.dangling_records_removed, 2u);
  EXPECT_EQ(report.uncommitted_versions_removed, 2u);
  EXPECT_EQ(report.files_quarantined, 3u);

  EXPECT_EQ(ListDir(dir0), (std::vector<std::string>{good.file(), "notes.txt"}));
  EXPECT_EQ(ListDir(RankDir(job, 1)), std::vector<std::string>{});
  EXPECT_EQ(ListDir(RankDir(job, 2)), std::vector<std::string>{});
  // Layer files are moved, never deleted: the orphan and the versions after
  // their rank's last event wait in quarantine/ for `ckptctl repair`.
  const std::string q = tmp_.Join("quarantine/" + job);
  std::vector<std::string> q0{late.file(), orphan};
  std::sort(q0.begin(), q0.end());
  EXPECT_EQ(ListDir(q + "/rank-00000000"), q0);
  EXPECT_EQ(ListDir(q + "/rank-00000002"), std::vector<std::string>{noevent.file()});
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore(job, 0, 0, ~uint64_t{0}));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first, 1u);
  for (auto [rank, layer] : std::vector<std::pair<uint32_t, uint32_t>>{{0, 1}, {1, 0}, {2, 0}}) {
    CKPT_ASSERT_OK_AND_ASSIGN(v, index_->VersionAtOrBefore(job, rank, layer, ~uint64_t{0}));
    EXPECT_FALSE(v.has_value()) << "rank " << rank << " layer " << layer;
  }
  good_s.version.lease = StagingLease();
  CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion loaded, Read({job, 0, 0, 1}, good));
  const store::TensorEntry& t = loaded.decoded.header.tensors(0);
  EXPECT_TRUE(ImageBytes(loaded.lease, loaded.decoded.layout.header_bytes + t.offset(),
                         t.nbytes()) == good_s.data[0]);

  // A second pass finds nothing to do.
  CKPT_ASSERT_OK_AND_ASSIGN(report, store_->Reconcile());
  EXPECT_EQ(report.temp_files_removed, 0u);
  EXPECT_EQ(report.orphan_files_quarantined, 0u);
  EXPECT_EQ(report.files_quarantined, 0u);
  EXPECT_EQ(report.dangling_records_removed, 0u);
  EXPECT_EQ(report.uncommitted_versions_removed, 0u);
}

TEST_P(LayerStoreTest, ReconcileOfACleanStoreChangesNothing) {
  const VersionKey key{"job-c", 0, 0, 4};
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit(key, 2, {1000, 2000}, 40, &s, &rec));
  CKPT_ASSERT_OK(index_->PutEvent(key.job, 0, 4, store::EventRecord()));
  CKPT_ASSERT_OK(index_->PutJob(key.job, store::JobRecord()));
  CKPT_ASSERT_OK(index_->PutRank(key.job, 0, store::RankRecord()));
  ASSERT_NO_FATAL_FAILURE(NewStore());
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport report, store_->Reconcile());
  EXPECT_EQ(report.temp_files_removed + report.orphan_files_quarantined +
                report.dangling_records_removed + report.uncommitted_versions_removed,
            0u);
  CKPT_EXPECT_OK(Read(key, rec));
}

// A damaged WAL or MANIFEST length field made RocksDB open an older index
// state, and start-up reconciliation then deleted the newer versions' files
// as orphans (and as versions after the last event): acknowledged data lost.
// Now reconciliation quarantines them and RepairDataDir makes every one a
// record again.
TEST_P(LayerStoreTest, AnIndexRolledBackLosesNoFileAndRepairRestoresEveryVersion) {
  const std::string job = "job-rb";
  Staged s[4];
  store::VersionRecord rec[4];
  VersionKey keys[4];
  for (uint32_t i = 0; i < 4; ++i) {
    keys[i] = VersionKey{job, 0, i % 2, i + 1};
    ASSERT_NO_FATAL_FAILURE(Commit(keys[i], 3, {3000, 700}, 50 + i, &s[i], &rec[i]));
    s[i].version.lease = StagingLease();
    store::EventRecord ev;
    ev.add_layers(i % 2);
    ev.set_aux("position " + std::to_string(i + 1));
    CKPT_ASSERT_OK(index_->PutEvent(job, 0, i + 1, ev));
  }
  store::JobRecord owner;
  owner.set_owner_uid(1234);
  CKPT_ASSERT_OK(index_->PutJob(job, owner));
  CKPT_ASSERT_OK(index_->PutRank(job, 0, store::RankRecord()));
  // The index as RocksDB opened it: step 3's version record survived, its
  // event and everything of step 4 did not.
  CKPT_ASSERT_OK(index_->DeleteVersion(keys[3]));
  CKPT_ASSERT_OK(index_->DeleteEvent(job, 0, 3));
  CKPT_ASSERT_OK(index_->DeleteEvent(job, 0, 4));

  ASSERT_NO_FATAL_FAILURE(NewStore());
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport report, store_->Reconcile());
  EXPECT_EQ(report.uncommitted_versions_removed, 1u);
  EXPECT_EQ(report.orphan_files_quarantined, 1u);
  EXPECT_EQ(report.files_quarantined, 2u);
  std::vector<std::string> q{rec[2].file(), rec[3].file()};
  std::sort(q.begin(), q.end());
  EXPECT_EQ(ListDir(tmp_.Join("quarantine/job-rb/rank-00000000")), q);

  // Offline repair: the index's lock must be free.
  store_.reset();
  index_.reset();
  CKPT_ASSERT_OK_AND_ASSIGN(RepairReport rep, RepairDataDir(tmp_.path(), fs_, RepairOptions()));
  EXPECT_FALSE(rep.index_rebuilt);
  EXPECT_EQ(rep.files_checked, 4u);
  EXPECT_EQ(rep.records_kept, 2u);
  EXPECT_EQ(rep.records_added, 2u);
  EXPECT_EQ(rep.files_unquarantined, 2u);
  EXPECT_EQ(rep.events_added, 2u);
  EXPECT_TRUE(rep.skipped.empty());
  EXPECT_TRUE(ListDir(tmp_.Join("quarantine/job-rb/rank-00000000")).empty());

  CKPT_ASSERT_OK_AND_ASSIGN(index_, Index::Open(tmp_.Join("index")));
  ASSERT_NO_FATAL_FAILURE(NewStore());
  CKPT_ASSERT_OK_AND_ASSIGN(report, store_->Reconcile());
  EXPECT_EQ(report.files_quarantined, 0u);
  EXPECT_EQ(report.dangling_records_removed, 0u);
  for (uint32_t i = 0; i < 4; ++i) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v,
                              index_->VersionAtOrBefore(job, 0, keys[i].layer, keys[i].step));
    ASSERT_TRUE(v.has_value() && v->first == keys[i].step) << "step " << keys[i].step;
    EXPECT_EQ(v->second.header_xxh3(), rec[i].header_xxh3());
    CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion loaded, Read(keys[i], v->second));
    for (int t = 0; t < 2; ++t) {
      const store::TensorEntry& e = loaded.decoded.header.tensors(t);
      EXPECT_TRUE(ImageBytes(loaded.lease, loaded.decoded.layout.header_bytes + e.offset(),
                             e.nbytes()) == s[i].data[t])
          << "step " << keys[i].step << " tensor " << t;
    }
  }
  CKPT_ASSERT_OK_AND_ASSIGN(auto last, index_->EventAtOrBefore(job, 0, ~uint64_t{0}));
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->first, 4u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto kept_owner, index_->GetJob(job));
  ASSERT_TRUE(kept_owner.has_value());
  EXPECT_EQ(kept_owner->owner_uid(), 1234u);
  // A new registration's generation never names an existing file again.
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t gen, index_->NextGeneration());
  EXPECT_GT(gen, 3u);
}

// Counts directory fsyncs; the real file system does the work.
class DirSyncCounter final : public FileSystem {
 public:
  absl::Status SyncDir(int dir_fd) override {
    ++dir_syncs;
    return FileSystem::SyncDir(dir_fd);
  }
  uint64_t dir_syncs = 0;
};

// Counts per-file size lookups (what start-up's reconcile did per version).
class SizeLookupCounter final : public FileSystem {
 public:
  absl::StatusOr<uint64_t> FileSizeAt(int dir_fd, const std::string& name) override {
    ++lookups;
    return FileSystem::FileSizeAt(dir_fd, name);
  }
  uint64_t lookups = 0;
};

// After a clean stop, start-up looks the recorded files up by name: no
// per-version size lookup, and still a missing file's record is dropped, an
// orphan quarantined, a temp file removed, and the rest kept. After a crash
// (kSizes) each recorded file's size is looked up, as before.
TEST_P(LayerStoreTest, ReconcileAfterACleanStopChecksNamesNotSizes) {
  const std::string job = "job-c";
  std::vector<store::VersionRecord> recs(6);
  for (uint32_t l = 0; l < recs.size(); ++l) {
    Staged s;
    ASSERT_NO_FATAL_FAILURE(Commit({job, 0, l, 3}, 1, {2000}, 100 + l, &s, &recs[l]));
  }
  store::EventRecord ev;
  for (uint32_t l = 0; l < recs.size(); ++l) ev.add_layers(l);
  CKPT_ASSERT_OK(index_->PutEvent(job, 0, 3, ev));
  SizeLookupCounter counter;
  fs_ = &counter;
  ASSERT_NO_FATAL_FAILURE(NewStore());
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport full, store_->Reconcile());
  EXPECT_EQ(counter.lookups, recs.size());
  EXPECT_EQ(full.dangling_records_removed, 0u);

  // While stopped: one recorded file goes, another is replaced by a link to
  // a copy of itself, a temp file and an orphan appear.
  const std::string dir = RankDir(job, 0);
  ASSERT_EQ(::unlink((dir + "/" + recs[2].file()).c_str()), 0);
  const std::string linked = dir + "/" + recs[4].file();
  ASSERT_EQ(::rename(linked.c_str(), tmp_.Join("outside.ckv").c_str()), 0);
  ASSERT_EQ(::symlink(tmp_.Join("outside.ckv").c_str(), linked.c_str()), 0);
  WriteFile(dir + "/tmp.left-over", "x");
  WriteFile(dir + "/L00000009-S0000000000000003-G0000000000000001.ckv", "y");
  ASSERT_NO_FATAL_FAILURE(NewStore());
  counter.lookups = 0;
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport names,
                            store_->Reconcile(LayerStore::ReconcileCheck::kNames));
  EXPECT_EQ(counter.lookups, 0u);
  EXPECT_EQ(names.dangling_records_removed, 1u);
  EXPECT_EQ(names.temp_files_removed, 1u);
  EXPECT_EQ(names.orphan_files_quarantined, 1u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto gone, index_->VersionAtOrBefore(job, 0, 2, 3));
  EXPECT_FALSE(gone.has_value());
  for (uint32_t l = 0; l < recs.size(); ++l) {
    if (l == 2) continue;
    if (l == 4) {
      // Found when read: the link is not followed.
      absl::StatusOr<LoadedVersion> through_link = Read({job, 0, l, 3}, recs[l]);
      EXPECT_FALSE(through_link.ok());
      EXPECT_TRUE(absl::StrContains(through_link.status().message(), "symbolic link"))
          << through_link.status();
      continue;
    }
    CKPT_EXPECT_OK(Read({job, 0, l, 3}, recs[l])) << "layer " << l;
  }
  EXPECT_EQ(ListDir(dir).size(), recs.size() - 1);
  store_.reset();
  fs_ = DefaultFileSystem();
}

// Writes `stageds` (staged already) with LayerStore::Write, in order.
std::vector<WrittenVersion> WriteAll(LayerStore* store, IoBackend* io,
                                     std::vector<Staged>* stageds) {
  std::vector<WrittenVersion> group;
  for (Staged& s : *stageds) {
    absl::StatusOr<WrittenVersion> w = store->Write(&s.version, io);
    EXPECT_TRUE(w.ok()) << w.status();
    if (w.ok()) group.push_back(*std::move(w));
  }
  return group;
}

// A group of five written versions of two ranks is invisible until
// published; Publish makes all five visible with one directory fsync per
// rank directory (Commit, one version at a time, fsyncs once per version),
// and each reads back with its own bytes.
TEST_P(LayerStoreTest, PublishMakesAGroupVisibleWithOneDirectoryFsyncPerRank) {
  DirSyncCounter counter;
  fs_ = &counter;
  ASSERT_NO_FATAL_FAILURE(NewStore());
  const std::vector<VersionKey> keys = {{"job-g", 0, 0, 5},
                                        {"job-g", 0, 1, 5},
                                        {"job-g", 1, 0, 5},
                                        {"job-g", 0, 2, 5},
                                        {"job-g", 1, 1, 5}};
  std::vector<Staged> stageds(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(
        StageVersion(pool_.get(), keys[i], 3, {1000 + 100 * i, 5000}, 70 + i, &stageds[i]));
  }
  std::vector<WrittenVersion> group = WriteAll(store_.get(), io_.get(), &stageds);
  ASSERT_EQ(group.size(), keys.size());
  for (const VersionKey& k : keys) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore(k.job, k.rank, k.layer, k.step));
    EXPECT_FALSE(v.has_value()) << "visible before it was published";
  }
  for (uint32_t rank : {0u, 1u}) {
    for (const std::string& name : ListDir(RankDir("job-g", rank))) {
      EXPECT_TRUE(absl::StartsWith(name, "tmp.")) << name;
    }
  }
  counter.dir_syncs = 0;
  std::vector<absl::StatusOr<store::VersionRecord>> recs = store_->Publish(&group);
  EXPECT_EQ(counter.dir_syncs, 2u);
  ASSERT_EQ(recs.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    CKPT_ASSERT_OK(recs[i]);
    EXPECT_GT(recs[i]->committed_unix_ms(), 0);
    EXPECT_GT(group[i].timings.total_seconds, 0.0);
    CKPT_ASSERT_OK_AND_ASSIGN(
        auto v, index_->VersionAtOrBefore(keys[i].job, keys[i].rank, keys[i].layer, keys[i].step));
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->second.file(), recs[i]->file());
    CKPT_ASSERT_OK_AND_ASSIGN(LoadedVersion loaded, Read(keys[i], *recs[i]));
    const store::TensorEntry& t = loaded.decoded.header.tensors(0);
    EXPECT_TRUE(ImageBytes(loaded.lease, loaded.decoded.layout.header_bytes + t.offset(),
                           t.nbytes()) == stageds[i].data[0]);
  }
  ExpectNoTempFiles(RankDir("job-g", 0));
  ExpectNoTempFiles(RankDir("job-g", 1));
  EXPECT_EQ(index_->VersionsOf("job-g", 0).total.versions, 3u);
  EXPECT_EQ(index_->VersionsOf("job-g", 1).total.versions, 2u);
  store_.reset();
  fs_ = DefaultFileSystem();
}

// A directory fsync that fails fails the versions renamed into that
// directory (their files are removed, no record is written) and only them:
// the group's versions of the other rank are published.
TEST_P(LayerStoreTest, AFailedDirectoryFsyncFailsOnlyThatDirectorysVersions) {
  ASSERT_EQ(::mkdir(tmp_.Join("graveyard").c_str(), 0700), 0);
  FaultFileSystem fault(DefaultFileSystem(), tmp_.Join("graveyard"), 1);
  fs_ = &fault;
  ASSERT_NO_FATAL_FAILURE(NewStore());
  const std::vector<VersionKey> keys = {
      {"job-f", 0, 0, 2}, {"job-f", 1, 0, 2}, {"job-f", 0, 1, 2}, {"job-f", 1, 1, 2}};
  std::vector<Staged> stageds(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), keys[i], 1, {3000}, 80 + i, &stageds[i]));
  }
  std::vector<WrittenVersion> group = WriteAll(store_.get(), io_.get(), &stageds);
  ASSERT_EQ(group.size(), keys.size());
  fault.FailNth(FaultClass::kDirSync, 1, EIO);  // rank 0's directory: the group's first
  std::vector<absl::StatusOr<store::VersionRecord>> recs = store_->Publish(&group);
  EXPECT_EQ(fault.injected(FaultClass::kDirSync), 1u);
  ASSERT_EQ(recs.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    CKPT_ASSERT_OK_AND_ASSIGN(
        auto v, index_->VersionAtOrBefore(keys[i].job, keys[i].rank, keys[i].layer, keys[i].step));
    if (keys[i].rank == 0) {
      EXPECT_FALSE(recs[i].ok());
      EXPECT_EQ(ReasonOf(recs[i].status()), ErrorReason::kFsync) << recs[i].status();
      EXPECT_FALSE(v.has_value());
    } else {
      CKPT_EXPECT_OK(recs[i]);
      ASSERT_TRUE(v.has_value());
      CKPT_EXPECT_OK(Read(keys[i], v->second));
    }
  }
  EXPECT_EQ(ListDir(RankDir("job-f", 0)), std::vector<std::string>{});
  EXPECT_EQ(ListDir(RankDir("job-f", 1)).size(), 2u);
  store_.reset();
  fs_ = DefaultFileSystem();
}

// The publisher calls each version's `done` in the order they were
// submitted, and publishes what queued up while it was busy as one group:
// held at its first group (one version), the four submitted meanwhile go
// out together. A version submitted after Stop is published at once.
TEST_P(LayerStoreTest, PublisherGroupsWhatQueuedAndKeepsTheOrder) {
  if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
  SyncPoint* sp = SyncPoint::GetInstance();
  sp->StartTest(absl::Seconds(30));
  sp->LoadDependency({{"test.all_submitted", "publisher.before_group"}});
  // Layers 0..4 go through the thread, layer 5 after Stop.
  std::vector<Staged> stageds(5), last(1);
  for (uint32_t l = 0; l < 6; ++l) {
    ASSERT_NO_FATAL_FAILURE(StageVersion(pool_.get(), VersionKey{"job-p", 0, l, 9}, 1, {2000},
                                         90 + l, l < 5 ? &stageds[l] : &last[0]));
  }
  std::vector<WrittenVersion> written = WriteAll(store_.get(), io_.get(), &stageds);
  ASSERT_EQ(written.size(), 5u);
  absl::Mutex mu;
  std::vector<uint32_t> order;
  std::vector<absl::Status> results;
  auto done = [&](uint32_t layer) {
    return [&, layer](absl::StatusOr<store::VersionRecord> rec, const CommitTimings&) {
      absl::MutexLock lock(&mu);
      order.push_back(layer);
      results.push_back(rec.status());
    };
  };
  {
    Publisher publisher(store_.get());
    publisher.Submit(std::move(written[0]), done(0));
    ASSERT_TRUE(sp->WaitForArrivals("publisher.before_group", 1, absl::Now() + absl::Seconds(30)));
    for (uint32_t i = 1; i < 5; ++i) publisher.Submit(std::move(written[i]), done(i));
    CKPT_SYNC_POINT("test.all_submitted");
    publisher.Stop();
    EXPECT_EQ(publisher.groups(), 2u);
    EXPECT_EQ(publisher.versions(), 5u);
    std::vector<WrittenVersion> after = WriteAll(store_.get(), io_.get(), &last);
    ASSERT_EQ(after.size(), 1u);
    publisher.Submit(std::move(after[0]), done(5));
    absl::MutexLock lock(&mu);
    EXPECT_EQ(order, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
  }
  for (const absl::Status& s : results) CKPT_EXPECT_OK(s);
  EXPECT_EQ(index_->VersionsOf("job-p", 0).total.versions, 6u);
  EXPECT_EQ(sp->timeouts(), 0u);
  sp->EndTest();
}

// The quarantine move goes through the FileSystem seam: a failing rename
// fails start-up and leaves the file where it was (never deleted).
TEST_P(LayerStoreTest, QuarantineGoesThroughTheFileSystemSeam) {
  const std::string job = "job-q";
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit({job, 0, 0, 2}, 1, {4000}, 60, &s, &rec));
  s.version.lease = StagingLease();
  // No event: the version is after the rank's last event.
  ASSERT_EQ(::mkdir(tmp_.Join("graveyard").c_str(), 0700), 0);
  FaultFileSystem fault(DefaultFileSystem(), tmp_.Join("graveyard"), 1);
  fs_ = &fault;
  ASSERT_NO_FATAL_FAILURE(NewStore());
  fault.FailNth(FaultClass::kRename, 1, EIO);
  absl::StatusOr<ReconcileReport> failed = store_->Reconcile();
  EXPECT_FALSE(failed.ok());
  EXPECT_EQ(fault.injected(FaultClass::kRename), 1u);
  EXPECT_TRUE(PathExists(RankDir(job, 0) + "/" + rec.file()));
  fault.ClearFaults();
  CKPT_ASSERT_OK_AND_ASSIGN(ReconcileReport report, store_->Reconcile());
  EXPECT_EQ(report.orphan_files_quarantined, 1u);
  EXPECT_TRUE(PathExists(tmp_.Join("quarantine/job-q/rank-00000000/" + rec.file())));
  store_.reset();
  fs_ = DefaultFileSystem();
}

// A symbolic link where start-up opens a rank directory failed it with ELOOP
// and a bare "open dir rank-00000000": ckptd crash-looped without saying
// where. Now the error is FAILED_PRECONDITION with the full path.
TEST_P(LayerStoreTest, ASymlinkInTheDataDirectoryIsRefusedWithItsPath) {
  const std::string job = "job-l";
  Staged s;
  store::VersionRecord rec;
  ASSERT_NO_FATAL_FAILURE(Commit({job, 0, 0, 1}, 1, {4000}, 61, &s, &rec));
  s.version.lease = StagingLease();
  CKPT_ASSERT_OK(index_->PutEvent(job, 0, 1, store::EventRecord()));
  CKPT_ASSERT_OK(index_->PutJob(job, store::JobRecord()));  // a registered rank
  CKPT_ASSERT_OK(index_->PutRank(job, 0, store::RankRecord()));
  const std::string rank_dir = RankDir(job, 0);
  ASSERT_EQ(::rename(rank_dir.c_str(), tmp_.Join("elsewhere").c_str()), 0);
  ASSERT_EQ(::symlink(tmp_.Join("elsewhere").c_str(), rank_dir.c_str()), 0);
  ASSERT_NO_FATAL_FAILURE(NewStore());
  absl::StatusOr<ReconcileReport> report = store_->Reconcile();
  ASSERT_FALSE(report.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(report.status())) << report.status();
  EXPECT_TRUE(absl::StrContains(report.status().message(), rank_dir)) << report.status();
  EXPECT_TRUE(absl::StrContains(report.status().message(), "symbolic link")) << report.status();
  EXPECT_TRUE(PathExists(tmp_.Join("elsewhere/" + rec.file())));
}

// The drift trace was opened with std::ofstream by path, following a
// symbolic link planted as drift.jsonl to wherever it pointed.
TEST_P(LayerStoreTest, SideFilesAreNeverOpenedThroughASymlink) {
  const std::string job = "job-t";
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, store_->OpenSideFile(job, 0, "drift.jsonl"));
  CKPT_ASSERT_OK(store_->AppendSideFile(fd.get(), "{\"step\":1}\n"));
  EXPECT_EQ(::ckpt::testing::ReadFile(RankDir(job, 0) + "/drift.jsonl"), "{\"step\":1}\n");
  const std::string target = tmp_.Join("target.txt");
  WriteFile(target, "keep");
  const std::string link = RankDir(job, 0) + "/link.jsonl";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  absl::StatusOr<UniqueFd> opened = store_->OpenSideFile(job, 0, "link.jsonl");
  ASSERT_FALSE(opened.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(opened.status())) << opened.status();
  EXPECT_TRUE(absl::StrContains(opened.status().message(), RankDir(job, 0))) << opened.status();
  EXPECT_EQ(::ckpt::testing::ReadFile(target), "keep");
}

INSTANTIATE_TEST_SUITE_P(Backends, LayerStoreTest,
                         ::testing::Values(IoBackendKind::kUring, IoBackendKind::kPwrite),
                         BackendParamName);

TEST(LayerStoreFileNameTest, FixedWidthHex) {
  EXPECT_EQ(LayerStore::FileName({"j", 0, 0x1a, 0xff}, 0x10),
            "L0000001a-S00000000000000ff-G0000000000000010.ckv");
}

}  // namespace
}  // namespace ckpt
