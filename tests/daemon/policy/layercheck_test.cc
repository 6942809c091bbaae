// Property tests of the LayerCheck policy over random drift sequences.
#include "daemon/policy/layercheck.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace ckpt {
namespace {

struct Trace {
  std::vector<double> lr;  // per step (index = step - 1)
  std::vector<std::vector<drift::LayerSums>> sums;
};

// Random per-layer drift: each layer has its own scale, some steps spike, some
// layers are nearly frozen; the LR follows a warm-up + decay schedule.
Trace RandomTrace(uint64_t seed, size_t layers, uint64_t steps) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> scale(std::log(3e-4), 1.5);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> layer_scale(layers);
  for (double& s : layer_scale) s = scale(rng);
  Trace t;
  for (uint64_t s = 1; s <= steps; ++s) {
    const double lr = 1e-3 * std::min(1.0, s / 50.0) * (1.0 - 0.9 * s / static_cast<double>(steps));
    t.lr.push_back(lr);
    std::vector<drift::LayerSums> v(layers);
    for (size_t l = 0; l < layers; ++l) {
      double d = layer_scale[l] * (u(rng) < 0.02 ? 20.0 : u(rng));
      const double w2 = 1.0 + 100.0 * u(rng);
      v[l] = drift::LayerSums{d * d * w2, w2};
    }
    t.sums.push_back(std::move(v));
  }
  return t;
}

std::vector<LayerKind> Kinds(size_t n) {
  std::vector<LayerKind> k(n, LayerKind::kBlock);
  k[0] = LayerKind::kEmbedding;
  k[n - 1] = LayerKind::kHead;
  return k;
}

class LayerCheckProperties : public ::testing::TestWithParam<uint64_t> {};

// After the base checkpoint, no layer's newest selected version is S_max or
// more steps old; a layer is persisted at t iff its rule holds; D resets.
TEST_P(LayerCheckProperties, RulesHoldAtEveryStep) {
  const uint64_t seed = GetParam();
  std::mt19937_64 rng(seed);
  LayerCheckConfig c;
  c.s_max = 5 + rng() % 60;
  c.warmup = rng() % 40;
  c.warmup_interval = 1 + rng() % 15;
  c.k0 = std::pow(10.0, -4.0 + (rng() % 300) / 100.0);
  c.full_every = rng() % 3 == 0 ? 25 + rng() % 50 : 0;
  const size_t layers = 3 + rng() % 10;
  const uint64_t steps = 400;
  Trace t = RandomTrace(seed, layers, steps);
  LayerCheckPolicy p(c, Kinds(layers));

  std::vector<uint64_t> last(layers, 0);
  std::vector<double> acc(layers, 0.0);
  double lr_ref = 0;  // the largest learning rate so far
  for (uint64_t s = 1; s <= steps; ++s) {
    std::vector<LayerDecision> dec = p.Decide(s, t.lr[s - 1], t.sums[s - 1], {});
    lr_ref = std::max(lr_ref, t.lr[s - 1]);
    ASSERT_EQ(dec.size(), layers);
    const bool in_warmup = s <= c.warmup;
    const bool warm_full = in_warmup && (s == 1 || s % c.warmup_interval == 0 || s == c.warmup);
    const bool full = !in_warmup && c.full_every > 0 && (s - c.warmup) % c.full_every == 0;
    for (size_t l = 0; l < layers; ++l) {
      const double d = drift::NormalizedDrift(t.sums[s - 1][l]);
      acc[l] += d;
      const double k0 = l == 0 ? c.k0_embedding : c.k0;
      const double k = std::max(k0 * t.lr[s - 1] / lr_ref, c.k_floor);
      EXPECT_NEAR(dec[l].threshold, k, 1e-15 + 1e-12 * k);
      EXPECT_NEAR(dec[l].accumulated, acc[l], 1e-12);
      bool expect;
      if (last[l] == 0) {
        expect = true;
      } else if (in_warmup) {
        expect = warm_full;
      } else {
        expect = full || s - last[l] >= c.s_max || acc[l] >= k;
      }
      const bool persisted = dec[l].reason != PersistReason::kNone;
      ASSERT_EQ(persisted, expect) << "seed " << seed << " step " << s << " layer " << l
                                   << " reason " << PersistReasonName(dec[l].reason);
      if (persisted) {
        last[l] = s;
        acc[l] = 0;
      }
      EXPECT_EQ(p.last_persisted(l), last[l]);
      // The staleness invariant, from the base checkpoint on.
      if (s >= std::max<uint64_t>(c.warmup, 1)) {
        ASSERT_LT(s - p.last_persisted(l), c.s_max) << "seed " << seed << " step " << s;
      }
    }
    if (s == c.warmup || s == 1) {  // the base checkpoint / the first step: everything
      for (size_t l = 0; l < layers; ++l) ASSERT_EQ(p.last_persisted(l), s);
    }
  }
}

// Two engines fed the same vectors decide the same, whatever else happens.
TEST_P(LayerCheckProperties, IdenticalInputsGiveIdenticalDecisions) {
  const uint64_t seed = GetParam();
  LayerCheckConfig c;
  c.warmup = 20;
  c.warmup_interval = 7;
  c.s_max = 30;
  Trace t = RandomTrace(seed * 7 + 1, 9, 300);
  LayerCheckPolicy a(c, Kinds(9)), b(c, Kinds(9));
  for (uint64_t s = 1; s <= 300; ++s) {
    std::vector<LayerDecision> da = a.Decide(s, t.lr[s - 1], t.sums[s - 1], {});
    std::vector<LayerDecision> db = b.Decide(s, t.lr[s - 1], t.sums[s - 1], {});
    for (size_t l = 0; l < 9; ++l) {
      ASSERT_EQ(da[l].reason, db[l].reason);
      ASSERT_EQ(da[l].accumulated, db[l].accumulated);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, LayerCheckProperties, ::testing::Range<uint64_t>(1, 41));

TEST(LayerCheck, WarmupPersistsEverythingOnScheduleAndTakesABase) {
  LayerCheckConfig c;
  c.warmup = 10;
  c.warmup_interval = 4;
  LayerCheckPolicy p(c, Kinds(3));
  std::vector<drift::LayerSums> zero(3);
  std::vector<uint64_t> full_steps;
  for (uint64_t s = 1; s <= 30; ++s) {
    std::vector<LayerDecision> d = p.Decide(s, 1e-3, zero, {});
    int n = 0;
    for (const LayerDecision& x : d) n += x.reason != PersistReason::kNone;
    if (n == 3)
      full_steps.push_back(s);
    else
      EXPECT_EQ(n, 0) << "step " << s;
  }
  EXPECT_EQ(full_steps, (std::vector<uint64_t>{1, 4, 8, 10}));  // zero drift: nothing after
}

TEST(LayerCheck, ForcedLayersAndEmbeddingThreshold) {
  LayerCheckConfig c;
  c.warmup = 0;
  LayerCheckPolicy p(c, Kinds(3));
  std::vector<drift::LayerSums> d(3, drift::LayerSums{(2e-3) * (2e-3), 1.0});  // d = 2e-3
  p.Decide(1, 1e-3, d, {});  // first step: all (never persisted)
  std::vector<LayerDecision> dec = p.Decide(2, 1e-3, d, {});
  EXPECT_EQ(dec[0].reason, PersistReason::kNone);   // embedding: K0 = 1e-2
  EXPECT_EQ(dec[1].reason, PersistReason::kDrift);  // block: K0 = 1e-3
  std::vector<bool> forced = {true, false, false};
  std::vector<drift::LayerSums> zero(3);
  dec = p.Decide(3, 1e-3, zero, forced);
  EXPECT_EQ(dec[0].reason, PersistReason::kForced);
  EXPECT_EQ(dec[1].reason, PersistReason::kNone);
}

// A frozen layer is persisted at its first step and when forced, and never
// for warm-up, full checkpoints, staleness or drift, whatever its sums say.
TEST(LayerCheck, FrozenLayersArePersistedOnlyWhenNeverPersistedOrForced) {
  LayerCheckConfig c;
  c.warmup = 4;
  c.warmup_interval = 2;
  c.s_max = 3;
  c.full_every = 5;
  LayerCheckPolicy p(c, Kinds(3), {false, true, false});
  std::vector<drift::LayerSums> big(3, drift::LayerSums{1.0, 1.0});  // d = 1
  std::vector<uint64_t> frozen_steps, other_steps;
  for (uint64_t s = 1; s <= 30; ++s) {
    std::vector<bool> forced(3, false);
    forced[1] = s == 17;
    std::vector<LayerDecision> d = p.Decide(s, 1e-3, big, forced);
    if (d[1].reason != PersistReason::kNone) frozen_steps.push_back(s);
    if (d[2].reason != PersistReason::kNone) other_steps.push_back(s);
  }
  EXPECT_EQ(frozen_steps, (std::vector<uint64_t>{1, 17}));
  // The unfrozen layer, drifting by 1 a step, at every step but 3 (warm-up
  // selects nothing between its interval steps 2 and 4).
  std::vector<uint64_t> want;
  for (uint64_t s = 1; s <= 30; ++s) {
    if (s != 3) want.push_back(s);
  }
  EXPECT_EQ(other_steps, want);
}

TEST(LayerCheck, LowerLearningRateLowersTheThresholdDownToTheFloor) {
  LayerCheckConfig c;
  c.warmup = 0;
  LayerCheckPolicy p(c, Kinds(2));
  std::vector<drift::LayerSums> zero(2);
  p.Decide(1, 1e-3, zero, {});
  EXPECT_DOUBLE_EQ(p.Decide(2, 5e-4, zero, {})[1].threshold, 5e-4);
  EXPECT_DOUBLE_EQ(p.Decide(3, 1e-9, zero, {})[1].threshold, c.k_floor);
}

TEST(LayerCheck, ConfigValidation) {
  LayerCheckConfig c;
  EXPECT_TRUE(c.Validate().ok());
  c.s_max = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = LayerCheckConfig();
  c.k0 = -1;
  EXPECT_FALSE(c.Validate().ok());
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

// A warm-up from 10% must not raise the threshold at the peak tenfold (the paper's
// lr_0 = the first step's rate would): the reference is the largest rate so
// far, so K = K0 through the warm-up and at the peak, and K falls with decay.
TEST(LayerCheckPolicyTest, ThresholdFollowsThePeakLrThroughAWarmup) {
  LayerCheckConfig c;
  c.k0 = 1e-3;
  c.warmup = 0;
  LayerCheckPolicy p(c, {LayerKind::kBlock});
  const std::vector<drift::LayerSums> sums(1, drift::LayerSums{1e-8, 1.0});
  const double peak = 3e-4;
  for (uint64_t t = 1; t <= 10; ++t) {  // linear warm-up 10% -> 100%
    const double lr = peak * (0.1 + 0.9 * (t - 1) / 9.0);
    EXPECT_NEAR(p.Decide(t, lr, sums, {})[0].threshold, 1e-3, 1e-15) << "step " << t;
  }
  EXPECT_DOUBLE_EQ(p.lr_reference(), peak);
  EXPECT_NEAR(p.Decide(11, peak / 2, sums, {})[0].threshold, 5e-4, 1e-15);
  EXPECT_NEAR(p.Decide(12, peak / 1000, sums, {})[0].threshold, c.k_floor, 1e-18);
  EXPECT_DOUBLE_EQ(p.lr_reference(), peak);
}

TEST(LayerCheckResumeTest, ContinuesFromTheRestoredVersionsWithTheRunsPeakLr) {
  LayerCheckConfig c;
  c.k0 = 0.5;
  c.warmup = 0;
  c.s_max = 100;
  LayerCheckPolicy p(c, {LayerKind::kBlock, LayerKind::kBlock, LayerKind::kBlock});
  p.RaiseLrReference(1e-4);
  p.RaiseLrReference(1e-2);  // the earlier registrations' peak
  p.RaiseLrReference(1e-3);  // never lowers it
  p.Resume(20, {13, 20, 0});
  const std::vector<drift::LayerSums> tiny(3, drift::LayerSums{1e-10, 1.0});  // d = 1e-5
  std::vector<LayerDecision> d = p.Decide(21, 1e-3, tiny, {});
  EXPECT_EQ(d[0].reason, PersistReason::kNone);
  EXPECT_EQ(d[1].reason, PersistReason::kNone);
  EXPECT_EQ(d[2].reason, PersistReason::kNever);  // no version was restored for it
  EXPECT_NEAR(d[0].threshold, 0.05, 1e-12);       // k0 * lr / lr_ref
  EXPECT_EQ(p.last_persisted(0), 13u);
  EXPECT_NEAR(p.accumulated(0), 1e-5, 1e-15);
  // The staleness guard counts from the restored version.
  for (uint64_t t = 22; t < 113; ++t) p.Decide(t, 1e-3, tiny, {});
  EXPECT_EQ(p.Decide(113, 1e-3, tiny, {})[0].reason, PersistReason::kStaleness);
}

}  // namespace
}  // namespace ckpt
