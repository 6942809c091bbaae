// ckpt_policy_sim: replays a recorded LayerCheck drift trace under other
// parameters, so K0 / S_max / warm-up / a write budget can be tuned without
// re-training.
//
//   ckpt_policy_sim --trace=<data_dir>/jobs/<job>/rank-00000000/drift.jsonl
//       [--k0=1e-4,1e-3,1e-2] [--s-max=100,200] [--warmup=1,200] [--warmup-interval=50]
//       [--k0-embedding=X] [--full-every=N]
//       [--budget-bytes-per-step=LIST | --budget-bytes-per-s=LIST --step-s=S |
//        --budget-share=LIST --step-s=S --device-write-bytes-per-s=X]
//       [--budget-k-min=X] [--budget-k-max=X] [--budget-horizon=N] [--no-budget]
//       [--json] [--series]
//
// --series (with --json) adds per-step arrays: bytes selected, the largest
// staleness, the K0 multiplier and the layers persisted.
// The trace is what ckptd writes with PolicySpec.record_trace: a header line
// (layers with name, kind, bytes; the recorded config, with its budget) and
// one line per step (step, lr, per-layer normalized drift d, the layers
// persisted, and the budget's multiplier when one was set). Every combination
// of the listed values is replayed through the daemon's own LayerCheckPolicy;
// for each it prints layer writes, bytes written (and the fraction of policy
// `all`), the achieved bytes per step (and per second with a step time)
// against the budget, the bytes the forcing rules wrote (base, never
// persisted, staleness guard, full checkpoints), checkpoint events, mean and
// max staleness, mean size-weighted staleness and the mean multiplier of K0.
// Without options the recorded config (and budget) is replayed, and the
// steps whose persist set the replay reproduces are counted.
// Budget sizes accept the suffixes K, M, G (powers of 1000) and Ki, Mi, Gi.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/policy/layercheck.h"
#include "nlohmann/json.hpp"
#include "tools/flags.h"

namespace {

using ckpt::LayerCheckBudget;
using ckpt::LayerCheckConfig;
using ckpt::LayerCheckPolicy;

struct Step {
  uint64_t step;
  double lr;
  std::vector<double> d;
  std::vector<uint32_t> persist;
  bool has_persist = false;
  double unix_s = 0;
};

struct Result {
  LayerCheckConfig config;
  uint64_t layer_writes = 0, bytes = 0, forced_bytes = 0, events = 0, max_staleness = 0;
  double mean_staleness = 0, mean_weighted_staleness = 0, mean_multiplier = 0;
  double budget_bytes_per_step = 0, achieved_bytes_per_step = 0;
  uint64_t matching_steps = 0;  // persist set equal to the recorded one
  std::vector<uint64_t> series_bytes, series_max_staleness;
  std::vector<double> series_multiplier;
  std::vector<std::vector<uint32_t>> series_persist;
};

// A non-negative number with an optional K/M/G (1000) or Ki/Mi/Gi (1024) suffix.
bool ParseSize(absl::string_view s, double* out) {
  double scale = 1;
  const struct {
    const char* suffix;
    double scale;
  } units[] = {{"Ki", 1024.0}, {"Mi", 1048576.0}, {"Gi", 1073741824.0},
               {"K", 1e3},     {"M", 1e6},        {"G", 1e9}};
  for (const auto& u : units) {
    if (absl::EndsWith(s, u.suffix)) {
      s.remove_suffix(std::char_traits<char>::length(u.suffix));
      scale = u.scale;
      break;
    }
  }
  double v;
  if (!absl::SimpleAtod(s, &v) || !std::isfinite(v) || v < 0) return false;
  *out = v * scale;
  return true;
}

template <typename T>
bool ParseList(const std::string& s, std::vector<T>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    T v;
    if constexpr (std::is_same_v<T, double>) {
      if (!ParseSize(p, &v)) return false;
    } else {
      if (!absl::SimpleAtoi(p, &v)) return false;
    }
    out->push_back(v);
  }
  return !out->empty();
}

Result Replay(const LayerCheckConfig& config, const std::vector<ckpt::LayerKind>& kinds,
              const std::vector<uint64_t>& bytes, const std::vector<Step>& steps, bool series) {
  Result r;
  r.config = config;
  LayerCheckPolicy policy(config, kinds, {}, bytes);
  r.budget_bytes_per_step = policy.budget_bytes_per_step();
  const size_t n = kinds.size();
  double total_bytes = 0;
  for (uint64_t b : bytes) total_bytes += static_cast<double>(b);
  double staleness_sum = 0, weighted_sum = 0, multiplier_sum = 0;
  uint64_t samples = 0;
  for (const Step& s : steps) {
    std::vector<ckpt::drift::LayerSums> sums(n);
    for (size_t l = 0; l < n && l < s.d.size(); ++l) sums[l] = {s.d[l] * s.d[l], 1.0};
    std::vector<ckpt::LayerDecision> dec = policy.Decide(s.step, s.lr, sums, {});
    std::vector<uint32_t> persisted;
    double weighted = 0;
    uint64_t step_max = 0;
    for (size_t l = 0; l < n; ++l) {
      if (dec[l].reason != ckpt::PersistReason::kNone) {
        ++r.layer_writes;
        r.bytes += bytes[l];
        if (dec[l].reason != ckpt::PersistReason::kDrift) r.forced_bytes += bytes[l];
        persisted.push_back(static_cast<uint32_t>(l));
      }
      const uint64_t st = s.step - policy.last_persisted(l);
      step_max = std::max(step_max, st);
      staleness_sum += static_cast<double>(st);
      weighted += static_cast<double>(bytes[l]) * static_cast<double>(st);
    }
    r.max_staleness = std::max(r.max_staleness, step_max);
    weighted_sum += total_bytes > 0 ? weighted / total_bytes : 0;
    multiplier_sum += policy.k_multiplier();
    samples += n;
    if (!persisted.empty()) ++r.events;
    if (s.has_persist && persisted == s.persist) ++r.matching_steps;
    if (series) {
      r.series_bytes.push_back(policy.selected_bytes());
      r.series_max_staleness.push_back(step_max);
      r.series_multiplier.push_back(policy.k_multiplier());
      r.series_persist.push_back(persisted);
    }
  }
  const double count = static_cast<double>(steps.size());
  r.mean_staleness = samples ? staleness_sum / static_cast<double>(samples) : 0;
  r.mean_weighted_staleness = steps.empty() ? 0 : weighted_sum / count;
  r.mean_multiplier = steps.empty() ? 0 : multiplier_sum / count;
  r.achieved_bytes_per_step = steps.empty() ? 0 : static_cast<double>(r.bytes) / count;
  return r;
}

int Usage() {
  std::fprintf(stderr,
               "usage: ckpt_policy_sim --trace=FILE [--k0=LIST] [--s-max=LIST] [--warmup=LIST]\n"
               "         [--warmup-interval=N] [--k0-embedding=X] [--full-every=N]\n"
               "         [--budget-bytes-per-step=LIST | --budget-bytes-per-s=LIST --step-s=S |\n"
               "          --budget-share=LIST --step-s=S --device-write-bytes-per-s=X]\n"
               "         [--budget-k-min=X] [--budget-k-max=X] [--budget-horizon=N] [--no-budget]\n"
               "         [--json] [--series]\n");
  return 2;
}

// Which form the --budget-* values take.
enum class BudgetForm { kNone, kPerStep, kPerSecond, kShare };

// The command line.
struct Options {
  std::string trace;
  std::vector<double> k0s, budgets;
  std::vector<uint64_t> s_maxes, warmups;
  BudgetForm form = BudgetForm::kNone;
  LayerCheckConfig base;
  LayerCheckBudget budget_opts;  // the bounds and step time given on the command line
  bool json = false, series = false, no_budget = false, have_k0e = false, have_interval = false;
  bool have_k_min = false, have_k_max = false, have_horizon = false, have_step_s = false;
  bool overridden = false;  // anything but --json / --series
};

// Sets a --budget-bytes-per-step, --budget-bytes-per-s or --budget-share list;
// 2 after a message when another form was given already.
int SetBudgets(const std::string& k, const std::string& v, Options* o, bool* ok) {
  const BudgetForm f = k == "--budget-bytes-per-step" ? BudgetForm::kPerStep
                       : k == "--budget-bytes-per-s"  ? BudgetForm::kPerSecond
                                                      : BudgetForm::kShare;
  if (o->form != BudgetForm::kNone && o->form != f) {
    std::fprintf(stderr, "ckpt_policy_sim: give one form of budget\n");
    return 2;
  }
  o->form = f;
  *ok = ParseList(v, &o->budgets);
  return 0;
}

// Fills `o` from argv. Returns 0, or 2 after the usage text or a message.
int ParseOptions(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k != "--trace" && k != "--json" && k != "--series") o->overridden = true;
    if (k == "--trace") {
      o->trace = v;
    } else if (k == "--k0") {
      ok = ParseList(v, &o->k0s);
    } else if (k == "--s-max") {
      ok = ParseList(v, &o->s_maxes);
    } else if (k == "--warmup") {
      ok = ParseList(v, &o->warmups);
    } else if (k == "--warmup-interval") {
      ok = absl::SimpleAtoi(v, &o->base.warmup_interval);
      o->have_interval = true;
    } else if (k == "--k0-embedding") {
      ok = absl::SimpleAtod(v, &o->base.k0_embedding);
      o->have_k0e = true;
    } else if (k == "--full-every") {
      ok = absl::SimpleAtoi(v, &o->base.full_every);
    } else if (k == "--budget-bytes-per-step" || k == "--budget-bytes-per-s" ||
               k == "--budget-share") {
      if (int rc = SetBudgets(k, v, o, &ok); rc != 0) return rc;
    } else if (k == "--step-s") {
      ok = absl::SimpleAtod(v, &o->budget_opts.step_s);
      o->have_step_s = true;
    } else if (k == "--device-write-bytes-per-s") {
      ok = ParseSize(v, &o->budget_opts.device_write_bytes_per_s);
    } else if (k == "--budget-k-min") {
      ok = absl::SimpleAtod(v, &o->budget_opts.k_min);
      o->have_k_min = true;
    } else if (k == "--budget-k-max") {
      ok = absl::SimpleAtod(v, &o->budget_opts.k_max);
      o->have_k_max = true;
    } else if (k == "--budget-horizon") {
      ok = absl::SimpleAtoi(v, &o->budget_opts.horizon);
      o->have_horizon = true;
    } else if (k == "--no-budget") {
      o->no_budget = true;
    } else if (k == "--json") {
      o->json = true;
    } else if (k == "--series") {
      o->series = true;
    } else {
      return Usage();
    }
    if (!ok) {
      std::fprintf(stderr, "ckpt_policy_sim: bad value for %s\n", k.c_str());
      return 2;
    }
  }
  if (o->trace.empty()) return Usage();
  return 0;
}

// What a trace holds: the layer table, the steps (the newest timeline when
// a restart replayed some) and the recorded config.
struct Trace {
  std::vector<ckpt::LayerKind> kinds;
  std::vector<uint64_t> bytes;
  std::vector<Step> steps;
  LayerCheckConfig recorded;
  bool recorded_budget = false;
};

// A header's recorded config, over the defaults in `t`.
void ReadRecordedConfig(const nlohmann::json& c, Trace* t) {
  LayerCheckConfig& recorded = t->recorded;
  recorded.k0 = c.value("k0", recorded.k0);
  recorded.k0_embedding = c.value("k0_embedding", recorded.k0_embedding);
  recorded.k_floor = c.value("k_floor", recorded.k_floor);
  recorded.s_max = c.value("s_max", recorded.s_max);
  recorded.warmup = c.value("warmup", recorded.warmup);
  recorded.warmup_interval = c.value("warmup_interval", recorded.warmup_interval);
  recorded.full_every = c.value("full_every", recorded.full_every);
  if (c.contains("budget") && c["budget"].is_object()) {
    const auto& b = c["budget"];
    t->recorded_budget = true;
    recorded.budget.bytes_per_step = b.value("bytes_per_step", 0.0);
    recorded.budget.step_s = b.value("step_s", 0.0);
    recorded.budget.k_min = b.value("k_min", recorded.budget.k_min);
    recorded.budget.k_max = b.value("k_max", recorded.budget.k_max);
    recorded.budget.horizon = b.value("horizon", recorded.budget.horizon);
    recorded.budget.layer_bytes = b.value("layer_bytes", std::vector<uint64_t>{});
  }
}

// A header: a (re-)registration. Later headers must describe the same
// model; false after a message when one does not.
bool ReadHeader(const nlohmann::json& j, Trace* t) {
  std::vector<ckpt::LayerKind> k;
  std::vector<uint64_t> b;
  for (const auto& l : j["layers"]) {
    k.push_back(static_cast<ckpt::LayerKind>(l.value("kind", 2)));
    b.push_back(l.value("bytes", uint64_t{0}));
  }
  if (!t->kinds.empty() && (k != t->kinds || b != t->bytes)) {
    std::fprintf(stderr, "ckpt_policy_sim: the trace changes its layer table\n");
    return false;
  }
  t->kinds = k;
  t->bytes = b;
  if (j.contains("config") && j["config"].is_object()) ReadRecordedConfig(j["config"], t);
  return true;
}

// A step line, appended to the steps.
void AddStep(const nlohmann::json& j, std::vector<Step>* steps) {
  Step s{j["step"].get<uint64_t>(), j.value("lr", 0.0),    j["d"].get<std::vector<double>>(), {},
         j.contains("persist"),     j.value("unix_s", 0.0)};
  if (s.has_persist) s.persist = j["persist"].get<std::vector<uint32_t>>();
  if (!steps->empty() && s.step <= steps->back().step) {
    // A restart replayed steps: keep the newest timeline.
    while (!steps->empty() && steps->back().step >= s.step) steps->pop_back();
  }
  steps->push_back(std::move(s));
}

// Reads the trace at `path`. Returns 0, or 1 after a message.
int ReadTrace(const std::string& path, Trace* t) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "ckpt_policy_sim: cannot read %s\n", path.c_str());
    return 1;
  }
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;  // a torn last line
    if (j.contains("layers") && j["layers"].is_array() && j["layers"].size() > 0 &&
        j["layers"][0].is_object()) {
      if (!ReadHeader(j, t)) return 1;
      continue;
    }
    if (!j.contains("step") || !j.contains("d")) continue;
    AddStep(j, &t->steps);
  }
  if (t->kinds.empty() || t->steps.empty()) {
    std::fprintf(stderr, "ckpt_policy_sim: %s has no header or no steps\n", path.c_str());
    return 1;
  }
  return 0;
}

// What the command line leaves open comes from the recorded config.
void UseRecorded(const Trace& t, Options* o) {
  const LayerCheckConfig& recorded = t.recorded;
  if (o->k0s.empty()) o->k0s = {recorded.k0};
  if (o->s_maxes.empty()) o->s_maxes = {recorded.s_max};
  if (o->warmups.empty()) o->warmups = {recorded.warmup};
  if (!o->have_k0e) o->base.k0_embedding = recorded.k0_embedding;
  if (!o->have_interval) o->base.warmup_interval = recorded.warmup_interval;
  o->base.k_floor = recorded.k_floor;
  if (o->base.full_every == 0) o->base.full_every = recorded.full_every;
}

// The budgets to replay: the command line's, else the recorded one (unless
// --no-budget), with the command line's bounds and step time.
std::vector<LayerCheckBudget> BudgetsToReplay(const Options& o, const Trace& t) {
  LayerCheckBudget budget_base =
      t.recorded_budget && !o.no_budget ? t.recorded.budget : LayerCheckBudget();
  if (o.have_k_min) budget_base.k_min = o.budget_opts.k_min;
  if (o.have_k_max) budget_base.k_max = o.budget_opts.k_max;
  if (o.have_horizon) budget_base.horizon = o.budget_opts.horizon;
  if (o.have_step_s) budget_base.step_s = o.budget_opts.step_s;
  budget_base.device_write_bytes_per_s = o.budget_opts.device_write_bytes_per_s;
  std::vector<LayerCheckBudget> budget_list;
  if (o.form == BudgetForm::kNone) {
    budget_list.push_back(budget_base);
    return budget_list;
  }
  for (double b : o.budgets) {
    LayerCheckBudget x = budget_base;
    x.bytes_per_step = x.bytes_per_s = x.share = 0;
    (o.form == BudgetForm::kPerStep     ? x.bytes_per_step
     : o.form == BudgetForm::kPerSecond ? x.bytes_per_s
                                        : x.share) = b;
    budget_list.push_back(x);
  }
  return budget_list;
}

// The step interval the recorded wall times imply (median of the gaps
// between consecutive steps); 0 without wall times.
double MeasuredStepSeconds(const std::vector<Step>& steps) {
  std::vector<double> gaps;
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i].unix_s > 0 && steps[i - 1].unix_s > 0 && steps[i].step == steps[i - 1].step + 1) {
      gaps.push_back(steps[i].unix_s - steps[i - 1].unix_s);
    }
  }
  if (gaps.empty()) return 0;
  std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
  return gaps[gaps.size() / 2];
}

// Replays every combination of the listed values. Returns 0, or 2 after a
// message for a combination that is not a valid config.
int ReplayAll(const Options& o, const Trace& t, std::vector<Result>* results) {
  const std::vector<LayerCheckBudget> budget_list = BudgetsToReplay(o, t);
  for (double k0 : o.k0s) {
    for (uint64_t s_max : o.s_maxes) {
      for (uint64_t w : o.warmups) {
        for (const LayerCheckBudget& b : budget_list) {
          LayerCheckConfig c = o.base;
          c.k0 = k0;
          c.s_max = s_max;
          c.warmup = w;
          c.budget = b;
          if (absl::Status st = c.Validate(); !st.ok()) {
            std::fprintf(stderr, "ckpt_policy_sim: invalid config (k0=%g s_max=%lu): %s\n", k0,
                         static_cast<unsigned long>(s_max), std::string(st.message()).c_str());
            return 2;
          }
          results->push_back(Replay(c, t.kinds, t.bytes, t.steps, o.series));
        }
      }
    }
  }
  return 0;
}

// The report's inputs besides the results.
struct Totals {
  uint64_t all_bytes = 0;      // what policy `all` would write over the trace
  double measured_step_s = 0;  // MeasuredStepSeconds
  // Seconds per step for the per-second figures: the budget's declared step
  // time, else the one the trace's wall times imply.
  double StepSeconds(const Result& r) const {
    return r.config.budget.step_s > 0 ? r.config.budget.step_s : measured_step_s;
  }
};

// One result as JSON.
nlohmann::json ResultJson(const Options& o, const Totals& totals, const Result& r) {
  const uint64_t all_bytes = totals.all_bytes;
  nlohmann::json x = {{"k0", r.config.k0},
                      {"s_max", r.config.s_max},
                      {"warmup", r.config.warmup},
                      {"layer_writes", r.layer_writes},
                      {"bytes", r.bytes},
                      {"bytes_fraction_of_all", all_bytes ? double(r.bytes) / all_bytes : 0},
                      {"forced_bytes", r.forced_bytes},
                      {"achieved_bytes_per_step", r.achieved_bytes_per_step},
                      {"events", r.events},
                      {"mean_staleness", r.mean_staleness},
                      {"max_staleness", r.max_staleness},
                      {"mean_size_weighted_staleness", r.mean_weighted_staleness},
                      {"mean_k_multiplier", r.mean_multiplier}};
  if (r.budget_bytes_per_step > 0) {
    x["budget_bytes_per_step"] = r.budget_bytes_per_step;
    x["achieved_over_budget"] = r.achieved_bytes_per_step / r.budget_bytes_per_step;
    x["budget_k_min"] = r.config.budget.k_min;
    x["budget_k_max"] = r.config.budget.k_max;
    x["budget_horizon"] = r.config.budget.horizon;
  }
  const double step_s = totals.StepSeconds(r);
  if (step_s > 0) {
    x["step_s"] = step_s;
    x["achieved_bytes_per_s"] = r.achieved_bytes_per_step / step_s;
    if (r.budget_bytes_per_step > 0) {
      x["budget_bytes_per_s"] = r.budget_bytes_per_step / step_s;
    }
  }
  if (!o.overridden) x["steps_matching_trace"] = r.matching_steps;
  if (o.series) {
    x["series"] = {{"bytes", r.series_bytes},
                   {"max_staleness", r.series_max_staleness},
                   {"k_multiplier", r.series_multiplier},
                   {"persist", r.series_persist}};
  }
  return x;
}

// --json: one document with the trace's figures and one object per result.
void PrintJson(const Options& o, const Trace& t, const Totals& totals,
               const std::vector<Result>& results) {
  nlohmann::json out;
  out["steps"] = t.steps.size();
  out["layers"] = t.kinds.size();
  out["bytes_all"] = totals.all_bytes;
  out["measured_step_s"] = totals.measured_step_s;
  for (const Result& r : results) out["results"].push_back(ResultJson(o, totals, r));
  std::printf("%s\n", out.dump(2).c_str());
}

// The table: one line per result, then the per-second figures and, for a
// replay of the recorded config, how much of the trace it reproduces.
void PrintTable(const Options& o, const Trace& t, const Totals& totals,
                const std::vector<Result>& results) {
  const std::vector<Step>& steps = t.steps;
  const uint64_t all_bytes = totals.all_bytes;
  std::printf("trace: %zu steps (%lu..%lu), %zu layers; policy all would write %.1f MiB",
              steps.size(), static_cast<unsigned long>(steps.front().step),
              static_cast<unsigned long>(steps.back().step), t.kinds.size(), all_bytes / 1048576.0);
  if (totals.measured_step_s > 0) {
    std::printf("; recorded step interval %.3f s (median)", totals.measured_step_s);
  }
  std::printf("\n");
  std::printf("%9s %5s %6s %7s %11s %11s %7s %7s %8s %7s %10s %9s %8s %6s\n", "K0", "S_MAX",
              "WARMUP", "WRITES", "MIB WRITTEN", "BUDGET/STEP", "ACHIEVED", "FORCED", "OF ALL",
              "EVENTS", "MEAN STALE", "MAX STALE", "SW STALE", "K MULT");
  for (const Result& r : results) {
    std::string budget = "-", achieved = "-";
    if (r.budget_bytes_per_step > 0) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.2f MiB", r.budget_bytes_per_step / 1048576.0);
      budget = buf;
      std::snprintf(buf, sizeof(buf), "%.3fx", r.achieved_bytes_per_step / r.budget_bytes_per_step);
      achieved = buf;
    }
    std::printf(
        "%9.1e %5lu %6lu %7lu %11.1f %11s %7s %6.1f%% %7.1f%% %7lu %10.2f %9lu %8.2f %6.2f\n",
        r.config.k0, static_cast<unsigned long>(r.config.s_max),
        static_cast<unsigned long>(r.config.warmup), static_cast<unsigned long>(r.layer_writes),
        r.bytes / 1048576.0, budget.c_str(), achieved.c_str(),
        r.bytes ? 100.0 * r.forced_bytes / r.bytes : 0.0,
        all_bytes ? 100.0 * r.bytes / all_bytes : 0.0, static_cast<unsigned long>(r.events),
        r.mean_staleness, static_cast<unsigned long>(r.max_staleness), r.mean_weighted_staleness,
        r.mean_multiplier);
  }
  std::printf(
      "ACHIEVED = bytes written per step / BUDGET/STEP; FORCED = share of the bytes "
      "written by the base, never-persisted, staleness and full-checkpoint rules.\n");
  for (const Result& r : results) {
    const double step_s = totals.StepSeconds(r);
    if (r.budget_bytes_per_step > 0 && step_s > 0) {
      std::printf("K0 %.1e budget %.2f MiB/s -> achieved %.2f MiB/s (%.3f s per step%s)\n",
                  r.config.k0, r.budget_bytes_per_step / step_s / 1048576.0,
                  r.achieved_bytes_per_step / step_s / 1048576.0, step_s,
                  r.config.budget.step_s > 0 ? ", declared" : ", from the trace's wall times");
    }
  }
  if (!o.overridden) {
    for (const Result& r : results) {
      std::printf(
          "replay of the recorded config: %lu of %zu steps persist what the trace "
          "recorded\n",
          static_cast<unsigned long>(r.matching_steps), steps.size());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (int rc = ParseOptions(argc, argv, &o); rc != 0) return rc;
  Trace t;
  if (int rc = ReadTrace(o.trace, &t); rc != 0) return rc;
  UseRecorded(t, &o);
  Totals totals;
  totals.measured_step_s = MeasuredStepSeconds(t.steps);
  for (uint64_t b : t.bytes) totals.all_bytes += b;
  totals.all_bytes *= t.steps.size();
  std::vector<Result> results;
  if (int rc = ReplayAll(o, t, &results); rc != 0) return rc;
  if (o.json) {
    PrintJson(o, t, totals, results);
  } else {
    PrintTable(o, t, totals, results);
  }
  return 0;
}
