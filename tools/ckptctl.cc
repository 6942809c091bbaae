// ckptctl: the operator CLI of ckptd. Talks to the daemon's ckpt.v1.Admin
// service over its Unix socket and prints human tables or, with --json, one
// JSON document built field by field (stable names, numbers as numbers).
// Text from the daemon or the command line (names, ids, messages, paths) is
// printed through TerminalSafe() (tools/terminal_text.h), so no control
// character reaches the terminal; --json escapes through the JSON encoder.
// Run `ckptctl --help` for commands, flags and exit codes.
#include <grpcpp/grpcpp.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "daemon/io/file_system.h"
#include "daemon/store/repair.h"
#include "nlohmann/json.hpp"
#include "tools/export_writer.h"
#include "tools/terminal_text.h"

namespace {

namespace v1 = ::ckpt::v1;
using Json = nlohmann::ordered_json;  // keeps the proto's field order
using ckpt::TerminalSafe;

constexpr char kDefaultSocket[] = "/run/ckptd/ckptd.sock";
constexpr double kDefaultTimeoutSeconds = 10;

// Exit codes (also in the usage text).
constexpr int kExitOk = 0;
constexpr int kExitDaemonError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;
constexpr int kExitCorrupt = 4;
constexpr int kExitLocalError = 5;

constexpr char kUsage[] = R"(usage: ckptctl [FLAGS] COMMAND [ARGS] [FLAGS]

Inspects a running ckptd through its Admin API. Flags may appear before or
after the command; values are given as --flag=VALUE or --flag VALUE.

Commands:
  status                  daemon status: version, data directory, I/O backend,
                          staging pool use, commit and error counters, uptime
  jobs                    every job the caller may see, with its ranks
  layers JOB [--rank=R]   per-layer table of one rank: size, newest durable
                          version, staleness against the rank's latest durable
                          step, number of stored versions
  history JOB [--rank=R] [--layer=L] [--limit=N]
                          checkpoint events of one rank, newest first as the
                          daemon returns them; --layer keeps the events that
                          persisted layer L, --limit caps the count (0 = all)
  plan JOB [--rank=R] [--step=N]
                          the composite restore plan at step N (0 or absent =
                          latest durable step): which version of each layer
                          would be restored and how stale it is
  gc JOB [--dry-run]      apply the retention policy to the job: delete the
                          versions and events no retained target needs (a
                          layer's newest version and everything the newest
                          plans use are always kept); --dry-run only reports
  export JOB --out=DIR [--step=N] [--rank=R]
                          write the composite checkpoint of every rank (or one)
                          as DIR/rank-NNNNN.safetensors plus DIR/manifest.json
                          with each rank's plan; readable without ckptd
  restore JOB --out=DIR [--rank=R] [--step=N]
                          the same for one rank (default 0): for restoring a
                          rank that is not running (a running rank restores
                          through its client into its own buffers)
  release JOB [--rank=R]  end the rank's registration without its trainer
                          (one that exited, or is stuck): its memory is
                          released after its staged versions are written
  delete JOB              delete the job and its whole history (every version,
                          event and rank); the job id is free again. Refused
                          while a rank is registered by a running trainer
                          (stop it or release the rank first)
  config                  the daemon's effective configuration
  verify JOB [--rank=R] [--deep]
                          check every committed version of the job (or of one
                          rank): that its file exists whole, and with --deep
                          re-read it and check every checksum; lists failures
                          and exits 4 when any version does not verify
  repair --data-dir=DIR [--owner-uid=UID]
                          offline, with ckptd stopped (refused while it holds
                          DIR/index/ckptd.lock): rebuild the index from the
                          self-describing layer files in DIR/jobs and
                          DIR/quarantine, so every version whose file verifies
                          is restorable again; an index that does not open is
                          kept as DIR/index.damaged-<time>. Events' aux blobs
                          and learning rates are not in the files and are not
                          recovered; jobs without a record get owner UID
                          (default 0, root). Nothing is deleted
  help [COMMAND]          this text

Global flags:
  --socket=PATH           daemon socket (default $CKPT_SOCKET, else
                          /run/ckptd/ckptd.sock)
  --timeout=SECONDS       deadline of the call (default 10; fractions allowed)
  --json                  print one JSON document on stdout instead of tables
                          (sizes as raw byte counts, field names as in the
                          ckpt.v1 proto, snake_case)
  -h, --help              this text

Command flags (decimal integers):
  --rank=R                rank of the job (default 0)
  --layer=L               layer id (history only)
  --limit=N               most events to print (history only; default 0 = all)
  --step=N                target step (plan, export, restore; default 0 = latest)
  --out=DIR               output directory (export, restore; created if missing)
  --dry-run               report only (gc)
  --deep                  read every byte and check checksums (verify)
  --data-dir=DIR          ckptd's data directory (repair only)
  --owner-uid=UID         owner of jobs repair recreates (repair only)

Exit codes:
  0  success
  1  the daemon returned an error (printed as "ckptctl: CODE: message")
  2  usage error (unknown command or flag, bad number, missing argument)
  3  daemon unreachable (UNAVAILABLE, or DEADLINE_EXCEEDED before a
     connection was made)
  4  verify found versions that do not verify (checksum, size, missing file)
  5  a local file or directory could not be created or written (export,
     restore), or repair failed or was refused
)";

// ---- argument parsing ----

struct Options {
  std::string socket;
  double timeout_seconds = kDefaultTimeoutSeconds;
  bool json = false;
  bool help = false;
  std::string command;
  std::vector<std::string> positional;  // after the command
  std::optional<uint32_t> rank;
  std::optional<int64_t> layer;
  std::optional<uint32_t> limit;
  std::optional<uint64_t> step;
  std::string out;
  bool dry_run = false;
  bool deep = false;
  std::string data_dir;
  std::optional<uint32_t> owner_uid;
};

// Prints a usage error and returns kExitUsage.
int UsageError(absl::string_view msg) {
  std::fprintf(stderr, "ckptctl: %s\nRun 'ckptctl --help' for usage.\n", TerminalSafe(msg).c_str());
  return kExitUsage;
}

// Strict unsigned decimal: digits only, no sign, no spaces, no overflow.
template <typename T>
bool ParseUnsigned(absl::string_view s, T max, T* out) {
  if (s.empty() || s.size() > 20) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v > static_cast<uint64_t>(max)) return false;
  *out = static_cast<T>(v);
  return true;
}

// Seconds: decimal digits with an optional fraction, > 0 and at most a day.
bool ParseSeconds(absl::string_view s, double* out) {
  if (s.empty()) return false;
  int dots = 0;
  for (char c : s) {
    if (c == '.') {
      ++dots;
    } else if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  double v = 0;
  if (dots > 1 || s == "." || !absl::SimpleAtod(s, &v)) return false;
  if (!std::isfinite(v) || v <= 0 || v > 86400) return false;
  *out = v;
  return true;
}

// Fills `o` from argv. Returns kExitOk or the exit code of a usage error.
int ParseArgs(int argc, char** argv, Options* o) {
  const char* env = std::getenv("CKPT_SOCKET");
  o->socket = (env != nullptr && env[0] != '\0') ? env : kDefaultSocket;
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (flags_done || !absl::StartsWith(arg, "-") || arg == "-") {
      if (o->command.empty()) {
        o->command = std::string(arg);
      } else {
        o->positional.emplace_back(arg);
      }
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    if (arg == "-h" || arg == "--help") {
      o->help = true;
      continue;
    }
    if (arg == "--json") {
      o->json = true;
      continue;
    }
    if (absl::StartsWith(arg, "--json=")) return UsageError("--json takes no value");
    if (arg == "--dry-run") {
      o->dry_run = true;
      continue;
    }
    if (arg == "--deep") {
      o->deep = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--")) return UsageError(absl::StrCat("unknown flag '", arg, "'"));
    std::string name, value;
    size_t eq = arg.find('=');
    if (eq != absl::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
    } else {
      name = std::string(arg);
      if (name != "--socket" && name != "--timeout" && name != "--rank" && name != "--layer" &&
          name != "--limit" && name != "--step" && name != "--out" && name != "--data-dir" &&
          name != "--owner-uid") {
        return UsageError(absl::StrCat("unknown flag '", name, "'"));
      }
      if (i + 1 >= argc) return UsageError(absl::StrCat(name, " needs a value"));
      value = argv[++i];
    }
    auto bad = [&](absl::string_view what) {
      return UsageError(absl::StrCat("bad value '", value, "' for ", name, ": expected ", what));
    };
    if (name == "--socket") {
      if (value.empty()) return bad("a path");
      o->socket = value;
    } else if (name == "--timeout") {
      if (!ParseSeconds(value, &o->timeout_seconds)) return bad("seconds in (0, 86400]");
    } else if (name == "--rank") {
      uint32_t v;
      if (!ParseUnsigned<uint32_t>(value, UINT32_MAX, &v)) return bad("a rank (0..4294967295)");
      o->rank = v;
    } else if (name == "--layer") {
      uint32_t v;
      if (!ParseUnsigned<uint32_t>(value, UINT32_MAX, &v)) return bad("a layer id (0..4294967295)");
      o->layer = v;
    } else if (name == "--limit") {
      uint32_t v;
      if (!ParseUnsigned<uint32_t>(value, UINT32_MAX, &v)) return bad("a count (0..4294967295)");
      o->limit = v;
    } else if (name == "--out") {
      if (value.empty()) return bad("a directory");
      o->out = value;
    } else if (name == "--data-dir") {
      if (value.empty()) return bad("a directory");
      o->data_dir = value;
    } else if (name == "--owner-uid") {
      uint32_t v;
      if (!ParseUnsigned<uint32_t>(value, UINT32_MAX, &v)) return bad("a uid");
      o->owner_uid = v;
    } else if (name == "--step") {
      uint64_t v;
      if (!ParseUnsigned<uint64_t>(value, UINT64_MAX, &v)) return bad("a step number");
      o->step = v;
    } else {
      return UsageError(absl::StrCat("unknown flag '", name, "'"));
    }
  }
  return kExitOk;
}

// Checks that the command got exactly the arguments and flags it takes.
int ValidateCommand(const Options& o) {
  const std::string& c = o.command;
  size_t want_args = 0;
  bool rank_ok = false, layer_ok = false, limit_ok = false, step_ok = false;
  if (c == "status" || c == "jobs") {
  } else if (c == "layers") {
    want_args = 1;
    rank_ok = true;
  } else if (c == "history") {
    want_args = 1;
    rank_ok = layer_ok = limit_ok = true;
  } else if (c == "plan") {
    want_args = 1;
    rank_ok = step_ok = true;
  } else if (c == "gc" || c == "delete") {
    want_args = 1;
  } else if (c == "release") {
    want_args = 1;
    rank_ok = true;
  } else if (c == "export" || c == "restore") {
    want_args = 1;
    rank_ok = step_ok = true;
    if (o.out.empty()) return UsageError(absl::StrCat(c, ": --out=DIR is required"));
  } else if (c == "config") {
  } else if (c == "repair") {
    if (o.data_dir.empty()) return UsageError("repair: --data-dir=DIR is required");
  } else if (c == "verify") {
    want_args = 1;
    rank_ok = true;
  } else {
    return UsageError(absl::StrCat("unknown command '", c, "'"));
  }
  if (o.positional.size() < want_args) return UsageError(absl::StrCat(c, ": missing JOB"));
  if (o.positional.size() > want_args) {
    return UsageError(absl::StrCat(c, ": unexpected argument '", o.positional[want_args], "'"));
  }
  if (want_args == 1 && o.positional[0].empty()) return UsageError(absl::StrCat(c, ": empty JOB"));
  auto reject = [&](bool given, bool ok, const char* flag) {
    return given && !ok ? UsageError(absl::StrCat(flag, " is not valid for '", c, "'")) : kExitOk;
  };
  for (int rc : {reject(o.rank.has_value(), rank_ok, "--rank"),
                 reject(o.layer.has_value(), layer_ok, "--layer"),
                 reject(o.limit.has_value(), limit_ok, "--limit"),
                 reject(o.step.has_value(), step_ok, "--step"),
                 reject(!o.data_dir.empty(), c == "repair", "--data-dir"),
                 reject(o.owner_uid.has_value(), c == "repair", "--owner-uid")}) {
    if (rc != kExitOk) return rc;
  }
  return kExitOk;
}

// ---- formatting helpers ----

std::string HumanBytes(uint64_t b) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (b < 1024) return absl::StrCat(b, " B");
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

std::string StepOrDash(uint64_t step) { return step == 0 ? "-" : absl::StrCat(step); }

const char* KindName(v1::LayerKind k) {
  switch (k) {
    case v1::LAYER_EMBEDDING:
      return "embedding";
    case v1::LAYER_BLOCK:
      return "block";
    case v1::LAYER_NORM:
      return "norm";
    case v1::LAYER_HEAD:
      return "head";
    default:
      return "other";
  }
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

// Layer ids as ranges ("0-3,5,7-9"); cut at an element boundary with a count
// of the rest when longer than `max_chars`.
std::string LayerList(const google::protobuf::RepeatedField<uint32_t>& layers, size_t max_chars) {
  std::vector<std::string> parts;
  for (int i = 0; i < layers.size();) {
    int j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(layers[i]) : absl::StrCat(layers[i], "-", layers[j]));
    i = j + 1;
  }
  if (parts.empty()) return "-";
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    std::string next = out.empty() ? parts[k] : absl::StrCat(out, ",", parts[k]);
    if (next.size() > max_chars && k > 0) {
      return absl::StrCat(out, ",... (", layers.size(), " layers)");
    }
    out = std::move(next);
  }
  return out;
}

// A plain text table: columns separated by two spaces; numeric columns
// right-aligned.
class Table {
 public:
  Table(std::vector<std::string> headers, std::vector<bool> right)
      : headers_(std::move(headers)), right_(std::move(right)) {}
  // Every cell is stored terminal-safe, so widths are those printed.
  void Add(std::vector<std::string> row) {
    for (std::string& cell : row) cell = TerminalSafe(cell);
    rows_.push_back(std::move(row));
  }
  void Print() const {
    std::vector<size_t> w(headers_.size());
    for (size_t c = 0; c < w.size(); ++c) {
      w[c] = headers_[c].size();
      for (const auto& r : rows_) w[c] = std::max(w[c], r[c].size());
    }
    auto line = [&](const std::vector<std::string>& r) {
      std::string s;
      for (size_t c = 0; c < w.size(); ++c) {
        if (c > 0) s += "  ";
        std::string pad(w[c] - r[c].size(), ' ');
        bool last = c + 1 == w.size();
        s += right_[c] ? pad + r[c] : (last ? r[c] : r[c] + pad);
      }
      std::printf("%s\n", s.c_str());
    };
    line(headers_);
    for (const auto& r : rows_) line(r);
  }

 private:
  std::vector<std::string> headers_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

void PrintKv(const std::vector<std::pair<std::string, std::string>>& kv) {
  size_t w = 0;
  for (const auto& [k, v] : kv) w = std::max(w, k.size());
  for (const auto& [k, v] : kv) {
    std::printf("%s:%s %s\n", k.c_str(), std::string(w - k.size(), ' ').c_str(),
                TerminalSafe(v).c_str());
  }
}

// JSON text that is printable ASCII: the encoder escapes C0 controls and,
// with ensure_ascii, everything above 0x7f (C1 controls included); invalid
// UTF-8 becomes U+FFFD instead of an exception; DEL, which JSON allows raw,
// can only occur inside a string and is escaped there.
std::string JsonText(const Json& j) {
  std::string text = j.dump(2, ' ', /*ensure_ascii=*/true, Json::error_handler_t::replace);
  return absl::StrReplaceAll(text, {{"\x7f", "\\u007f"}});
}

void PrintJson(const Json& j) { std::printf("%s\n", JsonText(j).c_str()); }

std::string BytesWithRaw(uint64_t b) {
  return b < 1024 ? HumanBytes(b) : absl::StrCat(HumanBytes(b), " (", b, ")");
}

// ---- commands ----

class Ctl {
 public:
  explicit Ctl(const Options& o)
      : o_(o),
        channel_(grpc::CreateChannel("unix:" + o.socket, grpc::InsecureChannelCredentials())),
        stub_(v1::Admin::NewStub(channel_)) {}

  int Run() {
    const std::string& c = o_.command;
    if (c == "status") return Status();
    if (c == "jobs") return Jobs();
    if (c == "layers") return Layers();
    if (c == "history") return History();
    if (c == "plan") return Plan();
    if (c == "verify") return Verify();
    if (c == "gc") return Gc();
    if (c == "release") return Release();
    if (c == "delete") return Delete();
    if (c == "export" || c == "restore") return Export(c == "restore");
    if (c == "config") return Config();
    return UsageError(absl::StrCat("unknown command '", c, "'"));
  }

 private:
  // Runs one unary Admin call with the deadline; returns the exit code.
  // A call that could not connect is tried again, until the deadline, while
  // ckptd is there but busy: its listen queue full for a moment (another
  // user connecting faster than ckptd accepts), or this connection closed at
  // once for a connection cap. A socket nobody listens on fails at once.
  template <typename Req, typename Reply, typename Fn>
  int Call(Fn fn, const Req& req, Reply* reply) {
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(o_.timeout_seconds * 1e6));
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline);
      const grpc::Status s = (stub_.get()->*fn)(&ctx, req, reply);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE || !DaemonListening() ||
          std::chrono::system_clock::now() + pause >= deadline) {
        return Report(s);
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
    }
  }

  // True when something listens on the socket, even with a full queue
  // (a non-blocking connect then fails with EAGAIN).
  bool DaemonListening() const {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (o_.socket.size() >= sizeof(addr.sun_path)) return false;
    std::memcpy(addr.sun_path, o_.socket.data(), o_.socket.size());
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    const int err = errno;
    ::close(fd);
    return rc == 0 || err == EAGAIN;
  }

  // Prints a failed call's status; returns the exit code for it.
  int Report(const grpc::Status& s) {
    if (s.ok()) return kExitOk;
    const bool unreachable =
        s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
         channel_->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY);
    if (unreachable) {
      std::fprintf(stderr, "ckptctl: cannot reach ckptd at %s: %s: %s\n",
                   TerminalSafe(o_.socket).c_str(), CodeName(s.error_code()),
                   TerminalSafe(s.error_message()).c_str());
      return kExitUnreachable;
    }
    std::fprintf(stderr, "ckptctl: %s: %s\n", CodeName(s.error_code()),
                 TerminalSafe(s.error_message()).c_str());
    return kExitDaemonError;
  }

  int Status() {
    v1::StatusReply r;
    if (int rc = Call(&v1::Admin::Stub::Status, v1::StatusRequest(), &r); rc != kExitOk) return rc;
    if (o_.json) {
      PrintJson(Json{{"version", r.version()},
                     {"data_dir", r.data_dir()},
                     {"io_backend", r.io_backend()},
                     {"pool_bytes", r.pool_bytes()},
                     {"pool_bytes_in_use", r.pool_bytes_in_use()},
                     {"registered_ranks", r.registered_ranks()},
                     {"jobs", r.jobs()},
                     {"versions_committed", r.versions_committed()},
                     {"bytes_committed", r.bytes_committed()},
                     {"snapshots_skipped", r.snapshots_skipped()},
                     {"write_errors", r.write_errors()},
                     {"uptime_seconds", r.uptime_seconds()},
                     {"orphan_files_quarantined", r.orphan_files_quarantined()},
                     {"files_quarantined", r.files_quarantined()},
                     {"dangling_records_removed", r.dangling_records_removed()},
                     {"temp_files_removed", r.temp_files_removed()},
                     {"metrics_address", r.metrics_address()},
                     {"disk_bytes_used", r.disk_bytes_used()},
                     {"disk_bytes_limit", r.disk_bytes_limit()},
                     {"gpu", r.gpu()},
                     {"open_gpu_mappings", r.open_gpu_mappings()},
                     {"open_gpu_mapping_bytes", r.open_gpu_mapping_bytes()},
                     {"remote", r.remote()},
                     {"remote_lag_steps", r.remote_lag_steps()},
                     {"remote_lag_bytes", r.remote_lag_bytes()},
                     {"remote_error", r.remote_error()}});
      return kExitOk;
    }
    std::string in_use = BytesWithRaw(r.pool_bytes_in_use());
    if (r.pool_bytes() > 0) {
      absl::StrAppendFormat(&in_use, ", %.1f%%", 100.0 * r.pool_bytes_in_use() / r.pool_bytes());
    }
    PrintKv({
        {"version", OrDash(r.version())},
        {"data_dir", OrDash(r.data_dir())},
        {"io_backend", OrDash(r.io_backend())},
        {"pool_bytes", BytesWithRaw(r.pool_bytes())},
        {"pool_bytes_in_use", in_use},
        {"registered_ranks", absl::StrCat(r.registered_ranks())},
        {"jobs", absl::StrCat(r.jobs())},
        {"versions_committed", absl::StrCat(r.versions_committed())},
        {"bytes_committed", BytesWithRaw(r.bytes_committed())},
        {"snapshots_skipped", absl::StrCat(r.snapshots_skipped())},
        {"write_errors", absl::StrCat(r.write_errors())},
        {"uptime_seconds",
         absl::StrFormat("%.1f (%s)", r.uptime_seconds(),
                         absl::FormatDuration(absl::Seconds(std::floor(r.uptime_seconds()))))},
        {"orphan_files_quarantined", absl::StrCat(r.orphan_files_quarantined())},
        {"files_quarantined", absl::StrCat(r.files_quarantined())},
        {"dangling_records_removed", absl::StrCat(r.dangling_records_removed())},
        {"temp_files_removed", absl::StrCat(r.temp_files_removed())},
        {"gpu", OrDash(r.gpu())},
        {"open_gpu_mappings", absl::StrCat(r.open_gpu_mappings(), " (",
                                           BytesWithRaw(r.open_gpu_mapping_bytes()), ")")},
        {"metrics_address", r.metrics_address().empty() ? "- (off)" : r.metrics_address()},
        {"disk_bytes_used", BytesWithRaw(r.disk_bytes_used())},
        {"disk_bytes_limit", r.disk_bytes_limit() == 0 ? "- (no bound)"
                                                       : BytesWithRaw(r.disk_bytes_limit())},
        {"remote", OrDash(r.remote())},
        {"remote_lag", absl::StrCat(r.remote_lag_steps(), " steps, ",
                                    BytesWithRaw(r.remote_lag_bytes()))},
        {"remote_error", r.remote_error().empty() ? "-" : r.remote_error()},
    });
    return kExitOk;
  }

  int Jobs() {
    v1::JobsReply r;
    if (int rc = Call(&v1::Admin::Stub::Jobs, v1::JobsRequest(), &r); rc != kExitOk) return rc;
    if (o_.json) {
      Json jobs = Json::array();
      for (const v1::JobInfo& j : r.jobs()) {
        Json ranks = Json::array();
        for (const v1::RankInfo& k : j.ranks()) {
          ranks.push_back(Json{{"rank", k.rank()},
                               {"registered", k.registered()},
                               {"stale", k.stale()},
                               {"generation", k.generation()},
                               {"latest_durable_step", k.latest_durable_step()},
                               {"last_step_seen", k.last_step_seen()},
                               {"agreed_step", k.agreed_step()},
                               {"remote_step", k.remote_step()},
                               {"layers", k.layers()}});
        }
        jobs.push_back(Json{{"job_id", j.job_id()},
                            {"owner_uid", j.owner_uid()},
                            {"versions", j.versions()},
                            {"bytes", j.bytes()},
                            {"ranks", std::move(ranks)}});
      }
      PrintJson(Json{{"jobs", std::move(jobs)}});
      return kExitOk;
    }
    if (r.jobs().empty()) {
      std::printf("no jobs\n");
      return kExitOk;
    }
    Table t({"JOB", "OWNER", "RANKS", "REGISTERED", "STALE", "LATEST STEP", "AGREED STEP",
             "REMOTE STEP", "VERSIONS", "BYTES"},
            {false, true, true, true, true, true, true, true, true, true});
    for (const v1::JobInfo& j : r.jobs()) {
      // The job-wide latest step: the range over its ranks when they differ.
      uint64_t lo = UINT64_MAX, hi = 0, agreed = 0, remote = UINT64_MAX;
      int registered = 0, stale = 0;
      for (const v1::RankInfo& k : j.ranks()) {
        agreed = std::max(agreed, k.agreed_step());  // the newest agreement any rank reported
        remote = std::min(remote, k.remote_step());  // the step every rank has remotely
        stale += k.stale() ? 1 : 0;
        lo = std::min(lo, k.latest_durable_step());
        hi = std::max(hi, k.latest_durable_step());
        registered += k.registered() ? 1 : 0;
      }
      std::string latest = j.ranks().empty() ? "-"
                           : lo == hi        ? StepOrDash(lo)
                                             : absl::StrCat(StepOrDash(lo), "..", hi);
      t.Add({j.job_id(), absl::StrCat(j.owner_uid()), absl::StrCat(j.ranks_size()),
             absl::StrCat(registered), absl::StrCat(stale), latest, StepOrDash(agreed),
             StepOrDash(j.ranks().empty() ? 0 : remote), absl::StrCat(j.versions()),
             HumanBytes(j.bytes())});
    }
    t.Print();
    return kExitOk;
  }

  int Layers() {
    v1::LayersRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_rank(o_.rank.value_or(0));
    v1::LayersReply r;
    if (int rc = Call(&v1::Admin::Stub::Layers, req, &r); rc != kExitOk) return rc;
    const bool live_drift = r.s_max() > 0;  // a live layercheck registration
    if (o_.json) {
      Json layers = Json::array();
      for (const v1::LayerInfo& l : r.layers()) {
        Json j{{"layer", l.layer()},         {"name", l.name()},
               {"kind", KindName(l.kind())}, {"bytes", l.bytes()},
               {"last_step", l.last_step()}, {"staleness", l.staleness()},
               {"versions", l.versions()}, {"frozen", l.frozen()}};
        if (l.live()) {
          j["accumulated_drift"] = l.accumulated_drift();
          j["threshold"] = l.threshold();
          j["last_drift"] = l.last_drift();
        }
        layers.push_back(std::move(j));
      }
      Json out{{"job_id", r.job_id()},
               {"rank", r.rank()},
               {"latest_durable_step", r.latest_durable_step()},
               {"policy", r.policy()},
               {"layers", std::move(layers)}};
      if (live_drift) out["s_max"] = r.s_max();
      PrintJson(out);
      return kExitOk;
    }
    std::printf("job %s rank %u: latest durable step %s%s\n", TerminalSafe(r.job_id()).c_str(),
                r.rank(),
                r.latest_durable_step() == 0 ? "- (no history)"
                                             : absl::StrCat(r.latest_durable_step()).c_str(),
                r.policy().empty() ? ", not registered"
                                   : absl::StrCat(", policy ", TerminalSafe(r.policy()),
                                                  live_drift ? absl::StrCat(", S_max ", r.s_max())
                                                             : std::string())
                                         .c_str());
    std::vector<std::string> head = {"LAYER", "NAME", "KIND", "BYTES", "LAST STEP", "STALENESS",
                                     "VERSIONS"};
    std::vector<bool> right = {true, false, false, true, true, true, true};
    if (live_drift) {
      for (const char* h : {"DRIFT", "ACC DRIFT", "THRESHOLD"}) {
        head.push_back(h);
        right.push_back(true);
      }
    }
    Table t(head, right);
    for (const v1::LayerInfo& l : r.layers()) {
      bool never = l.last_step() == 0;
      const std::string kind =
          l.frozen() ? absl::StrCat(KindName(l.kind()), " (frozen)") : KindName(l.kind());
      std::vector<std::string> row = {absl::StrCat(l.layer()), OrDash(l.name()), kind,
                                      HumanBytes(l.bytes()), StepOrDash(l.last_step()),
                                      never ? "-" : absl::StrCat(l.staleness()),
                                      absl::StrCat(l.versions())};
      if (live_drift) {
        row.push_back(absl::StrFormat("%.2e", l.last_drift()));
        row.push_back(absl::StrFormat("%.2e", l.accumulated_drift()));
        row.push_back(absl::StrFormat("%.2e", l.threshold()));
      }
      t.Add(row);
    }
    t.Print();
    return kExitOk;
  }

  int History() {
    v1::HistoryRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_rank(o_.rank.value_or(0));
    req.set_layer(o_.layer.value_or(-1));
    req.set_limit(o_.limit.value_or(0));
    v1::HistoryReply r;
    if (int rc = Call(&v1::Admin::Stub::History, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      Json events = Json::array();
      for (const v1::HistoryEvent& e : r.events()) {
        std::vector<uint32_t> layers(e.layers().begin(), e.layers().end());
        events.push_back(Json{{"step", e.step()},
                              {"layers", std::move(layers)},
                              {"bytes", e.bytes()},
                              {"failed", e.failed()},
                              {"skipped", e.skipped()},
                              {"remote", e.remote()}});
      }
      PrintJson(Json{{"events", std::move(events)}});
      return kExitOk;
    }
    if (r.events().empty()) {
      std::printf("no events\n");
      return kExitOk;
    }
    Table t({"STEP", "LAYERS", "BYTES", "FAILED", "SKIPPED", "REMOTE"},
            {true, false, true, true, true, false});
    for (const v1::HistoryEvent& e : r.events()) {
      t.Add({absl::StrCat(e.step()), LayerList(e.layers(), 40), HumanBytes(e.bytes()),
             absl::StrCat(e.failed()), absl::StrCat(e.skipped()), e.remote() ? "yes" : "-"});
    }
    t.Print();
    return kExitOk;
  }

  int Plan() {
    v1::PlanRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_rank(o_.rank.value_or(0));
    req.set_target_step(o_.step.value_or(0));
    v1::Plan r;
    if (int rc = Call(&v1::Admin::Stub::Plan, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      Json layers = Json::array();
      for (const v1::LayerPlan& l : r.layers()) {
        layers.push_back(Json{{"layer", l.layer()},
                              {"name", l.name()},
                              {"has_version", l.has_version()},
                              {"step", l.step()},
                              {"staleness", l.staleness()},
                              {"bytes", l.bytes()},
                              {"file", l.file()}});
      }
      PrintJson(Json{{"job_id", r.job_id()},
                     {"rank", r.rank()},
                     {"target_step", r.target_step()},
                     {"complete", r.complete()},
                     {"total_bytes", r.total_bytes()},
                     {"max_staleness", r.max_staleness()},
                     {"size_weighted_staleness", r.size_weighted_staleness()},
                     {"layers", std::move(layers)}});
      return kExitOk;
    }
    std::printf("job %s rank %u\n", TerminalSafe(r.job_id()).c_str(), r.rank());
    PrintKv({
        {"target step", absl::StrCat(r.target_step())},
        {"complete", r.complete() ? "yes" : "no (some layers have no version)"},
        {"total bytes", BytesWithRaw(r.total_bytes())},
        {"max staleness", absl::StrCat(r.max_staleness())},
        {"size-weighted staleness", absl::StrFormat("%.2f", r.size_weighted_staleness())},
    });
    std::printf("\n");
    Table t({"LAYER", "NAME", "STEP", "STALENESS", "BYTES"}, {true, false, true, true, true});
    for (const v1::LayerPlan& l : r.layers()) {
      t.Add({absl::StrCat(l.layer()), OrDash(l.name()),
             l.has_version() ? absl::StrCat(l.step()) : "-",
             l.has_version() ? absl::StrCat(l.staleness()) : "-",
             l.has_version() ? HumanBytes(l.bytes()) : "-"});
    }
    t.Print();
    return kExitOk;
  }

  int Gc() {
    v1::GcRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_dry_run(o_.dry_run);
    v1::GcReply r;
    if (int rc = Call(&v1::Admin::Stub::Gc, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      PrintJson(Json{{"dry_run", o_.dry_run},
                     {"versions_deleted", r.versions_deleted()},
                     {"bytes_deleted", r.bytes_deleted()},
                     {"events_deleted", r.events_deleted()},
                     {"versions_kept", r.versions_kept()},
                     {"bytes_kept", r.bytes_kept()},
                     {"retained_targets", r.retained_targets()},
                     {"ranks_busy", r.ranks_busy()}});
      return kExitOk;
    }
    const char* verb = o_.dry_run ? "would delete" : "deleted";
    PrintKv({
        {verb, absl::StrCat(r.versions_deleted(), " versions, ", BytesWithRaw(r.bytes_deleted()),
                            ", ", r.events_deleted(), " events")},
        {"kept", absl::StrCat(r.versions_kept(), " versions, ", BytesWithRaw(r.bytes_kept()))},
        {"restorable steps", absl::StrCat(r.retained_targets())},
        {"ranks busy (skipped)", absl::StrCat(r.ranks_busy())},
    });
    return kExitOk;
  }

  int Release() {
    v1::ReleaseRankRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_rank(o_.rank.value_or(0));
    v1::ReleaseRankReply r;
    if (int rc = Call(&v1::Admin::Stub::ReleaseRank, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      PrintJson(Json{{"job_id", req.job_id()}, {"rank", req.rank()}, {"generation", r.generation()}});
      return kExitOk;
    }
    std::printf("released job %s rank %u (generation %llu)\n", TerminalSafe(req.job_id()).c_str(),
                req.rank(), static_cast<unsigned long long>(r.generation()));
    return kExitOk;
  }

  int Delete() {
    v1::DeleteJobRequest req;
    req.set_job_id(o_.positional[0]);
    v1::DeleteJobReply r;
    if (int rc = Call(&v1::Admin::Stub::DeleteJob, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      PrintJson(Json{{"job_id", req.job_id()},
                     {"ranks", r.ranks()},
                     {"versions_deleted", r.versions_deleted()},
                     {"bytes_deleted", r.bytes_deleted()},
                     {"events_deleted", r.events_deleted()}});
      return kExitOk;
    }
    PrintKv({
        {"deleted job", req.job_id()},
        {"ranks", absl::StrCat(r.ranks())},
        {"versions", absl::StrCat(r.versions_deleted(), ", ", BytesWithRaw(r.bytes_deleted()))},
        {"events", absl::StrCat(r.events_deleted())},
    });
    return kExitOk;
  }

  int Config() {
    v1::ConfigReply r;
    if (int rc = Call(&v1::Admin::Stub::Config, v1::ConfigRequest(), &r); rc != kExitOk) return rc;
    if (o_.json) {
      Json j = Json::object();
      for (absl::string_view line : absl::StrSplit(r.text(), '\n')) {
        line = absl::StripAsciiWhitespace(line);
        if (line.empty() || line[0] == '#') continue;
        auto eq = line.find('=');
        if (eq == absl::string_view::npos) continue;
        const std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
        const std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
        // Numbers and booleans as JSON numbers and booleans, the rest as text.
        uint64_t number;
        if (absl::SimpleAtoi(value, &number)) {
          j[key] = number;
        } else if (value == "true" || value == "false") {
          j[key] = value == "true";
        } else {
          j[key] = value;
        }
      }
      PrintJson(j);
    } else {
      // Line by line: the file's own newlines stay, anything else is escaped.
      std::vector<absl::string_view> lines = absl::StrSplit(r.text(), '\n');
      if (!lines.empty() && lines.back().empty()) lines.pop_back();
      for (absl::string_view line : lines) std::printf("%s\n", TerminalSafe(line).c_str());
    }
    return kExitOk;
  }

  // export: every rank of the job (or --rank); restore: one rank (default 0).
  int Export(bool one_rank) {
    const std::string& job = o_.positional[0];
    std::vector<uint32_t> ranks;
    if (one_rank || o_.rank.has_value()) {
      ranks.push_back(o_.rank.value_or(0));
    } else {
      v1::JobsReply jobs;
      if (int rc = Call(&v1::Admin::Stub::Jobs, v1::JobsRequest(), &jobs); rc != kExitOk) return rc;
      for (const v1::JobInfo& j : jobs.jobs()) {
        if (j.job_id() != job) continue;
        for (const v1::RankInfo& ri : j.ranks()) ranks.push_back(ri.rank());
      }
      if (ranks.empty()) {
        std::fprintf(stderr, "ckptctl: NOT_FOUND: job %s does not exist\n",
                     TerminalSafe(job).c_str());
        return kExitDaemonError;
      }
    }
    // Every rank's plan first: a refusal (another user's job, no checkpoint
    // at that step) leaves nothing behind, not even the output directory.
    for (uint32_t rank : ranks) {
      v1::PlanRequest req;
      req.set_job_id(job);
      req.set_rank(rank);
      req.set_target_step(o_.step.value_or(0));
      v1::Plan plan;
      if (int rc = Call(&v1::Admin::Stub::Plan, req, &plan); rc != kExitOk) return rc;
    }
    // The output directory: created private (0700) when missing, then
    // opened once without following a symbolic link; every file is created
    // beneath it (export_writer.h), so links planted in it are never followed.
    std::error_code mkdir_error;
    const bool created = std::filesystem::create_directories(o_.out, mkdir_error);
    if (mkdir_error) {
      std::fprintf(stderr, "ckptctl: cannot create %s: %s\n", TerminalSafe(o_.out).c_str(),
                   TerminalSafe(mkdir_error.message()).c_str());
      return kExitLocalError;
    }
    if (created) ::chmod(o_.out.c_str(), 0700);
    const int dir_fd = ::open(o_.out.c_str(), O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir_fd < 0) {
      std::fprintf(stderr, "ckptctl: cannot open %s as a directory (%s; a symbolic link is refused)\n",
                   TerminalSafe(o_.out).c_str(), std::strerror(errno));
      return kExitLocalError;
    }
    struct CloseDir {
      int fd;
      ~CloseDir() { ::close(fd); }
    } close_dir{dir_fd};
    Json manifest{{"format", "ckptd-export-v1"}, {"job_id", job}, {"ranks", Json::array()}};
    const bool bar = !o_.json && ::isatty(2);
    for (uint32_t rank : ranks) {
      v1::ExportRequest req;
      req.set_job_id(job);
      req.set_rank(rank);
      req.set_target_step(o_.step.value_or(0));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(
                           std::max(o_.timeout_seconds, 3600.0) * 1e6)));
      std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = stub_->Export(&ctx, req);
      const std::string file = absl::StrFormat("rank-%05u.safetensors", rank);
      auto progress = [&](uint64_t done, uint64_t total) {
        if (!bar) return;
        const int w = 40, filled = total ? static_cast<int>(w * done / total) : w;
        std::fprintf(stderr, "\r%s [%s%s] %3d%%", file.c_str(), std::string(filled, '#').c_str(),
                     std::string(w - filled, ' ').c_str(),
                     total ? static_cast<int>(100 * done / total) : 100);
      };
      absl::StatusOr<Json> entry = ckpt::WriteSafetensors(
          [&](v1::ExportChunk* c) { return reader->Read(c); }, dir_fd, file, progress);
      if (bar) std::fprintf(stderr, "\n");
      if (!entry.ok()) ctx.TryCancel();  // stop the stream; the file is gone already
      grpc::Status s = reader->Finish();
      if (!entry.ok()) {
        std::fprintf(stderr, "ckptctl: %s\n", TerminalSafe(entry.status().ToString()).c_str());
        // The stream itself (DATA_LOSS) or a refused table is the daemon's
        // side; anything else is the local file system.
        return absl::IsDataLoss(entry.status()) || absl::IsInvalidArgument(entry.status())
                   ? kExitDaemonError
                   : kExitLocalError;
      }
      if (!s.ok()) return Report(s);
      (*entry)["file"] = file;
      manifest["ranks"].push_back(*entry);
      if (!o_.json) {
        std::printf("rank %u: step %lu, %s -> %s/%s\n", rank,
                    static_cast<unsigned long>((*entry)["target_step"].get<uint64_t>()),
                    HumanBytes((*entry)["bytes"].get<uint64_t>()).c_str(),
                    TerminalSafe(o_.out).c_str(), file.c_str());
      }
    }
    if (absl::Status w = ckpt::WriteFileBeneath(dir_fd, "manifest.json", JsonText(manifest) + "\n");
        !w.ok()) {
      std::fprintf(stderr, "ckptctl: %s/manifest.json: %s\n", TerminalSafe(o_.out).c_str(),
                   TerminalSafe(w.message()).c_str());
      return kExitLocalError;
    }
    if (o_.json) PrintJson(manifest);
    return kExitOk;
  }

  int Verify() {
    v1::VerifyRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_rank(o_.rank.has_value() ? static_cast<int64_t>(*o_.rank) : -1);
    req.set_deep(o_.deep);
    v1::VerifyReply r;
    if (int rc = Call(&v1::Admin::Stub::Verify, req, &r); rc != kExitOk) return rc;
    if (o_.json) {
      Json failures = Json::array();
      for (const v1::VerifyFailure& f : r.failures()) {
        failures.push_back(
            Json{{"rank", f.rank()}, {"layer", f.layer()}, {"step", f.step()}, {"error", f.error()}});
      }
      PrintJson(Json{{"versions_checked", r.versions_checked()},
                     {"bytes_checked", r.bytes_checked()},
                     {"seconds", r.seconds()},
                     {"failures", std::move(failures)}});
    } else {
      PrintKv({
          {"versions checked", absl::StrCat(r.versions_checked())},
          {"bytes checked", BytesWithRaw(r.bytes_checked())},
          {"seconds", absl::StrFormat("%.3f", r.seconds())},
          {"failures", absl::StrCat(r.failures_size())},
      });
      if (r.failures_size() > 0) {
        std::printf("\n");
        Table t({"RANK", "LAYER", "STEP", "ERROR"}, {true, true, true, false});
        for (const v1::VerifyFailure& f : r.failures()) {
          t.Add({absl::StrCat(f.rank()), absl::StrCat(f.layer()), absl::StrCat(f.step()), f.error()});
        }
        t.Print();
      }
    }
    return r.failures_size() > 0 ? kExitCorrupt : kExitOk;
  }

  const Options& o_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> stub_;
};

}  // namespace

// `repair`: the offline index rebuild (daemon/store/repair.h); no daemon.
int Repair(const Options& o) {
  ckpt::RepairOptions ro;
  ro.owner_uid = o.owner_uid.value_or(0);
  absl::StatusOr<ckpt::RepairReport> r = ckpt::RepairDataDir(o.data_dir, ckpt::DefaultFileSystem(), ro);
  if (!r.ok()) {
    std::fprintf(stderr, "ckptctl: %s: repair of %s: %s\n",
                 absl::StatusCodeToString(r.status().code()).c_str(), o.data_dir.c_str(),
                 std::string(r.status().message()).c_str());
    return kExitLocalError;
  }
  if (o.json) {
    PrintJson(Json{{"index_rebuilt", r->index_rebuilt},
                   {"damaged_index", r->damaged_index},
                   {"open_error", r->open_error},
                   {"files_checked", r->files_checked},
                   {"records_kept", r->records_kept},
                   {"records_added", r->records_added},
                   {"files_unquarantined", r->files_unquarantined},
                   {"events_added", r->events_added},
                   {"ranks_added", r->ranks_added},
                   {"jobs_added", r->jobs_added},
                   {"skipped", r->skipped}});
    return kExitOk;
  }
  PrintKv({{"index_rebuilt", r->index_rebuilt ? "yes (old index kept as " + r->damaged_index + ")"
                                              : std::string("no")},
           {"files_checked", absl::StrCat(r->files_checked)},
           {"records_kept", absl::StrCat(r->records_kept)},
           {"records_added", absl::StrCat(r->records_added)},
           {"files_unquarantined", absl::StrCat(r->files_unquarantined)},
           {"events_added", absl::StrCat(r->events_added)},
           {"ranks_added", absl::StrCat(r->ranks_added)},
           {"jobs_added", absl::StrCat(r->jobs_added)},
           {"files_left_in_place", absl::StrCat(r->skipped.size())}});
  for (const std::string& s : r->skipped) std::printf("left in place: %s\n", s.c_str());
  return kExitOk;
}

// `help COMMAND`: the command's entry of the usage text, or a usage error.
static int HelpFor(const std::string& command) {
  // An entry starts with "  COMMAND" at two spaces and runs until the next
  // line that starts a new entry or section.
  std::string entry;
  bool in = false;
  for (absl::string_view line : absl::StrSplit(kUsage, '\n')) {
    const bool starts_entry = absl::StartsWith(line, "  ") && line.size() > 2 && line[2] != ' ';
    if (starts_entry || (!line.empty() && line[0] != ' ')) {
      in = starts_entry && (line.substr(2) == command ||
                            absl::StartsWith(line.substr(2), command + " "));
    }
    if (in) absl::StrAppend(&entry, line, "\n");
  }
  if (entry.empty()) return UsageError(absl::StrCat("help: unknown command '", command, "'"));
  std::printf("usage: ckptctl [FLAGS] %s\n\n%s", TerminalSafe(command).c_str(), entry.c_str());
  return kExitOk;
}

int main(int argc, char** argv) {
  Options o;
  if (int rc = ParseArgs(argc, argv, &o); rc != kExitOk) return rc;
  if (o.help || o.command == "help") {
    if (o.command == "help" && !o.positional.empty()) return HelpFor(o.positional[0]);
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (o.command.empty()) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  if (int rc = ValidateCommand(o); rc != kExitOk) return rc;
  if (o.command == "repair") return Repair(o);
  return Ctl(o).Run();
}
