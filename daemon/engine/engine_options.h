// EngineOptions: what an Engine (engine.h) is started with.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "daemon/common/clock.h"
#include "daemon/engine/peer_tier.h"
#include "daemon/engine/quota.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/remote_tier.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/io/io_backend.h"
#include "daemon/metrics/metrics.h"
#include "daemon/policy/layercheck.h"
#include "daemon/store/retention.h"

namespace ckpt {

// The engine's options. The defaults are ckptd's: daemon/config binds each
// configurable one to its config-file key (config.cc), so they are declared
// here and nowhere else.
struct EngineOptions {
  std::string data_dir;           // reported by Status
  std::string metrics_address;    // reported by Status ("" = off)
  QuotaTable* quota = nullptr;    // per-uid usage, shared with the replica store; null: own
  unsigned writer_threads = 2;    // layer versions written concurrently
  unsigned snapshot_threads = 1;  // ranks snapshotted concurrently
  IoBackendKind io_backend = IoBackendKind::kAuto;
  unsigned io_queue_depth = 16;                         // chunk writes in flight per writer
  absl::Duration admission_timeout = absl::Seconds(2);  // wait for staging, then skip
  absl::Duration drain_timeout = absl::Seconds(60);     // re-register waits this long
  absl::Duration restore_timeout = absl::Minutes(30);
  uint64_t max_aux_bytes = 1 << 20;
  int drift_threads = 2;  // CPU drift kernel workers per snapshot
  // The data device's sustained write bandwidth in bytes/s, as the operator
  // measured it; a LayerCheck write budget given as a share is relative to
  // it. 0 = unknown: such budgets are refused.
  uint64_t device_write_bytes_per_s = 0;
  RetentionPolicy retention;
  uint64_t max_disk_bytes = 0;  // bound on committed version bytes; 0 = none
  // Layer versions are refused while the data file system has less free than
  // this (plus the version), so RocksDB's WAL never meets a full disk.
  uint64_t min_free_disk_bytes = 64 << 20;
  // Per-uid quotas (quota.h), each 0 = none. The disk quota counts a uid's
  // layer files and index records; 0 here means half the size of the data
  // file system, measured at start.
  uint64_t max_disk_bytes_per_uid = 0;
  uint64_t max_index_bytes_per_uid = uint64_t{1} << 30;  // tables, aux blobs, events, versions
  // One job's layer files and index records, whoever owns it; 0 = none.
  uint64_t max_disk_bytes_per_job = 0;
  // A rank's StepDone queue (steps not yet taken by a snapshot worker), and
  // a uid's steps in flight (StepDone until the checkpoint event). Each
  // holds its aux blob in memory; those bytes also count against
  // max_index_bytes_per_uid while in flight.
  uint32_t max_queued_steps_per_rank = 64;
  uint32_t max_queued_steps_per_uid = 1024;
  // Ranks one uid may have registered at once (stale ones included); 0 = none.
  uint32_t max_registrations_per_uid = 256;
  Metrics* metrics = nullptr;                     // optional; not owned
  absl::Duration gc_interval = absl::Minutes(5);  // periodic GC of every job; 0 = off
  RegistrationLimits limits;
  // The CUDA calls behind GPU registrations; null = the CUDA runtime's (or,
  // without CUDA, a twin that refuses GPU registrations). Not owned.
  CudaIpc* cuda_ipc = nullptr;
  // What the engine stamps and ages records with (event times, retention,
  // the durability lag); null = the real clock. Not owned.
  Clock* clock = nullptr;
  // GPU ranks: how long a snapshot waits for a step's event (from the first
  // poll that found it pending, on `clock`) and for ckptd's own copies (in
  // real time) before the step is given up and its layers are retried.
  // The snapshot threads serve other ranks meanwhile.
  absl::Duration gpu_wait_timeout = absl::Seconds(120);
  // GPU pages handed over as fabric handles are accepted (ipc_memory.h).
  bool gpu_fabric_handles = false;
  absl::Duration trainer_watch_interval = absl::Milliseconds(200);  // trainers' exit checks
  // The memory tier (memory_tier.h): staging-pool bytes keeping the newest
  // committed version of each layer for restores; 0 = off.
  uint64_t memory_tier_bytes = 0;
  // The remote tier (remote_tier.h, docs/remote.md), off while remote.store
  // is null, and the peer tier (peer_tier.h, docs/peer.md), off while
  // peers.peers is empty and tried first; retention and pull wait are the
  // engine's. `peer` is the one-peer form (F = 1) the tests use.
  RemoteTierOptions remote;
  PeerTierOptions peers;
  RemoteTierOptions peer{"peer", TierMetricIds::Peer("")};
  std::string node_name, node_rack;  // this node (StatusReply.node, .rack)
};

}  // namespace ckpt
