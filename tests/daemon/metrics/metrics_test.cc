// Tests of daemon/metrics: the metric table, the scrape, the HTTP endpoint,
// the series caps, promtool's lint, and the names used by deploy/.
#include "daemon/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

#ifndef CKPT_SOURCE_DIR
#error "CKPT_SOURCE_DIR must name the source tree"
#endif

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;

size_t CountOccurrences(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

// Lines of `text` that are samples of `name` (name followed by '{' or ' ').
std::vector<std::string> Samples(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, name + "{") || absl::StartsWith(line, name + " ")) {
      out.emplace_back(line);
    }
  }
  return out;
}

constexpr uint32_t kUid = 1000;  // the owner of the ranks of most tests

// Gives every labelled family at least one series, so that every family of
// the table appears in a scrape.
void PopulateLabelled(Metrics* m) {
  m->Set(Gauge::kIoBackendInfo, "io_uring", 1);
  m->Set(Gauge::kUidDiskUsedBytes, "1000", 4096);
  m->Set(Gauge::kUidIndexUsedBytes, "1000", 512);
  for (Gauge g : {Gauge::kPeerLagSteps, Gauge::kPeerLagBytes, Gauge::kPeerUp}) {
    m->Set(g, "node-b", 1);  // per peer node
  }
  m->SetLayer("job-a", 0, 0, /*uid=*/1000, 2, 0.5);
}

// A plain HTTP/1.0 GET of `path` on 127.0.0.1:port; the whole response, or ""
// on error.
std::string HttpGet(int port, const std::string& path) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return "";
  timeval tv{};
  tv.tv_sec = 10;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return "";
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return "";
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
    if (n < 0) return "";
    if (n == 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  return response;
}

std::set<std::string> TableNames() {
  std::set<std::string> names;
  for (const MetricInfo& m : Metrics::AllMetrics()) names.insert(m.name);
  return names;
}

TEST(MetricsTableTest, NamesAreValidUniqueAndTyped) {
  const std::regex name_re("[a-z_][a-z0-9_]*");
  const std::regex labels_re("([a-z_][a-z0-9_]*(,[a-z_][a-z0-9_]*)*)?");
  std::set<std::string> seen;
  for (const MetricInfo& m : Metrics::AllMetrics()) {
    SCOPED_TRACE(m.name);
    EXPECT_TRUE(std::regex_match(m.name, name_re));
    EXPECT_TRUE(absl::StartsWith(m.name, "ckpt_"));
    EXPECT_TRUE(seen.insert(m.name).second) << "duplicate name";
    const std::string type = m.type;
    EXPECT_TRUE(type == "counter" || type == "gauge" || type == "histogram");
    EXPECT_EQ(type == "counter", absl::EndsWith(m.name, "_total"));
    EXPECT_TRUE(std::regex_match(m.labels, labels_re));
    EXPECT_FALSE(std::string(m.help).empty());
    if (type == "histogram") {
      EXPECT_TRUE(absl::EndsWith(m.name, "_seconds"));
    }
  }
  EXPECT_EQ(Metrics::AllMetrics().size(), kNumCounters + kNumGauges + kNumHistograms);
}

TEST(MetricsTableTest, InfoMatchesEnumOrder) {
  const auto& all = Metrics::AllMetrics();
  for (size_t i = 0; i < kNumCounters; ++i) {
    EXPECT_EQ(&Metrics::Info(static_cast<Counter>(i)) - &Metrics::Info(Counter::kVersionsStaged),
              static_cast<ptrdiff_t>(i));
    EXPECT_STREQ(Metrics::Info(static_cast<Counter>(i)).name, all[i].name);
  }
  for (size_t i = 0; i < kNumGauges; ++i) {
    EXPECT_STREQ(Metrics::Info(static_cast<Gauge>(i)).name, all[kNumCounters + i].name);
  }
  for (size_t i = 0; i < kNumHistograms; ++i) {
    EXPECT_STREQ(Metrics::Info(static_cast<Histogram>(i)).name,
                 all[kNumCounters + kNumGauges + i].name);
  }
  EXPECT_STREQ(Metrics::Info(Counter::kVersionsCommitted).name, "ckpt_versions_committed_total");
  EXPECT_STREQ(Metrics::Info(Gauge::kDurabilityLagSeconds).name, "ckpt_durability_lag_seconds");
  EXPECT_STREQ(Metrics::Info(Histogram::kFenceWaitSeconds).name, "ckpt_fence_wait_seconds");
}

TEST(MetricsTableTest, MarkdownTableHasOneRowPerMetric) {
  const std::string md = Metrics::MarkdownTable();
  EXPECT_TRUE(absl::StartsWith(md, "| name | type | labels | meaning |\n|---|---|---|---|\n"));
  for (const MetricInfo& m : Metrics::AllMetrics()) {
    EXPECT_EQ(CountOccurrences(md, absl::StrCat("| `", m.name, "` | ", m.type, " |")), 1u)
        << m.name;
  }
  EXPECT_EQ(CountOccurrences(md, "\n"), Metrics::AllMetrics().size() + 2);
  EXPECT_TRUE(absl::StrContains(md, "`kind`: write, fsync, index, read, checksum"));
}

TEST(MetricsTest, EveryTableEntryIsRegisteredOnceAndScraped) {
  Metrics m;
  PopulateLabelled(&m);
  const std::string text = m.Scrape();
  for (const MetricInfo& info : Metrics::AllMetrics()) {
    SCOPED_TRACE(info.name);
    EXPECT_EQ(CountOccurrences(text, absl::StrCat("# TYPE ", info.name, " ", info.type, "\n")), 1u);
    EXPECT_EQ(CountOccurrences(text, absl::StrCat("# HELP ", info.name, " ")), 1u);
    const std::string sample =
        std::string(info.name) + (std::string(info.type) == "histogram" ? "_count" : "");
    EXPECT_FALSE(Samples(text, sample).empty());
  }
  // No family outside the table.
  EXPECT_EQ(CountOccurrences(text, "# TYPE "), Metrics::AllMetrics().size());
}

TEST(MetricsTest, UpdatesAppearInTheScrape) {
  Metrics m;
  for (int i = 0; i < 3; ++i) m.Inc(Counter::kVersionsCommitted);
  m.Inc(Counter::kCommittedBytes, 4096);
  m.Inc(Counter::kErrors, "fsync", 2);
  m.Inc(Counter::kSnapshotsSkipped, "pool_full", 1);
  m.Set(Gauge::kDurabilityLagSeconds, 12.5);
  m.Set(Gauge::kIoBackendInfo, "pwrite", 1);
  m.Observe(Histogram::kWriteSeconds, 0.003);
  m.Observe(Histogram::kWriteSeconds, 0.2);
  const std::string text = m.Scrape();
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_versions_committed_total 3\n")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_committed_bytes_total 4096\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_errors_total{kind=\"fsync\"} 2\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_errors_total{kind=\"write\"} 0\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_snapshots_skipped_total{reason=\"pool_full\"} 1\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_durability_lag_seconds 12.5\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_io_backend_info{backend=\"pwrite\"} 1\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_write_seconds_count 2\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_write_seconds_bucket{le=\"0.005\"} 1\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_write_seconds_bucket{le=\"+Inf\"} 2\n"));
  EXPECT_EQ(Samples(text, "ckpt_metric_series_dropped_total"),
            std::vector<std::string>{"ckpt_metric_series_dropped_total 0"});
}

TEST(MetricsTest, HistogramBucketsSpan100MicrosecondsTo30Seconds) {
  const std::vector<double>& b = HistogramBucketsSeconds();
  ASSERT_FALSE(b.empty());
  EXPECT_DOUBLE_EQ(b.front(), 0.0001);
  EXPECT_DOUBLE_EQ(b.back(), 30);
  for (size_t i = 1; i < b.size(); ++i) EXPECT_LT(b[i - 1], b[i]);
}

TEST(MetricsTest, MisusedLabelsAreDroppedAndCounted) {
  Metrics m;
  m.Inc(Counter::kErrors);                        // labelled counter without a label
  m.Set(Gauge::kIoBackendInfo, 1);                // labelled gauge without a label
  m.Set(Gauge::kLayerStalenessSteps, "x", 1);     // per-layer gauge outside SetLayer
  m.Inc(Counter::kRestores, "ignored-label", 2);  // unlabelled: label ignored
  const std::string text = m.Scrape();
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_metric_series_dropped_total 3\n")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_restores_total 2\n"));
  EXPECT_TRUE(Samples(text, "ckpt_layer_staleness_steps").empty());
}

TEST(MetricsTest, LabelledFamilyIsCapped) {
  Metrics m;
  const size_t cap = Metrics::kMaxSeriesPerLabelledFamily;
  for (size_t i = 0; i < cap + 5; ++i) m.Inc(Counter::kErrors, absl::StrCat("k", i), 1);
  const std::string text = m.Scrape();
  EXPECT_EQ(Samples(text, "ckpt_errors_total").size(), cap);
  // The 8 presets count toward the cap: cap + 5 new values, cap - 8 accepted.
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_metric_series_dropped_total 13\n")) << text;
  m.Inc(Counter::kErrors, "write", 1);  // an existing series still counts
  EXPECT_TRUE(absl::StrContains(m.Scrape(), "\nckpt_errors_total{kind=\"write\"} 1\n"));
}

TEST(MetricsTest, LayerSeriesAreCappedAndCounted) {
  Metrics m(/*max_layer_series=*/4);
  for (uint32_t layer = 0; layer < 6; ++layer)
    m.SetLayer("job", 0, layer, kUid, layer, 0.25 * layer);
  EXPECT_EQ(m.layer_series(), 4u);
  m.SetLayer("job", 0, 3, kUid, 7, 1.5);    // an existing triple is updated at the cap
  m.SetLayer("other", 1, 0, kUid, 1, 0.0);  // a new one of the same uid is not
  EXPECT_EQ(m.layer_series(), 4u);
  const std::string text = m.Scrape();
  EXPECT_EQ(Samples(text, "ckpt_layer_staleness_steps").size(), 4u);
  EXPECT_EQ(Samples(text, "ckpt_layer_accumulated_drift").size(), 4u);
  EXPECT_TRUE(absl::StrContains(
      text, "ckpt_layer_staleness_steps{ckpt_job=\"job\",layer=\"3\",rank=\"0\"} 7\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "ckpt_layer_accumulated_drift{ckpt_job=\"job\",layer=\"3\",rank=\"0\"} 1.5\n"));
  EXPECT_FALSE(absl::StrContains(text, "layer=\"5\""));
  EXPECT_FALSE(absl::StrContains(text, "ckpt_job=\"other\""));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_metric_series_dropped_total 3\n"));
}

// Regression: a stale 65,536-layer registration took all 4,096 per-layer
// series, and another user's layers got none. The budget is shared per uid:
// a uid under an equal share takes series from the uid holding the most, and
// one at its share takes none, so the shares settle instead of flapping.
TEST(MetricsTest, LayerSeriesAreSharedFairlyAmongUids) {
  constexpr uint32_t kHog = 4243, kVictim = 4242, kThird = 4244;
  Metrics m(/*max_layer_series=*/64);
  for (uint32_t layer = 0; layer < 1000; ++layer) m.SetLayer("hog", 0, layer, kHog, 1, 0);
  EXPECT_EQ(m.layer_series_of(kHog), 64u);
  for (uint32_t layer = 0; layer < 10; ++layer) m.SetLayer("victim", 0, layer, kVictim, 2, 0);
  EXPECT_EQ(m.layer_series_of(kVictim), 10u) << "under its share of 32, it gets all it needs";
  EXPECT_EQ(m.layer_series_of(kHog), 54u);
  for (uint32_t layer = 0; layer < 100; ++layer) m.SetLayer("third", 0, layer, kThird, 3, 0);
  EXPECT_EQ(m.layer_series_of(kThird), 64u / 3);
  EXPECT_EQ(m.layer_series_of(kVictim), 10u);
  EXPECT_EQ(m.layer_series_of(kHog), 64u - 10 - 64 / 3);
  EXPECT_EQ(m.layer_series(), 64u);
  // A second scrape's updates change nothing: the shares are stable.
  for (int round = 0; round < 2; ++round) {
    for (uint32_t layer = 0; layer < 1000; ++layer) m.SetLayer("hog", 0, layer, kHog, 1, 0);
    for (uint32_t layer = 0; layer < 100; ++layer) m.SetLayer("third", 0, layer, kThird, 3, 0);
    for (uint32_t layer = 0; layer < 10; ++layer) m.SetLayer("victim", 0, layer, kVictim, 2, 0);
  }
  EXPECT_EQ(m.layer_series_of(kVictim), 10u);
  EXPECT_EQ(m.layer_series_of(kThird), 64u / 3);
  const std::string text = m.Scrape();
  EXPECT_EQ(Samples(text, "ckpt_layer_staleness_steps").size(), 64u);
  for (uint32_t layer = 0; layer < 10; ++layer) {
    EXPECT_TRUE(absl::StrContains(
        text, absl::StrCat("ckpt_layer_staleness_steps{ckpt_job=\"victim\",layer=\"", layer,
                           "\",rank=\"0\"} 2\n")))
        << layer;
  }
  // Once the hog unregisters, the others may grow into the whole budget.
  m.RemoveRank("hog", 0);
  for (uint32_t layer = 0; layer < 100; ++layer) m.SetLayer("third", 0, layer, kThird, 3, 0);
  EXPECT_EQ(m.layer_series_of(kThird), 64u - 10);
  EXPECT_EQ(m.layer_series_of(kHog), 0u);
}

TEST(MetricsTest, RemoveRankRemovesItsSeriesAndFreesTheCap) {
  Metrics m(/*max_layer_series=*/4);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    m.SetLayer("job", 0, layer, kUid, 1, 0);
    m.SetLayer("job", 1, layer, kUid, 2, 0);
  }
  EXPECT_EQ(m.layer_series(), 4u);
  m.RemoveRank("job", 0);
  m.RemoveRank("job", 7);  // unknown: no-op
  EXPECT_EQ(m.layer_series(), 2u);
  std::string text = m.Scrape();
  EXPECT_FALSE(absl::StrContains(text, "rank=\"0\""));
  EXPECT_EQ(Samples(text, "ckpt_layer_staleness_steps").size(), 2u);
  m.SetLayer("job2", 0, 0, kUid, 3, 0);
  m.SetLayer("job2", 0, 1, kUid, 3, 0);
  EXPECT_EQ(m.layer_series(), 4u);
  m.RemoveRank("job", 1);
  m.RemoveRank("job2", 0);
  EXPECT_EQ(m.layer_series(), 0u);
  text = m.Scrape();
  EXPECT_TRUE(Samples(text, "ckpt_layer_staleness_steps").empty());
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_metric_series_dropped_total 0\n"));
}

TEST(MetricsTest, CollectHookAndUptimeRunAtScrape) {
  Metrics m;
  int calls = 0;
  m.SetCollectHook([&] {
    ++calls;
    m.Set(Gauge::kWriteQueueDepth, 17);
  });
  const std::string text = m.Scrape();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_write_queue_depth 17\n"));
  const std::vector<std::string> uptime = Samples(text, "ckpt_uptime_seconds");
  ASSERT_EQ(uptime.size(), 1u);
  EXPECT_NE(uptime[0], "ckpt_uptime_seconds 0");
  m.SetCollectHook(nullptr);
  m.Scrape();
  EXPECT_EQ(calls, 1);
}

TEST(MetricsExposerTest, ServesMetricsOverHttp) {
  Metrics m;
  EXPECT_EQ(m.port(), 0);
  CKPT_ASSERT_OK(m.StartExposer("127.0.0.1:0"));
  ASSERT_GT(m.port(), 0);
  for (int i = 0; i < 3; ++i) m.Inc(Counter::kVersionsCommitted);
  const std::string response = HttpGet(m.port(), "/metrics");
  ASSERT_TRUE(absl::StartsWith(response, "HTTP/1.")) << response;
  EXPECT_TRUE(absl::StrContains(response.substr(0, response.find('\n')), " 200 ")) << response;
  EXPECT_TRUE(absl::StrContains(response, "\nckpt_versions_committed_total 3\n")) << response;
  EXPECT_TRUE(absl::StrContains(response, "\n# TYPE ckpt_fsync_seconds histogram\n"));
  EXPECT_TRUE(absl::StrContains(response, "\nckpt_uptime_seconds "));
  CKPT_EXPECT_CODE(m.StartExposer("127.0.0.1:0"), kFailedPrecondition);
}

TEST(MetricsExposerTest, EmptyAddressDisablesAndBusyPortFails) {
  Metrics disabled;
  CKPT_EXPECT_OK(disabled.StartExposer(""));
  EXPECT_EQ(disabled.port(), 0);

  Metrics first;
  CKPT_ASSERT_OK(first.StartExposer("127.0.0.1:0"));
  Metrics second;
  const absl::Status s = second.StartExposer(absl::StrCat("127.0.0.1:", first.port()));
  CKPT_EXPECT_CODE(s, kUnavailable);
  EXPECT_EQ(second.port(), 0);
  CKPT_EXPECT_CODE(second.StartExposer("not-an-address:x"), kUnavailable);
}

TEST(MetricsTest, ConcurrentUpdatesAndScrapes) {
  Metrics m(/*max_layer_series=*/64);
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      for (uint32_t i = 0; i < 500; ++i) {
        m.Inc(Counter::kVersionsStaged);
        m.Inc(Counter::kErrors, i % 2 ? "write" : "read", 1);
        m.Observe(Histogram::kCommitSeconds, 0.001 * (i % 10));
        m.SetLayer("job", t, i % 8, kUid, i, 0.1);
        if (i % 100 == 99) m.RemoveRank("job", t);
      }
    });
  }
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(m.Scrape().empty());
  for (std::thread& t : threads) t.join();
  const std::string text = m.Scrape();
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_versions_staged_total 2000\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_errors_total{kind=\"write\"} 1000\n"));
  EXPECT_TRUE(absl::StrContains(text, "\nckpt_commit_seconds_count 2000\n"));
  EXPECT_EQ(m.layer_series(), 0u);
}

TEST(MetricsPromtoolTest, ScrapePassesPromtoolCheckMetrics) {
  const std::string promtool = "/usr/bin/promtool";
  if (::access(promtool.c_str(), X_OK) != 0) GTEST_SKIP() << "promtool is not installed";
  Metrics m;
  PopulateLabelled(&m);
  m.Inc(Counter::kVersionsCommitted, 3);
  m.Observe(Histogram::kFsyncSeconds, 0.01);
  TempDir dir;
  const std::string scrape = dir.Join("scrape.txt");
  const std::string out = dir.Join("promtool.out");
  ::ckpt::testing::WriteFile(scrape, m.Scrape());
  const std::string cmd =
      absl::StrCat(promtool, " check metrics < '", scrape, "' > '", out, "' 2>&1");
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << ::ckpt::testing::ReadFile(out);
}

// Every ckpt_ metric (and ckpt_ label) that the dashboard, the alert rules
// and their tests use exists in the table (histogram series suffixes
// stripped).
// Regression: the training job was labelled `job`, which Prometheus
// renames to exported_job on scrape (it sets `job` to the scrape job), so
// the dashboard's per-job variable and panels showed nothing.
TEST(MetricsTableTest, NoMetricUsesPrometheusTargetLabels) {
  for (const MetricInfo& m : Metrics::AllMetrics()) {
    for (absl::string_view label : absl::StrSplit(m.labels, ',', absl::SkipEmpty())) {
      EXPECT_NE(label, "job") << m.name;
      EXPECT_NE(label, "instance") << m.name;
    }
  }
}

TEST(DeployTest, DashboardAndAlertsUseOnlyTableMetrics) {
  std::set<std::string> names = TableNames();
  for (const MetricInfo& m : Metrics::AllMetrics()) {
    for (absl::string_view label : absl::StrSplit(m.labels, ',', absl::SkipEmpty())) {
      names.insert(std::string(label));
    }
  }
  const std::regex token_re("ckpt_[a-z0-9_]+");
  for (const char* rel :
       {"deploy/grafana/ckptd-dashboard.json", "deploy/prometheus/ckptd-alerts.yml",
        "deploy/prometheus/ckptd-alerts_test.yml"}) {
    SCOPED_TRACE(rel);
    const std::string text = ::ckpt::testing::ReadFile(absl::StrCat(CKPT_SOURCE_DIR, "/", rel));
    ASSERT_NE(text, "<missing>");
    size_t used = 0;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), token_re);
         it != std::sregex_iterator(); ++it) {
      std::string name = it->str();
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        if (absl::EndsWith(name, suffix) && names.count(name) == 0) {
          name.resize(name.size() - std::string(suffix).size());
          break;
        }
      }
      EXPECT_EQ(names.count(name), 1u) << it->str() << " is not in the metric table";
      ++used;
    }
    EXPECT_GT(used, 5u);
  }
}

}  // namespace
}  // namespace ckpt
