// ckptd: the node-local checkpoint daemon. Flags, config and wiring only.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/common/systemd_notify.h"
#include "daemon/common/unix_socket.h"
#include "daemon/config/config.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/cuda_host.h"
#include "daemon/io/file_system.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/peer_node.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_auth.h"
#include "daemon/remote/s3_store.h"
#include "daemon/rpc/server.h"
#include "daemon/shm/handover.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {
namespace {

constexpr char kUsage[] =
    "usage: ckptd [--config=FILE] [--key=value ...]\n"
    "       ckptd --dump-default-config\n\n"
    "Node-local checkpoint daemon. Options (file keys and flags alike):\n";

// Exit status of a start-up refusal that a restart cannot cure (a damaged
// index, a symbolic link in the data directory): EX_CONFIG, which the
// systemd unit lists in RestartPreventExitStatus= so ckptd does not loop.
constexpr int kExitNeedsOperator = 78;

// The remote tier the config names; null for none. A store that refuses
// ckptd's credentials or does not answer is logged and kept: training and
// local checkpoints go on, and the uploader retries (docs/remote.md).
// The cluster key of the remote and peer tiers, when there is one (`needed`).
absl::StatusOr<std::optional<ckpt::remote::RemoteKey>> LoadRemoteKey(const ckpt::RemoteConfig& rc,
                                                                     bool needed) {
  if (!needed) return std::optional<ckpt::remote::RemoteKey>();
  absl::StatusOr<ckpt::remote::RemoteKey> key = ckpt::remote::RemoteKey::FromFile(rc.key_file);
  if (!key.ok()) return key.status();
  CKPT_LOG(INFO) << "remote and peer tiers: signing with the cluster key " << key->Fingerprint();
  return std::optional<ckpt::remote::RemoteKey>(*std::move(key));
}

absl::StatusOr<std::unique_ptr<ckpt::remote::RemoteStore>> OpenRemote(
    const ckpt::RemoteConfig& rc) {
  using ckpt::remote::RemoteStore;
  if (rc.kind == "posix") {
    absl::StatusOr<std::unique_ptr<ckpt::remote::PosixStore>> s =
        ckpt::remote::PosixStore::Open(rc.path);
    if (!s.ok()) return s.status();
    return std::unique_ptr<RemoteStore>(std::move(*s));
  }
  if (rc.kind != "s3") return std::unique_ptr<RemoteStore>();
  ckpt::remote::S3Options o;
  o.endpoint = rc.endpoint;
  o.bucket = rc.bucket;
  o.region = rc.region;
  o.prefix = rc.prefix;
  o.path_style = rc.path_style;
  o.ca_file = rc.ca_file;
  o.part_bytes = rc.part_bytes;
  o.parallel_parts = rc.parallel_parts;
  // The secret will be in this process's memory: no core dump (and no
  // ptrace by the same uid) may carry it out.
  const rlimit no_core{0, 0};
  if (setrlimit(RLIMIT_CORE, &no_core) != 0 || prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    return ckpt::ErrnoStatus(errno, "turning core dumps off before reading credentials");
  }
  if (absl::Status s = ckpt::remote::ReadS3Credentials(rc.credentials_file, &o); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<ckpt::remote::S3Store>> store =
      ckpt::remote::S3Store::Create(std::move(o));
  if (!store.ok()) return store.status();
  if (absl::Status s = (*store)->CheckAccess(); !s.ok()) {
    CKPT_LOG(ERROR) << "remote tier " << (*store)->Describe()
                    << " does not accept ckptd yet (uploads are retried): " << s;
  }
  return std::unique_ptr<RemoteStore>(std::move(*store));
}

int Fail(const std::string& what, const absl::Status& s) {
  CKPT_LOG(ERROR) << what << ": " << s;
  return 1;
}

// The index could not be opened. Corruption is refused with the way out;
// ckptd never rebuilds or deletes anything itself.
int FailIndex(const std::string& data_dir, const absl::Status& s) {
  CKPT_LOG(ERROR) << "index: " << s;
  if (!absl::IsDataLoss(s)) return 1;
  CKPT_LOG(ERROR) << "index: the index under " << data_dir
                  << "/index is damaged; ckptd changed nothing. With ckptd stopped, run "
                     "`ckptctl repair --data-dir="
                  << data_dir
                  << "` to rebuild it from the self-describing layer files (the damaged index "
                     "is kept beside it), then start ckptd again";
  return kExitNeedsOperator;
}

// Start-up met something in the data directory it must not touch (a
// symbolic link): the message names the path; no restart can cure it.
int FailDataDir(const std::string& what, const absl::Status& s) {
  CKPT_LOG(ERROR) << what << ": " << s;
  if (!absl::IsFailedPrecondition(s)) return 1;
  CKPT_LOG(ERROR) << what
                  << ": refusing to start; move each path named above out of the data directory "
                     "(or replace a link with what it points to) and start ckptd again";
  return kExitNeedsOperator;
}

// Reads the command line: --config=FILE first, then every other --key=value
// over it, then Validate(). Returns the exit status when main() is to stop
// here: 0 after --help or a --dump-* (printed), 2 after a usage or config
// error (printed to stderr); nullopt when ckptd is to run with `config`.
std::optional<int> ParseCommandLine(int argc, char** argv, DaemonConfig* config) {
  std::string config_path;
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s%s", kUsage, ConfigHelp().c_str());
      return 0;
    }
    if (a == "--dump-metrics-table") {
      std::printf("%s", Metrics::MarkdownTable().c_str());
      return 0;
    }
    if (a == "--dump-default-config") {
      std::printf("%s", DumpConfig(DaemonConfig()).c_str());
      return 0;
    }
    if (!absl::StartsWith(a, "--")) {
      std::fprintf(stderr, "ckptd: unexpected argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
    a = a.substr(2);
    std::string key = a, value;
    auto eq = a.find('=');
    if (eq != std::string::npos) {
      key = a.substr(0, eq);
      value = a.substr(eq + 1);
    } else if (i + 1 < argc) {
      value = argv[++i];
    }
    if (key == "config") {
      config_path = value;
    } else {
      flags.emplace_back(key, value);
    }
  }
  if (!config_path.empty()) {
    if (absl::Status s = LoadConfigFile(config_path, config); !s.ok()) {
      std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  for (const auto& [k, v] : flags) {
    if (absl::Status s = SetConfigOption(k, v, config); !s.ok()) {
      std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (absl::Status s = config->Validate(); !s.ok()) {
    std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  return std::nullopt;
}

// SIGTERM/SIGINT are taken synchronously by the main thread (sigwait,
// WaitForStopSignal): blocked here, before ckptd starts a thread, so every
// thread it starts inherits the mask. SIGPIPE is ignored.
sigset_t BlockStopSignals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return sigs;
}

// Brings the store up: LayerStore::Init, then start-up reconciliation
// (after a clean stop every commit had finished, so the recorded files are
// checked by name; after anything else, each one's size is checked), logged.
// Returns the exit status when ckptd cannot start; nullopt with `report`
// filled in otherwise.
std::optional<int> StartStore(const DaemonConfig& config, Index* index, LayerStore* store,
                              ReconcileReport* report) {
  if (absl::Status s = store->Init(); !s.ok()) return FailDataDir("store", s);
  absl::StatusOr<bool> clean_stop = index->CleanStop();
  if (!clean_stop.ok()) return FailIndex(config.data_dir, clean_stop.status());
  const absl::Time reconcile_start = absl::Now();
  absl::StatusOr<ReconcileReport> reconciled = store->Reconcile(
      *clean_stop ? LayerStore::ReconcileCheck::kNames : LayerStore::ReconcileCheck::kSizes);
  if (!reconciled.ok()) return FailDataDir("start-up reconciliation", reconciled.status());
  *report = *reconciled;
  CKPT_LOG(INFO) << "start-up check "
                 << (*clean_stop ? "after a clean stop: recorded files looked up by name"
                                 : "after a crash or a first start: every recorded file's size "
                                   "checked")
                 << ", " << absl::ToDoubleSeconds(absl::Now() - reconcile_start) << " s";
  CKPT_LOG(INFO) << "reconciled: " << report->temp_files_removed << " temp files removed, "
                 << report->orphan_files_quarantined << " orphan files quarantined, "
                 << report->uncommitted_versions_removed << " unacknowledged versions and "
                 << report->dangling_records_removed << " dangling records removed";
  if (report->files_quarantined > 0) {
    CKPT_LOG(WARNING) << "reconciled: " << report->files_quarantined << " layer files moved to "
                      << config.data_dir
                      << "/quarantine (paths above); if acknowledged versions are missing, stop "
                         "ckptd and run `ckptctl repair --data-dir="
                      << config.data_dir << "`";
  }
  return std::nullopt;
}

// The node-wide staging pool, pre-faulted (and locked when configured),
// logged with how long that took.
absl::StatusOr<std::unique_ptr<StagingPool>> CreateStagingPool(const StagingPoolOptions& options) {
  const absl::Time pool_start = absl::Now();
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(options);
  if (!pool.ok()) return pool;
  CKPT_LOG(INFO) << "staging pool: " << (*pool)->budget_bytes() << " bytes in "
                 << (*pool)->chunk_bytes() << "-byte chunks, pre-faulted in "
                 << absl::ToDoubleSeconds(absl::Now() - pool_start) << " s, "
                 << ((*pool)->locked() ? "locked" : "NOT locked");
  return pool;
}

// Starts the Prometheus endpoint on `address` (empty: none). Returns the
// host:port it listens on, empty when it is off or failed to bind (a
// warning: ckptd runs on without it).
// This node's name when no certificate names it (StatusReply.node).
std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// The replicas this node keeps for other nodes' jobs, charged to the
// quotas of the uids that own those jobs.
class QuotaCharges final : public peer::ReplicaCharges {
 public:
  explicit QuotaCharges(QuotaTable* quota) : quota_(quota) {}
  absl::Status Reserve(uid_t uid, uint64_t bytes, uint64_t replaced) override {
    return quota_->ReserveReplica(uid, bytes, replaced);
  }
  void Release(uid_t uid, uint64_t bytes) override { quota_->ReleaseReplica(uid, bytes); }
  void Seed(uid_t uid, uint64_t bytes) override { quota_->SeedReplica(uid, bytes); }

 private:
  QuotaTable* const quota_;
};

// Peer replication's node: the transports to the peer nodes and the
// replica store (its service starts with PeerNode::Serve).
absl::StatusOr<std::unique_ptr<peer::PeerNode>> StartPeers(const DaemonConfig& config,
                                                           Metrics* metrics,
                                                           const remote::RemoteKey* key,
                                                           peer::ReplicaCharges* charges) {
  peer::PeerConfig pc = config.peer;
  pc.calls_at_once = config.engine.peer.upload_threads;
  pc.min_free_disk_bytes = config.engine.min_free_disk_bytes;
  return peer::PeerNode::Start(pc, config.data_dir, metrics, key, charges);
}

// This node's name and the engine's peer tier: every node of peer_nodes
// but this one, each over its PeerStore; the cluster key is eo->remote's.
void SetPeerTier(const DaemonConfig& config, const peer::PeerNode& peers, EngineOptions* eo) {
  eo->node_name = peers.self().empty() ? HostName() : peers.self();
  eo->node_rack = peers.rack();
  eo->peers.tier = config.engine.peer;
  eo->peers.tier.key = eo->remote.key;
  eo->peers.self = eo->node_name;
  eo->peers.self_rack = eo->node_rack;
  eo->peers.copies = config.peer.copies;
  eo->peers.require_other_rack = config.peer.require_other_rack;
  for (const peer::PeerLink& l : peers.links()) {
    eo->peers.peers.push_back(PeerTarget{PeerNodeInfo{l.node.name, l.node.rack}, l.store});
  }
}

std::string StartMetricsEndpoint(const std::string& address, Metrics* metrics) {
  if (address.empty()) return std::string();
  if (absl::Status s = metrics->StartExposer(address); !s.ok()) {
    CKPT_LOG(WARNING) << "metrics endpoint " << address
                      << " unavailable, continuing without it: " << s;
    return std::string();
  }
  auto colon = address.rfind(':');
  std::string listening =
      absl::StrCat(colon == std::string::npos ? std::string("0.0.0.0") : address.substr(0, colon),
                   ":", metrics->port());
  CKPT_LOG(INFO) << "metrics on http://" << listening << "/metrics";
  return listening;
}

// The directories of the gRPC and handover sockets: created 0750 when
// missing (systemd's RuntimeDirectory does this in production), then
// checked (CheckSocketDirectory).
absl::Status MakeSocketDirectories(const DaemonConfig& config, FileSystem* fs) {
  for (const std::string& sock : {config.socket, config.HandoverSocketPath()}) {
    auto slash = sock.rfind('/');
    if (slash == std::string::npos || slash == 0) continue;
    CKPT_ASSIGN_OR_RETURN(UniqueFd dir, fs->MakeDirs(sock.substr(0, slash)));
    CKPT_RETURN_IF_ERROR(CheckSocketDirectory(dir.get(), sock.substr(0, slash)));
  }
  return absl::OkStatus();
}

// The servers' counters at the last metrics collection. Hook runs are
// serialized, so they need no lock.
struct ServerCounters {
  HandoverServer::Stats handover;
  RpcServer::ConnectionStats rpc;
};

// The metrics hook's share beside Engine::CollectMetrics: what the handover
// and gRPC servers counted since the last run.
void CollectServerMetrics(const HandoverServer& handover, const RpcServer& rpc,
                          ServerCounters* seen, Metrics* metrics) {
  const HandoverServer::Stats now = handover.stats();
  metrics->Set(Gauge::kHandoverFdsHeld, static_cast<double>(now.fds_held));
  metrics->Inc(Counter::kHandoverRefused,
               static_cast<double>(now.refused - seen->handover.refused));
  metrics->Inc(Counter::kHandoverAcceptErrors,
               static_cast<double>(now.accept_errors - seen->handover.accept_errors));
  seen->handover = now;
  const RpcServer::ConnectionStats conns = rpc.connection_stats();
  metrics->Inc(Counter::kRpcConnectionsRefused,
               static_cast<double>(conns.refused - seen->rpc.refused));
  metrics->Inc(Counter::kRpcAcceptErrors,
               static_cast<double>(conns.accept_errors - seen->rpc.accept_errors));
  seen->rpc = conns;
}

// Blocks until SIGTERM or SIGINT (BlockStopSignals), then tells systemd
// that ckptd is stopping.
void WaitForStopSignal(const sigset_t& sigs) {
  int sig = 0;
  sigwait(&sigs, &sig);
  CKPT_LOG(INFO) << "signal " << sig << ": shutting down";
  NotifyStopping();
}

// The parts the stop sequence takes down, in StopServing's order.
struct Serving {
  Engine* engine;
  Metrics* metrics;
  RpcServer* rpc;
  HandoverServer* handover;
  Index* index;
};

// Stops serving: the engine first -- it refuses new steps, wakes every
// waiter and lets the writers finish staged versions within `grace` -- then
// the RPC server can stop quickly, then the handover server; the sockets
// are unlinked. Last the clean stop is recorded: nothing writes the store
// or the index any more, every commit has finished, so the next start may
// check the recorded files by name.
void StopServing(const Serving& s, absl::Duration grace, const std::string& socket,
                 const std::string& handover_socket) {
  s.engine->Shutdown(grace);
  s.metrics->SetCollectHook(nullptr);
  s.rpc->Shutdown(absl::Seconds(1));
  s.handover->Stop();
  ::unlink(socket.c_str());
  ::unlink(handover_socket.c_str());
  if (absl::Status st = s.index->MarkCleanStop(); !st.ok()) {
    CKPT_LOG(WARNING) << "could not record the clean stop (the next start checks every "
                         "recorded file's size): "
                      << st;
  }
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  using namespace ckpt;
  InitKillPoints();
  DaemonConfig config;
  if (std::optional<int> exit_status = ParseCommandLine(argc, argv, &config)) return *exit_status;
  const sigset_t stop_signals = BlockStopSignals();

  // The store and the index.
  CKPT_LOG(INFO) << "ckptd starting: data_dir " << config.data_dir << ", socket " << config.socket;
  FileSystem* fs = DefaultFileSystem();
  absl::StatusOr<UniqueFd> data_dir = fs->MakeDirs(config.data_dir);
  if (!data_dir.ok()) return Fail("data directory", data_dir.status());
  absl::StatusOr<std::unique_ptr<Index>> index = Index::Open(config.data_dir + "/index");
  if (!index.ok()) return FailIndex(config.data_dir, index.status());
  LayerStore store(config.data_dir, fs, index->get(), config.direct_io);
  ReconcileReport report;
  if (std::optional<int> exit_status = StartStore(config, index->get(), &store, &report)) {
    return *exit_status;
  }

  // Staging memory, metrics and the remote tier.
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = CreateStagingPool(config.staging);
  if (!pool.ok()) return Fail("staging pool", pool.status());
  HostRegistration cuda_pin((*pool)->base(), (*pool)->budget_bytes(), (*pool)->chunk_bytes());
  CKPT_LOG(INFO) << "gpu: " << CudaSupport() << "; " << cuda_pin.reason();
  Metrics metrics(config.max_layer_series);
  const std::string metrics_address = StartMetricsEndpoint(config.metrics_address, &metrics);
  absl::StatusOr<std::unique_ptr<remote::RemoteStore>> remote_store = OpenRemote(config.remote);
  if (!remote_store.ok()) return Fail("remote tier", remote_store.status());
  if (*remote_store != nullptr) CKPT_LOG(INFO) << "remote tier: " << (*remote_store)->Describe();

  absl::StatusOr<std::optional<remote::RemoteKey>> remote_key =
      LoadRemoteKey(config.remote, *remote_store != nullptr || config.peer.enabled());
  if (!remote_key.ok()) return Fail("remote tier key", remote_key.status());
  // Per-uid usage: the engine's checkpoints and the replicas kept here for
  // other nodes' jobs count against the same quotas.
  QuotaTable quota;
  QuotaCharges charges(&quota);
  absl::StatusOr<std::unique_ptr<peer::PeerNode>> peers =
      StartPeers(config, &metrics, remote_key->has_value() ? &**remote_key : nullptr, &charges);
  if (!peers.ok()) return Fail("peer replication", peers.status());

  // The engine.
  EngineOptions eo = config.engine;
  eo.quota = &quota;
  eo.memory_tier_bytes = config.MemoryTierBytes();
  eo.remote.store = remote_store->get();
  eo.remote.key = remote_key->has_value() ? &**remote_key : nullptr;
  SetPeerTier(config, **peers, &eo);
  eo.data_dir = config.data_dir;
  eo.metrics = &metrics;
  eo.metrics_address = metrics_address;
  Engine engine(eo, index->get(), &store, pool->get());
  engine.RecordReconcile(report);
  if (absl::Status s = engine.Start(); !s.ok()) return Fail("engine", s);
  CKPT_LOG(INFO) << "io backend: " << engine.io_backend_name();
  // Replicas are taken once the quotas they count against are set.
  if (absl::Status s = (*peers)->Serve(); !s.ok()) return Fail("peer replication", s);

  // The servers.
  if (absl::Status s = MakeSocketDirectories(config, fs); !s.ok()) {
    return Fail("socket directory", s);
  }
  HandoverOptions ho = config.handover;
  ho.socket_path = config.HandoverSocketPath();
  HandoverServer handover(ho);
  if (absl::Status s = handover.Start(); !s.ok()) return Fail("handover socket", s);
  RpcServerOptions ro = config.rpc;
  ro.socket_path = config.socket;
  ro.config_text = DumpConfig(config, ConfigTitle::kEffective);
  RpcServer rpc(ro, &engine, &handover);
  ServerCounters seen;
  metrics.SetCollectHook([&engine, &handover, &rpc, &metrics, &seen, &peers] {
    engine.CollectMetrics();
    (*peers)->CollectMetrics();
    CollectServerMetrics(handover, rpc, &seen, &metrics);
  });
  if (absl::Status s = rpc.Start(); !s.ok()) return Fail("gRPC server", s);
  CKPT_LOG(INFO) << "ckptd ready on " << config.socket << " (handover " << ho.socket_path << ")";
  NotifyReady("serving on " + config.socket);
  // Under systemd's WatchdogSec=: the probe takes the engine's lock and reads
  // the index, so a wedged engine stops the pings and systemd restarts ckptd.
  WatchdogPinger watchdog(WatchdogInterval(), [&engine] {
    engine.GetStatus();
    return true;
  });

  // Until SIGTERM or SIGINT.
  WaitForStopSignal(stop_signals);
  watchdog.Stop();  // systemd disarms the watchdog once the unit is stopping
  StopServing(Serving{&engine, &metrics, &rpc, &handover, index->get()}, config.shutdown_grace,
              config.socket, ho.socket_path);
  (*peers)->Shutdown(absl::Now() + absl::Seconds(2));
  CKPT_LOG(INFO) << "ckptd stopped";
  return 0;
}
