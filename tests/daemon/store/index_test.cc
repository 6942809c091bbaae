// Tests of daemon/store/index against a real RocksDB in a temp directory.
#include "daemon/store/index.h"

#include <rocksdb/db.h>
#include <rocksdb/perf_context.h>
#include <rocksdb/perf_level.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(); }

  void Reopen() {
    index_.reset();
    absl::StatusOr<std::unique_ptr<Index>> index = Index::Open(tmp_.Join("index"));
    ASSERT_TRUE(::ckpt::testing::IsOk(index));
    index_ = std::move(index).value();
  }

  static store::VersionRecord Rec(const std::string& file) {
    store::VersionRecord r;
    r.set_file(file);
    r.set_file_bytes(8192);
    r.set_payload_bytes(100);
    r.set_generation(3);
    return r;
  }
  // Rec("f") whose file has `file_bytes` bytes.
  static store::VersionRecord RecOfBytes(uint64_t file_bytes) {
    store::VersionRecord r = Rec("f");
    r.set_file_bytes(file_bytes);
    return r;
  }

  static std::string FileFor(const VersionKey& k) {
    return absl::StrCat(k.job, "|", k.rank, "|", k.layer, "|", k.step);
  }

  TempDir tmp_;
  std::unique_ptr<Index> index_;
};

TEST_F(IndexTest, JobsRoundTrip) {
  CKPT_ASSERT_OK_AND_ASSIGN(std::optional<store::JobRecord> missing, index_->GetJob("job"));
  EXPECT_FALSE(missing.has_value());
  store::JobRecord rec;
  rec.set_owner_uid(1234);
  rec.set_created_unix_ms(99);
  CKPT_ASSERT_OK(index_->PutJob("job", rec));
  CKPT_ASSERT_OK(index_->PutJob("job2", store::JobRecord()));
  CKPT_ASSERT_OK(index_->PutJob("a.b", store::JobRecord()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::optional<store::JobRecord> got, index_->GetJob("job"));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->owner_uid(), 1234u);
  EXPECT_EQ(got->created_unix_ms(), 99);
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> jobs, index_->ListJobs());
  std::sort(jobs.begin(), jobs.end());
  EXPECT_EQ(jobs, (std::vector<std::string>{"a.b", "job", "job2"}));
}

TEST_F(IndexTest, RanksRoundTripAndDoNotLeakAcrossJobs) {
  store::RankRecord rec;
  rec.set_world_size(8);
  rec.set_generation(5);
  rec.add_layers()->set_name("emb");
  CKPT_ASSERT_OK(index_->PutRank("job", 3, rec));
  CKPT_ASSERT_OK(index_->PutRank("job", 0, store::RankRecord()));
  CKPT_ASSERT_OK(index_->PutRank("job2", 1, store::RankRecord()));
  CKPT_ASSERT_OK(index_->PutRank("a", 7, store::RankRecord()));
  CKPT_ASSERT_OK(index_->PutRank("a.b", 9, store::RankRecord()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::optional<store::RankRecord> got, index_->GetRank("job", 3));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->world_size(), 8u);
  EXPECT_EQ(got->generation(), 5u);
  ASSERT_EQ(got->layers_size(), 1);
  EXPECT_EQ(got->layers(0).name(), "emb");
  CKPT_ASSERT_OK_AND_ASSIGN(std::optional<store::RankRecord> none, index_->GetRank("job", 4));
  EXPECT_FALSE(none.has_value());
  CKPT_ASSERT_OK_AND_ASSIGN(none, index_->GetRank("job2", 3));
  EXPECT_FALSE(none.has_value());

  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> ranks, index_->ListRanks("job"));
  EXPECT_EQ(ranks, (std::vector<uint32_t>{0, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(ranks, index_->ListRanks("job2"));
  EXPECT_EQ(ranks, (std::vector<uint32_t>{1}));
  CKPT_ASSERT_OK_AND_ASSIGN(ranks, index_->ListRanks("a"));
  EXPECT_EQ(ranks, (std::vector<uint32_t>{7}));
  CKPT_ASSERT_OK_AND_ASSIGN(ranks, index_->ListRanks("a.b"));
  EXPECT_EQ(ranks, (std::vector<uint32_t>{9}));
  CKPT_ASSERT_OK_AND_ASSIGN(ranks, index_->ListRanks("jo"));
  EXPECT_TRUE(ranks.empty());
}

// Versions and events of prefix-similar jobs, checked against a brute-force model.
TEST_F(IndexTest, AtOrBeforeQueriesMatchAModel) {
  const std::vector<std::string> jobs = {"job", "job2", "a", "a.b", "a-b", "jo"};
  std::mt19937_64 rng(0x1dec5);
  // model[(job, rank, layer)] = steps
  std::map<std::tuple<std::string, uint32_t, uint32_t>, std::vector<uint64_t>> versions;
  std::map<std::pair<std::string, uint32_t>, std::vector<uint64_t>> events;
  const std::vector<uint64_t> special = {0,           1, 255, 256, 0xFFFFFFFFull, ~uint64_t{0} - 1,
                                         ~uint64_t{0}};
  for (int i = 0; i < 300; ++i) {
    VersionKey k{jobs[rng() % jobs.size()], static_cast<uint32_t>(rng() % 3),
                 static_cast<uint32_t>(rng() % 4), rng() % 60};
    if (i % 37 == 0) k.step = special[rng() % special.size()];
    CKPT_ASSERT_OK(index_->PutVersion(k, Rec(FileFor(k))));
    versions[{k.job, k.rank, k.layer}].push_back(k.step);
  }
  for (int i = 0; i < 60; ++i) {
    const std::string job = jobs[rng() % jobs.size()];
    const uint32_t rank = static_cast<uint32_t>(rng() % 3);
    const uint64_t step = i % 13 == 0 ? special[rng() % special.size()] : rng() % 60;
    store::EventRecord e;
    e.set_bytes(step * 7 + rank);
    e.set_aux(absl::StrCat(job, "/", rank, "/", step));
    CKPT_ASSERT_OK(index_->PutEvent(job, rank, step, e));
    events[{job, rank}].push_back(step);
  }

  std::vector<uint64_t> queries = special;
  for (uint64_t s = 0; s <= 61; ++s) queries.push_back(s);
  for (const std::string& job : jobs) {
    for (uint32_t rank = 0; rank < 4; ++rank) {
      for (uint64_t q : queries) {
        for (uint32_t layer = 0; layer < 5; ++layer) {
          std::optional<uint64_t> want;
          for (uint64_t s : versions[{job, rank, layer}]) {
            if (s <= q && (!want.has_value() || s > *want)) want = s;
          }
          CKPT_ASSERT_OK_AND_ASSIGN(auto got, index_->VersionAtOrBefore(job, rank, layer, q));
          ASSERT_EQ(got.has_value(), want.has_value())
              << job << " r" << rank << " l" << layer << " q" << q;
          if (want.has_value()) {
            EXPECT_EQ(got->first, *want) << job << " r" << rank << " l" << layer << " q" << q;
            EXPECT_EQ(got->second.file(), FileFor(VersionKey{job, rank, layer, *want}));
          }
        }
        std::optional<uint64_t> want_event;
        for (uint64_t s : events[{job, rank}]) {
          if (s <= q && (!want_event.has_value() || s > *want_event)) want_event = s;
        }
        CKPT_ASSERT_OK_AND_ASSIGN(auto ev, index_->EventAtOrBefore(job, rank, q));
        ASSERT_EQ(ev.has_value(), want_event.has_value()) << job << " r" << rank << " q" << q;
        if (want_event.has_value()) {
          EXPECT_EQ(ev->first, *want_event) << job << " r" << rank << " q" << q;
          EXPECT_EQ(ev->second.aux(), absl::StrCat(job, "/", rank, "/", *want_event));
        }
      }
    }
  }
}

TEST_F(IndexTest, VersionsOfSimilarJobIdsStaySeparate) {
  CKPT_ASSERT_OK(index_->PutVersion({"job", 0, 0, 10}, Rec("job")));
  CKPT_ASSERT_OK(index_->PutVersion({"job2", 0, 0, 5}, Rec("job2")));
  CKPT_ASSERT_OK(index_->PutVersion({"a", 0, 0, 7}, Rec("a")));
  CKPT_ASSERT_OK(index_->PutVersion({"a.b", 0, 0, 3}, Rec("a.b")));
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("job", 0, 0, 9));
  EXPECT_FALSE(v.has_value());
  CKPT_ASSERT_OK_AND_ASSIGN(v, index_->VersionAtOrBefore("job2", 0, 0, 100));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->second.file(), "job2");
  CKPT_ASSERT_OK_AND_ASSIGN(v, index_->VersionAtOrBefore("a", 0, 0, 5));
  EXPECT_FALSE(v.has_value()) << "must not return a.b's step 3";
  CKPT_ASSERT_OK_AND_ASSIGN(v, index_->VersionAtOrBefore("a.b", 0, 0, ~uint64_t{0}));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first, 3u);
  EXPECT_EQ(v->second.file(), "a.b");
  int seen = 0;
  CKPT_ASSERT_OK(
      index_->ForEachVersion("a", 0, -1, [&](const VersionKey& k, const store::VersionRecord& r) {
        EXPECT_EQ(k.job, "a");
        EXPECT_EQ(r.file(), "a");
        ++seen;
        return true;
      }));
  EXPECT_EQ(seen, 1);
}

TEST_F(IndexTest, ForEachVersionOrderFilterAndEarlyStop) {
  std::vector<VersionKey> keys;
  for (uint32_t layer : {2u, 0u, 1u}) {
    for (uint64_t step : {30u, 5u, 300u, 17u}) keys.push_back({"job", 1, layer, step});
  }
  keys.push_back({"job", 0, 0, 1});   // another rank
  keys.push_back({"job", 2, 0, 1});   // another rank
  keys.push_back({"job2", 1, 0, 1});  // another job
  for (const VersionKey& k : keys) CKPT_ASSERT_OK(index_->PutVersion(k, Rec(FileFor(k))));

  std::vector<std::pair<uint32_t, uint64_t>> all;
  CKPT_ASSERT_OK(
      index_->ForEachVersion("job", 1, -1, [&](const VersionKey& k, const store::VersionRecord& r) {
        EXPECT_EQ(k.job, "job");
        EXPECT_EQ(k.rank, 1u);
        EXPECT_EQ(r.file(), FileFor(k));
        all.emplace_back(k.layer, k.step);
        return true;
      }));
  std::vector<std::pair<uint32_t, uint64_t>> want;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    for (uint64_t step : {5u, 17u, 30u, 300u}) want.emplace_back(layer, step);
  }
  EXPECT_EQ(all, want);

  std::vector<uint64_t> steps;
  CKPT_ASSERT_OK(
      index_->ForEachVersion("job", 1, 1, [&](const VersionKey& k, const store::VersionRecord&) {
        EXPECT_EQ(k.layer, 1u);
        steps.push_back(k.step);
        return true;
      }));
  EXPECT_EQ(steps, (std::vector<uint64_t>{5, 17, 30, 300}));

  int calls = 0;
  CKPT_ASSERT_OK(index_->ForEachVersion(
      "job", 1, -1, [&](const VersionKey&, const store::VersionRecord&) { return ++calls < 2; }));
  EXPECT_EQ(calls, 2);

  CKPT_ASSERT_OK(index_->DeleteVersion({"job", 1, 1, 17}));
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("job", 1, 1, 29));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first, 5u);
}

TEST_F(IndexTest, EventsBatchOrderAndDelete) {
  std::vector<std::pair<uint64_t, store::EventRecord>> batch;
  for (uint64_t step : {40u, 10u, 20u}) {
    store::EventRecord e;
    e.add_layers(static_cast<uint32_t>(step));
    e.set_bytes(step * 100);
    e.set_lr(0.5);
    batch.emplace_back(step, e);
  }
  CKPT_ASSERT_OK(index_->PutEvents("job", 2, batch));
  CKPT_ASSERT_OK(index_->PutEvent("job", 3, 15, store::EventRecord()));
  CKPT_ASSERT_OK(index_->PutEvent("job2", 2, 25, store::EventRecord()));

  std::vector<uint64_t> oldest_first, newest_first;
  CKPT_ASSERT_OK(
      index_->ForEachEvent("job", 2, false, [&](uint64_t s, const store::EventRecord& e) {
        EXPECT_EQ(e.bytes(), s * 100);
        EXPECT_DOUBLE_EQ(e.lr(), 0.5);
        oldest_first.push_back(s);
        return true;
      }));
  CKPT_ASSERT_OK(index_->ForEachEvent("job", 2, true, [&](uint64_t s, const store::EventRecord&) {
    newest_first.push_back(s);
    return true;
  }));
  EXPECT_EQ(oldest_first, (std::vector<uint64_t>{10, 20, 40}));
  EXPECT_EQ(newest_first, (std::vector<uint64_t>{40, 20, 10}));

  int calls = 0;
  CKPT_ASSERT_OK(index_->ForEachEvent("job", 2, true, [&](uint64_t s, const store::EventRecord&) {
    EXPECT_EQ(s, 40u);
    ++calls;
    return false;
  }));
  EXPECT_EQ(calls, 1);

  CKPT_ASSERT_OK_AND_ASSIGN(auto e, index_->EventAtOrBefore("job", 2, 39));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->first, 20u);
  EXPECT_EQ(e->second.layers(0), 20u);
  CKPT_ASSERT_OK_AND_ASSIGN(e, index_->EventAtOrBefore("job", 2, ~uint64_t{0}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->first, 40u);
  CKPT_ASSERT_OK_AND_ASSIGN(e, index_->EventAtOrBefore("job", 2, 9));
  EXPECT_FALSE(e.has_value());
  CKPT_ASSERT_OK_AND_ASSIGN(e, index_->EventAtOrBefore("job", 4, ~uint64_t{0}));
  EXPECT_FALSE(e.has_value());

  CKPT_ASSERT_OK(index_->DeleteEvent("job", 2, 40));
  CKPT_ASSERT_OK_AND_ASSIGN(e, index_->EventAtOrBefore("job", 2, ~uint64_t{0}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->first, 20u);
}

TEST_F(IndexTest, NextGenerationIncreasesAndSurvivesReopen) {
  uint64_t last = 0;
  for (int i = 0; i < 5; ++i) {
    CKPT_ASSERT_OK_AND_ASSIGN(uint64_t g, index_->NextGeneration());
    EXPECT_GT(g, last);
    last = g;
  }
  ASSERT_NO_FATAL_FAILURE(Reopen());
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t g, index_->NextGeneration());
  EXPECT_GT(g, last);
}

TEST_F(IndexTest, RecordsSurviveReopen) {
  CKPT_ASSERT_OK(index_->PutVersion({"job", 0, 1, 9}, Rec("kept")));
  CKPT_ASSERT_OK(index_->PutEvent("job", 0, 9, store::EventRecord()));
  ASSERT_NO_FATAL_FAILURE(Reopen());
  CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("job", 0, 1, 9));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->second.file(), "kept");
  CKPT_ASSERT_OK_AND_ASSIGN(auto e, index_->EventAtOrBefore("job", 0, 9));
  EXPECT_TRUE(e.has_value());
}

TEST_F(IndexTest, SecondOpenOfTheSameDatabaseIsRefused) {
  CKPT_EXPECT_CODE(Index::Open(tmp_.Join("index")), kFailedPrecondition);
}

// An index written by a newer ckptd (a higher schema version) is refused
// rather than misread; one without a version is stamped with this one.
TEST(IndexSchemaTest, NewerSchemaIsRefusedAndAnUnversionedIndexIsStamped) {
  ::ckpt::testing::TempDir tmp;
  const std::string path = tmp.Join("index");
  {
    rocksdb::Options options;
    options.create_if_missing = true;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, path, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    rocksdb::WriteOptions wo;
    wo.sync = true;
    ASSERT_TRUE(db->Put(wo, "m/schema_version", absl::StrCat(kIndexSchemaVersion + 1)).ok());
  }
  absl::StatusOr<std::unique_ptr<Index>> newer = Index::Open(path);
  CKPT_EXPECT_CODE(newer, kFailedPrecondition);
  EXPECT_NE(newer.status().message().find("newer ckptd"), absl::string_view::npos)
      << newer.status();

  const std::string fresh = tmp.Join("fresh");
  {
    rocksdb::Options options;
    options.create_if_missing = true;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, fresh, &raw).ok());
    delete raw;  // an index as written before the key existed
  }
  CKPT_ASSERT_OK(Index::Open(fresh).status());
  rocksdb::DB* raw = nullptr;
  ASSERT_TRUE(rocksdb::DB::OpenForReadOnly(rocksdb::Options(), fresh, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string v;
  ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), "m/schema_version", &v).ok());
  EXPECT_EQ(v, absl::StrCat(kIndexSchemaVersion));
}

// Regression (found by fuzz_index): a version record of a layer number no
// registration can have (a damaged or forged key) made the per-layer count
// grow to that number: 0xcccccccc layers, an allocation of 51 GiB on open.
// Such a record counts in the rank's total only.
TEST_F(IndexTest, AHugeLayerNumberCountsWithoutAPerLayerEntry) {
  auto rec = &IndexTest::RecOfBytes;
  CKPT_ASSERT_OK(index_->PutVersion({"job", 0, 0xcccccccc, 1}, rec(100)));
  CKPT_ASSERT_OK(index_->PutVersion({"job", 0, 2, 1}, rec(10)));
  auto check = [&](const char* when) {
    const Index::RankVersions r = index_->VersionsOf("job", 0);
    EXPECT_EQ(r.total.versions, 2u) << when;
    EXPECT_EQ(r.total.file_bytes, 110u) << when;
    EXPECT_EQ(r.layers.size(), 3u) << when;
  };
  check("as written");
  ASSERT_NO_FATAL_FAILURE(Reopen());
  check("after reopen");
  CKPT_ASSERT_OK(index_->DeleteVersion({"job", 0, 0xcccccccc, 1}));
  EXPECT_EQ(index_->VersionsOf("job", 0).total.versions, 1u);
  EXPECT_EQ(index_->VersionsOf("job", 0).layers.size(), 3u);
}

// The per-rank version counts (VersionsOf) follow puts, overwrites and
// deletes, read no entry, and are counted again from the records on open.
TEST_F(IndexTest, VersionCountsFollowPutsOverwritesAndDeletesAndSurviveReopen) {
  auto rec = &IndexTest::RecOfBytes;
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 0, 1}, rec(100)));
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 0, 2}, rec(200)));
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 3, 2}, rec(400)));
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 3, 2}, rec(450)));  // written over: still one
  CKPT_ASSERT_OK(index_->PutVersion({"job", 2, 0, 1}, rec(1)));    // another rank
  CKPT_ASSERT_OK(index_->PutVersion({"jo", 1, 0, 1}, rec(1)));     // a prefix of the job id
  CKPT_ASSERT_OK(index_->DeleteVersion({"job", 1, 0, 1}));
  CKPT_ASSERT_OK(index_->DeleteVersion({"job", 1, 0, 7}));  // not there: nothing changes
  auto check = [&](const char* when) {
    const uint64_t before = index_->entries_read();
    const Index::RankVersions r = index_->VersionsOf("job", 1);
    EXPECT_EQ(index_->entries_read(), before) << when;
    EXPECT_EQ(r.total.versions, 2u) << when;
    EXPECT_EQ(r.total.file_bytes, 650u) << when;
    ASSERT_EQ(r.layers.size(), 4u) << when;
    EXPECT_EQ(r.layers[0].versions, 1u) << when;
    EXPECT_EQ(r.layers[0].file_bytes, 200u) << when;
    EXPECT_EQ(r.layers[1].versions, 0u) << when;
    EXPECT_EQ(r.layers[3].versions, 1u) << when;
    EXPECT_EQ(r.layers[3].file_bytes, 450u) << when;
    EXPECT_EQ(index_->VersionsOf("job", 2).total.versions, 1u) << when;
    EXPECT_EQ(index_->VersionsOf("jo", 1).total.versions, 1u) << when;
    EXPECT_EQ(index_->VersionsOf("job", 9).total.versions, 0u) << when;
  };
  check("as written");
  ASSERT_NO_FATAL_FAILURE(Reopen());
  check("after reopen");
  CKPT_ASSERT_OK(index_->DeleteVersion({"job", 2, 0, 1}));
  EXPECT_EQ(index_->VersionsOf("job", 2).total.versions, 0u);
  EXPECT_TRUE(index_->VersionsOf("job", 2).layers.empty());
}

// A clean stop's mark survives a reopen (the next start), and holds while
// nothing is written after it: a start that writes and then crashes is not
// taken for a clean stop; a start that wrote nothing changed nothing.
TEST_F(IndexTest, CleanStopHoldsUntilTheNextWrite) {
  CKPT_ASSERT_OK_AND_ASSIGN(bool clean, index_->CleanStop());
  EXPECT_FALSE(clean) << "a new index was never stopped cleanly";
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 0, 1}, Rec("a")));
  CKPT_ASSERT_OK(index_->MarkCleanStop());
  ASSERT_NO_FATAL_FAILURE(Reopen());
  CKPT_ASSERT_OK_AND_ASSIGN(clean, index_->CleanStop());
  EXPECT_TRUE(clean);
  ASSERT_NO_FATAL_FAILURE(Reopen());  // a start that wrote nothing, then a crash
  CKPT_ASSERT_OK_AND_ASSIGN(clean, index_->CleanStop());
  EXPECT_TRUE(clean);
  CKPT_ASSERT_OK(index_->PutEvent("job", 1, 1, store::EventRecord()));
  ASSERT_NO_FATAL_FAILURE(Reopen());  // a start that wrote, then a crash
  CKPT_ASSERT_OK_AND_ASSIGN(clean, index_->CleanStop());
  EXPECT_FALSE(clean);
  CKPT_ASSERT_OK(index_->MarkCleanStop());
  ASSERT_NO_FATAL_FAILURE(Reopen());
  CKPT_ASSERT_OK_AND_ASSIGN(clean, index_->CleanStop());
  EXPECT_TRUE(clean);
}

// PutVersions writes a group in one batch and counts each record once: a
// record it writes over, and a key twice in the same batch, count as one
// version with the last record's bytes. Keys and records of different
// lengths are refused with nothing written.
TEST_F(IndexTest, PutVersionsCountsAGroupAsItsRecords) {
  auto rec = &IndexTest::RecOfBytes;
  CKPT_ASSERT_OK(index_->PutVersion({"job", 1, 0, 1}, rec(100)));
  CKPT_ASSERT_OK(index_->PutVersions(
      {{"job", 1, 0, 1}, {"job", 1, 1, 1}, {"job", 1, 2, 1}, {"job", 1, 2, 1}, {"job", 2, 0, 1}},
      {rec(10), rec(20), rec(30), rec(35), rec(5)}));
  auto check = [&](const char* when) {
    const Index::RankVersions r = index_->VersionsOf("job", 1);
    EXPECT_EQ(r.total.versions, 3u) << when;
    EXPECT_EQ(r.total.file_bytes, 10u + 20u + 35u) << when;
    ASSERT_EQ(r.layers.size(), 3u) << when;
    EXPECT_EQ(r.layers[2].versions, 1u) << when;
    EXPECT_EQ(r.layers[2].file_bytes, 35u) << when;
    EXPECT_EQ(index_->VersionsOf("job", 2).total.versions, 1u) << when;
  };
  check("as written");
  CKPT_ASSERT_OK_AND_ASSIGN(auto got, index_->VersionAtOrBefore("job", 1, 2, 1));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->second.file_bytes(), 35u);
  ASSERT_NO_FATAL_FAILURE(Reopen());
  check("after reopen");
  EXPECT_TRUE(
      absl::IsInvalidArgument(index_->PutVersions({{"job", 3, 0, 1}, {"job", 3, 1, 1}}, {rec(1)})));
  EXPECT_EQ(index_->VersionsOf("job", 3).total.versions, 0u);
  CKPT_ASSERT_OK_AND_ASSIGN(auto none, index_->VersionAtOrBefore("job", 3, 0, 1));
  EXPECT_FALSE(none.has_value());
}

// MemoryBytes (the ckpt_index_memory_bytes gauge) sees what RocksDB keeps:
// 2,000 records written raise it by at least their bytes (they sit in the
// memtable until a flush).
TEST_F(IndexTest, MemoryBytesCountsTheMemtable) {
  const uint64_t before = index_->MemoryBytes();
  std::vector<VersionKey> keys;
  std::vector<store::VersionRecord> recs;
  uint64_t written = 0;
  for (uint64_t step = 1; step <= 2000; ++step) {
    keys.push_back({"job", 1, 0, step});
    recs.push_back(RecOfBytes(4096));
    written += recs.back().ByteSizeLong();
  }
  CKPT_ASSERT_OK(index_->PutVersions(keys, recs));
  EXPECT_GE(index_->MemoryBytes(), before + written);
}

// ForEachVersionAfter reads one entry per layer plus what it finds, not the
// history below the step: 3 layers of 2,000 versions each, the last 5 of
// each found in 3 + 15 entries (a scan would read 6,000).
TEST_F(IndexTest, ForEachVersionAfterReadsLayersPlusWhatItFinds) {
  index_.reset();
  {
    // Written straight into RocksDB (unsynced) to build a long history fast.
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), tmp_.Join("index"), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    const std::string rec = Rec("f").SerializeAsString();
    for (uint32_t layer = 0; layer < 3; ++layer) {
      for (uint64_t step = 1; step <= 2000; ++step) {
        const std::string k = absl::StrCat("v/job/00000001/", absl::Hex(layer, absl::kZeroPad8),
                                           "/", absl::Hex(step, absl::kZeroPad16));
        ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), k, rec).ok());
      }
    }
    ASSERT_TRUE(
        db->Put(rocksdb::WriteOptions(), "v/job/00000002/00000000/0000000000000009", rec).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  ASSERT_NO_FATAL_FAILURE(Reopen());
  EXPECT_EQ(index_->VersionsOf("job", 1).total.versions, 6000u);
  std::vector<std::pair<uint32_t, uint64_t>> found;
  const uint64_t before = index_->entries_read();
  CKPT_ASSERT_OK(index_->ForEachVersionAfter(
      "job", 1, 1995, [&](const VersionKey& k, const store::VersionRecord& r) {
        EXPECT_EQ(r.file(), "f");
        found.emplace_back(k.layer, k.step);
        return true;
      }));
  EXPECT_LE(index_->entries_read() - before, 3u + 15u);
  std::vector<std::pair<uint32_t, uint64_t>> want;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    for (uint64_t step = 1996; step <= 2000; ++step) want.emplace_back(layer, step);
  }
  EXPECT_EQ(found, want);
  // Nothing after the newest step; everything after 0; an early stop.
  found.clear();
  CKPT_ASSERT_OK(index_->ForEachVersionAfter("job", 1, 2000,
                                             [&](const VersionKey& k, const store::VersionRecord&) {
                                               found.emplace_back(k.layer, k.step);
                                               return true;
                                             }));
  EXPECT_TRUE(found.empty());
  CKPT_ASSERT_OK(index_->ForEachVersionAfter("job", 1, ~uint64_t{0},
                                             [&](const VersionKey& k, const store::VersionRecord&) {
                                               found.emplace_back(k.layer, k.step);
                                               return true;
                                             }));
  EXPECT_TRUE(found.empty());
  uint64_t all = 0;
  CKPT_ASSERT_OK(index_->ForEachVersionAfter("job", 2, 0,
                                             [&](const VersionKey& k, const store::VersionRecord&) {
                                               EXPECT_EQ(k.step, 9u);
                                               ++all;
                                               return true;
                                             }));
  EXPECT_EQ(all, 1u);
  int calls = 0;
  CKPT_ASSERT_OK(index_->ForEachVersionAfter(
      "job", 1, 1990, [&](const VersionKey&, const store::VersionRecord&) { return ++calls < 3; }));
  EXPECT_EQ(calls, 3);
}

// Regression (found by tests/fuzz/index_fuzzer.cc): number fields of keys were
// parsed leniently (upper case, "+", "0x"), so a non-canonical key read back
// as a version whose canonical key is another key: Reconcile "removed" it by
// deleting the canonical key, unlinked its file and left the record behind.
// A lookup of one rank reads that rank's keys only: not another job's, and
// not the tombstones a deleted job leaves before compaction. A job of
// 30,000 layers, deleted, once made another user's Register (a seek per
// layer that has no version yet) and plan 40 times slower.
TEST_F(IndexTest, LookupsDoNotWadeThroughAnotherJobsTombstones) {
  constexpr uint32_t kLayers = 3000;
  std::vector<VersionKey> big;
  for (uint32_t l = 0; l < kLayers; ++l) big.push_back(VersionKey{"a-big", 0, l, 1});
  CKPT_ASSERT_OK(index_->PutVersions(big, std::vector<store::VersionRecord>(kLayers, Rec("f"))));
  CKPT_ASSERT_OK(index_->PutEvent("a-big", 0, 1, store::EventRecord()));
  for (const VersionKey& k : big) CKPT_ASSERT_OK(index_->DeleteVersion(k));
  CKPT_ASSERT_OK(index_->DeleteEvent("a-big", 0, 1));
  // "b-small" sorts right after the deleted job; it has no versions yet.
  auto skipped = [] { return rocksdb::get_perf_context()->internal_delete_skipped_count; };
  rocksdb::SetPerfLevel(rocksdb::PerfLevel::kEnableCount);
  rocksdb::get_perf_context()->Reset();
  for (uint32_t l = 0; l < 200; ++l) {
    CKPT_ASSERT_OK_AND_ASSIGN(auto v, index_->VersionAtOrBefore("b-small", 0, l, ~uint64_t{0}));
    EXPECT_FALSE(v.has_value());
  }
  CKPT_ASSERT_OK_AND_ASSIGN(auto e, index_->EventAtOrBefore("b-small", 0, ~uint64_t{0}));
  EXPECT_FALSE(e.has_value());
  CKPT_ASSERT_OK(index_->ForEachEvent("b-small", 0, /*newest_first=*/true,
                                      [](uint64_t, const store::EventRecord&) { return true; }));
  CKPT_ASSERT_OK(index_->ForEachVersionAfter(
      "a-big", 0, 0, [](const VersionKey&, const store::VersionRecord&) { return true; }));
  const uint64_t before_compaction = skipped();
  // The deleted job's own range has its tombstones until it is compacted.
  CKPT_ASSERT_OK(index_->CompactJob("a-big"));
  rocksdb::get_perf_context()->Reset();
  CKPT_ASSERT_OK(index_->ForEachVersionAfter(
      "a-big", 0, 0, [](const VersionKey&, const store::VersionRecord&) { return true; }));
  const uint64_t after_compaction = skipped();
  rocksdb::SetPerfLevel(rocksdb::PerfLevel::kDisable);
  // Only the scan of the deleted job's own range met its tombstones.
  EXPECT_LE(before_compaction, uint64_t{kLayers} + 1);
  EXPECT_EQ(after_compaction, 0u);
}

TEST_F(IndexTest, NonCanonicalNumberInAKeyIsDataLoss) {
  index_.reset();
  {
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), tmp_.Join("index"), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    const std::string rec = Rec("f").SerializeAsString();
    ASSERT_TRUE(
        db->Put(rocksdb::WriteOptions(), "v/job/00000001/00000003/000000000000000A", rec).ok());
    ASSERT_TRUE(
        db->Put(rocksdb::WriteOptions(), "v/job/00000002/+0000003/000000000000000a", rec).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "e/job/00000001/0x00000000000009", "").ok());
    ASSERT_TRUE(db->Close().ok());
  }
  ASSERT_NO_FATAL_FAILURE(Reopen());
  auto scan = [&](uint32_t rank) {
    return index_->ForEachVersion(
        "job", rank, -1, [](const VersionKey&, const store::VersionRecord&) { return true; });
  };
  CKPT_EXPECT_CODE(scan(1), kDataLoss);
  CKPT_EXPECT_CODE(scan(2), kDataLoss);
  CKPT_EXPECT_CODE(index_->VersionAtOrBefore("job", 1, 3, ~uint64_t{0}), kDataLoss);
  CKPT_EXPECT_CODE(index_->EventAtOrBefore("job", 1, ~uint64_t{0}), kDataLoss);
}

}  // namespace
}  // namespace ckpt
