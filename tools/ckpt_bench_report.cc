// ckpt_bench's rounds and report (ckpt_bench.h): Run sets up a Bench, runs
// --rounds rounds of the four paths (alternating which of each pair goes
// first, so drift such as disk warm-up hits both), and prints each round's
// throughputs and, at the end, the medians: a table, or with --json one
// JSON object. GB/s are 10^9 payload bytes per second.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "tools/ckpt_bench.h"

namespace ckpt::bench {
namespace {

using Json = nlohmann::json;

std::string HumanBytes(uint64_t b) {
  if (b % (uint64_t{1} << 30) == 0) return absl::StrCat(b >> 30, " GiB");
  if (b % (uint64_t{1} << 20) == 0) return absl::StrCat(b >> 20, " MiB");
  if (b % (uint64_t{1} << 10) == 0) return absl::StrCat(b >> 10, " KiB");
  return absl::StrCat(b, " B");
}

double GBps(uint64_t bytes, absl::Duration d) {
  double s = absl::ToDoubleSeconds(d);
  return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0;
}

// The wall times of one round's paths: A and B, and with --restore C and D.
struct RoundTimes {
  absl::Duration store, raw, restore, raw_read;
};

// One round: A and B, then C and D on what they wrote, each pair in the
// round's order; everything written is removed before the next round.
absl::StatusOr<RoundTimes> RunRound(Bench& b, uint32_t r) {
  RoundTimes t;
  if (r % 2 == 1) {
    CKPT_ASSIGN_OR_RETURN(t.store, b.RunStore(r));
    CKPT_ASSIGN_OR_RETURN(t.raw, b.RunRaw());
  } else {
    CKPT_ASSIGN_OR_RETURN(t.raw, b.RunRaw());
    CKPT_ASSIGN_OR_RETURN(t.store, b.RunStore(r));
  }
  if (!b.restore()) {
    CKPT_RETURN_IF_ERROR(b.RemoveVersions());
    CKPT_RETURN_IF_ERROR(b.RemoveRaw());
    return t;
  }
  absl::Status s = absl::OkStatus();
  absl::StatusOr<absl::Duration> c, d;
  if (r % 2 == 1) {
    c = b.RunRestore();
    if (c.ok()) d = b.RunRawRead();
  } else {
    d = b.RunRawRead();
    if (d.ok()) c = b.RunRestore();
  }
  s = c.ok() ? d.status() : c.status();
  absl::Status removed = b.RemoveVersions();
  absl::Status removed_raw = b.RemoveRaw();
  CKPT_RETURN_IF_ERROR(s);
  CKPT_RETURN_IF_ERROR(removed);
  CKPT_RETURN_IF_ERROR(removed_raw);
  t.restore = *c;
  t.raw_read = *d;
  return t;
}

// The per-round figures, kept for their medians.
class Figures {
 public:
  // Adds round `r`'s figures and returns them as the round's JSON object.
  Json AddRound(const Bench& b, uint32_t r, const RoundTimes& t);
  // The line of the round AddRound added last.
  void PrintRound(const Bench& b, uint32_t r) const;
  // The whole run as one JSON object, `rounds` included.
  Json Summary(const Args& a, const Bench& b, Json rounds) const;
  // The medians as text.
  void PrintSummary(const Args& a, const Bench& b) const;

 private:
  std::vector<double> ga_, gb_, ratio_, gc_, gd_, restore_ratio_, groups_, commit_ms_;
  std::vector<double> restore_cpu_, raw_read_cpu_;  // CPU seconds per GiB
  std::vector<double> reading_share_;               // of the restore's time
  std::vector<double> share_[4];                    // of commit time: write, sync, rest; checksums
};

Json Figures::AddRound(const Bench& b, uint32_t r, const RoundTimes& t) {
  ga_.push_back(GBps(b.bytes_per_round(), t.store));
  gb_.push_back(GBps(b.bytes_per_round(), t.raw));
  ratio_.push_back(gb_.back() > 0 ? ga_.back() / gb_.back() : 0);
  Json round{{"round", r},
             {"ckptd_gbps", ga_.back()},
             {"raw_gbps", gb_.back()},
             {"ratio", ratio_.back()},
             {"ckptd_seconds", absl::ToDoubleSeconds(t.store)},
             {"raw_seconds", absl::ToDoubleSeconds(t.raw)}};
  if (b.restore()) {
    gc_.push_back(GBps(b.bytes_per_round(), t.restore));
    gd_.push_back(GBps(b.bytes_per_round(), t.raw_read));
    restore_ratio_.push_back(gd_.back() > 0 ? gc_.back() / gd_.back() : 0);
    round["restore_gbps"] = gc_.back();
    round["raw_read_gbps"] = gd_.back();
    round["restore_ratio"] = restore_ratio_.back();
    const double gib = static_cast<double>(b.bytes_per_round()) / (1 << 30);
    restore_cpu_.push_back(b.restore_cpu_seconds() / gib);
    raw_read_cpu_.push_back(b.raw_read_cpu_seconds() / gib);
    round["restore_cpu_seconds_per_gib"] = restore_cpu_.back();
    round["raw_read_cpu_seconds_per_gib"] = raw_read_cpu_.back();
    reading_share_.push_back(b.restore_reading_share());
    round["restore_reading_share"] = reading_share_.back();
  }
  const std::vector<double> parts = b.CommitBreakdown();
  const double all = parts[0] + parts[1] + parts[2];
  for (size_t i = 0; i < parts.size(); ++i) {
    share_[i].push_back(all > 0 ? parts[i] / all : 0);
  }
  round["commit_share"] = Json{{"write", share_[0].back()},
                               {"datasync", share_[1].back()},
                               {"create_rename_dirsync_index", share_[2].back()},
                               {"checksums_during_write", share_[3].back()}};
  round["publish_groups"] = b.groups();
  round["median_commit_seconds"] = b.MedianCommitSeconds();
  groups_.push_back(b.groups());
  commit_ms_.push_back(1e3 * b.MedianCommitSeconds());
  return round;
}

void Figures::PrintRound(const Bench& b, uint32_t r) const {
  std::printf("round %u: write ckptd %.2f GB/s, raw %.2f GB/s, ratio %.2f", r, ga_.back(),
              gb_.back(), ratio_.back());
  if (b.restore()) {
    std::printf("; restore ckptd %.2f GB/s, raw read %.2f GB/s, ratio %.2f", gc_.back(), gd_.back(),
                restore_ratio_.back());
  }
  std::printf("\n");
  std::fflush(stdout);
}

Json Figures::Summary(const Args& a, const Bench& b, Json rounds) const {
  Json j{{"dir", a.dir},
         {"backend", b.backend()},
         {"direct_io", b.direct()},
         {"writers", a.writers},
         {"commit", a.serial_commit ? "serial" : "grouped"},
         {"ranks", a.ranks},
         {"queue_depth", a.queue_depth},
         {"chunk_bytes", a.chunk_bytes},
         {"layer_bytes", a.layer_bytes},
         {"versions_per_round", b.versions()},
         {"bytes_per_round", b.bytes_per_round()},
         {"rounds", std::move(rounds)},
         {"ckptd_gbps", Median(ga_)},
         {"raw_gbps", Median(gb_)},
         {"ratio", Median(ratio_)}};
  if (b.restore()) {
    j["restore_gbps"] = Median(gc_);
    j["raw_read_gbps"] = Median(gd_);
    j["restore_ratio"] = Median(restore_ratio_);
    j["restore_cpu_seconds_per_gib"] = Median(restore_cpu_);
    j["raw_read_cpu_seconds_per_gib"] = Median(raw_read_cpu_);
    j["restore_reading_share"] = Median(reading_share_);
  }
  return j;
}

void Figures::PrintSummary(const Args& a, const Bench& b) const {
  std::printf("ckptd write path (%s commit): %.2f GB/s (median of %u)\n",
              a.serial_commit ? "serial" : "grouped", Median(ga_), a.rounds);
  std::printf("raw O_DIRECT:     %.2f GB/s\n", Median(gb_));
  std::printf("ratio (ckptd / raw): %.2f (median of per-round ratios)\n", Median(ratio_));
  std::printf(
      "commit time (summed over versions, medians): write %.0f%% (checksums computed "
      "meanwhile: %.0f%%), fdatasync %.0f%%, temp file + rename + directory fsync + "
      "index%s %.0f%%\n",
      100 * Median(share_[0]), 100 * Median(share_[3]), 100 * Median(share_[1]),
      a.serial_commit ? "" : " + waiting for the publisher", 100 * Median(share_[2]));
  std::printf(
      "versions per publish group: %.1f; time from temp file to record: %.0f ms "
      "(medians)\n",
      b.versions() / std::max(1.0, Median(groups_)), Median(commit_ms_));
  if (!b.restore()) return;
  std::printf("ckptd restore path: %.2f GB/s (median of %u)\n", Median(gc_), a.rounds);
  std::printf("raw O_DIRECT read:  %.2f GB/s\n", Median(gd_));
  std::printf("restore ratio (ckptd / raw): %.2f (median of per-round ratios)\n",
              Median(restore_ratio_));
  std::printf("CPU per GiB read (all threads, medians): restore %.3f s, raw read %.3f s\n",
              Median(restore_cpu_), Median(raw_read_cpu_));
  std::printf(
      "read calls under way during the restore: %.0f%% of its time (the lowest "
      "rank's, median of rounds)\n",
      100 * Median(reading_share_));
}

// What is measured: the directory, the backend and the sizes of one round.
void PrintSetup(const Args& a, const Bench& b) {
  std::printf(
      "dir %s: backend %s, O_DIRECT %s, %u writers, %u ranks, queue depth %u, chunk %s\n"
      "per round and path: %llu layer versions x %s = %s (ckptd file: %llu bytes each)\n",
      a.dir.c_str(), b.backend(), b.direct() ? "yes" : "no (file system refuses it)", a.writers,
      a.ranks, a.queue_depth, HumanBytes(a.chunk_bytes).c_str(),
      static_cast<unsigned long long>(b.versions()), HumanBytes(a.layer_bytes).c_str(),
      HumanBytes(b.bytes_per_round()).c_str(), static_cast<unsigned long long>(b.file_bytes()));
  if (b.leftovers() > 0) {
    std::printf("removed %llu leftovers of an earlier run\n",
                static_cast<unsigned long long>(b.leftovers()));
  }
  std::fflush(stdout);
}

}  // namespace

absl::Status Run(const Args& a) {
  Bench b(a);
  CKPT_RETURN_IF_ERROR(b.Setup());
  if (!a.json) PrintSetup(a, b);
  Figures figures;
  Json rounds = Json::array();
  for (uint32_t r = 1; r <= a.rounds; ++r) {
    CKPT_ASSIGN_OR_RETURN(RoundTimes t, RunRound(b, r));
    rounds.push_back(figures.AddRound(b, r, t));
    if (!a.json) figures.PrintRound(b, r);
  }
  if (a.json) {
    std::printf("%s\n", figures.Summary(a, b, std::move(rounds)).dump(2).c_str());
  } else {
    figures.PrintSummary(a, b);
  }
  return absl::OkStatus();
}

}  // namespace ckpt::bench
