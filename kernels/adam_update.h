// The Adam(W) update direction u = m̂ / (√v̂ + ε), shared by the CPU drift
// kernels (drift_cpu.cc) and their CUDA twin (cuda/drift.cu).
//
// u is computed in f32, as the optimizer computes it for f32 parameters:
// one multiply for each bias correction, a square root, an add and a
// divide, each an IEEE f32 operation rounded to nearest, in this order, so
// every implementation (scalar, AVX2 eight lanes wide, CUDA without fast
// math) gets the same bits. The squares and sums that use u are f64.
// Computing u in f64 made the CPU kernel bound by the f64 square root and
// divide (about 0.6 of a plain read of the same bytes, docs/throughput.md);
// f32 gives eight lanes per instruction instead of four, at a cost (relative
// error about 1e-7 per element) far below what a drift threshold resolves.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define CKPT_HOST_DEVICE __host__ __device__
#else
#define CKPT_HOST_DEVICE
#endif

namespace ckpt::drift {

// The constants of one tensor's step, rounded to f32 once.
struct AdamConstants {
  float inv_bc1;  // 1 / (1 - β1^t)
  float inv_bc2;  // 1 / (1 - β2^t)
  float eps;
};

CKPT_HOST_DEVICE inline float AdamUpdate(float m, float v, const AdamConstants& c) {
  return (m * c.inv_bc1) / (sqrtf(v * c.inv_bc2) + c.eps);
}

}  // namespace ckpt::drift
