// ckpt_policy_sim: replays a recorded LayerCheck drift trace under other
// parameters, so K0 / S_max / warm-up can be tuned without re-training.
//
//   ckpt_policy_sim --trace=<data_dir>/jobs/<job>/rank-00000000/drift.jsonl
//       [--k0=1e-4,1e-3,1e-2] [--s-max=100,200] [--warmup=200] [--warmup-interval=50]
//       [--k0-embedding=X] [--full-every=N] [--json]
//
// The trace is what ckptd writes with PolicySpec.record_trace: a header line
// (layers with name, kind, bytes; the recorded config) and one line per step
// (step, lr, per-layer normalized drift d). Every combination of the listed
// values is replayed through the daemon's own LayerCheckPolicy; for each it
// prints layer writes, bytes written (and the fraction of policy `all`),
// checkpoint events, mean and max staleness, and mean size-weighted staleness.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "daemon/policy/layercheck.h"
#include "nlohmann/json.hpp"

namespace {

using ckpt::LayerCheckConfig;
using ckpt::LayerCheckPolicy;

struct Step {
  uint64_t step;
  double lr;
  std::vector<double> d;
};

struct Result {
  LayerCheckConfig config;
  uint64_t layer_writes = 0, bytes = 0, events = 0, max_staleness = 0;
  double mean_staleness = 0, mean_weighted_staleness = 0;
};

template <typename T>
bool ParseList(const std::string& s, std::vector<T>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    T v;
    if constexpr (std::is_same_v<T, double>) {
      if (!absl::SimpleAtod(p, &v)) return false;
    } else {
      if (!absl::SimpleAtoi(p, &v)) return false;
    }
    out->push_back(v);
  }
  return !out->empty();
}

Result Replay(const LayerCheckConfig& config, const std::vector<ckpt::LayerKind>& kinds,
              const std::vector<uint64_t>& bytes, const std::vector<Step>& steps) {
  Result r;
  r.config = config;
  LayerCheckPolicy policy(config, kinds);
  const size_t n = kinds.size();
  double total_bytes = 0;
  for (uint64_t b : bytes) total_bytes += static_cast<double>(b);
  double staleness_sum = 0, weighted_sum = 0;
  uint64_t samples = 0;
  for (const Step& s : steps) {
    std::vector<ckpt::drift::LayerSums> sums(n);
    for (size_t l = 0; l < n && l < s.d.size(); ++l) sums[l] = {s.d[l] * s.d[l], 1.0};
    std::vector<ckpt::LayerDecision> dec = policy.Decide(s.step, s.lr, sums, {});
    bool any = false;
    double weighted = 0;
    for (size_t l = 0; l < n; ++l) {
      if (dec[l].reason != ckpt::PersistReason::kNone) {
        ++r.layer_writes;
        r.bytes += bytes[l];
        any = true;
      }
      const uint64_t st = s.step - policy.last_persisted(l);
      r.max_staleness = std::max(r.max_staleness, st);
      staleness_sum += static_cast<double>(st);
      weighted += static_cast<double>(bytes[l]) * static_cast<double>(st);
    }
    weighted_sum += total_bytes > 0 ? weighted / total_bytes : 0;
    samples += n;
    if (any) ++r.events;
  }
  r.mean_staleness = samples ? staleness_sum / static_cast<double>(samples) : 0;
  r.mean_weighted_staleness = steps.empty() ? 0 : weighted_sum / static_cast<double>(steps.size());
  return r;
}

int Usage() {
  std::fprintf(stderr,
               "usage: ckpt_policy_sim --trace=FILE [--k0=LIST] [--s-max=LIST] [--warmup=LIST]\n"
               "                       [--warmup-interval=N] [--k0-embedding=X] [--full-every=N] "
               "[--json]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string trace;
  std::vector<double> k0s;
  std::vector<uint64_t> s_maxes, warmups;
  LayerCheckConfig base;
  bool json = false, have_base = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    std::string k = a.substr(0, eq), v = eq == std::string::npos ? "" : a.substr(eq + 1);
    bool ok = true;
    if (k == "--trace") trace = v;
    else if (k == "--k0") ok = ParseList(v, &k0s);
    else if (k == "--s-max") ok = ParseList(v, &s_maxes);
    else if (k == "--warmup") ok = ParseList(v, &warmups);
    else if (k == "--warmup-interval") ok = absl::SimpleAtoi(v, &base.warmup_interval);
    else if (k == "--k0-embedding") ok = absl::SimpleAtod(v, &base.k0_embedding), have_base = true;
    else if (k == "--full-every") ok = absl::SimpleAtoi(v, &base.full_every);
    else if (k == "--json") json = true;
    else return Usage();
    if (!ok) {
      std::fprintf(stderr, "ckpt_policy_sim: bad value for %s\n", k.c_str());
      return 2;
    }
  }
  if (trace.empty()) return Usage();
  std::ifstream in(trace);
  if (!in) {
    std::fprintf(stderr, "ckpt_policy_sim: cannot read %s\n", trace.c_str());
    return 1;
  }
  std::vector<ckpt::LayerKind> kinds;
  std::vector<uint64_t> bytes;
  std::vector<Step> steps;
  LayerCheckConfig recorded;
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;  // a torn last line
    if (j.contains("layers") && j["layers"].is_array() && j["layers"].size() > 0 &&
        j["layers"][0].is_object()) {
      // A header: a (re-)registration. Later headers must describe the same model.
      std::vector<ckpt::LayerKind> k;
      std::vector<uint64_t> b;
      for (const auto& l : j["layers"]) {
        k.push_back(static_cast<ckpt::LayerKind>(l.value("kind", 2)));
        b.push_back(l.value("bytes", uint64_t{0}));
      }
      if (!kinds.empty() && (k != kinds || b != bytes)) {
        std::fprintf(stderr, "ckpt_policy_sim: the trace changes its layer table\n");
        return 1;
      }
      kinds = k;
      bytes = b;
      if (j.contains("config")) {
        const auto& c = j["config"];
        recorded.k0 = c.value("k0", recorded.k0);
        recorded.k0_embedding = c.value("k0_embedding", recorded.k0_embedding);
        recorded.k_floor = c.value("k_floor", recorded.k_floor);
        recorded.s_max = c.value("s_max", recorded.s_max);
        recorded.warmup = c.value("warmup", recorded.warmup);
        recorded.warmup_interval = c.value("warmup_interval", recorded.warmup_interval);
      }
      continue;
    }
    if (!j.contains("step") || !j.contains("d")) continue;
    Step s{j["step"].get<uint64_t>(), j.value("lr", 0.0), j["d"].get<std::vector<double>>()};
    if (!steps.empty() && s.step <= steps.back().step) {
      // A restart replayed steps: keep the newest timeline.
      while (!steps.empty() && steps.back().step >= s.step) steps.pop_back();
    }
    steps.push_back(std::move(s));
  }
  if (kinds.empty() || steps.empty()) {
    std::fprintf(stderr, "ckpt_policy_sim: %s has no header or no steps\n", trace.c_str());
    return 1;
  }
  if (k0s.empty()) k0s = {recorded.k0};
  if (s_maxes.empty()) s_maxes = {recorded.s_max};
  if (warmups.empty()) warmups = {recorded.warmup};
  if (!have_base) base.k0_embedding = recorded.k0_embedding;
  base.k_floor = recorded.k_floor;
  if (base.warmup_interval == 50 && recorded.warmup_interval != 50) {
    base.warmup_interval = recorded.warmup_interval;
  }

  uint64_t all_bytes = 0;
  for (uint64_t b : bytes) all_bytes += b;
  all_bytes *= steps.size();
  std::vector<Result> results;
  for (double k0 : k0s) {
    for (uint64_t s_max : s_maxes) {
      for (uint64_t w : warmups) {
        LayerCheckConfig c = base;
        c.k0 = k0;
        c.s_max = s_max;
        c.warmup = w;
        if (!c.Validate().ok()) {
          std::fprintf(stderr, "ckpt_policy_sim: invalid config k0=%g s_max=%lu\n", k0,
                       static_cast<unsigned long>(s_max));
          return 2;
        }
        results.push_back(Replay(c, kinds, bytes, steps));
      }
    }
  }
  if (json) {
    nlohmann::json out;
    out["steps"] = steps.size();
    out["layers"] = kinds.size();
    out["bytes_all"] = all_bytes;
    for (const Result& r : results) {
      out["results"].push_back({{"k0", r.config.k0},
                                {"s_max", r.config.s_max},
                                {"warmup", r.config.warmup},
                                {"layer_writes", r.layer_writes},
                                {"bytes", r.bytes},
                                {"bytes_fraction_of_all", all_bytes ? double(r.bytes) / all_bytes : 0},
                                {"events", r.events},
                                {"mean_staleness", r.mean_staleness},
                                {"max_staleness", r.max_staleness},
                                {"mean_size_weighted_staleness", r.mean_weighted_staleness}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("trace: %zu steps (%lu..%lu), %zu layers; policy all would write %.1f MiB\n",
              steps.size(), static_cast<unsigned long>(steps.front().step),
              static_cast<unsigned long>(steps.back().step), kinds.size(), all_bytes / 1048576.0);
  std::printf("%10s %6s %6s %12s %12s %8s %8s %10s %10s %10s\n", "K0", "S_MAX", "WARMUP",
              "LAYER WRITES", "MIB WRITTEN", "OF ALL", "EVENTS", "MEAN STALE", "MAX STALE",
              "SW STALE");
  for (const Result& r : results) {
    std::printf("%10.1e %6lu %6lu %12lu %12.1f %7.1f%% %8lu %10.2f %10lu %10.2f\n", r.config.k0,
                static_cast<unsigned long>(r.config.s_max), static_cast<unsigned long>(r.config.warmup),
                static_cast<unsigned long>(r.layer_writes), r.bytes / 1048576.0,
                all_bytes ? 100.0 * r.bytes / all_bytes : 0.0, static_cast<unsigned long>(r.events),
                r.mean_staleness, static_cast<unsigned long>(r.max_staleness),
                r.mean_weighted_staleness);
  }
  return 0;
}
