#include "daemon/config/config.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace ckpt {
namespace {

// One option: its name, documentation, how to read and write it in a
// DaemonConfig, and the bound check Validate() runs.
struct Option {
  const char* name;
  const char* help;
  std::function<absl::Status(const std::string&, DaemonConfig*)> set;
  std::function<std::string(const DaemonConfig&)> get;
  std::function<absl::Status(const DaemonConfig&)> check;
};

// The field an option binds: `DaemonConfig& -> T&`.
#define CKPT_FIELD(expr) \
  [](DaemonConfig & c) -> auto& { return c.expr; }

template <typename Field>
auto& Get(const Field& field, const DaemonConfig& c) {
  return field(const_cast<DaemonConfig&>(c));
}

absl::Status NotANumber(const char* name, const std::string& v) {
  return absl::InvalidArgumentError(
      absl::StrCat("option ", name, ": '", v, "' is not a valid number"));
}

absl::Status OutOfBounds(const char* name, uint64_t min, uint64_t max) {
  return max == std::numeric_limits<uint64_t>::max()
             ? absl::InvalidArgumentError(absl::StrCat(name, " must be at least ", min))
             : absl::InvalidArgumentError(absl::StrCat(name, " must be ", min, "..", max));
}

// An unsigned integer in [min, max].
template <typename Field>
Option Num(const char* name, const char* help, Field field, uint64_t min,
           uint64_t max = std::numeric_limits<uint64_t>::max()) {
  using T = std::remove_reference_t<decltype(field(std::declval<DaemonConfig&>()))>;
  return Option{name, help,
                [name, field, min, max](const std::string& v, DaemonConfig* c) {
                  uint64_t x;
                  if (!absl::SimpleAtoi(v, &x)) return NotANumber(name, v);
                  if (x > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
                    return OutOfBounds(name, min,
                                       std::min<uint64_t>(max, std::numeric_limits<T>::max()));
                  }
                  field(*c) = static_cast<T>(x);
                  return absl::OkStatus();
                },
                [field](const DaemonConfig& c) { return absl::StrCat(Get(field, c)); },
                [name, field, min, max](const DaemonConfig& c) {
                  const uint64_t x = static_cast<uint64_t>(Get(field, c));
                  return x < min || x > max ? OutOfBounds(name, min, max) : absl::OkStatus();
                }};
}

// An absl::Duration written as an integer number of `unit`s, in [min, max] units.
template <typename Field>
Option Time(const char* name, const char* help, Field field, absl::Duration unit, uint64_t min,
            uint64_t max) {
  return Option{name, help,
                [name, field, unit](const std::string& v, DaemonConfig* c) {
                  uint64_t x;
                  if (!absl::SimpleAtoi(v, &x) ||
                      x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
                    return NotANumber(name, v);
                  }
                  field(*c) = unit * static_cast<int64_t>(x);
                  return absl::OkStatus();
                },
                [field, unit](const DaemonConfig& c) {
                  absl::Duration rest;
                  return absl::StrCat(absl::IDivDuration(Get(field, c), unit, &rest));
                },
                [name, field, unit, min, max](const DaemonConfig& c) {
                  absl::Duration rest;
                  const int64_t x = absl::IDivDuration(Get(field, c), unit, &rest);
                  return x < 0 || static_cast<uint64_t>(x) < min || static_cast<uint64_t>(x) > max
                             ? OutOfBounds(name, min, max)
                             : absl::OkStatus();
                }};
}

template <typename Field>
Option Str(const char* name, const char* help, Field field, bool required = false) {
  return Option{name, help,
                [field](const std::string& v, DaemonConfig* c) {
                  field(*c) = v;
                  return absl::OkStatus();
                },
                [field](const DaemonConfig& c) { return std::string(Get(field, c)); },
                [name, field, required](const DaemonConfig& c) {
                  return required && Get(field, c).empty()
                             ? absl::InvalidArgumentError(absl::StrCat(name, " must be set"))
                             : absl::OkStatus();
                }};
}

template <typename Field>
Option Bool(const char* name, const char* help, Field field) {
  return Option{
      name, help,
      [name, field](const std::string& v, DaemonConfig* c) {
        if (v == "true" || v == "1" || v == "yes") {
          field(*c) = true;
        } else if (v == "false" || v == "0" || v == "no") {
          field(*c) = false;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("option ", name, ": '", v, "' is not true or false"));
        }
        return absl::OkStatus();
      },
      [field](const DaemonConfig& c) { return std::string(Get(field, c) ? "true" : "false"); },
      [](const DaemonConfig&) { return absl::OkStatus(); }};
}

Option Backend(const char* name, const char* help) {
  return Option{
      name, help,
      [name](const std::string& v, DaemonConfig* c) {
        absl::StatusOr<IoBackendKind> kind = ParseIoBackendKind(v);
        if (!kind.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("option ", name, ": '", v, "' is not auto, io_uring or pwrite"));
        }
        c->engine.io_backend = *kind;
        return absl::OkStatus();
      },
      [](const DaemonConfig& c) { return std::string(IoBackendKindName(c.engine.io_backend)); },
      [](const DaemonConfig&) { return absl::OkStatus(); }};
}

// The memory tier's size: "auto" (kMemoryTierAuto, a share of the staging
// pool resolved by DaemonConfig::MemoryTierBytes) or a number of bytes.
Option TierBytes(const char* name, const char* help) {
  return Option{name, help,
                [name](const std::string& v, DaemonConfig* c) {
                  uint64_t x;
                  if (v == "auto") {
                    c->memory_tier_bytes.reset();
                  } else if (absl::SimpleAtoi(v, &x)) {
                    c->memory_tier_bytes = x;
                  } else {
                    return absl::InvalidArgumentError(absl::StrCat(
                        "option ", name, ": '", v, "' is not auto or a number of bytes"));
                  }
                  return absl::OkStatus();
                },
                [](const DaemonConfig& c) {
                  return c.memory_tier_bytes.has_value() ? absl::StrCat(*c.memory_tier_bytes)
                                                         : std::string("auto");
                },
                [](const DaemonConfig&) { return absl::OkStatus(); }};
}

// Below this not even a Register of one small layer fits.
constexpr uint64_t kMinMessageBytes = 4096;
// Room in a StepDone beside its aux blob: the layer ids and drift sums of up
// to 65536 layers (about 1.7 MiB encoded).
constexpr uint64_t kStepListBytes = 2 << 20;

// How the remote and peer tiers copy, and peer replication (docs/peer.md):
// the last topics of the table.
const std::vector<Option>& PeerOptions() {
  static const std::vector<Option>* const options = new std::vector<Option>{
      Num("remote_upload_threads", "layer versions uploaded to the remote tier at once",
          CKPT_FIELD(engine.remote.upload_threads), 1, 64),
      Num("remote_max_pending_events",
          "per rank, the oldest checkpoint events not yet uploaded that local GC keeps for the "
          "uploader; beyond them (a long outage) the ordinary retention applies and the "
          "uploader skips to the events that are left",
          CKPT_FIELD(engine.remote.max_pending_events), 1, 1 << 20),
      Str("peer_listen",
          "host:port where this ckptd keeps replicas for its peers (mutual TLS); empty = it "
          "keeps none; docs/peer.md",
          CKPT_FIELD(peer.listen)),
      Str("peer_nodes",
          "the nodes whose ckptd may keep this node's replicas, in the cluster's ring order: "
          "name=host:port[@rack], comma-separated (name: the common name of the node's "
          "certificate; this node may be listed, it is left out). Each job's copies go to the "
          "next nodes of its own nodes' ring, then of this list (docs/peer.md, Placement). "
          "Uses remote_key_file's cluster key to sign what it sends",
          CKPT_FIELD(peer.nodes)),
      Num("peer_copies", "copies of each durable layer version kept on other nodes (F)",
          CKPT_FIELD(peer.copies), 1, 16),
      Str("peer_rack",
          "this node's rack (failure domain); empty = its entry's in peer_nodes, if any",
          CKPT_FIELD(peer.rack)),
      Bool("peer_require_other_rack",
           "never place a copy in a rack that holds one already (this node's included): fewer "
           "copies rather than two in one rack; off = other racks first",
           CKPT_FIELD(peer.require_other_rack)),
      Str("peer_address",
          "host:port of one more node for peer_nodes (the one-peer form, with peer_name)",
          CKPT_FIELD(peer.address)),
      Str("peer_name", "the common name the certificate of peer_address must carry",
          CKPT_FIELD(peer.name)),
      Str("peer_allow",
          "comma-separated certificate names that may keep replicas here; empty = any "
          "certificate peer_ca_file signed",
          CKPT_FIELD(peer.allow)),
      Str("peer_cert_file", "this node's certificate (PEM; systemd: LoadCredential=)",
          CKPT_FIELD(peer.cert_file)),
      Str("peer_tls_key_file",
          "the private key of peer_cert_file (PEM, a file only ckptd's user may read)",
          CKPT_FIELD(peer.tls_key_file)),
      Str("peer_ca_file", "the CA that signs every node's certificate (PEM)",
          CKPT_FIELD(peer.ca_file)),
      Num("peer_rate_bytes",
          "bytes per second replication may send to the peer, so training keeps the network; "
          "0 = no cap",
          CKPT_FIELD(peer.rate_bytes), 0),
      Num("peer_memory_bytes",
          "the newest replicas kept in memory too, so a restore from this peer reads no disk "
          "(every replica is on disk before it is acknowledged); taken and populated when "
          "ckptd starts with peer_listen",
          CKPT_FIELD(peer.memory_bytes), 0),
      Num("peer_max_replica_bytes", "all replicas kept for peers (on disk)",
          CKPT_FIELD(peer.max_replica_bytes), 0),
      Num("peer_max_bytes_per_peer",
          "replicas kept for any one peer: a flood from one leaves room for the others",
          CKPT_FIELD(peer.max_bytes_per_peer), 0),
      Num("peer_timeout_ms",
          "deadline of each call to the peer, plus its bytes' time at its share of "
          "peer_rate_bytes (8 MiB/s without a cap)",
          CKPT_FIELD(peer.timeout_ms), 100, 3600000),
      Num("peer_upload_threads", "layer versions replicated to each peer node at once",
          CKPT_FIELD(engine.peer.upload_threads), 1, 64),
      Num("peer_max_pending_events",
          "per rank, the oldest checkpoint events not yet on every peer node placed for it that "
          "local GC keeps (as remote_max_pending_events for the remote tier)",
          CKPT_FIELD(engine.peer.max_pending_events), 1, 1 << 20),
  };
  return *options;
}

// Every option, one entry each, in the order `ckptd --help` and
// `ckptd --dump-default-config` (the shipped deploy/ckptd.conf) list them.
// Peer replication's options close the table (PeerOptions, below).
// The handover socket's limits (docs/operations.md), between the requests'
// and LayerCheck's rows of the table.
const std::vector<Option>& HandoverRows() {
  static const std::vector<Option>* const options = new std::vector<Option>{
      Time("handover_token_ttl_s", "unclaimed handed-over regions are closed after this",
           CKPT_FIELD(handover.token_ttl), absl::Seconds(1), 1, 24 * 3600),
      Time("handover_connection_deadline_ms",
           "a handover connection must deliver its message within this, else it is refused",
           CKPT_FIELD(handover.connection_deadline), absl::Milliseconds(1), 10, 600 * 1000),
      Num("handover_max_connections", "open handover connections, node-wide",
          CKPT_FIELD(handover.max_connections), 1, 1 << 16),
      Num("handover_max_connections_per_uid",
          "open handover connections of one user; more are refused with RESOURCE_EXHAUSTED",
          CKPT_FIELD(handover.max_connections_per_uid), 1, 1 << 16),
      Num("handover_max_pending", "unclaimed handovers (tokens), node-wide",
          CKPT_FIELD(handover.max_pending), 1, 1 << 20),
      Num("handover_max_pending_per_uid",
          "unclaimed handovers of one user; more are refused with RESOURCE_EXHAUSTED",
          CKPT_FIELD(handover.max_pending_per_uid), 1, 1 << 20),
      Num("handover_max_fds_per_uid",
          "handed-over descriptors ckptd holds for one user: unclaimed, claimed by a Register "
          "still running, or held by its live registrations (each is a mapping too)",
          CKPT_FIELD(handover.max_fds_per_uid), 1, 1 << 24),
      Num("handover_max_fds",
          "handed-over descriptors held node-wide (0 = the RLIMIT_NOFILE soft limit minus "
          "handover_fd_reserve, or half the limit when the reserve is more than half, and at "
          "most vm.max_map_count minus handover_map_reserve)",
          CKPT_FIELD(handover.max_fds), 0, 1 << 24),
      Num("handover_fd_reserve",
          "descriptors left to RocksDB, io_uring, gRPC and layer files when handover_max_fds is "
          "0",
          CKPT_FIELD(handover.fd_reserve), 0, 1 << 24),
      Num("handover_map_reserve",
          "mappings of vm.max_map_count left to the rest of ckptd when handover_max_fds is 0",
          CKPT_FIELD(handover.map_reserve), 0, 1 << 24),
      Str("handover_cuda_device_file",
          "the NVIDIA driver's control device: CUDA page descriptors handed over must be "
          "character devices of its major number (cuMemExportToShareableHandle exports into "
          "an open /dev/nvidiactl); when it is missing, CUDA page handovers are refused",
          CKPT_FIELD(handover.cuda_device_file)),
      Time("handover_accept_backoff_ms",
           "first pause of the handover accept loop when out of descriptors; doubles up to 1 s",
           CKPT_FIELD(handover.accept_backoff), absl::Milliseconds(1), 1, 1000),
  };
  return *options;
}

// The order follows topics (paths, staging, writers, requests, handover,
// LayerCheck, retention, disk and quotas, metrics, the memory and remote
// tiers), which cut across the subsystems' option structs; so it stays one
// table.
std::vector<Option>* CoreOptions() {
  auto* front = new std::vector<Option>{
      Str("socket", "gRPC Unix socket (created 0660; its directory 0750)", CKPT_FIELD(socket),
          /*required=*/true),
      Str("handover_socket", "Unix socket for passing memfd regions; empty = <socket>.fds",
          CKPT_FIELD(handover_socket)),
      Str("data_dir", "where layer versions and the RocksDB index live", CKPT_FIELD(data_dir),
          /*required=*/true),
      Num("staging_pool_bytes",
          "node-wide pinned staging memory; every layer must fit; never grows",
          CKPT_FIELD(staging.budget_bytes), kChunkAlignment),
      Num("staging_chunk_bytes", "staging allocation unit and I/O size (multiple of 4096)",
          CKPT_FIELD(staging.chunk_bytes), kChunkAlignment),
      Bool("lock_staging_memory", "mlock the staging pool (needs LimitMEMLOCK)",
           CKPT_FIELD(staging.lock_memory)),
      Num("writer_threads", "layer versions written concurrently",
          CKPT_FIELD(engine.writer_threads), 1, 64),
      Num("snapshot_threads", "ranks snapshotted concurrently", CKPT_FIELD(engine.snapshot_threads),
          1, 64),
      Backend("io_backend", "auto | io_uring | pwrite (auto falls back to pwrite)"),
      Num("io_queue_depth", "chunk writes in flight per writer", CKPT_FIELD(engine.io_queue_depth),
          1, 4096),
      Bool("direct_io", "O_DIRECT for layer files (falls back where unsupported)",
           CKPT_FIELD(direct_io)),
      Time("admission_timeout_ms",
           "how long a snapshot waits for staging memory before the layer is skipped and counted",
           CKPT_FIELD(engine.admission_timeout), absl::Milliseconds(1), 0, 3600 * 1000),
      Time("gpu_wait_timeout_ms",
           "GPU ranks: longest wait for a step's event or its copies; then its layers are retried",
           CKPT_FIELD(engine.gpu_wait_timeout), absl::Milliseconds(1), 1, 3600 * 1000),
      Bool("gpu_fabric_handles",
           "accept GPU pages handed over as fabric handles (GPUs without POSIX-descriptor "
           "export, e.g. multi-node NVLink): importing one needs an IMEX channel, which ckptd "
           "may hold where a user does not, so a user could have ckptd import handles they could "
           "not (docs/protocol.md); off: such registrations are refused naming this option",
           CKPT_FIELD(engine.gpu_fabric_handles)),
      Time("drain_timeout_ms", "how long a re-registration waits for the old one's writes",
           CKPT_FIELD(engine.drain_timeout), absl::Milliseconds(1), 0, 3600 * 1000),
      Time("shutdown_grace_ms", "on SIGTERM, how long staged versions may still be written",
           CKPT_FIELD(shutdown_grace), absl::Milliseconds(1), 0, 3600 * 1000),
      Num("max_message_bytes",
          "largest gRPC message, i.e. the largest Register request (a model's tensor table); "
          "gRPC refuses a larger one once it has received it",
          CKPT_FIELD(rpc.max_message_bytes), kMinMessageBytes, std::numeric_limits<int>::max()),
      Num("max_request_bytes",
          "largest request of every method but Register; larger ones fail with "
          "RESOURCE_EXHAUSTED (at least max_aux_bytes + 2 MiB; max_message_bytes caps it too)",
          CKPT_FIELD(rpc.max_request_bytes), kMinMessageBytes, std::numeric_limits<int>::max()),
      Num("max_large_calls",
          "Register calls above max_request_bytes running at once, node-wide; more fail with "
          "RESOURCE_EXHAUSTED",
          CKPT_FIELD(rpc.max_large_calls), 1, 1 << 16),
      Num("max_calls_per_uid", "calls one user may have in flight; more: RESOURCE_EXHAUSTED",
          CKPT_FIELD(rpc.max_calls_per_uid), 1, 1 << 20),
      Num("max_heavy_calls", "verify, export and gc calls running at once, node-wide",
          CKPT_FIELD(rpc.max_heavy_calls), 1, 1 << 20),
      Num("max_connections_per_uid", "gRPC connections one user may hold open; more are closed",
          CKPT_FIELD(rpc.max_connections_per_uid), 1, 1 << 20),
      Num("max_connections", "gRPC connections open at once, node-wide",
          CKPT_FIELD(rpc.max_connections), 1, 1 << 20),
      Time("accept_backoff_ms",
           "first pause of the gRPC accept loop when out of descriptors; doubles up to 1 s",
           CKPT_FIELD(rpc.accept_backoff), absl::Milliseconds(1), 1, 1000),
      Num("max_aux_bytes", "largest per-step aux blob (RNG, scheduler, data position)",
          CKPT_FIELD(engine.max_aux_bytes), 0, 64 << 20),
  };
  // The handover rows, then LayerCheck onwards.
  const std::vector<Option>& handover = HandoverRows();
  front->insert(front->end(), handover.begin(), handover.end());
  const std::vector<Option> back{
      Num("drift_threads", "CPU threads of the LayerCheck drift kernel per snapshot",
          CKPT_FIELD(engine.drift_threads), 1, 256),
      Num("device_write_bytes_per_s",
          "sustained write bandwidth of the data device in bytes/s (e.g. fio with O_DIRECT); a "
          "LayerCheck write budget given as a share of the device is relative to it (0 = "
          "unknown: such budgets are refused)",
          CKPT_FIELD(engine.device_write_bytes_per_s), 0),
      Num("keep_last_events",
          "retention: the composite plans of the newest N checkpoint events stay restorable",
          CKPT_FIELD(engine.retention.keep_last_events), 0),
      Num("keep_every_steps",
          "retention: plans at steps that are multiples of M stay restorable (0 = off)",
          CKPT_FIELD(engine.retention.keep_every_steps), 0),
      Num("keep_hours", "retention: plans of events younger than T hours stay restorable (0 = off)",
          CKPT_FIELD(engine.retention.keep_hours), 0),
      Time("gc_interval_s", "how often retention runs over every job (0 = only `ckptctl gc JOB`)",
           CKPT_FIELD(engine.gc_interval), absl::Seconds(1), 0, 365 * 24 * 3600),
      Num("max_disk_bytes", "bound on committed version bytes; past it versions fail (0 = none)",
          CKPT_FIELD(engine.max_disk_bytes), 0),
      Num("min_free_disk_bytes",
          "new versions and peers' replicas fail while the data file system has less free; index "
          "records (events, aux blobs) may use it down to a quarter of it, so RocksDB keeps room",
          CKPT_FIELD(engine.min_free_disk_bytes), 0),
      Num("max_disk_bytes_per_uid",
          "layer files plus index records one user's jobs may hold; past it that user's steps "
          "and versions fail with RESOURCE_EXHAUSTED (0 = half the data file system)",
          CKPT_FIELD(engine.max_disk_bytes_per_uid), 0),
      Num("max_disk_bytes_per_job",
          "layer files plus index records one job may hold, within its owner's "
          "max_disk_bytes_per_uid; past it that job's steps and versions fail with "
          "RESOURCE_EXHAUSTED (0 = none)",
          CKPT_FIELD(engine.max_disk_bytes_per_job), 0),
      Num("max_index_bytes_per_uid",
          "index records (rank tables, aux blobs, events, versions) one user's jobs may hold; "
          "past it that user's steps fail with RESOURCE_EXHAUSTED (0 = none)",
          CKPT_FIELD(engine.max_index_bytes_per_uid), 0),
      Num("max_queued_steps_per_rank",
          "steps of one rank queued for a snapshot (each holds its aux blob); more fail with "
          "RESOURCE_EXHAUSTED (0 = none)",
          CKPT_FIELD(engine.max_queued_steps_per_rank), 0, 1 << 20),
      Num("max_queued_steps_per_uid",
          "steps of one user's ranks from StepDone until their checkpoint event is written; more "
          "fail with RESOURCE_EXHAUSTED (0 = none)",
          CKPT_FIELD(engine.max_queued_steps_per_uid), 0, 1 << 24),
      Num("max_registration_table_bytes",
          "the largest table one registration may record (every layer's and tensor's name, "
          "shape, role); its bytes also count against max_index_bytes_per_uid",
          CKPT_FIELD(engine.limits.max_table_bytes), 4096, uint64_t{1} << 30),
      Num("max_registrations_per_uid",
          "ranks one user may have registered at once (each maps its memory and holds its "
          "descriptors); more fail with RESOURCE_EXHAUSTED (0 = none)",
          CKPT_FIELD(engine.max_registrations_per_uid), 0, 1 << 20),
      Str("metrics_address",
          "Prometheus endpoint host:port (empty = off; a bind failure is a warning); loopback "
          "by default, since it lists every user's jobs: bind 0.0.0.0 (or one interface) to "
          "let a remote Prometheus scrape it",
          CKPT_FIELD(metrics_address)),
      Num("max_layer_series", "cap on per-layer metric series, shared fairly among uids",
          CKPT_FIELD(max_layer_series), 0),
      TierBytes("memory_tier_bytes",
                "staging-pool bytes that keep the newest committed version of each layer in "
                "memory, so a restore after a trainer crash reads no disk: auto (half of "
                "staging_pool_bytes), a number of bytes (at most staging_pool_bytes), or 0 = "
                "off; snapshots take room back from it first, so it never delays one"),
      Str("remote_kind",
          "the remote tier every durable step is copied to in the background: none, s3 (an "
          "S3-compatible object store) or posix (a shared directory); docs/remote.md",
          CKPT_FIELD(remote.kind)),
      Str("remote_path", "posix remote tier: the shared directory (Lustre, GPFS, CephFS, NFS)",
          CKPT_FIELD(remote.path)),
      Str("remote_endpoint", "s3 remote tier: http(s)://host[:port] of the object store",
          CKPT_FIELD(remote.endpoint)),
      Str("remote_bucket", "s3 remote tier: the bucket (it must exist)", CKPT_FIELD(remote.bucket)),
      Str("remote_region", "s3 remote tier: the region the requests are signed for",
          CKPT_FIELD(remote.region)),
      Str("remote_prefix", "s3 remote tier: a prefix for every key (one bucket, many clusters)",
          CKPT_FIELD(remote.prefix)),
      Str("remote_credentials_file",
          "s3 remote tier: a file only ckptd's user may read, with lines access_key_id = ... and "
          "secret_access_key = ... (systemd: LoadCredential=, then "
          "%d/<name>); never logged or shown",
          CKPT_FIELD(remote.credentials_file)),
      Str("remote_key_file",
          "a file only ckptd's user may read, with at least 32 bytes of secret shared by every "
          "node of the cluster (make one with: head -c 32 /dev/urandom | base64); every "
          "manifest, object and job owner record in the remote tier is signed with it, and "
          "nothing it does not authenticate is restored (systemd: LoadCredential=)",
          CKPT_FIELD(remote.key_file)),
      Bool("remote_path_style",
           "s3 remote tier: address objects as endpoint/bucket/key (RGW, MinIO) rather than "
           "bucket.host/key",
           CKPT_FIELD(remote.path_style)),
      Str("remote_ca_file", "s3 remote tier over https: a CA bundle (empty = the system's)",
          CKPT_FIELD(remote.ca_file)),
      Num("remote_part_bytes", "s3 remote tier: multipart part size; larger objects go in parts",
          CKPT_FIELD(remote.part_bytes), uint64_t{5} << 20, uint64_t{5} << 30),
      Num("remote_parallel_parts", "s3 remote tier: parts of one object uploaded at once",
          CKPT_FIELD(remote.parallel_parts), 1, 64),
  };
  front->insert(front->end(), back.begin(), back.end());
  return front;
}

const std::vector<Option>& Options() {
  static const std::vector<Option>* const options = [] {
    std::vector<Option>* all = CoreOptions();
    all->insert(all->end(), PeerOptions().begin(), PeerOptions().end());
    return all;
  }();
  return *options;
}

#undef CKPT_FIELD

}  // namespace

absl::Status DaemonConfig::Validate() const {
  for (const Option& o : Options()) CKPT_RETURN_IF_ERROR(o.check(*this));
  if (staging.chunk_bytes % kChunkAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_chunk_bytes must be a positive multiple of ", kChunkAlignment));
  }
  if (staging.budget_bytes < staging.chunk_bytes) {
    return absl::InvalidArgumentError("staging_pool_bytes must hold at least one chunk");
  }
  if (memory_tier_bytes.value_or(0) > staging.budget_bytes) {
    return absl::InvalidArgumentError(
        "memory_tier_bytes must be at most staging_pool_bytes (the tier keeps pool chunks)");
  }
  if (remote.kind != "none" && remote.kind != "s3" && remote.kind != "posix") {
    return absl::InvalidArgumentError("remote_kind must be none, s3 or posix");
  }
  if (remote.kind == "posix" && remote.path.empty()) {
    return absl::InvalidArgumentError("remote_kind posix needs remote_path");
  }
  if (remote.kind != "none" && remote.key_file.empty()) {
    return absl::InvalidArgumentError(
        "a remote tier needs remote_key_file: the cluster key that signs what ckptd writes "
        "there, so that nothing another party put there is ever restored (docs/remote.md)");
  }
  if (remote.kind == "s3" &&
      (remote.endpoint.empty() || remote.bucket.empty() || remote.credentials_file.empty())) {
    return absl::InvalidArgumentError(
        "remote_kind s3 needs remote_endpoint, remote_bucket and remote_credentials_file");
  }
  CKPT_RETURN_IF_ERROR(peer.Validate());
  if (peer.enabled() && remote.key_file.empty()) {
    return absl::InvalidArgumentError(
        "peer replication needs remote_key_file: the cluster key that signs every manifest, "
        "object and owner record it replicates or keeps (docs/peer.md)");
  }
  if (engine.max_aux_bytes + kStepListBytes > static_cast<uint64_t>(rpc.max_request_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_request_bytes must be at least max_aux_bytes + ", kStepListBytes,
                     " (a StepDone carries the aux blob and per-layer lists)"));
  }
  return absl::OkStatus();
}

absl::Status SetConfigOption(const std::string& key, const std::string& value,
                             DaemonConfig* config) {
  for (const Option& o : Options()) {
    if (key == o.name) return o.set(value, config);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown option '", key, "'"));
}
absl::Status ParseConfigText(const std::string& text, DaemonConfig* config) {
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    auto hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    auto eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("config line ", line_no, ": expected key = value"));
    }
    std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    absl::Status s = SetConfigOption(key, value, config);
    if (!s.ok())
      return absl::InvalidArgumentError(absl::StrCat("config line ", line_no, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status LoadConfigFile(const std::string& path, DaemonConfig* config) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseConfigText(ss.str(), config);
}

std::string DumpConfig(const DaemonConfig& config, ConfigTitle title) {
  std::string out =
      title == ConfigTitle::kDefaults
          ? "# ckptd configuration. Generated by `ckptd --dump-default-config`; every\n"
            "# option is shown with its default. Flags (--key=value) override this file.\n"
          : "# The configuration this ckptd runs with: the config file and flags applied\n"
            "# over the defaults (`ckptd --dump-default-config` prints those).\n";
  for (const Option& o : Options()) {
    absl::StrAppend(&out, "\n# ", o.help, "\n", o.name, " = ", o.get(config), "\n");
  }
  return out;
}

std::string ConfigHelp() {
  DaemonConfig defaults;
  std::string out;
  for (const Option& o : Options()) {
    absl::StrAppend(&out, "  --", o.name, "=", o.get(defaults), "\n      ", o.help, "\n");
  }
  return out;
}

}  // namespace ckpt
