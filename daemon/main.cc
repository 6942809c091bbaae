// ckptd: the node-local checkpoint daemon. Flags, config and wiring only.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "base/logging.h"
#include "daemon/common/systemd_notify.h"
#include "daemon/common/unix_socket.h"
#include "daemon/config/config.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/cuda_host.h"
#include "daemon/metrics/metrics.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_auth.h"
#include "daemon/remote/s3_store.h"
#include "daemon/io/file_system.h"
#include "daemon/rpc/server.h"
#include "daemon/shm/handover.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

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
                  << ": refusing to start; move the path named above out of the data directory "
                     "(or replace the link with what it points to) and start ckptd again";
  return kExitNeedsOperator;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ckpt;
  InitKillPoints();
  DaemonConfig config;
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
    if (absl::Status s = LoadConfigFile(config_path, &config); !s.ok()) {
      std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  for (const auto& [k, v] : flags) {
    if (absl::Status s = SetConfigOption(k, v, &config); !s.ok()) {
      std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (absl::Status s = config.Validate(); !s.ok()) {
    std::fprintf(stderr, "ckptd: %s\n", std::string(s.message()).c_str());
    return 2;
  }

  // SIGTERM/SIGINT are taken synchronously by the main thread (sigwait).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  CKPT_LOG(INFO) << "ckptd starting: data_dir " << config.data_dir << ", socket " << config.socket;
  FileSystem* fs = DefaultFileSystem();
  absl::StatusOr<UniqueFd> data_dir = fs->MakeDirs(config.data_dir);
  if (!data_dir.ok()) return Fail("data directory", data_dir.status());
  absl::StatusOr<std::unique_ptr<Index>> index = Index::Open(config.data_dir + "/index");
  if (!index.ok()) return FailIndex(config.data_dir, index.status());
  LayerStore store(config.data_dir, fs, index->get(), config.direct_io);
  if (absl::Status s = store.Init(); !s.ok()) return FailDataDir("store", s);
  // After a clean stop every commit had finished: the recorded files are
  // checked by name. After anything else, each one's size is checked.
  absl::StatusOr<bool> clean_stop = (*index)->CleanStop();
  if (!clean_stop.ok()) return FailIndex(config.data_dir, clean_stop.status());
  const absl::Time reconcile_start = absl::Now();
  absl::StatusOr<ReconcileReport> report = store.Reconcile(
      *clean_stop ? LayerStore::ReconcileCheck::kNames : LayerStore::ReconcileCheck::kSizes);
  if (!report.ok()) return FailDataDir("start-up reconciliation", report.status());
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
    CKPT_LOG(WARNING) << "reconciled: " << report->files_quarantined
                      << " layer files moved to " << config.data_dir
                      << "/quarantine (paths above); if acknowledged versions are missing, stop "
                         "ckptd and run `ckptctl repair --data-dir="
                      << config.data_dir << "`";
  }

  const absl::Time pool_start = absl::Now();
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(config.staging);
  if (!pool.ok()) return Fail("staging pool", pool.status());
  CKPT_LOG(INFO) << "staging pool: " << (*pool)->budget_bytes() << " bytes in "
                 << (*pool)->chunk_bytes() << "-byte chunks, pre-faulted in "
                 << absl::ToDoubleSeconds(absl::Now() - pool_start) << " s, "
                 << ((*pool)->locked() ? "locked" : "NOT locked");

  HostRegistration cuda_pin((*pool)->base(), (*pool)->budget_bytes());
  CKPT_LOG(INFO) << "gpu: " << CudaSupport() << "; " << cuda_pin.reason();

  Metrics metrics(config.max_layer_series);
  std::string metrics_address;
  if (!config.metrics_address.empty()) {
    if (absl::Status s = metrics.StartExposer(config.metrics_address); s.ok()) {
      auto colon = config.metrics_address.rfind(':');
      metrics_address = absl::StrCat(
          colon == std::string::npos ? std::string("0.0.0.0") : config.metrics_address.substr(0, colon),
          ":", metrics.port());
      CKPT_LOG(INFO) << "metrics on http://" << metrics_address << "/metrics";
    } else {
      CKPT_LOG(WARNING) << "metrics endpoint " << config.metrics_address
                        << " unavailable, continuing without it: " << s;
    }
  }

  absl::StatusOr<std::unique_ptr<remote::RemoteStore>> remote_store = OpenRemote(config.remote);
  if (!remote_store.ok()) return Fail("remote tier", remote_store.status());
  if (*remote_store != nullptr) CKPT_LOG(INFO) << "remote tier: " << (*remote_store)->Describe();

  std::optional<remote::RemoteKey> remote_key;
  if (*remote_store != nullptr) {
    absl::StatusOr<remote::RemoteKey> key = remote::RemoteKey::FromFile(config.remote.key_file);
    if (!key.ok()) return Fail("remote tier key", key.status());
    remote_key = *std::move(key);
    CKPT_LOG(INFO) << "remote tier: signing with the cluster key " << remote_key->Fingerprint();
  }

  EngineOptions eo = config.engine;
  eo.remote = remote_store->get();
  eo.remote_key = remote_key.has_value() ? &*remote_key : nullptr;
  eo.data_dir = config.data_dir;
  eo.metrics = &metrics;
  eo.metrics_address = metrics_address;
  Engine engine(eo, index->get(), &store, pool->get());
  engine.RecordReconcile(*report);
  if (absl::Status s = engine.Start(); !s.ok()) return Fail("engine", s);
  CKPT_LOG(INFO) << "io backend: " << engine.io_backend_name();

  // Socket directories: created 0750 when missing (systemd's RuntimeDirectory
  // does this in production).
  for (const std::string& sock : {config.socket, config.HandoverSocketPath()}) {
    auto slash = sock.rfind('/');
    if (slash == std::string::npos || slash == 0) continue;
    absl::StatusOr<UniqueFd> dir = fs->MakeDirs(sock.substr(0, slash));
    if (!dir.ok()) return Fail("socket directory", dir.status());
    if (absl::Status s = CheckSocketDirectory(dir->get(), sock.substr(0, slash)); !s.ok()) {
      return Fail("socket directory", s);
    }
  }

  HandoverOptions ho = config.handover;
  ho.socket_path = config.HandoverSocketPath();
  HandoverServer handover(ho);
  if (absl::Status s = handover.Start(); !s.ok()) return Fail("handover socket", s);
  RpcServerOptions ro = config.rpc;
  ro.socket_path = config.socket;
  ro.config_text = DumpConfig(config, ConfigTitle::kEffective);
  RpcServer rpc(ro, &engine, &handover);
  // Hook runs are serialized, so the counters' last values need no lock.
  HandoverServer::Stats handover_seen;
  RpcServer::ConnectionStats rpc_seen;
  metrics.SetCollectHook([&engine, &handover, &rpc, &metrics, &handover_seen, &rpc_seen] {
    engine.CollectMetrics();
    const HandoverServer::Stats now = handover.stats();
    metrics.Set(Gauge::kHandoverFdsHeld, static_cast<double>(now.fds_held));
    metrics.Inc(Counter::kHandoverRefused, static_cast<double>(now.refused - handover_seen.refused));
    metrics.Inc(Counter::kHandoverAcceptErrors,
                static_cast<double>(now.accept_errors - handover_seen.accept_errors));
    handover_seen = now;
    const RpcServer::ConnectionStats conns = rpc.connection_stats();
    metrics.Inc(Counter::kRpcConnectionsRefused,
                static_cast<double>(conns.refused - rpc_seen.refused));
    metrics.Inc(Counter::kRpcAcceptErrors,
                static_cast<double>(conns.accept_errors - rpc_seen.accept_errors));
    rpc_seen = conns;
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

  int sig = 0;
  sigwait(&sigs, &sig);
  CKPT_LOG(INFO) << "signal " << sig << ": shutting down";
  NotifyStopping();
  watchdog.Stop();  // systemd disarms the watchdog once the unit is stopping
  const absl::Duration grace = config.shutdown_grace;
  // The engine first: it refuses new steps, wakes every waiter and lets the
  // writers finish staged versions; then the RPC server can stop quickly.
  engine.Shutdown(grace);
  metrics.SetCollectHook(nullptr);
  rpc.Shutdown(absl::Seconds(1));
  handover.Stop();
  ::unlink(config.socket.c_str());
  ::unlink(ho.socket_path.c_str());
  // Last: nothing writes the store or the index any more, every commit has
  // finished, so the next start may check the recorded files by name.
  if (absl::Status s = (*index)->MarkCleanStop(); !s.ok()) {
    CKPT_LOG(WARNING) << "could not record the clean stop (the next start checks every "
                         "recorded file's size): " << s;
  }
  CKPT_LOG(INFO) << "ckptd stopped";
  return 0;
}
