// ckpt_bench: write-path and restore-path benchmark. In one process and on
// one directory it alternates rounds of
//   A  the daemon's real commit path (LayerStore::Write from a StagingPool:
//      checksums, header, O_DIRECT writes, fdatasync, on `writers` threads;
//      then a Publisher: renames, one dir fsync per rank directory and one
//      RocksDB sync batch per group, as ckptd commits), the versions spread
//      over `ranks` ranks (--commit=serial: LayerStore::Commit per version
//      on the writers, the whole protocol one version at a time), and
//   B  a raw baseline: the same bytes written sequentially with O_DIRECT by
//      `writers` threads, one file each, through the same IoBackend kind,
//      chunk size and queue depth, then fdatasync;
// then, on the versions A committed,
//   C  the daemon's restore path (RestoreInto: index lookups, O_DIRECT reads,
//      every checksum, copies into a freshly mapped memfd per rank, as after
//      a trainer's new registration), one restore per rank at once, and
//   D  a raw baseline: B's files read back with O_DIRECT by one thread per
//      rank, each a contiguous share, through the same IoBackend kind, chunk
//      size and queue depth (one queue kept full across a whole share: the
//      most a reader gets from this disk);
// and reports the median throughput of each and the median per-round ratios.
// Staging buffers are filled before the clock starts; cleanup is not timed.
//
// The parts are listed in ckpt_bench.h. This file: the flags and main.
#include "tools/ckpt_bench.h"

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/io/io_backend.h"

namespace ckpt::bench {
namespace {

constexpr char kUsage[] =
    R"(usage: ckpt_bench --dir=PATH [--total-bytes=SIZE] [--layer-bytes=SIZE] [--writers=N]
                  [--ranks=N] [--queue-depth=N] [--chunk-bytes=SIZE]
                  [--backend=auto|io_uring|pwrite] [--commit=grouped|serial] [--rounds=N]
                  [--no-restore] [--json]

Compares ckptd's layer-version commit path with raw O_DIRECT writes of the
same bytes, and ckptd's restore path with raw O_DIRECT reads of the files it
wrote, on the same directory (created when missing; the benchmark removes
what it writes). SIZE takes a K, M or G suffix (powers of 1024).

  --dir=PATH          directory on the disk under test (required)
  --total-bytes=SIZE  bytes written per path per round (default 2G)
  --layer-bytes=SIZE  payload of one layer version (default 64M)
  --writers=N         layer versions / raw files in flight (default 2)
  --ranks=N           ranks the versions belong to; restores run one per rank
                      at once (default 1)
  --queue-depth=N     I/O queue depth per writer (default 16)
  --chunk-bytes=SIZE  staging chunk = I/O segment size, multiple of 4096 (default 4M)
  --backend=KIND      auto, io_uring or pwrite (default auto)
  --commit=HOW        grouped: writers write, one publisher makes groups of
                      versions durable and visible, as ckptd does (default);
                      serial: each writer runs the whole protocol per version
  --rounds=N          A/B rounds, alternating which path goes first (default 3)
  --no-restore        measure the write paths only
  --json              one JSON object on stdout

GB/s are 10^9 payload bytes per second. Exit: 0 ok, 1 benchmark failed, 2 usage.
)";

// Digits with an optional K/M/G suffix; no sign, no spaces, no overflow.
bool ParseSize(absl::string_view s, uint64_t* out) {
  uint64_t mult = 1;
  if (!s.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(s.back()))) {
      case 'K':
        mult = uint64_t{1} << 10;
        break;
      case 'M':
        mult = uint64_t{1} << 20;
        break;
      case 'G':
        mult = uint64_t{1} << 30;
        break;
      default:
        break;
    }
    if (mult != 1) s.remove_suffix(1);
  }
  if (s.empty() || s.size() > 20) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v > UINT64_MAX / mult) return false;
  *out = v * mult;
  return true;
}

bool ParseCount(absl::string_view s, uint32_t lo, uint32_t hi, uint32_t* out) {
  if (s.empty() || s.size() > 10) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v < lo || v > hi) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

absl::Status ParseArgs(int argc, char** argv, Args* a, bool* help) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      *help = true;
      continue;
    }
    if (arg == "--json") {
      a->json = true;
      continue;
    }
    if (arg == "--no-restore") {
      a->restore = false;
      continue;
    }
    size_t eq = arg.find('=');
    if (!absl::StartsWith(arg, "--") || eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument '", arg, "'"));
    }
    absl::string_view k = arg.substr(0, eq), v = arg.substr(eq + 1);
    bool ok = true;
    if (k == "--dir") {
      a->dir = std::string(v);
      ok = !v.empty();
    } else if (k == "--total-bytes") {
      ok = ParseSize(v, &a->total_bytes) && a->total_bytes > 0;
    } else if (k == "--layer-bytes") {
      ok = ParseSize(v, &a->layer_bytes) && a->layer_bytes > 0 &&
           a->layer_bytes <= (uint64_t{1} << 40);
    } else if (k == "--writers") {
      ok = ParseCount(v, 1, 256, &a->writers);
    } else if (k == "--ranks") {
      ok = ParseCount(v, 1, 64, &a->ranks);
    } else if (k == "--queue-depth") {
      ok = ParseCount(v, 1, 4096, &a->queue_depth);
    } else if (k == "--chunk-bytes") {
      ok = ParseSize(v, &a->chunk_bytes) && a->chunk_bytes > 0 &&
           a->chunk_bytes % kDirectAlignment == 0 && a->chunk_bytes <= (uint64_t{1} << 30);
    } else if (k == "--backend") {
      a->backend = std::string(v);
      ok = ParseIoBackendKind(a->backend).ok();
    } else if (k == "--commit") {
      ok = v == "grouped" || v == "serial";
      a->serial_commit = v == "serial";
    } else if (k == "--rounds") {
      ok = ParseCount(v, 1, 1000, &a->rounds);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", k, "'"));
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("bad value for ", k, ": '", v, "'"));
  }
  if (*help) return absl::OkStatus();
  if (a->dir.empty()) return absl::InvalidArgumentError("--dir is required");
  if (a->total_bytes < a->layer_bytes) {
    return absl::InvalidArgumentError("--total-bytes must be at least --layer-bytes");
  }
  if (a->total_bytes / a->layer_bytes < a->ranks) {
    return absl::InvalidArgumentError("--total-bytes must hold one --layer-bytes version per rank");
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Args a;
  bool help = false;
  if (absl::Status s = ParseArgs(argc, argv, &a, &help); !s.ok()) {
    std::fprintf(stderr, "ckpt_bench: %s\n%s", std::string(s.message()).c_str(), kUsage);
    return 2;
  }
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (absl::Status s = Run(a); !s.ok()) {
    std::fprintf(stderr, "ckpt_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace ckpt::bench

int main(int argc, char** argv) { return ckpt::bench::Main(argc, argv); }
