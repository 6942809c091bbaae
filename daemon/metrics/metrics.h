// Metrics: every ckptd metric, declared once, exported in the Prometheus text
// format over HTTP (GET /metrics).
//
// One enumerated table (like RocksDB's statistics.h): each Counter, Gauge and
// Histogram enumerator has exactly one MetricInfo row in metrics.cc with its
// name, type, label names and help text. The rows are checked at compile time
// (names are ckpt_-prefixed snake_case, counters end in _total, no name twice)
// and MarkdownTable() renders them for the README, so the code, the scrape and
// the documentation cannot drift apart.
//
// Cardinality is bounded. Labelled families other than the per-layer ones hold
// at most kMaxSeriesPerLabelledFamily label values; the per-layer family
// (ckpt_layer_staleness_steps, ckpt_layer_accumulated_drift, labels ckpt_job, rank,
// layer) holds at most `max_layer_series` (job, rank, layer) triples, shared
// fairly among the uids owning the ranks: once the budget is full, a uid
// holding fewer than an equal share (the budget over the uids holding series,
// itself included) takes a series from the uid holding the most, so one
// user's huge registration cannot leave another's layers without any. Each
// update that would create a series beyond a cap or share is dropped and
// counted in ckpt_metric_series_dropped_total (so the counter keeps rising
// while it is hit). RemoveRank() frees a rank's triples.
//
// Thread-safety: all public methods are thread-safe. Inc/Set/Observe on
// unlabelled metrics are lock-free (prometheus-cpp atomics); labelled updates
// take an internal mutex.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Collectable;
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace ckpt {

// Monotonic counters (names end in _total). kCount is not a metric.
enum class Counter {
  kVersionsStaged,                // ckpt_versions_staged_total
  kStagedBytes,                   // ckpt_staged_bytes_total
  kVersionsCommitted,             // ckpt_versions_committed_total
  kCommittedBytes,                // ckpt_committed_bytes_total
  kVersionsFailed,                // ckpt_versions_failed_total
  kSnapshotsSkipped,              // ckpt_snapshots_skipped_total{reason}
  kErrors,                        // ckpt_errors_total{kind}
  kRestores,                      // ckpt_restores_total
  kRestoredBytes,                 // ckpt_restored_bytes_total
  kGcVersionsDeleted,             // ckpt_gc_versions_deleted_total
  kGcDeletedBytes,                // ckpt_gc_deleted_bytes_total
  kMetricSeriesDropped,           // ckpt_metric_series_dropped_total
  kRegistrations,                 // ckpt_registrations_total
  kStalenessInvariantViolations,  // ckpt_staleness_invariant_violations_total
  kHandoverRefused,               // ckpt_handover_refused_total
  kHandoverAcceptErrors,          // ckpt_handover_accept_errors_total
  kRpcConnectionsRefused,         // ckpt_rpc_connections_refused_total
  kRpcAcceptErrors,               // ckpt_rpc_accept_errors_total
  kRanksReleased,                 // ckpt_ranks_released_total
  kJobsDeleted,                   // ckpt_jobs_deleted_total
  kQuotaRefused,                  // ckpt_quota_refused_total{kind}
  kEventsFailed,                  // ckpt_events_failed_total
  kRemoteUploadedVersions,        // ckpt_remote_uploaded_versions_total
  kRemoteUploadedBytes,           // ckpt_remote_uploaded_bytes_total
  kRemoteManifests,               // ckpt_remote_manifests_total
  kRemoteFailures,                // ckpt_remote_failures_total{reason}
  kRemotePulledBytes,             // ckpt_remote_pulled_bytes_total
  kRemoteGcDeletedObjects,        // ckpt_remote_gc_deleted_objects_total
  kMemoryTierRestoredBytes,       // ckpt_memory_tier_restored_bytes_total
  kVersionsQuarantined,           // ckpt_versions_quarantined_total
  kVersionsRepaired,              // ckpt_versions_repaired_total{tier}
  kGpuWaitsAbandoned,             // ckpt_gpu_waits_abandoned_total{reason}
  kLostVersionRestores,           // ckpt_lost_version_restores_total{outcome}
  kPeerUploadedVersions,          // ckpt_peer_uploaded_versions_total
  kPeerUploadedBytes,             // ckpt_peer_uploaded_bytes_total
  kPeerSentFromMemoryBytes,       // ckpt_peer_sent_from_memory_bytes_total
  kPeerManifests,                 // ckpt_peer_manifests_total
  kPeerFailures,                  // ckpt_peer_failures_total{reason}
  kPeerPulledBytes,               // ckpt_peer_pulled_bytes_total
  kPeerGcDeletedObjects,          // ckpt_peer_gc_deleted_objects_total
  kPeerReplicaReceivedBytes,      // ckpt_peer_replica_received_bytes_total
  kPeerReplicaRefused,            // ckpt_peer_replica_refused_total{reason}
  kExportedBytes,                 // ckpt_exported_bytes_total{path}
  kCount
};

// Point-in-time values. kCount is not a metric.
enum class Gauge {
  kStagingPoolBytes,       // ckpt_staging_pool_bytes
  kStagingPoolInUseBytes,  // ckpt_staging_pool_in_use_bytes
  kWriteQueueDepth,        // ckpt_write_queue_depth
  kDurabilityLagBytes,     // ckpt_durability_lag_bytes
  kDurabilityLagSeconds,   // ckpt_durability_lag_seconds
  kRegisteredRanks,        // ckpt_registered_ranks
  kOpenGpuMappings,        // ckpt_open_gpu_mappings
  kOpenGpuMappingBytes,    // ckpt_open_gpu_mapping_bytes
  kDiskUsedBytes,          // ckpt_disk_used_bytes
  kDiskLimitBytes,         // ckpt_disk_limit_bytes
  kIoBackendInfo,          // ckpt_io_backend_info{backend}
  kLayerStalenessSteps,    // ckpt_layer_staleness_steps{ckpt_job,rank,layer}: SetLayer() only
  kLayerAccumulatedDrift,  // ckpt_layer_accumulated_drift{ckpt_job,rank,layer}: SetLayer() only
  kUptimeSeconds,          // ckpt_uptime_seconds: refreshed at every scrape
  kHandoverFdsHeld,        // ckpt_handover_fds_held
  kStaleRanks,             // ckpt_stale_ranks
  kUidDiskLimitBytes,      // ckpt_uid_disk_limit_bytes
  kUidIndexLimitBytes,     // ckpt_uid_index_limit_bytes
  kUidDiskUsedBytes,       // ckpt_uid_disk_used_bytes{uid}
  kUidIndexUsedBytes,      // ckpt_uid_index_used_bytes{uid}
  kIndexDegraded,          // ckpt_index_degraded
  kIndexMemoryBytes,       // ckpt_index_memory_bytes
  kGlobalDurableLagSteps,  // ckpt_global_durable_lag_steps
  kRemoteLagSteps,         // ckpt_remote_lag_steps
  kRemoteLagBytes,         // ckpt_remote_lag_bytes
  kRemoteUp,               // ckpt_remote_up
  kMemoryTierBytes,        // ckpt_memory_tier_bytes
  kGpuDevicesPoisoned,     // ckpt_gpu_devices_poisoned
  kPeerLagSteps,           // ckpt_peer_lag_steps
  kPeerLagBytes,           // ckpt_peer_lag_bytes
  kPeerUp,                 // ckpt_peer_up
  kPeerReplicaBytes,       // ckpt_peer_replica_bytes{where}
  kCount
};

// Latency distributions in seconds, buckets 100 us .. 30 s. kCount is not a
// metric.
enum class Histogram {
  kWriteSeconds,         // ckpt_write_seconds
  kFsyncSeconds,         // ckpt_fsync_seconds
  kCommitSeconds,        // ckpt_commit_seconds
  kFenceWaitSeconds,     // ckpt_fence_wait_seconds
  kSnapshotCopySeconds,  // ckpt_snapshot_copy_seconds
  kDriftSeconds,         // ckpt_drift_seconds
  kRestoreSeconds,       // ckpt_restore_seconds
  kRemoteUploadSeconds,  // ckpt_remote_upload_seconds
  kPeerUploadSeconds,    // ckpt_peer_upload_seconds
  kCount
};

inline constexpr size_t kNumCounters = static_cast<size_t>(Counter::kCount);
inline constexpr size_t kNumGauges = static_cast<size_t>(Gauge::kCount);
inline constexpr size_t kNumHistograms = static_cast<size_t>(Histogram::kCount);

// One row of the metric table.
struct MetricInfo {
  const char* name;    // full Prometheus name, e.g. "ckpt_errors_total"
  const char* type;    // "counter", "gauge" or "histogram"
  const char* help;    // one sentence, rendered as # HELP and in the README
  const char* labels;  // comma-separated label names; "" when unlabelled
  // Comma-separated label values whose series exist (at 0) from the start, so
  // rate() and alerts see them before the first event; "" for none.
  const char* preset_values;
};

// Upper bounds of every histogram's buckets, in seconds.
const std::vector<double>& HistogramBucketsSeconds();

class Metrics {
 public:
  static constexpr size_t kDefaultMaxLayerSeries = 4096;
  static constexpr size_t kMaxSeriesPerLabelledFamily = 64;

  // Creates a registry holding every family of the table; unlabelled metrics
  // and preset label values start at 0.
  explicit Metrics(size_t max_layer_series = kDefaultMaxLayerSeries);
  // Stops the HTTP endpoint first; that can take up to ~2 s (civetweb polls
  // its listening socket with a 2 s timeout).
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The table: every counter, then every gauge, then every histogram, each in
  // enum order.
  static const std::vector<MetricInfo>& AllMetrics();
  static const MetricInfo& Info(Counter c);
  static const MetricInfo& Info(Gauge g);
  static const MetricInfo& Info(Histogram h);

  // The table as a Markdown table (name | type | labels | meaning), one row
  // per metric, in AllMetrics() order.
  static std::string MarkdownTable();

  // Unlabelled counter += v (v < 0 is ignored). On a labelled counter the
  // update is dropped and counted in ckpt_metric_series_dropped_total.
  void Inc(Counter c, double v = 1);
  // Labelled counter{label=label_value} += v. On an unlabelled counter the
  // label is ignored.
  void Inc(Counter c, const std::string& label_value, double v);
  // Unlabelled gauge = v. On a labelled gauge the update is dropped and
  // counted (the per-layer gauges are set through SetLayer()).
  void Set(Gauge g, double v);
  // Labelled gauge{label=label_value} = v, e.g.
  // Set(Gauge::kIoBackendInfo, "io_uring", 1). Not for the per-layer gauges.
  void Set(Gauge g, const std::string& label_value, double v);
  void Observe(Histogram h, double seconds);

  // Sets ckpt_layer_staleness_steps and ckpt_layer_accumulated_drift of one
  // (job, rank, layer) of a rank owned by `uid`. A new triple beyond
  // max_layer_series is dropped and counted, unless `uid` holds less than an
  // equal share: then the uid holding the most gives up its rank's highest
  // layer for it.
  void SetLayer(const std::string& job, uint32_t rank, uint32_t layer, uint32_t uid,
                double staleness, double accumulated_drift);
  // Removes every per-layer series of (job, rank), e.g. when it unregisters.
  void RemoveRank(const std::string& job, uint32_t rank);
  // Number of (job, rank, layer) triples held now, in all and by `uid`.
  size_t layer_series() const;
  size_t layer_series_of(uint32_t uid) const;

  // `hook` runs before every scrape (HTTP or Scrape()), serialized, so cheap
  // gauges (pool usage, queue depth, disk usage) can be read on demand instead
  // of being pushed. It may call Set/Inc/SetLayer but not SetCollectHook.
  // Empty clears it.
  void SetCollectHook(std::function<void()> hook);

  // Starts the HTTP endpoint on `address` ("host:port", "port", or ":port"
  // for every interface; port 0 picks a free one). Empty: disabled, OK.
  // UNAVAILABLE when it cannot listen, FAILED_PRECONDITION when already
  // started.
  absl::Status StartExposer(const std::string& address);
  // The port the endpoint listens on; 0 when it is not started.
  int port() const { return port_.load(std::memory_order_acquire); }

  // The text exposition format of every metric, as GET /metrics returns it.
  std::string Scrape();

 private:
  class ScrapeSource;
  using LayerKey = std::pair<std::string, uint32_t>;  // (job, rank)
  struct LayerSeries {
    prometheus::Gauge* staleness;
    prometheus::Gauge* drift;
  };
  struct RankSeries {
    uint32_t uid = 0;
    std::map<uint32_t, LayerSeries> layers;
  };

  void BeforeScrape();
  void CountDropped();
  // Frees one series of the uid holding the most, when `uid` holds less than
  // an equal share of the full budget; false when it does not.
  bool TakeFairShareLocked(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveSeriesLocked(const LayerSeries& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveRankLocked(std::map<LayerKey, RankSeries>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The series of a labelled family for `label_value`, created on first use
  // while the family holds fewer than kMaxSeriesPerLabelledFamily; nullptr
  // beyond.
  prometheus::Counter* LabelledCounter(size_t index, const std::string& label_value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  prometheus::Gauge* LabelledGauge(size_t index, const std::string& label_value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_layer_series_;
  const int64_t started_ns_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ScrapeSource> scrape_source_;

  // Families and unlabelled series, indexed by enum value; a labelled
  // metric's series pointer is nullptr. Immutable after the constructor.
  std::array<prometheus::Family<prometheus::Counter>*, kNumCounters> counter_families_{};
  std::array<prometheus::Counter*, kNumCounters> counters_{};
  std::array<prometheus::Family<prometheus::Gauge>*, kNumGauges> gauge_families_{};
  std::array<prometheus::Gauge*, kNumGauges> gauges_{};
  std::array<prometheus::Histogram*, kNumHistograms> histograms_{};

  mutable absl::Mutex mu_;
  std::array<std::map<std::string, prometheus::Counter*>, kNumCounters> labelled_counters_
      ABSL_GUARDED_BY(mu_);
  std::array<std::map<std::string, prometheus::Gauge*>, kNumGauges> labelled_gauges_
      ABSL_GUARDED_BY(mu_);
  std::map<LayerKey, RankSeries> layers_ ABSL_GUARDED_BY(mu_);
  size_t layer_series_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint32_t, size_t> uid_series_ ABSL_GUARDED_BY(mu_);  // no entry at 0

  absl::Mutex hook_mu_;  // serializes scrapes and guards the hook
  std::function<void()> hook_ ABSL_GUARDED_BY(hook_mu_);

  absl::Mutex exposer_mu_;
  std::unique_ptr<prometheus::Exposer> exposer_ ABSL_GUARDED_BY(exposer_mu_);
  std::atomic<int> port_{0};
};

}  // namespace ckpt
