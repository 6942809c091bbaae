// DaemonConfig: every ckptd option, its default and its documentation.
//
// One table (kOptions in config.cc) drives parsing of the config file, the
// command-line flags and `ckptd --dump-default-config`, so the three cannot
// drift apart. File format: one `key = value` per line, `#` starts a comment.
// Flags: `--key=value`; flags override the file. Validate() checks ranges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ckpt {

struct DaemonConfig {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string handover_socket;  // empty: <socket>.fds
  std::string data_dir = "/var/lib/ckptd";
  uint64_t staging_pool_bytes = uint64_t{1} << 30;
  uint64_t staging_chunk_bytes = uint64_t{4} << 20;
  bool lock_staging_memory = true;
  uint32_t writer_threads = 2;
  uint32_t snapshot_threads = 1;
  std::string io_backend = "auto";
  uint32_t io_queue_depth = 16;
  bool direct_io = true;
  uint32_t admission_timeout_ms = 2000;
  uint32_t drain_timeout_ms = 60000;
  uint32_t shutdown_grace_ms = 10000;
  uint32_t max_message_bytes = 64 << 20;
  uint32_t max_calls_per_uid = 64;
  uint32_t max_heavy_calls = 4;
  uint32_t max_aux_bytes = 1 << 20;
  uint32_t handover_token_ttl_s = 120;
  uint32_t drift_threads = 2;
  uint64_t keep_last_events = 50;
  uint64_t keep_every_steps = 1000;
  uint64_t keep_hours = 0;
  uint32_t gc_interval_s = 300;
  uint64_t max_disk_bytes = 0;
  uint64_t min_free_disk_bytes = 64 << 20;
  std::string metrics_address = "0.0.0.0:9464";
  uint32_t max_layer_series = 4096;

  absl::Status Validate() const;
  std::string HandoverSocketPath() const {
    return handover_socket.empty() ? socket + ".fds" : handover_socket;
  }
};

// Applies the `key = value` lines of `text` (a config file's contents).
absl::Status ParseConfigText(const std::string& text, DaemonConfig* config);
absl::Status LoadConfigFile(const std::string& path, DaemonConfig* config);
// Sets one option by name; INVALID_ARGUMENT for an unknown key or bad value.
absl::Status SetConfigOption(const std::string& key, const std::string& value, DaemonConfig* config);
// The config file text: every option with its documentation and value.
std::string DumpConfig(const DaemonConfig& config);
// One line per option for --help.
std::string ConfigHelp();

}  // namespace ckpt
