// The metric table of ckptd: one row per Counter, Gauge and Histogram
// enumerator (metrics.h), in enum order, with the compile-time checks that
// keep it well formed (names, labels, one row per enumerator, no name used
// twice). Private to ckpt_metrics: metrics.cc builds the registry from it,
// and docs/metrics.md is generated from it (Metrics::MarkdownTable).
#pragma once

#include <cstddef>
#include <iterator>

#include "daemon/metrics/metrics.h"

namespace ckpt {
namespace metrics_table {

// ---- the table: one row per enumerator, in enum order ----

constexpr MetricInfo kCounterTable[] = {
    {"ckpt_versions_staged_total", "counter",
     "Layer versions copied from a rank's buffers into the staging pool.", "", ""},
    {"ckpt_staged_bytes_total", "counter", "Bytes copied into the staging pool.", "", ""},
    {"ckpt_versions_committed_total", "counter",
     "Layer versions made durable (data written, fsynced and recorded in the index).", "", ""},
    {"ckpt_committed_bytes_total", "counter", "Bytes of layer versions made durable.", "", ""},
    {"ckpt_versions_failed_total", "counter",
     "Layer versions that were staged but failed to become durable.", "", ""},
    {"ckpt_snapshots_skipped_total", "counter",
     "Layer snapshots not taken, by reason (pool_full: no staging memory within the "
     "admission timeout); the layer is re-selected at the next step.",
     "reason", "pool_full"},
    {"ckpt_errors_total", "counter",
     "I/O and integrity errors by kind: write, fsync, index (RocksDB), read, checksum, "
     "snapshot_copy (a GPU copy failed), disk_full (bound, reserve or ENOSPC), quota (a per-uid "
     "quota).",
     "kind", "write,fsync,index,read,checksum,snapshot_copy,disk_full,quota"},
    {"ckpt_restores_total", "counter",
     "Composite restores served: into a trainer's buffers, or exported (ckptctl restore/export, "
     "one per rank).",
     "", ""},
    {"ckpt_restored_bytes_total", "counter", "Bytes restored into rank buffers or exported.", "",
     ""},
    {"ckpt_gc_versions_deleted_total", "counter",
     "Superseded layer versions deleted by garbage collection.", "", ""},
    {"ckpt_gc_deleted_bytes_total", "counter",
     "Bytes of superseded layer versions deleted by garbage collection.", "", ""},
    {"ckpt_metric_series_dropped_total", "counter",
     "Metric updates dropped because a labelled family reached its series cap.", "", ""},
    {"ckpt_registrations_total", "counter", "Successful rank registrations.", "", ""},
    {"ckpt_staleness_invariant_violations_total", "counter",
     "Times a layer's staleness exceeded the configured bound S_max.", "", ""},
    {"ckpt_handover_refused_total", "counter",
     "Memory handovers refused: a per-uid or node-wide handover limit, a malformed message "
     "(including a region passed twice) or a connection past its deadline.",
     "", ""},
    {"ckpt_handover_accept_errors_total", "counter",
     "Times the handover socket could not accept (out of descriptors or memory) and paused "
     "accepting.",
     "", ""},
    {"ckpt_rpc_connections_refused_total", "counter",
     "gRPC connections closed as soon as accepted: their uid had max_connections_per_uid open "
     "or ckptd had max_connections.",
     "", ""},
    {"ckpt_rpc_accept_errors_total", "counter",
     "Times the gRPC socket could not accept (out of descriptors or memory) and paused "
     "accepting.",
     "", ""},
    {"ckpt_ranks_released_total", "counter",
     "Registrations ended by an operator (ckptctl release) rather than by their trainer.", "", ""},
    {"ckpt_jobs_deleted_total", "counter",
     "Jobs deleted with their whole history (ckptctl delete).", "", ""},
    {"ckpt_quota_refused_total", "counter",
     "Steps and layer versions refused by a per-uid quota: disk (max_disk_bytes_per_uid or "
     "_per_job), index (max_index_bytes_per_uid) or queued_steps "
     "(max_queued_steps_per_rank/_per_uid).",
     "kind", "disk,index,queued_steps"},
    {"ckpt_events_failed_total", "counter",
     "Checkpoint events not recorded (quota, the index's free-space floor, a RocksDB error); "
     "their steps are not durable and later steps are tried again.",
     "", ""},
    {"ckpt_remote_uploaded_versions_total", "counter", "Layer versions copied to the remote tier.",
     "", ""},
    {"ckpt_remote_uploaded_bytes_total", "counter",
     "Bytes of layer versions copied to the remote tier (its upload throughput is the rate).", "",
     ""},
    {"ckpt_remote_manifests_total", "counter",
     "Step manifests written to the remote tier: each makes one rank's step remote-durable.", "",
     ""},
    {"ckpt_remote_failures_total", "counter",
     "Failed remote-tier operations by reason: unavailable (unreachable, 5xx, throttled after "
     "retries), denied (credentials refused), timeout, corrupt (a checksum did not match), "
     "local (reading the local copy failed), other.",
     "reason", "unavailable,denied,timeout,corrupt,local,other"},
    {"ckpt_remote_pulled_bytes_total", "counter",
     "Bytes of layer versions read back from the remote tier (a replacement node).", "", ""},
    {"ckpt_remote_gc_deleted_objects_total", "counter",
     "Objects (versions and manifests) remote retention deleted.", "", ""},
    {"ckpt_memory_tier_restored_bytes_total", "counter",
     "Restored bytes served from the memory tier (checksums verified) instead of the disk.", "",
     ""},
    {"ckpt_versions_quarantined_total", "counter",
     "Committed layer versions a restore or export found damaged on disk (missing, "
     "short, a checksum) with no intact copy in any tier: marked lost, their files moved to "
     "quarantine/.",
     "", ""},
    {"ckpt_versions_repaired_total", "counter",
     "Committed layer versions a restore or export found damaged on disk and replaced by an "
     "intact copy of the same version from a tier, by tier; the damaged files are in "
     "quarantine/.",
     "tier", "remote,peer"},
    {"ckpt_gpu_waits_abandoned_total", "counter",
     "GPU snapshots given up while waiting for the device, by reason: the trainer's step event "
     "not complete at gpu_wait_timeout (deadline), its fence gave up (fence), the rank was "
     "released (released), ckptd stopped (stopping), or ckptd's own copies not complete in "
     "time (copies). The step is not durable; its layers are retried.",
     "reason", "deadline,fence,released,stopping,copies"},
    {"ckpt_lost_version_restores_total", "counter",
     "Restores and exports whose plan needed a lost version (damaged, no intact copy in any "
     "tier), by outcome: refused (DATA_LOSS, the default) or older (the layer's previous "
     "version, as the request allowed with older_within_steps).",
     "outcome", "refused,older"},
    {"ckpt_peer_uploaded_versions_total", "counter",
     "Layer versions replicated to the peer tier (a peer node's ckptd).", "", ""},
    {"ckpt_peer_uploaded_bytes_total", "counter",
     "Bytes of layer versions replicated to the peer tier (its throughput is the rate).", "", ""},
    {"ckpt_peer_sent_from_memory_bytes_total", "counter",
     "Of those bytes, the ones sent from the memory tier: their files were not read.", "", ""},
    {"ckpt_peer_manifests_total", "counter",
     "Step manifests written to the peer tier: each makes one rank's step peer-durable.", "", ""},
    {"ckpt_peer_failures_total", "counter",
     "Failed peer-tier operations by reason, as ckpt_remote_failures_total counts them for the "
     "remote tier (unavailable includes a peer whose replica store is full).",
     "reason", "unavailable,denied,timeout,corrupt,local,other"},
    {"ckpt_peer_pulled_bytes_total", "counter",
     "Bytes of layer versions read back from the peer tier (a replacement node).", "", ""},
    {"ckpt_peer_gc_deleted_objects_total", "counter",
     "Objects (versions and manifests) peer-tier retention deleted.", "", ""},
    {"ckpt_peer_replica_received_bytes_total", "counter",
     "Bytes of replicas this ckptd stored for its peers.", "", ""},
    {"ckpt_peer_replica_refused_total", "counter",
     "Replica calls refused from peers, by reason: unknown_peer (no certificate, or a name not "
     "in peer_allow), full (the peer's share, the replica store's bound or the job owner's "
     "quota), bad_request (a bad key, or bytes that do not match the announced size), idle (a "
     "call that moved nothing for peer_timeout_ms, cancelled).",
     "reason", "unknown_peer,full,bad_request,idle"},
    {"ckpt_exported_bytes_total", "counter",
     "Bytes exported (ckpt.dcp loads, restores onto another world size, ckptctl export), by "
     "path: window (through a region the reader handed over) or stream (the messages of the "
     "Export stream: no region given, or one that could not be used).",
     "path", "window,stream"},
};

constexpr MetricInfo kGaugeTable[] = {
    {"ckpt_staging_pool_bytes", "gauge", "Size of the pinned staging pool.", "", ""},
    {"ckpt_staging_pool_in_use_bytes", "gauge",
     "Staging pool bytes holding versions not yet durable.", "", ""},
    {"ckpt_write_queue_depth", "gauge", "Layer versions waiting for a writer thread.", "", ""},
    {"ckpt_durability_lag_bytes", "gauge", "Bytes staged but not yet durable.", "", ""},
    {"ckpt_durability_lag_seconds", "gauge",
     "Age of the oldest staged version that is not yet durable; 0 when none.", "", ""},
    {"ckpt_registered_ranks", "gauge", "Ranks registered now.", "", ""},
    {"ckpt_open_gpu_mappings", "gauge",
     "CUDA IPC allocations of registered ranks mapped by ckptd now.", "", ""},
    {"ckpt_open_gpu_mapping_bytes", "gauge", "Bytes of the CUDA IPC allocations mapped now.", "",
     ""},
    {"ckpt_disk_used_bytes", "gauge", "Bytes of layer versions on disk in the data directory.", "",
     ""},
    {"ckpt_disk_limit_bytes", "gauge",
     "Bytes the layer versions may grow to: max_disk_bytes, or (without it, or when the disk "
     "holds less) what they use plus the free space above min_free_disk_bytes.",
     "", ""},
    {"ckpt_io_backend_info", "gauge", "1 for the I/O backend in use (io_uring or pwrite).",
     "backend", ""},
    {"ckpt_layer_staleness_steps", "gauge",
     "Steps since the layer's newest durable version (bounded series count).",
     "ckpt_job,rank,layer", ""},
    {"ckpt_layer_accumulated_drift", "gauge",
     "Drift accumulated by the layer since its newest durable version (bounded series "
     "count).",
     "ckpt_job,rank,layer", ""},
    {"ckpt_uptime_seconds", "gauge", "Seconds since the daemon started.", "", ""},
    {"ckpt_handover_fds_held", "gauge",
     "Handed-over descriptors ckptd holds: unclaimed, or claimed by a Register still running.", "",
     ""},
    {"ckpt_stale_ranks", "gauge",
     "Ranks still registered whose trainer process exited (their memory is released); the "
     "trainer's next registration or ckptctl release ends them.",
     "", ""},
    {"ckpt_uid_disk_limit_bytes", "gauge",
     "Per-uid quota on layer files plus index records: max_disk_bytes_per_uid, or half the "
     "data file system when that is 0.",
     "", ""},
    {"ckpt_uid_index_limit_bytes", "gauge",
     "Per-uid quota on index records (rank tables, aux blobs, events, versions): "
     "max_index_bytes_per_uid; 0 = none.",
     "", ""},
    {"ckpt_uid_disk_used_bytes", "gauge",
     "Layer files plus index records held by each uid's jobs, and the replicas this node keeps "
     "for the uid's jobs on other nodes (bounded series count).",
     "uid", ""},
    {"ckpt_uid_index_used_bytes", "gauge",
     "Index records held or reserved by each uid's jobs (bounded series count).", "uid", ""},
    {"ckpt_index_degraded", "gauge",
     "1 while the RocksDB index refuses writes after a failed write (e.g. ENOSPC) and has not "
     "reopened yet; reads go on.",
     "", ""},
    {"ckpt_index_memory_bytes", "gauge",
     "Memory the RocksDB index holds: memtables (records written since the last flush; at most "
     "two write buffers of 64 MiB), block cache (8 MiB) and table readers' index and "
     "filter blocks.",
     "", ""},
    {"ckpt_global_durable_lag_steps", "gauge",
     "Largest gap, over this node's registered ranks of multi-rank jobs, between a rank's "
     "newest step and the newest step its job's ranks last agreed is durable on every rank. "
     "It grows when a rank of the job lost its ckptd or cannot keep up.",
     "", ""},
    {"ckpt_remote_lag_steps", "gauge",
     "Largest gap, over this node's ranks, between a rank's newest locally durable step and its "
     "newest remote-durable step (0 without a remote tier).",
     "", ""},
    {"ckpt_remote_lag_bytes", "gauge",
     "Bytes of committed layer versions not yet in the remote tier.", "", ""},
    {"ckpt_remote_up", "gauge",
     "0 from a failed remote-tier operation until the next one succeeds, else 1 (also 1 "
     "without a remote tier).",
     "", ""},
    {"ckpt_memory_tier_bytes", "gauge",
     "Staging-pool bytes the memory tier holds: the newest committed version of layers, kept "
     "for restores (memory_tier_bytes bounds it).",
     "", ""},
    {"ckpt_gpu_devices_poisoned", "gauge",
     "GPUs whose CUDA context in ckptd a sticky error (an illegal address, a launch failure, an "
     "uncorrectable ECC error) made unusable: their ranks are released and registrations on "
     "them refused until ckptd restarts.",
     "", ""},
    {"ckpt_peer_lag_steps", "gauge",
     "Per peer node: largest gap, over this node's ranks placed there, between a rank's newest "
     "locally durable step and its newest step replicated there.",
     "peer", ""},
    {"ckpt_peer_lag_bytes", "gauge",
     "Per peer node: bytes of committed layer versions placed there and not yet replicated.",
     "peer", ""},
    {"ckpt_peer_up", "gauge",
     "Per peer node: 0 from a failed replication to it until the next one succeeds, else 1.",
     "peer", ""},
    {"ckpt_peer_replica_bytes", "gauge",
     "Bytes of replicas this ckptd keeps for its peers: disk (every replica) and memory (those "
     "also kept in memory for fast restores).",
     "where", "memory,disk"},
};

constexpr MetricInfo kHistogramTable[] = {
    {"ckpt_write_seconds", "histogram", "Time to write one layer version's data.", "", ""},
    {"ckpt_fsync_seconds", "histogram", "Time of one fsync of a layer version file.", "", ""},
    {"ckpt_commit_seconds", "histogram",
     "Time from creating a version's temporary file to recording it in the index (including "
     "the wait for the publisher, which records versions in groups).",
     "", ""},
    {"ckpt_fence_wait_seconds", "histogram",
     "Time a rank's WaitSnapshot waited for its snapshot to be taken.", "", ""},
    {"ckpt_snapshot_copy_seconds", "histogram",
     "Time to copy one step's selected layers into staging.", "", ""},
    {"ckpt_drift_seconds", "histogram", "Time to compute one step's layer drift.", "", ""},
    {"ckpt_restore_seconds", "histogram", "Time of one composite restore.", "", ""},
    {"ckpt_remote_upload_seconds", "histogram",
     "Time to upload one rank's step to the remote tier (its versions, then its manifest).", "",
     ""},
    {"ckpt_peer_upload_seconds", "histogram",
     "Time to replicate one rank's step to the peer tier (its versions, then its manifest).", "",
     ""},
};

static_assert(std::size(kCounterTable) == kNumCounters, "one row per Counter");
static_assert(std::size(kGaugeTable) == kNumGauges, "one row per Gauge");
static_assert(std::size(kHistogramTable) == kNumHistograms, "one row per Histogram");

// ---- compile-time checks of the table ----

constexpr size_t Len(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}

constexpr bool Equal(const char* a, const char* b) {
  size_t i = 0;
  for (; a[i] != '\0' && b[i] != '\0'; ++i) {
    if (a[i] != b[i]) return false;
  }
  return a[i] == b[i];
}

constexpr bool StartsWith(const char* s, const char* prefix) {
  for (size_t i = 0; prefix[i] != '\0'; ++i) {
    if (s[i] != prefix[i]) return false;
  }
  return true;
}

constexpr bool EndsWith(const char* s, const char* suffix) {
  const size_t n = Len(s);
  const size_t m = Len(suffix);
  return n >= m && Equal(s + n - m, suffix);
}

constexpr bool IsLowerSnake(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}

// [a-z_][a-z0-9_]*
constexpr bool ValidName(const char* s) {
  if (s[0] == '\0' || (s[0] >= '0' && s[0] <= '9')) return false;
  for (size_t i = 0; s[i] != '\0'; ++i) {
    if (!IsLowerSnake(s[i])) return false;
  }
  return true;
}

// "" or comma-separated valid names.
constexpr bool ValidLabelList(const char* s) {
  bool at_start = true;
  for (size_t i = 0; s[i] != '\0'; ++i) {
    if (s[i] == ',') {
      if (at_start) return false;
      at_start = true;
      continue;
    }
    if (!IsLowerSnake(s[i]) || (at_start && s[i] >= '0' && s[i] <= '9')) return false;
    at_start = false;
  }
  return s[0] == '\0' || !at_start;
}

constexpr bool HasComma(const char* s) {
  for (size_t i = 0; s[i] != '\0'; ++i) {
    if (s[i] == ',') return true;
  }
  return false;
}

template <size_t N>
constexpr bool RowsValid(const MetricInfo (&rows)[N], const char* type) {
  for (const MetricInfo& r : rows) {
    if (!ValidName(r.name) || !StartsWith(r.name, "ckpt_")) return false;
    if (!Equal(r.type, type) || Len(r.help) == 0 || !ValidLabelList(r.labels)) return false;
    const bool total = EndsWith(r.name, "_total");
    if (Equal(type, "counter") != total) return false;
    if (Len(r.preset_values) > 0 && Len(r.labels) == 0) return false;
  }
  return true;
}

template <size_t N, size_t M>
constexpr bool Disjoint(const MetricInfo (&a)[N], const MetricInfo (&b)[M], bool same) {
  for (size_t i = 0; i < N; ++i) {
    for (size_t j = same ? i + 1 : 0; j < M; ++j) {
      if (Equal(a[i].name, b[j].name)) return false;
    }
  }
  return true;
}

static_assert(RowsValid(kCounterTable, "counter"), "bad counter row");
static_assert(RowsValid(kGaugeTable, "gauge"), "bad gauge row");
static_assert(RowsValid(kHistogramTable, "histogram"), "bad histogram row");
static_assert(Disjoint(kCounterTable, kCounterTable, true) &&
                  Disjoint(kGaugeTable, kGaugeTable, true) &&
                  Disjoint(kHistogramTable, kHistogramTable, true) &&
                  Disjoint(kCounterTable, kGaugeTable, false) &&
                  Disjoint(kCounterTable, kHistogramTable, false) &&
                  Disjoint(kGaugeTable, kHistogramTable, false),
              "metric names must be unique");

constexpr bool IsLayerGauge(size_t i) {
  return i == static_cast<size_t>(Gauge::kLayerStalenessSteps) ||
         i == static_cast<size_t>(Gauge::kLayerAccumulatedDrift);
}

// Generic labelled families carry exactly one label; only the per-layer
// gauges carry several.
template <size_t N>
constexpr bool SingleLabel(const MetricInfo (&rows)[N], bool gauges) {
  for (size_t i = 0; i < N; ++i) {
    if (gauges && IsLayerGauge(i)) {
      if (!Equal(rows[i].labels, "ckpt_job,rank,layer")) return false;
    } else if (HasComma(rows[i].labels)) {
      return false;
    }
  }
  return true;
}
static_assert(SingleLabel(kCounterTable, false) && SingleLabel(kGaugeTable, true),
              "only the per-layer gauges have several labels");

template <size_t N>
constexpr bool Unlabelled(const MetricInfo (&rows)[N]) {
  for (const MetricInfo& r : rows) {
    if (Len(r.labels) != 0) return false;
  }
  return true;
}
static_assert(Unlabelled(kHistogramTable), "histograms are unlabelled");

}  // namespace metrics_table
}  // namespace ckpt
