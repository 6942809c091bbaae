// Unit tests of the CPU drift kernels (kernels/drift.h): the blocked,
// threaded reference against the scalar f64 reference, the ΔW formulas
// against a literal replay of the PyTorch update rules, and the element
// conversions.
#include "kernels/drift.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tests/kernels/drift_test_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define CKPT_TEST_HAVE_F16C 1
#endif

namespace ckpt::drift {
namespace {

using testing::MakeRandomSet;
using testing::RandomSet;
using testing::RelErr;
using testing::Rng;

float BitsToF32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

uint32_t F32ToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---- ComputeDriftCpu vs ComputeDriftScalar ----

// Both accumulate in f64 from the same f32-converted inputs; only the order
// of the additions differs. Measured max relative difference (sizes 1 to
// 1048577, all dtypes/optimizers, 7 layers, 1 and 2 threads): 4.9e-12 for dw2,
// 1.6e-13 for w2. Against a long-double sum the blocked kernel is within
// 1.4e-15 and the scalar reference (one accumulator over ~2M elements) within
// 4.9e-12: the difference is the scalar reference's own rounding.
TEST(DriftCpuTest, MatchesScalarReference) {
  const RandomSet set = MakeRandomSet(42, {1, 3, 4095, 4097, 1048577}, 7);
  std::vector<LayerSums> want(set.layers);
  ComputeDriftScalar(set.tasks, &want);
  double max_dw2 = 0, max_w2 = 0;
  for (int threads : {1, 2}) {
    std::vector<LayerSums> got(set.layers);
    ComputeDriftCpu(set.tasks, &got, threads);
    for (uint32_t l = 0; l < set.layers; ++l) {
      SCOPED_TRACE("threads=" + std::to_string(threads) + " layer=" + std::to_string(l));
      EXPECT_GT(want[l].dw2, 0.0);
      EXPECT_GT(want[l].w2, 0.0);
      EXPECT_LE(RelErr(got[l].dw2, want[l].dw2), 1e-9);
      EXPECT_LE(RelErr(got[l].w2, want[l].w2), 1e-9);
      max_dw2 = std::max(max_dw2, RelErr(got[l].dw2, want[l].dw2));
      max_w2 = std::max(max_w2, RelErr(got[l].w2, want[l].w2));
    }
  }
  std::printf("max relative error vs scalar: dw2 %.3g, w2 %.3g\n", max_dw2, max_w2);
}

// Every (dtype, optimizer) pair on its own, so a mistake in one combination
// cannot hide inside a layer sum.
TEST(DriftCpuTest, EachCombinationMatchesScalar) {
  const RandomSet set = MakeRandomSet(7, {4097, 70000}, 1);
  for (const TensorTask& task : set.tasks) {
    SCOPED_TRACE(std::string(testing::OptimizerName(task.optimizer)) + " w=" +
                 testing::DTypeName(task.w_dtype) + " m=" + testing::DTypeName(task.m_dtype) +
                 " v=" + testing::DTypeName(task.v_dtype) + " n=" + std::to_string(task.n));
    const std::vector<TensorTask> one = {task};
    std::vector<LayerSums> want(1), got(1);
    ComputeDriftScalar(one, &want);
    ComputeDriftCpu(one, &got, 2);
    EXPECT_LE(RelErr(got[0].dw2, want[0].dw2), 1e-9);
    EXPECT_LE(RelErr(got[0].w2, want[0].w2), 1e-9);
    if (task.optimizer == Optimizer::kNone) {
      EXPECT_EQ(got[0].dw2, 0.0);
    }
  }
}

// Units are taken in a fixed round-robin order and the workers' sums added in
// order: for a given thread count the result does not change a bit from run
// to run; different thread counts agree to rounding.
TEST(DriftCpuTest, DeterministicForAThreadCount) {
  const RandomSet set = MakeRandomSet(9, {1, 200001, 3 * 65536 + 5}, 3);
  for (int threads : {1, 2, 3}) {
    std::vector<LayerSums> first(set.layers);
    ComputeDriftCpu(set.tasks, &first, threads);
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<LayerSums> again(set.layers);
      ComputeDriftCpu(set.tasks, &again, threads);
      for (uint32_t l = 0; l < set.layers; ++l) {
        EXPECT_EQ(first[l].dw2, again[l].dw2) << "threads=" << threads << " layer=" << l;
        EXPECT_EQ(first[l].w2, again[l].w2) << "threads=" << threads << " layer=" << l;
      }
    }
  }
  std::vector<LayerSums> one(set.layers), three(set.layers);
  ComputeDriftCpu(set.tasks, &one, 1);
  ComputeDriftCpu(set.tasks, &three, 3);
  for (uint32_t l = 0; l < set.layers; ++l) {
    EXPECT_LE(RelErr(one[l].dw2, three[l].dw2), 1e-12);
    EXPECT_LE(RelErr(one[l].w2, three[l].w2), 1e-12);
  }
}

TEST(DriftCpuTest, ZeroesOutputAndUnusedLayers) {
  const RandomSet set = MakeRandomSet(3, {5}, 2);
  std::vector<LayerSums> out(4, LayerSums{123.0, 456.0});
  ComputeDriftCpu(set.tasks, &out, 2);
  EXPECT_GT(out[0].w2, 0.0);
  EXPECT_EQ(out[2].dw2, 0.0);
  EXPECT_EQ(out[3].w2, 0.0);
  std::vector<LayerSums> empty(2, LayerSums{1.0, 1.0});
  ComputeDriftCpu({}, &empty, 2);
  EXPECT_EQ(empty[0].dw2, 0.0);
  EXPECT_EQ(empty[1].w2, 0.0);
}

TEST(DriftCpuTest, CpuKernelObject) {
  const RandomSet set = MakeRandomSet(11, {1000}, 2);
  auto kernel = MakeCpuDriftKernel(2);
  ASSERT_NE(kernel, nullptr);
  EXPECT_STREQ(kernel->name(), "cpu");
  std::vector<LayerSums> got(set.layers), want(set.layers);
  std::string error;
  ASSERT_TRUE(kernel->Compute(set.tasks, &got, &error)) << error;
  ComputeDriftCpu(set.tasks, &want, 1);
  for (uint32_t l = 0; l < set.layers; ++l) {
    EXPECT_EQ(got[l].dw2, want[l].dw2);
    EXPECT_EQ(got[l].w2, want[l].w2);
  }
}

// Without a usable GPU (or without CUDA) the factory declines and says why.
TEST(DriftCpuTest, CudaFactoryExplainsRefusal) {
  std::string why;
  auto kernel = MakeCudaDriftKernel(&why);
  if (kernel == nullptr) {
    EXPECT_FALSE(why.empty());
  } else {
    EXPECT_STREQ(kernel->name(), "cuda");
  }
}

// ---- the ΔW formulas against a literal replay of the update rules ----

struct Replay {
  std::vector<double> w_prev, w, m, v;
};

// PyTorch's AdamW (decay first) or Adam (L2 decay folded into the gradient),
// in f64, for `steps` steps with the given gradients per step.
Replay ReplayAdam(bool decoupled, std::vector<double> w, const std::vector<std::vector<double>>& g,
                  double lr, double b1, double b2, double eps, double wd) {
  Replay r;
  r.m.assign(w.size(), 0.0);
  r.v.assign(w.size(), 0.0);
  for (size_t s = 0; s < g.size(); ++s) {
    r.w_prev = w;
    const double t = static_cast<double>(s + 1);
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < w.size(); ++i) {
      double grad = g[s][i];
      if (decoupled) {
        w[i] *= 1 - lr * wd;
      } else {
        grad += wd * w[i];
      }
      r.m[i] = b1 * r.m[i] + (1 - b1) * grad;
      r.v[i] = b2 * r.v[i] + (1 - b2) * grad * grad;
      const double denom = std::sqrt(r.v[i]) / std::sqrt(bc2) + eps;
      w[i] -= (lr / bc1) * r.m[i] / denom;
    }
  }
  r.w = w;
  return r;
}

// PyTorch's SGD with momentum (dampening 0, non-Nesterov) and L2 decay.
Replay ReplaySgd(std::vector<double> w, const std::vector<std::vector<double>>& g, double lr,
                 double momentum, double wd) {
  Replay r;
  r.m.assign(w.size(), 0.0);
  for (size_t s = 0; s < g.size(); ++s) {
    r.w_prev = w;
    for (size_t i = 0; i < w.size(); ++i) {
      const double grad = g[s][i] + wd * w[i];
      r.m[i] = s == 0 ? grad : momentum * r.m[i] + grad;
      w[i] -= lr * r.m[i];
    }
  }
  r.w = w;
  return r;
}

std::vector<float> ToF32(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

double TrueDw2(const Replay& r) {
  double s = 0;
  for (size_t i = 0; i < r.w.size(); ++i) s += (r.w[i] - r.w_prev[i]) * (r.w[i] - r.w_prev[i]);
  return s;
}

struct ReplayInputs {
  std::vector<double> w0;
  std::vector<std::vector<double>> grads;
};

ReplayInputs MakeReplayInputs(uint64_t seed, size_t n, size_t steps) {
  Rng rng(seed);
  ReplayInputs in;
  for (size_t i = 0; i < n; ++i) in.w0.push_back(rng.Uniform(-1, 1));
  in.grads.resize(steps);
  for (auto& g : in.grads) {
    for (size_t i = 0; i < n; ++i) g.push_back(rng.Uniform(-0.5, 0.5));
  }
  return in;
}

// The kernel's dw2 (from W_t, m, v rounded to f32) against Σ(W_t - W_{t-1})²
// of the replay in f64. f32 rounding of m and v (~6e-8 relative) bounds the
// An f32 Adam/AdamW task over (w, m, v).
TensorTask AdamTask(Optimizer opt, const std::vector<float>& w, const std::vector<float>& m,
                    const std::vector<float>& v, double lr, double b1, double b2, double eps,
                    double wd, uint64_t step) {
  TensorTask t;
  t.n = w.size();
  t.w = w.data();
  t.m = m.data();
  t.v = v.data();
  t.optimizer = opt;
  t.lr = lr;
  t.beta1 = b1;
  t.beta2 = b2;
  t.eps = eps;
  t.weight_decay = wd;
  t.step = step;
  return t;
}

// difference; measured ~1e-8.
TEST(DriftFormulaTest, AdamWMatchesLiteralUpdate) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  for (size_t steps : {1, 2, 5}) {
    const ReplayInputs in = MakeReplayInputs(100 + steps, 17, steps);
    const Replay r = ReplayAdam(true, in.w0, in.grads, lr, b1, b2, eps, wd);
    const std::vector<float> w = ToF32(r.w), m = ToF32(r.m), v = ToF32(r.v);
    TensorTask t = AdamTask(Optimizer::kAdamW, w, m, v, lr, b1, b2, eps, wd, steps);
    std::vector<LayerSums> out(1);
    ComputeDriftCpu({t}, &out, 1);
    const double truth = TrueDw2(r);
    SCOPED_TRACE("steps=" + std::to_string(steps));
    EXPECT_LE(RelErr(out[0].dw2, truth), 1e-6) << out[0].dw2 << " vs " << truth;
    double w2 = 0;
    for (float x : w) w2 += static_cast<double>(x) * x;
    EXPECT_LE(RelErr(out[0].w2, w2), 1e-12);
    // The reconstruction must depend on the decay: as Adam it would be off.
    t.optimizer = Optimizer::kAdam;
    ComputeDriftCpu({t}, &out, 1);
    EXPECT_GT(RelErr(out[0].dw2, truth), 1e-6);
  }
}

TEST(DriftFormulaTest, AdamMatchesLiteralUpdate) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.01;
  const ReplayInputs in = MakeReplayInputs(7, 33, 4);
  const Replay r = ReplayAdam(false, in.w0, in.grads, lr, b1, b2, eps, wd);
  const std::vector<float> w = ToF32(r.w), m = ToF32(r.m), v = ToF32(r.v);
  const TensorTask t = AdamTask(Optimizer::kAdam, w, m, v, lr, b1, b2, eps, wd, 4);
  std::vector<LayerSums> out(1);
  ComputeDriftCpu({t}, &out, 1);
  EXPECT_LE(RelErr(out[0].dw2, TrueDw2(r)), 1e-6);
}

TEST(DriftFormulaTest, SgdMatchesLiteralUpdate) {
  const double lr = 0.05, momentum = 0.9, wd = 0.001;
  const ReplayInputs in = MakeReplayInputs(8, 29, 3);
  const Replay r = ReplaySgd(in.w0, in.grads, lr, momentum, wd);
  const std::vector<float> w = ToF32(r.w), buf = ToF32(r.m);
  TensorTask t;
  t.n = w.size();
  t.w = w.data();
  t.m = buf.data();
  t.optimizer = Optimizer::kSgd;
  t.lr = lr;
  t.step = 3;
  std::vector<LayerSums> out(1);
  ComputeDriftCpu({t}, &out, 1);
  EXPECT_LE(RelErr(out[0].dw2, TrueDw2(r)), 1e-6);
}

// ---- conversions ----

TEST(ConversionTest, Bf16KnownValues) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(-2.5f), 0xc020);
  EXPECT_EQ(F32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(F32ToBf16(-0.0f), 0x8000);
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0xc020), -2.5f);
  // 65504 (0x477fe000) sits above the midpoint of bf16 65280 and 65536.
  EXPECT_EQ(F32ToBf16(65504.0f), 0x4780);
  EXPECT_EQ(Bf16ToF32(0x4780), 65536.0f);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToBf16(inf), 0x7f80);
  EXPECT_EQ(F32ToBf16(-inf), 0xff80);
  EXPECT_EQ(Bf16ToF32(0x7f80), inf);
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  // Smallest bf16 subnormal.
  EXPECT_EQ(F32ToBf16(BitsToF32(0x00010000)), 0x0001);
  EXPECT_EQ(Bf16ToF32(0x0001), BitsToF32(0x00010000));
}

TEST(ConversionTest, Bf16NanStaysNan) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(qnan))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(-qnan))));
  // A NaN whose payload sits only in the low 16 bits must not become inf.
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(BitsToF32(0x7f800001)))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(BitsToF32(0xffff0001)))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(0x7fc0)));
  EXPECT_TRUE(std::isnan(Bf16ToF32(0x7f81)));
}

TEST(ConversionTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16(BitsToF32(0x3f808000)), 0x3f80);  // tie, even below
  EXPECT_EQ(F32ToBf16(BitsToF32(0x3f818000)), 0x3f82);  // tie, even above
  EXPECT_EQ(F32ToBf16(BitsToF32(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(F32ToBf16(BitsToF32(0x3f807fff)), 0x3f80);  // just below the tie
  EXPECT_EQ(F32ToBf16(BitsToF32(0xbf818000)), 0xbf82);  // negative tie
}

TEST(ConversionTest, Bf16RoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(f)))) << h;
    } else {
      ASSERT_EQ(F32ToBf16(f), h) << h;
    }
  }
}

// An independent reference: pick the nearer of the two bf16 neighbours in
// f64, ties to the even one.
uint16_t RefBf16(float f) {
  const uint32_t bits = F32ToBits(f);
  const uint32_t lo = bits & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u;
  const double dlo = std::fabs(static_cast<double>(BitsToF32(lo)) - f);
  const double dhi = std::isinf(BitsToF32(hi)) && !std::isinf(BitsToF32(lo))
                         ? std::fabs(std::ldexp(1.0, 128) * (f < 0 ? -1 : 1) - f)
                         : std::fabs(static_cast<double>(BitsToF32(hi)) - f);
  if (dlo < dhi) return static_cast<uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

TEST(ConversionTest, Bf16MatchesIndependentRounding) {
  Rng rng(5);
  for (int i = 0; i < 2000000; ++i) {
    const float f = BitsToF32(static_cast<uint32_t>(rng.Next()));
    if (std::isnan(f) || std::isinf(f)) continue;
    ASSERT_EQ(F32ToBf16(f), RefBf16(f)) << std::hex << F32ToBits(f);
  }
}

TEST(ConversionTest, F16KnownValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.5f), 0xc100);
  EXPECT_EQ(F32ToF16(0.0f), 0x0000);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc100), -2.5f);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);  // below the midpoint to 65536
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // the midpoint: ties to even = inf
  EXPECT_EQ(F32ToF16(1e6f), 0x7c00);
  EXPECT_EQ(F32ToF16(-1e6f), 0xfc00);
  const float tiny = std::ldexp(1.0f, -24);  // smallest subnormal
  EXPECT_EQ(F32ToF16(tiny), 0x0001);
  EXPECT_EQ(F16ToF32(0x0001), tiny);
  EXPECT_EQ(F16ToF32(0x8001), -tiny);
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);     // tie between 0 and tiny: 0
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);     // above the tie
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -24)), 0x0002);     // tie between 1 and 2: 2
  EXPECT_EQ(F32ToF16(std::ldexp(2.5f, -24)), 0x0002);     // tie between 2 and 3: 2
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -30)), 0x0000);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToF16(inf), 0x7c00);
  EXPECT_EQ(F32ToF16(-inf), 0xfc00);
  EXPECT_EQ(F16ToF32(0x7c00), inf);
  EXPECT_EQ(F16ToF32(0xfc00), -inf);
}

TEST(ConversionTest, F16NanStaysNan) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(qnan))));
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(BitsToF32(0x7f800001)))));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7c01)));
  EXPECT_TRUE(std::isnan(F16ToF32(0xfc01)));
}

TEST(ConversionTest, F16RoundsToNearestEven) {
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, even below
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, even above
  EXPECT_EQ(F32ToF16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  EXPECT_EQ(F32ToF16(2.0f - std::ldexp(1.0f, -12)), 0x4000);  // carry into the exponent
  // Subnormal to normal carry: just below 2^-14, above the last subnormal tie.
  EXPECT_EQ(F32ToF16(std::ldexp(1023.5f, -24)), 0x0400);
}

TEST(ConversionTest, F16RoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f)))) << h;
    } else {
      ASSERT_EQ(F32ToF16(f), h) << h;
    }
  }
}

#ifdef CKPT_TEST_HAVE_F16C
__attribute__((target("f16c"))) uint16_t HwF32ToF16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
__attribute__((target("f16c"))) float HwF16ToF32(uint16_t h) { return _cvtsh_ss(h); }
// CPUID leaf 1 (clang 14's __builtin_cpu_supports does not know "f16c").
bool HaveF16c() {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}

// The x86 F16C instructions as an independent reference, on random bit
// patterns (every exponent, subnormals included).
TEST(ConversionTest, F16MatchesHardware) {
  if (!HaveF16c()) GTEST_SKIP() << "no F16C";
  Rng rng(6);
  for (int i = 0; i < 4000000; ++i) {
    const float f = BitsToF32(static_cast<uint32_t>(rng.Next()));
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), HwF32ToF16(f)) << std::hex << F32ToBits(f);
  }
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float want = HwF16ToF32(static_cast<uint16_t>(h));
    const float got = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(F32ToBits(got), F32ToBits(want)) << h;
    }
  }
}
#endif

TEST(NormalizedDriftTest, Values) {
  EXPECT_EQ(NormalizedDrift(LayerSums{}), 0.0);
  EXPECT_EQ(NormalizedDrift(LayerSums{0.0, 0.0}), 0.0);
  EXPECT_EQ(NormalizedDrift(LayerSums{0.0, 9.0}), 0.0);
  EXPECT_NEAR(NormalizedDrift(LayerSums{4.0, 16.0}), 0.5, 1e-12);
  EXPECT_TRUE(std::isfinite(NormalizedDrift(LayerSums{1.0, 0.0})));
}

}  // namespace
}  // namespace ckpt::drift
