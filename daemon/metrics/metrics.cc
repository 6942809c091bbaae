#include "daemon/metrics/metrics.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/metrics/metrics_table.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace ckpt {
namespace {

using metrics_table::IsLayerGauge;
using metrics_table::kCounterTable;
using metrics_table::kGaugeTable;
using metrics_table::kHistogramTable;
using metrics_table::Len;

int64_t SteadyNowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string MarkdownCell(absl::string_view s) { return absl::StrReplaceAll(s, {{"|", "\\|"}}); }

}  // namespace

// Delegates to the registry after refreshing the scrape-time gauges. Owned by
// Metrics; the exposer holds a weak_ptr and is destroyed first.
class Metrics::ScrapeSource : public prometheus::Collectable {
 public:
  explicit ScrapeSource(Metrics* metrics) : metrics_(metrics) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    metrics_->BeforeScrape();
    return metrics_->registry_->Collect();
  }

 private:
  Metrics* const metrics_;
};

const std::vector<double>& HistogramBucketsSeconds() {
  static const std::vector<double>* const kBuckets =
      new std::vector<double>{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                              0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30};
  return *kBuckets;
}

Metrics::Metrics(size_t max_layer_series)
    : max_layer_series_(max_layer_series),
      started_ns_(SteadyNowNanos()),
      registry_(std::make_shared<prometheus::Registry>()),
      scrape_source_(std::make_shared<ScrapeSource>(this)) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < kNumCounters; ++i) {
    const MetricInfo& info = kCounterTable[i];
    auto& family = prometheus::BuildCounter().Name(info.name).Help(info.help).Register(*registry_);
    counter_families_[i] = &family;
    if (Len(info.labels) == 0) {
      counters_[i] = &family.Add({});
      continue;
    }
    for (absl::string_view v : absl::StrSplit(info.preset_values, ',', absl::SkipEmpty())) {
      LabelledCounter(i, std::string(v));
    }
  }
  for (size_t i = 0; i < kNumGauges; ++i) {
    const MetricInfo& info = kGaugeTable[i];
    auto& family = prometheus::BuildGauge().Name(info.name).Help(info.help).Register(*registry_);
    gauge_families_[i] = &family;
    if (Len(info.labels) == 0) {
      gauges_[i] = &family.Add({});
      continue;
    }
    if (IsLayerGauge(i)) continue;
    for (absl::string_view v : absl::StrSplit(info.preset_values, ',', absl::SkipEmpty())) {
      LabelledGauge(i, std::string(v));
    }
  }
  for (size_t i = 0; i < kNumHistograms; ++i) {
    const MetricInfo& info = kHistogramTable[i];
    auto& family =
        prometheus::BuildHistogram().Name(info.name).Help(info.help).Register(*registry_);
    histograms_[i] = &family.Add({}, HistogramBucketsSeconds());
  }
}

Metrics::~Metrics() {
  // Stop serving before the registry and the families go away.
  absl::MutexLock lock(&exposer_mu_);
  exposer_.reset();
}

const std::vector<MetricInfo>& Metrics::AllMetrics() {
  static const std::vector<MetricInfo>* const kAll = [] {
    auto* all = new std::vector<MetricInfo>();
    all->insert(all->end(), std::begin(kCounterTable), std::end(kCounterTable));
    all->insert(all->end(), std::begin(kGaugeTable), std::end(kGaugeTable));
    all->insert(all->end(), std::begin(kHistogramTable), std::end(kHistogramTable));
    return all;
  }();
  return *kAll;
}

const MetricInfo& Metrics::Info(Counter c) { return kCounterTable[static_cast<size_t>(c)]; }
const MetricInfo& Metrics::Info(Gauge g) { return kGaugeTable[static_cast<size_t>(g)]; }
const MetricInfo& Metrics::Info(Histogram h) { return kHistogramTable[static_cast<size_t>(h)]; }

std::string Metrics::MarkdownTable() {
  std::string out = "| name | type | labels | meaning |\n|---|---|---|---|\n";
  for (const MetricInfo& m : AllMetrics()) {
    std::string labels;
    for (absl::string_view l : absl::StrSplit(m.labels, ',', absl::SkipEmpty())) {
      absl::StrAppend(&labels, labels.empty() ? "" : ", ", "`", l, "`");
    }
    if (Len(m.preset_values) > 0) {
      absl::StrAppend(&labels, ": ", absl::StrReplaceAll(m.preset_values, {{",", ", "}}));
    }
    absl::StrAppend(&out, "| `", m.name, "` | ", m.type, " | ", MarkdownCell(labels), " | ",
                    MarkdownCell(m.help), " |\n");
  }
  return out;
}

void Metrics::CountDropped() {
  counters_[static_cast<size_t>(Counter::kMetricSeriesDropped)]->Increment();
}

prometheus::Counter* Metrics::LabelledCounter(size_t index, const std::string& label_value) {
  auto& series = labelled_counters_[index];
  auto it = series.find(label_value);
  if (it != series.end()) return it->second;
  if (series.size() >= kMaxSeriesPerLabelledFamily) return nullptr;
  prometheus::Counter* c =
      &counter_families_[index]->Add({{kCounterTable[index].labels, label_value}});
  series.emplace(label_value, c);
  return c;
}

prometheus::Gauge* Metrics::LabelledGauge(size_t index, const std::string& label_value) {
  auto& series = labelled_gauges_[index];
  auto it = series.find(label_value);
  if (it != series.end()) return it->second;
  if (series.size() >= kMaxSeriesPerLabelledFamily) return nullptr;
  prometheus::Gauge* g = &gauge_families_[index]->Add({{kGaugeTable[index].labels, label_value}});
  series.emplace(label_value, g);
  return g;
}

void Metrics::Inc(Counter c, double v) {
  prometheus::Counter* counter = counters_[static_cast<size_t>(c)];
  if (counter == nullptr) {
    CountDropped();
    return;
  }
  counter->Increment(v);
}

void Metrics::Inc(Counter c, const std::string& label_value, double v) {
  const size_t i = static_cast<size_t>(c);
  if (counters_[i] != nullptr) {
    counters_[i]->Increment(v);
    return;
  }
  absl::MutexLock lock(&mu_);
  prometheus::Counter* counter = LabelledCounter(i, label_value);
  if (counter == nullptr) {
    CountDropped();
    return;
  }
  counter->Increment(v);
}

void Metrics::Set(Gauge g, double v) {
  prometheus::Gauge* gauge = gauges_[static_cast<size_t>(g)];
  if (gauge == nullptr) {
    CountDropped();
    return;
  }
  gauge->Set(v);
}

void Metrics::Set(Gauge g, const std::string& label_value, double v) {
  const size_t i = static_cast<size_t>(g);
  if (gauges_[i] != nullptr) {
    gauges_[i]->Set(v);
    return;
  }
  if (IsLayerGauge(i)) {
    CountDropped();
    return;
  }
  absl::MutexLock lock(&mu_);
  prometheus::Gauge* gauge = LabelledGauge(i, label_value);
  if (gauge == nullptr) {
    CountDropped();
    return;
  }
  gauge->Set(v);
}

void Metrics::Observe(Histogram h, double seconds) {
  histograms_[static_cast<size_t>(h)]->Observe(seconds);
}

void Metrics::SetLayer(const std::string& job, uint32_t rank, uint32_t layer, uint32_t uid,
                       double staleness, double accumulated_drift) {
  absl::MutexLock lock(&mu_);
  auto found = layers_.find(LayerKey(job, rank));
  if (found != layers_.end() && found->second.uid != uid) {
    RemoveRankLocked(found);  // the job id now belongs to another uid
    found = layers_.end();
  }
  if (found != layers_.end()) {
    auto it = found->second.layers.find(layer);
    if (it != found->second.layers.end()) {
      it->second.staleness->Set(staleness);
      it->second.drift->Set(accumulated_drift);
      return;
    }
  }
  if (layer_series_ >= max_layer_series_ && !TakeFairShareLocked(uid)) {
    CountDropped();
    return;
  }
  RankSeries& rank_series = layers_[LayerKey(job, rank)];  // TakeFairShareLocked may erase
  rank_series.uid = uid;
  const prometheus::Labels labels = {
      {"ckpt_job", job}, {"rank", absl::StrCat(rank)}, {"layer", absl::StrCat(layer)}};
  LayerSeries s;
  s.staleness = &gauge_families_[static_cast<size_t>(Gauge::kLayerStalenessSteps)]->Add(labels);
  s.drift = &gauge_families_[static_cast<size_t>(Gauge::kLayerAccumulatedDrift)]->Add(labels);
  s.staleness->Set(staleness);
  s.drift->Set(accumulated_drift);
  rank_series.layers.emplace(layer, s);
  ++layer_series_;
  ++uid_series_[uid];
}

bool Metrics::TakeFairShareLocked(uint32_t uid) {
  if (max_layer_series_ == 0) return false;
  auto mine = uid_series_.find(uid);
  const size_t held = mine == uid_series_.end() ? 0 : mine->second;
  const size_t holders = uid_series_.size() + (mine == uid_series_.end() ? 1 : 0);
  if (held >= max_layer_series_ / holders) return false;
  // The budget is full and `uid` is under an equal share, so another uid is
  // over it: the one holding the most gives up its largest rank's highest
  // layer.
  auto richest = uid_series_.begin();
  for (auto it = uid_series_.begin(); it != uid_series_.end(); ++it) {
    if (it->second > richest->second) richest = it;
  }
  auto largest = layers_.end();
  for (auto it = layers_.begin(); it != layers_.end(); ++it) {
    if (it->second.uid == richest->first &&
        (largest == layers_.end() || it->second.layers.size() > largest->second.layers.size())) {
      largest = it;
    }
  }
  if (largest == layers_.end() || largest->second.layers.empty()) return false;
  auto victim = std::prev(largest->second.layers.end());
  RemoveSeriesLocked(victim->second);
  largest->second.layers.erase(victim);
  if (largest->second.layers.empty()) layers_.erase(largest);
  --layer_series_;
  if (--richest->second == 0) uid_series_.erase(richest);
  return true;
}

void Metrics::RemoveSeriesLocked(const LayerSeries& s) {
  gauge_families_[static_cast<size_t>(Gauge::kLayerStalenessSteps)]->Remove(s.staleness);
  gauge_families_[static_cast<size_t>(Gauge::kLayerAccumulatedDrift)]->Remove(s.drift);
}

void Metrics::RemoveRank(const std::string& job, uint32_t rank) {
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(LayerKey(job, rank));
  if (it != layers_.end()) RemoveRankLocked(it);
}

void Metrics::RemoveRankLocked(std::map<LayerKey, RankSeries>::iterator it) {
  for (const auto& [layer, s] : it->second.layers) RemoveSeriesLocked(s);
  const size_t n = it->second.layers.size();
  layer_series_ -= n;
  auto owner = uid_series_.find(it->second.uid);
  if (owner != uid_series_.end()) {
    owner->second -= std::min(owner->second, n);
    if (owner->second == 0) uid_series_.erase(owner);
  }
  layers_.erase(it);
}

size_t Metrics::layer_series() const {
  absl::MutexLock lock(&mu_);
  return layer_series_;
}

size_t Metrics::layer_series_of(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = uid_series_.find(uid);
  return it == uid_series_.end() ? 0 : it->second;
}

void Metrics::SetCollectHook(std::function<void()> hook) {
  absl::MutexLock lock(&hook_mu_);
  hook_ = std::move(hook);
}

void Metrics::BeforeScrape() {
  absl::MutexLock lock(&hook_mu_);
  gauges_[static_cast<size_t>(Gauge::kUptimeSeconds)]->Set(
      static_cast<double>(SteadyNowNanos() - started_ns_) / 1e9);
  if (hook_) hook_();
}

absl::Status Metrics::StartExposer(const std::string& address) {
  if (address.empty()) return absl::OkStatus();
  absl::MutexLock lock(&exposer_mu_);
  if (exposer_ != nullptr) {
    return absl::FailedPreconditionError("metrics endpoint already started");
  }
  // civetweb takes "port" for every interface; accept ":port" as well.
  const std::string bind = address[0] == ':' ? address.substr(1) : address;
  // prometheus-cpp reports a failed bind only by throwing from the Exposer
  // constructor (civetweb); this is the one place ckptd catches an exception,
  // turning it into a status at the library boundary.
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(bind, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint: cannot listen on '", address, "': ", e.what()));
  }
  exposer_->RegisterCollectable(scrape_source_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_.store(ports.empty() ? 0 : ports[0], std::memory_order_release);
  return absl::OkStatus();
}

std::string Metrics::Scrape() {
  const ScrapeSource& source = *scrape_source_;
  return prometheus::TextSerializer().Serialize(source.Collect());
}

}  // namespace ckpt
