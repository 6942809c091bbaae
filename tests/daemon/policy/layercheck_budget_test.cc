// LayerCheck under a write budget, and LayerCheck's defaults on a real
// fine-tuning trace (docs/fidelity/traces, recorded by ckptd in the
// fidelity experiment).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "daemon/policy/layercheck.h"
#include "nlohmann/json.hpp"

namespace ckpt {
namespace {

// A drift trace: per step the LR and each layer's normalized drift.
struct DriftTrace {
  std::vector<LayerKind> kinds;
  std::vector<uint64_t> bytes;
  std::vector<uint64_t> steps;
  std::vector<double> lr;
  std::vector<std::vector<double>> d;
};

// Synthetic: layers of different sizes and drift scales, noise and rare
// spikes, an LR warm-up and a decay.
DriftTrace Synthetic(uint64_t seed, size_t layers, uint64_t steps) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> scale(std::log(2e-4), 0.7);
  std::uniform_real_distribution<double> u(0, 1);
  DriftTrace t;
  std::vector<double> layer_scale(layers);
  for (size_t l = 0; l < layers; ++l) {
    t.kinds.push_back(l == 0 ? LayerKind::kEmbedding : LayerKind::kBlock);
    t.bytes.push_back((1 + rng() % 16) << 20);
    layer_scale[l] = scale(rng);
  }
  for (uint64_t s = 1; s <= steps; ++s) {
    t.steps.push_back(s);
    t.lr.push_back(1e-4 * std::min(1.0, s / 20.0) * (1.0 - 0.8 * s / static_cast<double>(steps)));
    std::vector<double> d(layers);
    for (size_t l = 0; l < layers; ++l) {
      d[l] = layer_scale[l] * (u(rng) < 0.01 ? 10.0 : 0.5 + u(rng)) * t.lr.back() / 1e-4;
    }
    t.d.push_back(std::move(d));
  }
  return t;
}

// A drift.jsonl from the fidelity experiment (its first registration).
DriftTrace FromFile(const std::string& name) {
  const std::string path = std::string(CKPT_SOURCE_DIR) + "/docs/fidelity/traces/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot read " << path;
  DriftTrace t;
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    if (j.contains("layers") && !j.contains("step")) {
      if (!t.kinds.empty()) break;  // a later registration: keep the first timeline
      for (const auto& l : j["layers"]) {
        t.kinds.push_back(static_cast<LayerKind>(l["kind"].get<int>()));
        t.bytes.push_back(l["bytes"].get<uint64_t>());
      }
      continue;
    }
    if (!t.steps.empty() && j["step"].get<uint64_t>() <= t.steps.back()) break;
    t.steps.push_back(j["step"].get<uint64_t>());
    t.lr.push_back(j["lr"].get<double>());
    t.d.push_back(j["d"].get<std::vector<double>>());
  }
  return t;
}

struct Outcome {
  uint64_t bytes = 0;          // selected over the trace
  uint64_t forced_bytes = 0;   // selected by another reason than drift
  uint64_t max_staleness = 0;  // after the base checkpoint
  double mean_multiplier = 0;
  std::vector<std::vector<uint64_t>> persist_steps;  // per layer
  std::vector<double> multipliers;
};

Outcome Replay(const LayerCheckConfig& c, const DriftTrace& t) {
  LayerCheckPolicy p(c, t.kinds, {}, t.bytes);
  Outcome o;
  o.persist_steps.resize(t.kinds.size());
  for (size_t i = 0; i < t.steps.size(); ++i) {
    std::vector<drift::LayerSums> sums(t.kinds.size());
    for (size_t l = 0; l < sums.size(); ++l) sums[l] = {t.d[i][l] * t.d[i][l], 1.0};
    std::vector<LayerDecision> dec = p.Decide(t.steps[i], t.lr[i], sums, {});
    uint64_t step_bytes = 0;
    for (size_t l = 0; l < dec.size(); ++l) {
      if (dec[l].reason == PersistReason::kNone) continue;
      step_bytes += t.bytes[l];
      if (dec[l].reason != PersistReason::kDrift) o.forced_bytes += t.bytes[l];
      o.persist_steps[l].push_back(t.steps[i]);
    }
    EXPECT_EQ(p.selected_bytes(), step_bytes);
    o.bytes += step_bytes;
    o.multipliers.push_back(p.k_multiplier());
    o.mean_multiplier += p.k_multiplier() / static_cast<double>(t.steps.size());
    if (t.steps[i] >= std::max<uint64_t>(c.warmup, 1)) {
      for (size_t l = 0; l < dec.size(); ++l) {
        o.max_staleness = std::max(o.max_staleness, t.steps[i] - p.last_persisted(l));
      }
    }
  }
  return o;
}

double Rate(const Outcome& o, const DriftTrace& t) {
  return static_cast<double>(o.bytes) / static_cast<double>(t.steps.size());
}

// The average write rate converges to the budget: within 10 % on 1000
// steps, for budgets from a fifth of the unbudgeted rate to twice it, while
// the staleness guard holds.
TEST(LayerCheckBudget, RateConvergesToTheBudget) {
  for (uint64_t seed : {1, 2, 3}) {
    const DriftTrace t = Synthetic(seed, 24, 1000);
    LayerCheckConfig c;
    c.s_max = 200;
    const double free_rate = Rate(Replay(c, t), t);
    uint64_t total = 0;
    for (uint64_t b : t.bytes) total += b;
    for (double frac : {0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0}) {
      LayerCheckConfig b = c;
      b.budget.bytes_per_step = frac * free_rate;
      ASSERT_GT(b.budget.bytes_per_step, 1.5 * total / c.s_max) << "a budget the guard allows";
      ASSERT_TRUE(b.Validate().ok());
      const Outcome o = Replay(b, t);
      const double ratio = Rate(o, t) / b.budget.bytes_per_step;
      EXPECT_NEAR(ratio, 1.0, 0.10) << "seed " << seed << " budget " << frac << " of the rate";
      EXPECT_LT(o.max_staleness, c.s_max) << "seed " << seed << " budget " << frac;
    }
  }
}

// Every 100-step window after the first 200 steps stays within 25 % of the
// budget: the controller settles instead of alternating between long
// silences and bursts.
TEST(LayerCheckBudget, RateSettlesInEveryWindow) {
  const DriftTrace t = Synthetic(7, 24, 1200);
  LayerCheckConfig c;
  c.budget.bytes_per_step = 0.4 * Rate(Replay(c, t), t);
  LayerCheckPolicy p(c, t.kinds, {}, t.bytes);
  double window = 0;
  for (size_t i = 0; i < t.steps.size(); ++i) {
    std::vector<drift::LayerSums> sums(t.kinds.size());
    for (size_t l = 0; l < sums.size(); ++l) sums[l] = {t.d[i][l] * t.d[i][l], 1.0};
    p.Decide(t.steps[i], t.lr[i], sums, {});
    if (i >= 200) window += static_cast<double>(p.selected_bytes());
    if (i >= 200 && (i + 1) % 100 == 0) {
      EXPECT_NEAR(window / 100 / c.budget.bytes_per_step, 1.0, 0.25) << "steps up to " << i + 1;
      window = 0;
    }
  }
}

// A budget the staleness guard cannot keep: the guard wins (no layer gets
// S_max steps old), the rate exceeds the budget by what the guard forces,
// and the drift rule adds next to nothing: the debt the guard's writes run
// up keeps the multiplier at k_max.
TEST(LayerCheckBudget, TheStalenessGuardWinsOverTheBudget) {
  const DriftTrace t = Synthetic(11, 16, 600);
  uint64_t total = 0;
  for (uint64_t b : t.bytes) total += b;
  LayerCheckConfig c;
  c.s_max = 50;
  c.budget.bytes_per_step = 0.25 * total / c.s_max;  // a quarter of what the guard writes
  c.budget.k_max = 100;
  const Outcome o = Replay(c, t);
  EXPECT_LT(o.max_staleness, c.s_max);
  EXPECT_GT(Rate(o, t), 3.0 * c.budget.bytes_per_step);
  EXPECT_GT(o.forced_bytes, o.bytes * 97 / 100) << "the bytes are the guard's and the base's";
  EXPECT_GT(o.mean_multiplier, 0.9 * c.budget.k_max);
  for (double m : o.multipliers) {
    EXPECT_GE(m, c.budget.k_min);
    EXPECT_LE(m, c.budget.k_max);
  }
}

// The multiplier never leaves [k_min, k_max]; with budgets above what the
// drift rule needs, it goes below 1 down to k_min and no further, and the
// rate stays below the budget when even k_min cannot spend it.
TEST(LayerCheckBudget, MultiplierStaysWithinItsBounds) {
  const DriftTrace t = Synthetic(5, 12, 400);
  LayerCheckConfig c;
  const double free_rate = Rate(Replay(c, t), t);
  c.budget.bytes_per_step = 3 * free_rate;
  c.budget.k_min = 0.5;
  c.budget.k_max = 4;
  const Outcome o = Replay(c, t);
  for (double m : o.multipliers) {
    EXPECT_GE(m, 0.5);
    EXPECT_LE(m, 4.0);
  }
  EXPECT_DOUBLE_EQ(o.multipliers.back(), 0.5);
  EXPECT_LT(Rate(o, t), c.budget.bytes_per_step);
  EXPECT_GT(Rate(o, t), free_rate);  // it spent what k_min allowed
}

// Two policies fed the same inputs decide the same and hold the same
// multiplier bit for bit; so do two ranks that count the same layer_bytes
// although each registered a shard of a different size.
TEST(LayerCheckBudget, IdenticalInputsGiveIdenticalMultipliers) {
  const DriftTrace t = Synthetic(3, 10, 500);
  LayerCheckConfig c;
  c.budget.bytes_per_step = 0.3 * Rate(Replay(c, t), t);
  c.budget.layer_bytes = t.bytes;  // the whole layers, as every rank names them
  std::vector<uint64_t> shard0, shard1;
  for (uint64_t b : t.bytes) {
    shard0.push_back((b + 2) / 3 * 2);  // uneven shards of the same layers
    shard1.push_back(b - (b + 2) / 3 * 2);
  }
  LayerCheckPolicy a(c, t.kinds, {}, shard0), b(c, t.kinds, {}, shard1);
  for (size_t i = 0; i < t.steps.size(); ++i) {
    std::vector<drift::LayerSums> sums(t.kinds.size());
    for (size_t l = 0; l < sums.size(); ++l) sums[l] = {t.d[i][l] * t.d[i][l], 1.0};
    std::vector<LayerDecision> da = a.Decide(t.steps[i], t.lr[i], sums, {});
    std::vector<LayerDecision> db = b.Decide(t.steps[i], t.lr[i], sums, {});
    ASSERT_EQ(a.k_multiplier(), b.k_multiplier()) << "step " << t.steps[i];
    ASSERT_EQ(a.budget_ledger(), b.budget_ledger());
    for (size_t l = 0; l < da.size(); ++l) {
      ASSERT_EQ(da[l].reason, db[l].reason) << "step " << t.steps[i] << " layer " << l;
      ASSERT_EQ(da[l].threshold, db[l].threshold);
    }
  }
  // Without the common list, the shards' own sizes differ, and so would
  // their multipliers: the engine refuses that configuration.
  LayerCheckConfig own = c;
  own.budget.layer_bytes.clear();
  LayerCheckPolicy x(own, t.kinds, {}, shard0), y(own, t.kinds, {}, shard1);
  bool differ = false;
  for (size_t i = 0; i < t.steps.size() && !differ; ++i) {
    std::vector<drift::LayerSums> sums(t.kinds.size());
    for (size_t l = 0; l < sums.size(); ++l) sums[l] = {t.d[i][l] * t.d[i][l], 1.0};
    x.Decide(t.steps[i], t.lr[i], sums, {});
    y.Decide(t.steps[i], t.lr[i], sums, {});
    differ = x.k_multiplier() != y.k_multiplier();
  }
  EXPECT_TRUE(differ);
}

// A layer forced on one rank only (a retry after that rank's failed write)
// is written there but not charged: the multiplier the next step uses is
// the same on both ranks, and the forced bytes show in selected_bytes().
TEST(LayerCheckBudget, ARetryOnOneRankIsNotCharged) {
  const DriftTrace t = Synthetic(9, 8, 120);
  LayerCheckConfig c;
  c.budget.bytes_per_step = 0.3 * Rate(Replay(c, t), t);
  LayerCheckPolicy a(c, t.kinds, {}, t.bytes), b(c, t.kinds, {}, t.bytes);
  int retries = 0;
  for (size_t i = 0; i < 60; ++i) {
    std::vector<drift::LayerSums> sums(t.kinds.size());
    for (size_t l = 0; l < sums.size(); ++l) sums[l] = {t.d[i][l] * t.d[i][l], 1.0};
    std::vector<bool> forced(t.kinds.size(), false);
    size_t victim = 0;
    if (t.steps[i] == 40) {  // rank a retries a layer the rules do not select at step 40
      LayerCheckPolicy probe = b;
      std::vector<LayerDecision> dp = probe.Decide(t.steps[i], t.lr[i], sums, {});
      while (victim < dp.size() && dp[victim].reason != PersistReason::kNone) ++victim;
      ASSERT_LT(victim, dp.size());
      forced[victim] = true;
    }
    std::vector<LayerDecision> da = a.Decide(t.steps[i], t.lr[i], sums, forced);
    std::vector<LayerDecision> db = b.Decide(t.steps[i], t.lr[i], sums, {});
    ASSERT_EQ(a.next_k_multiplier(), b.next_k_multiplier()) << "step " << t.steps[i];
    ASSERT_EQ(a.budget_ledger(), b.budget_ledger());
    if (t.steps[i] == 40 && db[victim].reason == PersistReason::kNone) {
      ++retries;
      EXPECT_EQ(da[victim].reason, PersistReason::kForced);
      EXPECT_EQ(a.selected_bytes(), b.selected_bytes() + t.bytes[victim]);
      break;  // layer `victim`'s own state now differs between the two
    }
  }
  EXPECT_EQ(retries, 1) << "the forced layer was one the rules did not select";
}

// The multiplier's map is 2^x at integers, continuous and increasing in
// between, and its inverse returns x.
TEST(LayerCheckBudget, MultiplierMapAndItsInverse) {
  EXPECT_EQ(BudgetMultiplier(0), 1.0);
  EXPECT_EQ(BudgetMultiplier(3), 8.0);
  EXPECT_EQ(BudgetMultiplier(-2), 0.25);
  EXPECT_EQ(BudgetMultiplier(2.5), 6.0);  // halfway between 4 and 8
  double prev = 0;
  for (double x = -8; x <= 8; x += 1.0 / 64) {
    const double m = BudgetMultiplier(x);
    EXPECT_GT(m, prev);
    EXPECT_NEAR(BudgetMultiplier(x - 1e-9), m, 1e-6 * m);  // no jump at integers
    EXPECT_DOUBLE_EQ(BudgetExponent(m), x);
    prev = m;
  }
}

TEST(LayerCheckBudget, ValidationNamesWhatIsWrong) {
  auto error = [](LayerCheckBudget b) { return std::string(b.Validate().message()); };
  LayerCheckBudget b;
  EXPECT_TRUE(b.Validate().ok());  // no budget
  EXPECT_FALSE(b.enabled());
  b.bytes_per_s = 1e8;
  EXPECT_NE(error(b).find("step_s"), std::string::npos);
  b.step_s = 0.5;
  EXPECT_TRUE(b.Validate().ok());
  EXPECT_DOUBLE_EQ(b.BytesPerStep(), 5e7);
  b.bytes_per_step = 1e6;
  EXPECT_NE(error(b).find("one of"), std::string::npos);
  b = LayerCheckBudget();
  b.share = 0.5;
  b.step_s = 2;
  EXPECT_NE(error(b).find("device_write_bytes_per_s"), std::string::npos);
  b.device_write_bytes_per_s = 1e9;
  EXPECT_TRUE(b.Validate().ok());
  EXPECT_DOUBLE_EQ(b.BytesPerStep(), 1e9);
  b.share = 1.5;
  EXPECT_NE(error(b).find("above 1"), std::string::npos);
  b = LayerCheckBudget();
  b.bytes_per_step = 1e6;
  b.k_min = 2;
  b.k_max = 1;
  EXPECT_NE(error(b).find("k_min"), std::string::npos);
  b.k_max = 2;
  EXPECT_TRUE(b.Validate().ok());
  b.horizon = 0;
  EXPECT_NE(error(b).find("horizon"), std::string::npos);
  b.horizon = 10;
  b.bytes_per_step = std::nan("");
  EXPECT_FALSE(b.Validate().ok());
  b.bytes_per_step = 0.5;
  EXPECT_NE(error(b).find("at least 1"), std::string::npos);
  b.bytes_per_step = 1e6;
  b.layer_bytes = {4, 0};
  EXPECT_NE(error(b).find("layer_bytes"), std::string::npos);
  LayerCheckConfig c;
  c.budget.bytes_per_s = 1;
  EXPECT_FALSE(c.Validate().ok()) << "the config validates its budget";
}

// The fidelity experiment's traces (200 fine-tuning steps): a budget between
// the staleness guard's floor and twice the unbudgeted rate is met within
// 10 % on each of them.
TEST(LayerCheckBudget, FidelityTracesMeetTheirBudgets) {
  for (const char* name :
       {"lc_1e-4_ff.drift.jsonl", "lc_1e-3_ff.drift.jsonl", "lc_1e-2_ff.drift.jsonl"}) {
    const DriftTrace t = FromFile(name);
    ASSERT_GE(t.steps.size(), 100u) << name;
    uint64_t total = 0;
    for (uint64_t b : t.bytes) total += b;
    LayerCheckConfig c;
    c.s_max = 50;                                      // the experiment's
    for (double frac : {0.04, 0.06, 0.1, 0.2, 0.4}) {  // of a full checkpoint per step
      c.budget.bytes_per_step = frac * static_cast<double>(total);
      const Outcome o = Replay(c, t);
      EXPECT_NEAR(Rate(o, t) / c.budget.bytes_per_step, 1.0, 0.10) << name << " budget " << frac;
      EXPECT_LT(o.max_staleness, c.s_max) << name;
    }
  }
}

// ckptd's default LayerCheck on a 200-step fine-tune: after the base
// checkpoint at the first step the drift rule picks layers at different
// steps; the pre-change default (a warm-up of 200 steps with a full
// checkpoint every 50) persisted every layer at the same five steps.
TEST(LayerCheckDefaults, AShortFineTunePersistsLayersAtDifferentSteps) {
  const DriftTrace t = FromFile("lc_1e-3_ff.drift.jsonl");
  ASSERT_EQ(t.steps.size(), 200u);
  const LayerCheckConfig defaults;
  EXPECT_LE(defaults.warmup, 1u);
  EXPECT_FALSE(defaults.budget.enabled());
  const Outcome o = Replay(defaults, t);
  std::set<std::vector<uint64_t>> schedules;
  std::set<uint64_t> steps;
  size_t layers_by_drift = 0;
  for (const std::vector<uint64_t>& p : o.persist_steps) {
    ASSERT_FALSE(p.empty());
    EXPECT_EQ(p.front(), 1u) << "the base checkpoint";
    layers_by_drift += p.size() > 1;
    schedules.insert(p);
    steps.insert(p.begin(), p.end());
  }
  EXPECT_GE(layers_by_drift, t.kinds.size() / 2) << "most layers are persisted again by drift";
  EXPECT_GE(schedules.size(), t.kinds.size() / 2) << "layers follow their own schedules";
  EXPECT_GT(steps.size(), 20u) << "checkpoints spread over the run";
  EXPECT_LT(steps.size(), t.steps.size()) << "and the rule skips steps";
  // Most blocks are first persisted again within the first 20 steps.
  size_t early = 0;
  for (const std::vector<uint64_t>& p : o.persist_steps) early += p.size() > 1 && p[1] <= 20;
  EXPECT_GE(early, t.kinds.size() / 2);

  LayerCheckConfig old = defaults;
  old.warmup = 200;
  old.warmup_interval = 50;
  const Outcome w = Replay(old, t);
  for (const std::vector<uint64_t>& p : w.persist_steps) {
    EXPECT_EQ(p, (std::vector<uint64_t>{1, 50, 100, 150, 200}));
  }
}

}  // namespace
}  // namespace ckpt
