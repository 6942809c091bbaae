#include "daemon/config/config.h"

#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace ckpt {
namespace {

struct Option {
  const char* name;
  const char* help;
  std::function<absl::Status(const std::string&, DaemonConfig*)> set;
  std::function<std::string(const DaemonConfig&)> get;
};

template <typename T>
Option Num(const char* name, const char* help, T DaemonConfig::*field) {
  return Option{name, help,
                [name, field](const std::string& v, DaemonConfig* c) {
                  uint64_t x;
                  if (!absl::SimpleAtoi(v, &x) || x > static_cast<uint64_t>(~T{0})) {
                    return absl::InvalidArgumentError(
                        absl::StrCat("option ", name, ": '", v, "' is not a valid number"));
                  }
                  c->*field = static_cast<T>(x);
                  return absl::OkStatus();
                },
                [field](const DaemonConfig& c) { return absl::StrCat(c.*field); }};
}

Option Str(const char* name, const char* help, std::string DaemonConfig::*field) {
  return Option{name, help,
                [field](const std::string& v, DaemonConfig* c) {
                  c->*field = v;
                  return absl::OkStatus();
                },
                [field](const DaemonConfig& c) { return c.*field; }};
}

Option Bool(const char* name, const char* help, bool DaemonConfig::*field) {
  return Option{name, help,
                [name, field](const std::string& v, DaemonConfig* c) {
                  if (v == "true" || v == "1" || v == "yes") {
                    c->*field = true;
                  } else if (v == "false" || v == "0" || v == "no") {
                    c->*field = false;
                  } else {
                    return absl::InvalidArgumentError(
                        absl::StrCat("option ", name, ": '", v, "' is not true or false"));
                  }
                  return absl::OkStatus();
                },
                [field](const DaemonConfig& c) { return std::string(c.*field ? "true" : "false"); }};
}

const std::vector<Option>& Options() {
  static const std::vector<Option>* options = new std::vector<Option>{
      Str("socket", "gRPC Unix socket (created 0660; its directory 0750)", &DaemonConfig::socket),
      Str("handover_socket", "Unix socket for passing memfd regions; empty = <socket>.fds",
          &DaemonConfig::handover_socket),
      Str("data_dir", "where layer versions and the RocksDB index live", &DaemonConfig::data_dir),
      Num("staging_pool_bytes",
          "node-wide pinned staging memory; every layer must fit; never grows",
          &DaemonConfig::staging_pool_bytes),
      Num("staging_chunk_bytes", "staging allocation unit and I/O size (multiple of 4096)",
          &DaemonConfig::staging_chunk_bytes),
      Bool("lock_staging_memory", "mlock the staging pool (needs LimitMEMLOCK)",
           &DaemonConfig::lock_staging_memory),
      Num("writer_threads", "layer versions written concurrently", &DaemonConfig::writer_threads),
      Num("snapshot_threads", "ranks snapshotted concurrently", &DaemonConfig::snapshot_threads),
      Str("io_backend", "auto | io_uring | pwrite (auto falls back to pwrite)",
          &DaemonConfig::io_backend),
      Num("io_queue_depth", "chunk writes in flight per writer", &DaemonConfig::io_queue_depth),
      Bool("direct_io", "O_DIRECT for layer files (falls back where unsupported)",
           &DaemonConfig::direct_io),
      Num("admission_timeout_ms",
          "how long a snapshot waits for staging memory before the layer is skipped and counted",
          &DaemonConfig::admission_timeout_ms),
      Num("drain_timeout_ms", "how long a re-registration waits for the old one's writes",
          &DaemonConfig::drain_timeout_ms),
      Num("shutdown_grace_ms", "on SIGTERM, how long staged versions may still be written",
          &DaemonConfig::shutdown_grace_ms),
      Num("max_message_bytes", "largest gRPC message accepted", &DaemonConfig::max_message_bytes),
      Num("max_calls_per_uid", "calls one user may have in flight; more fail with RESOURCE_EXHAUSTED",
          &DaemonConfig::max_calls_per_uid),
      Num("max_heavy_calls", "verify, export and gc calls running at once, node-wide",
          &DaemonConfig::max_heavy_calls),
      Num("max_aux_bytes", "largest per-step aux blob (RNG, scheduler, data position)",
          &DaemonConfig::max_aux_bytes),
      Num("handover_token_ttl_s", "unclaimed handed-over regions are closed after this",
          &DaemonConfig::handover_token_ttl_s),
      Num("drift_threads", "CPU threads of the LayerCheck drift kernel per snapshot",
          &DaemonConfig::drift_threads),
      Num("keep_last_events",
          "retention: the composite plans of the newest N checkpoint events stay restorable",
          &DaemonConfig::keep_last_events),
      Num("keep_every_steps",
          "retention: plans at steps that are multiples of M stay restorable (0 = off)",
          &DaemonConfig::keep_every_steps),
      Num("keep_hours", "retention: plans of events younger than T hours stay restorable (0 = off)",
          &DaemonConfig::keep_hours),
      Num("gc_interval_s", "how often retention runs over every job (0 = only `ckptctl gc`)",
          &DaemonConfig::gc_interval_s),
      Num("max_disk_bytes",
          "bound on committed version bytes; past it new versions fail, counted (0 = none)",
          &DaemonConfig::max_disk_bytes),
      Num("min_free_disk_bytes",
          "new versions fail while the data file system has less free (RocksDB keeps room)",
          &DaemonConfig::min_free_disk_bytes),
      Str("metrics_address",
          "Prometheus endpoint host:port (empty = off; a bind failure is a warning)",
          &DaemonConfig::metrics_address),
      Num("max_layer_series", "cap on per-layer metric series (job, rank, layer) exported",
          &DaemonConfig::max_layer_series),
  };
  return *options;
}

}  // namespace

absl::Status DaemonConfig::Validate() const {
  if (socket.empty() || data_dir.empty()) return absl::InvalidArgumentError("socket and data_dir must be set");
  if (staging_chunk_bytes == 0 || staging_chunk_bytes % 4096 != 0) {
    return absl::InvalidArgumentError("staging_chunk_bytes must be a positive multiple of 4096");
  }
  if (staging_pool_bytes < staging_chunk_bytes) {
    return absl::InvalidArgumentError("staging_pool_bytes must hold at least one chunk");
  }
  if (writer_threads == 0 || writer_threads > 64 || snapshot_threads == 0 || snapshot_threads > 64) {
    return absl::InvalidArgumentError("writer_threads and snapshot_threads must be 1..64");
  }
  if (drift_threads == 0 || drift_threads > 256) {
    return absl::InvalidArgumentError("drift_threads must be 1..256");
  }
  if (io_queue_depth == 0 || io_queue_depth > 4096) {
    return absl::InvalidArgumentError("io_queue_depth must be 1..4096");
  }
  if (io_backend != "auto" && io_backend != "io_uring" && io_backend != "pwrite") {
    return absl::InvalidArgumentError("io_backend must be auto, io_uring or pwrite");
  }
  if (max_message_bytes < 4096) return absl::InvalidArgumentError("max_message_bytes too small");
  if (max_calls_per_uid == 0 || max_heavy_calls == 0) {
    return absl::InvalidArgumentError("max_calls_per_uid and max_heavy_calls must be at least 1");
  }
  return absl::OkStatus();
}

absl::Status SetConfigOption(const std::string& key, const std::string& value, DaemonConfig* config) {
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
      return absl::InvalidArgumentError(absl::StrCat("config line ", line_no, ": expected key = value"));
    }
    std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    absl::Status s = SetConfigOption(key, value, config);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("config line ", line_no, ": ", s.message()));
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

std::string DumpConfig(const DaemonConfig& config) {
  std::string out =
      "# ckptd configuration. Generated by `ckptd --dump-default-config`; every\n"
      "# option is shown with its default. Flags (--key=value) override this file.\n";
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
