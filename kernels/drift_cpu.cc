// CPU reference implementation of the drift kernels (drift.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "kernels/adam_update.h"
#include "kernels/drift.h"

namespace ckpt::drift {
namespace {

constexpr uint64_t kBlock = 2048;     // elements converted and reduced at a time
constexpr uint64_t kChunk = 1 << 16;  // elements per unit of parallel work

float LoadOne(const void* p, DType t, uint64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0;
}

// Returns a pointer to `n` f32 values starting at element `i`: the input
// itself for f32, else `scratch` filled by conversion.
const float* LoadBlock(const void* p, DType t, uint64_t i, uint64_t n, float* scratch) {
  if (t == DType::kF32) return static_cast<const float*>(p) + i;
  const uint16_t* h = static_cast<const uint16_t*>(p) + i;
  if (t == DType::kBF16) {
    for (uint64_t k = 0; k < n; ++k) scratch[k] = Bf16ToF32(h[k]);
  } else {
    for (uint64_t k = 0; k < n; ++k) scratch[k] = F16ToF32(h[k]);
  }
  return scratch;
}

struct Coeffs {
  double lr, wd, adamw_scale;
  AdamConstants adam;  // f32 (adam_update.h)
};

Coeffs MakeCoeffs(const TensorTask& t) {
  Coeffs c;
  c.lr = t.lr;
  c.wd = t.weight_decay;
  const double step = static_cast<double>(std::max<uint64_t>(1, t.step));
  c.adam.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(t.beta1, step)));
  c.adam.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(t.beta2, step)));
  c.adam.eps = static_cast<float>(t.eps);
  c.adamw_scale = -t.lr / (1.0 - t.lr * t.weight_decay);
  return c;
}

// The hot loops. Each keeps four f64 lane accumulators (element k goes to
// lane k % 4, elements in order; lanes are added as (0+1)+(2+3)), so the
// AVX2 version and the portable one give bit-identical sums: u is the same
// f32 computation in both (adam_update.h), the rest are exact IEEE f64
// operations, and the file is compiled without FMA contraction.
struct Lanes {
  double d[4] = {0, 0, 0, 0};
  double w[4] = {0, 0, 0, 0};
  void AddTo(double* dw2, double* w2) const {
    *dw2 += (d[0] + d[1]) + (d[2] + d[3]);
    *w2 += (w[0] + w[1]) + (w[2] + w[3]);
  }
};

void AdamTail(const float* w, const float* m, const float* v, uint64_t k, uint64_t n,
              const Coeffs& c, double scale, double wd, Lanes* l) {
  for (; k < n; ++k) {
    const double wk = w[k];
    // d = scale * (wd * w + u) covers both Adam (wd = 0, scale = -lr) and AdamW.
    const double d = scale * (wd * wk + static_cast<double>(AdamUpdate(m[k], v[k], c.adam)));
    l->d[k % 4] += d * d;
    l->w[k % 4] += wk * wk;
  }
}

// u for eight elements at once in f32; the squares and sums four at a time
// in f64, elements k..k+3 and then k+4..k+7 into lanes 0..3 (the order of
// the portable loop).
__attribute__((target("avx2"))) void AdamBlockAvx2(const float* w, const float* m, const float* v,
                                                   uint64_t n, const Coeffs& c, double scale,
                                                   double wd, Lanes* l) {
  __m256d acc_d = _mm256_loadu_pd(l->d), acc_w = _mm256_loadu_pd(l->w);
  const __m256 ibc1 = _mm256_set1_ps(c.adam.inv_bc1), ibc2 = _mm256_set1_ps(c.adam.inv_bc2);
  const __m256 eps = _mm256_set1_ps(c.adam.eps);
  const __m256d vs = _mm256_set1_pd(scale), vwd = _mm256_set1_pd(wd);
  uint64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 mk = _mm256_loadu_ps(m + k), vk = _mm256_loadu_ps(v + k);
    const __m256 u = _mm256_div_ps(_mm256_mul_ps(mk, ibc1),
                                   _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vk, ibc2)), eps));
    const __m128 us[2] = {_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)};
    for (int h = 0; h < 2; ++h) {
      const __m256d wk = _mm256_cvtps_pd(_mm_loadu_ps(w + k + 4 * h));
      const __m256d d =
          _mm256_mul_pd(vs, _mm256_add_pd(_mm256_mul_pd(vwd, wk), _mm256_cvtps_pd(us[h])));
      acc_d = _mm256_add_pd(acc_d, _mm256_mul_pd(d, d));
      acc_w = _mm256_add_pd(acc_w, _mm256_mul_pd(wk, wk));
    }
  }
  _mm256_storeu_pd(l->d, acc_d);
  _mm256_storeu_pd(l->w, acc_w);
  AdamTail(w, m, v, k, n, c, scale, wd, l);
}

void AdamBlockPortable(const float* w, const float* m, const float* v, uint64_t n, const Coeffs& c,
                       double scale, double wd, Lanes* l) {
  AdamTail(w, m, v, 0, n, c, scale, wd, l);
}

void SgdTail(const float* w, const float* buf, uint64_t k, uint64_t n, double lr, Lanes* l) {
  for (; k < n; ++k) {
    const double wk = w[k];
    const double d = -lr * buf[k];
    l->d[k % 4] += d * d;
    l->w[k % 4] += wk * wk;
  }
}

__attribute__((target("avx2"))) void SgdBlockAvx2(const float* w, const float* buf, uint64_t n,
                                                  double lr, Lanes* l) {
  __m256d acc_d = _mm256_loadu_pd(l->d), acc_w = _mm256_loadu_pd(l->w);
  const __m256d nlr = _mm256_set1_pd(-lr);
  uint64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d wk = _mm256_cvtps_pd(_mm_loadu_ps(w + k));
    const __m256d d = _mm256_mul_pd(nlr, _mm256_cvtps_pd(_mm_loadu_ps(buf + k)));
    acc_d = _mm256_add_pd(acc_d, _mm256_mul_pd(d, d));
    acc_w = _mm256_add_pd(acc_w, _mm256_mul_pd(wk, wk));
  }
  _mm256_storeu_pd(l->d, acc_d);
  _mm256_storeu_pd(l->w, acc_w);
  SgdTail(w, buf, k, n, lr, l);
}

void NormTail(const float* w, uint64_t k, uint64_t n, Lanes* l) {
  for (; k < n; ++k) l->w[k % 4] += static_cast<double>(w[k]) * w[k];
}

__attribute__((target("avx2"))) void NormBlockAvx2(const float* w, uint64_t n, Lanes* l) {
  __m256d acc_w = _mm256_loadu_pd(l->w);
  uint64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d wk = _mm256_cvtps_pd(_mm_loadu_ps(w + k));
    acc_w = _mm256_add_pd(acc_w, _mm256_mul_pd(wk, wk));
  }
  _mm256_storeu_pd(l->w, acc_w);
  NormTail(w, k, n, l);
}

const bool kHaveAvx2 = __builtin_cpu_supports("avx2");

// Sums over elements [begin, end) of one tensor. Blocks are multiples of 4
// elements long, so each element's lane is the same whatever the blocking.
LayerSums ReduceRange(const TensorTask& t, uint64_t begin, uint64_t end) {
  const Coeffs c = MakeCoeffs(t);
  const bool adamw = t.optimizer == Optimizer::kAdamW;
  const double scale = adamw ? c.adamw_scale : -c.lr;
  const double wd = adamw ? c.wd : 0.0;
  Lanes lanes;
  float sw[kBlock], sm[kBlock], sv[kBlock];
  for (uint64_t i = begin; i < end; i += kBlock) {
    const uint64_t n = std::min(kBlock, end - i);
    const float* w = LoadBlock(t.w, t.w_dtype, i, n, sw);
    switch (t.optimizer) {
      case Optimizer::kAdamW:
      case Optimizer::kAdam: {
        const float* m = LoadBlock(t.m, t.m_dtype, i, n, sm);
        const float* v = LoadBlock(t.v, t.v_dtype, i, n, sv);
        if (kHaveAvx2) {
          AdamBlockAvx2(w, m, v, n, c, scale, wd, &lanes);
        } else {
          AdamBlockPortable(w, m, v, n, c, scale, wd, &lanes);
        }
        break;
      }
      case Optimizer::kSgd: {
        const float* buf = LoadBlock(t.m, t.m_dtype, i, n, sm);
        if (kHaveAvx2) {
          SgdBlockAvx2(w, buf, n, t.lr, &lanes);
        } else {
          SgdTail(w, buf, 0, n, t.lr, &lanes);
        }
        break;
      }
      case Optimizer::kNone:
        if (kHaveAvx2) {
          NormBlockAvx2(w, n, &lanes);
        } else {
          NormTail(w, 0, n, &lanes);
        }
        break;
    }
  }
  LayerSums s;
  lanes.AddTo(&s.dw2, &s.w2);
  return s;
}

}  // namespace

double NormalizedDrift(const LayerSums& s) {
  return std::sqrt(std::max(0.0, s.dw2)) / (std::sqrt(std::max(0.0, s.w2)) + 1e-12);
}

float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs = bits & 0x7fffffff;
  if (abs > 0x7f800000) return sign | 0x7e00;   // NaN
  if (abs >= 0x477ff000) return sign | 0x7c00;  // overflow -> inf
  if (abs < 0x33000000) return sign;            // underflow -> 0
  int exp = static_cast<int>(abs >> 23) - 127 + 15;
  uint32_t mant = (abs & 0x7fffff) | 0x800000;
  if (exp <= 0) {  // subnormal half
    const int shift = 14 - exp;
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = (static_cast<uint32_t>(exp) << 10) | ((mant >> 13) & 0x3ff);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;  // may carry into the exponent: correct
  return sign | static_cast<uint16_t>(r);
}

void ComputeDriftScalar(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out) {
  for (LayerSums& s : *out) s = LayerSums();
  for (const TensorTask& t : tasks) {
    if (t.layer >= out->size()) continue;
    const Coeffs c = MakeCoeffs(t);
    LayerSums& s = (*out)[t.layer];
    for (uint64_t i = 0; i < t.n; ++i) {
      const double w = LoadOne(t.w, t.w_dtype, i);
      double d = 0;
      if (t.optimizer == Optimizer::kAdamW || t.optimizer == Optimizer::kAdam) {
        const double u = AdamUpdate(LoadOne(t.m, t.m_dtype, i), LoadOne(t.v, t.v_dtype, i), c.adam);
        d = t.optimizer == Optimizer::kAdamW ? c.adamw_scale * (c.wd * w + u) : -c.lr * u;
      } else if (t.optimizer == Optimizer::kSgd) {
        d = -c.lr * LoadOne(t.m, t.m_dtype, i);
      }
      s.dw2 += d * d;
      s.w2 += w * w;
    }
  }
}

void ComputeDriftCpu(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out,
                     int threads) {
  // Work units are 64K-element ranges; worker i takes units i, i+n, i+2n...
  // in order and accumulates per layer, and the workers' sums are added in
  // worker order: the result depends only on the inputs and `threads`, and
  // the extra memory is O(threads x layers), never O(model).
  struct Unit {
    size_t task;
    uint64_t begin, end;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < tasks.size(); ++i) {
    for (uint64_t b = 0; b < tasks[i].n; b += kChunk) {
      units.push_back(Unit{i, b, std::min(tasks[i].n, b + kChunk)});
    }
  }
  const size_t layers = out->size();
  const size_t n = std::max<size_t>(
      1, std::min<size_t>(static_cast<size_t>(std::max(1, threads)), units.size()));
  std::vector<std::vector<LayerSums>> per_worker(n, std::vector<LayerSums>(layers));
  auto work = [&](size_t worker) {
    std::vector<LayerSums>& acc = per_worker[worker];
    for (size_t u = worker; u < units.size(); u += n) {
      const TensorTask& t = tasks[units[u].task];
      if (t.layer >= layers) continue;  // outside `out`: ignored (documented)
      LayerSums s = ReduceRange(t, units[u].begin, units[u].end);
      acc[t.layer].dw2 += s.dw2;
      acc[t.layer].w2 += s.w2;
    }
  };
  if (n == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    for (size_t i = 1; i < n; ++i) pool.emplace_back(work, i);
    work(0);
    for (std::thread& t : pool) t.join();
  }
  for (LayerSums& s : *out) s = LayerSums();
  for (const std::vector<LayerSums>& acc : per_worker) {
    for (size_t l = 0; l < layers; ++l) {
      (*out)[l].dw2 += acc[l].dw2;
      (*out)[l].w2 += acc[l].w2;
    }
  }
}

namespace {

class CpuKernel final : public DriftKernel {
 public:
  explicit CpuKernel(int threads) : threads_(threads) {}
  const char* name() const override { return "cpu"; }
  bool Compute(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out,
               std::string*) override {
    ComputeDriftCpu(tasks, out, threads_);
    return true;
  }

 private:
  int threads_;
};

}  // namespace

std::unique_ptr<DriftKernel> MakeCpuDriftKernel(int threads) {
  return std::make_unique<CpuKernel>(threads);
}

#ifndef CKPT_HAVE_CUDA
std::unique_ptr<DriftKernel> MakeCudaDriftKernel(std::string* why) {
  if (why) *why = "built without CUDA";
  return nullptr;
}
#endif

}  // namespace ckpt::drift
