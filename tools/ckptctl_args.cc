// ckptctl's command line (ckptctl_args.h): the usage text, strict number
// parsing, the flags, and which command takes which arguments and flags.
#include "tools/ckptctl_args.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {
namespace {

constexpr char kDefaultSocket[] = "/run/ckptd/ckptd.sock";

}  // namespace

const char kUsage[] = R"(usage: ckptctl [FLAGS] COMMAND [ARGS] [FLAGS]

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
  release JOB --evict     (root) end every registration of the job and keep
                          them out until the job is deleted: a trainer that
                          registers again is refused
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
  --older-within=N        a layer whose version at the target was lost (damaged,
                          no intact copy anywhere) takes its previous version
                          when at most N steps older; without it such a plan is
                          refused (plan, export, restore)
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

int UsageError(absl::string_view msg) {
  std::fprintf(stderr, "ckptctl: %s\nRun 'ckptctl --help' for usage.\n", TerminalSafe(msg).c_str());
  return kExitUsage;
}

namespace {

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

// The flags that take a value and may give it as the next argument.
bool TakesValue(const std::string& name) {
  return name == "--socket" || name == "--timeout" || name == "--rank" || name == "--layer" ||
         name == "--limit" || name == "--step" || name == "--out" || name == "--data-dir" ||
         name == "--owner-uid" || name == "--older-within";
}

// Sets the flag `name` to `value`. Returns kExitOk or the exit code of a
// usage error (a bad value, or a flag that takes no value).
int SetFlag(const std::string& name, const std::string& value, Options* o) {
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
  } else if (name == "--older-within") {
    uint64_t v;
    if (!ParseUnsigned<uint64_t>(value, UINT64_MAX, &v) || v == 0) return bad("steps (>= 1)");
    o->older_within = v;
  } else {
    return UsageError(absl::StrCat("unknown flag '", name, "'"));
  }
  return kExitOk;
}

}  // namespace

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
    if (arg == "--evict") {
      o->evict = true;
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
      if (!TakesValue(name)) return UsageError(absl::StrCat("unknown flag '", name, "'"));
      if (i + 1 >= argc) return UsageError(absl::StrCat(name, " needs a value"));
      value = argv[++i];
    }
    if (int rc = SetFlag(name, value, o); rc != kExitOk) return rc;
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
                 reject(o.older_within.has_value(), step_ok, "--older-within"),
                 reject(!o.data_dir.empty(), c == "repair", "--data-dir"),
                 reject(o.owner_uid.has_value(), c == "repair", "--owner-uid"),
                 reject(o.evict, c == "release", "--evict"),
                 reject(o.evict && o.rank.has_value(), false, "--rank with --evict")}) {
    if (rc != kExitOk) return rc;
  }
  return kExitOk;
}

int HelpFor(const std::string& command) {
  // An entry starts with "  COMMAND" at two spaces and runs until the next
  // line that starts a new entry or section.
  std::string entry;
  bool in = false;
  for (absl::string_view line : absl::StrSplit(kUsage, '\n')) {
    const bool starts_entry = absl::StartsWith(line, "  ") && line.size() > 2 && line[2] != ' ';
    if (starts_entry || (!line.empty() && line[0] != ' ')) {
      in = starts_entry &&
           (line.substr(2) == command || absl::StartsWith(line.substr(2), command + " "));
    }
    if (in) absl::StrAppend(&entry, line, "\n");
  }
  if (entry.empty()) return UsageError(absl::StrCat("help: unknown command '", command, "'"));
  std::printf("usage: ckptctl [FLAGS] %s\n\n%s", TerminalSafe(command).c_str(), entry.c_str());
  return kExitOk;
}

}  // namespace ckpt::ctl
