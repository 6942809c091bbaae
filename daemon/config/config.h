// DaemonConfig: every ckptd option, declared once.
//
// Each option's default lives in the options struct of the subsystem that
// uses it (StagingPoolOptions, EngineOptions, HandoverOptions,
// RpcServerOptions) or, for the daemon's own settings, in DaemonConfig below;
// DaemonConfig holds those structs, so main() hands each subsystem its
// struct as configured. One table (kOptions in config.cc) gives every option
// its name, documentation and bounds, and drives the config file, the
// command-line flags, `ckptd --help`, `ckptd --dump-default-config` (the
// shipped deploy/ckptd.conf, checked in CI) and the effective configuration
// `ckptctl config` shows.
//
// File format: one `key = value` per line, `#` starts a comment. Flags:
// `--key=value`; flags override the file. Durations are integers in the unit
// their name ends with (_ms, _s). Validate() checks every bound and the
// rules between options.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/engine/engine.h"
#include "daemon/peer/peer_node.h"
#include "daemon/rpc/server.h"
#include "daemon/shm/handover.h"
#include "daemon/staging/staging_pool.h"

namespace ckpt {

// The remote tier (docs/remote.md): where main() points ckptd's RemoteStore.
struct RemoteConfig {
  std::string kind = "none";  // none, s3 or posix
  std::string path;           // posix: the shared directory
  std::string endpoint;       // s3: http(s)://host[:port]
  std::string bucket;
  std::string region = "us-east-1";
  std::string prefix;            // s3: prepended to every key
  std::string credentials_file;  // s3: access_key_id / secret_access_key (mode 0600)
  // The cluster key that signs what goes to the remote tier (remote_auth.h);
  // the same file on every node (mode 0600).
  std::string key_file;
  bool path_style = true;                    // s3: endpoint/bucket/key rather than bucket.host/key
  std::string ca_file;                       // s3 over https: a CA bundle instead of the system's
  uint64_t part_bytes = uint64_t{16} << 20;  // s3 multipart part size
  uint32_t parallel_parts = 4;               // s3 parts in flight per object
};

struct DaemonConfig {
  // The daemon's own settings.
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string handover_socket;  // empty: <socket>.fds
  std::string data_dir = "/var/lib/ckptd";
  bool direct_io = true;
  absl::Duration shutdown_grace = absl::Seconds(10);
  // Loopback: the endpoint names every job; expose it deliberately.
  std::string metrics_address = "127.0.0.1:9464";
  uint32_t max_layer_series = Metrics::kDefaultMaxLayerSeries;

  // The subsystems' options, defaults declared with each struct.
  StagingPoolOptions staging;
  EngineOptions engine;
  HandoverOptions handover;
  RpcServerOptions rpc;
  RemoteConfig remote;
  // Peer replication (docs/peer.md): the replica service and the peer tier.
  peer::PeerConfig peer;
  // The memory tier's budget (EngineOptions::memory_tier_bytes); unset =
  // "auto": half of the staging pool, whole chunks.
  std::optional<uint64_t> memory_tier_bytes;

  absl::Status Validate() const;
  uint64_t MemoryTierBytes() const {
    if (memory_tier_bytes.has_value()) return *memory_tier_bytes;
    return staging.budget_bytes / 2 / staging.chunk_bytes * staging.chunk_bytes;
  }
  std::string HandoverSocketPath() const {
    return handover_socket.empty() ? socket + ".fds" : handover_socket;
  }
};

// Applies the `key = value` lines of `text` (a config file's contents).
absl::Status ParseConfigText(const std::string& text, DaemonConfig* config);
absl::Status LoadConfigFile(const std::string& path, DaemonConfig* config);
// Sets one option by name; INVALID_ARGUMENT for an unknown key or a value
// that is not of the option's type (bounds are Validate's).
absl::Status SetConfigOption(const std::string& key, const std::string& value,
                             DaemonConfig* config);

// The config file text: every option with its documentation and value.
// kDefaults titles it as the shipped default file, kEffective as the
// configuration a running ckptd uses.
enum class ConfigTitle { kDefaults, kEffective };
std::string DumpConfig(const DaemonConfig& config, ConfigTitle title = ConfigTitle::kDefaults);
// One line per option for --help.
std::string ConfigHelp();

}  // namespace ckpt
