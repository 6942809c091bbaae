// Helpers shared by the drift kernel tests: seeded random tensors in any
// dtype and relative-error comparison.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/drift.h"

namespace ckpt::drift::testing {

// SplitMix64: small, seeded, identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * (static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0));
  }

 private:
  uint64_t s_;
};

// A tensor stored as raw bytes of its dtype.
struct Array {
  DType dtype = DType::kF32;
  uint64_t n = 0;
  std::vector<uint8_t> bytes;
  const void* data() const { return bytes.data(); }
  size_t size_bytes() const { return bytes.size(); }
};

inline size_t DTypeWidth(DType t) { return t == DType::kF32 ? 4 : 2; }

// Encodes f32 values as `dtype` (round to nearest even for bf16/f16).
inline Array Encode(const std::vector<float>& values, DType dtype) {
  Array a;
  a.dtype = dtype;
  a.n = values.size();
  a.bytes.resize(values.size() * DTypeWidth(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&a.bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(values[i]) : F32ToF16(values[i]);
      std::memcpy(&a.bytes[i * 2], &h, 2);
    }
  }
  return a;
}

inline std::vector<float> RandomValues(Rng* rng, uint64_t n, double lo, double hi) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng->Uniform(lo, hi));
  return v;
}

inline Array RandomArray(Rng* rng, uint64_t n, DType dtype, double lo, double hi) {
  return Encode(RandomValues(rng, n, lo, hi), dtype);
}

// |got - want| / max(|got|, |want|); 0 when both are 0.
inline double RelErr(double got, double want) {
  const double scale = std::max(std::fabs(got), std::fabs(want));
  return scale == 0 ? 0.0 : std::fabs(got - want) / scale;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

inline const char* OptimizerName(Optimizer o) {
  switch (o) {
    case Optimizer::kNone:
      return "none";
    case Optimizer::kAdamW:
      return "adamw";
    case Optimizer::kAdam:
      return "adam";
    case Optimizer::kSgd:
      return "sgd";
  }
  return "?";
}

// A set of random tensors (weights + optimizer state) covering every dtype
// and optimizer at the given sizes, spread over `layers` layers. The arrays
// live in `storage` (three per task: w, m, v; unused ones are empty).
struct RandomSet {
  std::vector<TensorTask> tasks;
  std::vector<Array> storage;
  uint32_t layers = 0;
};

inline RandomSet MakeRandomSet(uint64_t seed, const std::vector<uint64_t>& sizes, uint32_t layers) {
  constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  constexpr Optimizer kOpts[] = {Optimizer::kAdamW, Optimizer::kAdam, Optimizer::kSgd,
                                 Optimizer::kNone};
  Rng rng(seed);
  RandomSet set;
  set.layers = layers;
  int k = 0;
  for (uint64_t n : sizes) {
    for (DType dt : kDTypes) {
      for (Optimizer opt : kOpts) {
        TensorTask t;
        t.layer = static_cast<uint32_t>(k % static_cast<int>(layers));
        t.n = n;
        t.optimizer = opt;
        t.w_dtype = dt;
        t.m_dtype = kDTypes[(k / 3) % 3];  // state dtypes vary independently of w
        t.v_dtype = kDTypes[(k / 9) % 3];
        t.lr = opt == Optimizer::kSgd ? 0.05 : 1e-3;
        t.beta1 = 0.9;
        t.beta2 = opt == Optimizer::kAdam ? 0.95 : 0.999;
        t.eps = 1e-8;
        t.weight_decay = opt == Optimizer::kSgd ? 0.0 : 0.01 * (1 + k % 4);
        t.step = 1 + static_cast<uint64_t>(k % 17) * 5;
        set.storage.push_back(RandomArray(&rng, n, t.w_dtype, -2.0, 2.0));
        set.storage.push_back(RandomArray(&rng, n, t.m_dtype, -1e-2, 1e-2));
        set.storage.push_back(RandomArray(&rng, n, t.v_dtype, 0.0, 1e-4));
        set.tasks.push_back(t);
        ++k;
      }
    }
  }
  for (size_t i = 0; i < set.tasks.size(); ++i) {
    set.tasks[i].w = set.storage[3 * i].data();
    set.tasks[i].m = set.storage[3 * i + 1].data();
    set.tasks[i].v = set.storage[3 * i + 2].data();
  }
  return set;
}

}  // namespace ckpt::drift::testing
