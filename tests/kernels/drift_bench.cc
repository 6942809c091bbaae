// Throughput of the CPU drift kernel against a plain read of the same memory.
//
// Every benchmark reports bytes_per_second = bytes READ per wall-clock second
// (UseRealTime: the work runs on 2 threads). BM_ReadBaseline sums W, m and v
// (64 MiB each) in f64 with the same 2-thread split as ComputeDriftCpu, so it
// approximates what memory bandwidth allows. Read the ratio
//   BM_DriftAdamW_F32 bytes_per_second / BM_ReadBaseline bytes_per_second
// as the fraction of the achievable read bandwidth the kernel reaches: near 1
// means memory bound; well below 1 means the arithmetic (the f32 sqrt and divide
// per element) is the limit. BM_DriftNone_F32 reads only W (64 MiB).
//
// Run: drift_bench --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "kernels/drift.h"

namespace ckpt::drift {
namespace {

constexpr uint64_t kElems = (64ull << 20) / sizeof(float);  // 64 MiB per array
constexpr int kThreads = 2;
constexpr uint64_t kSplit = 1 << 16;  // ComputeDriftCpu's unit of parallel work

struct Buffers {
  std::vector<float> w, m, v;
};

// Allocated and written once, so every page is faulted in before timing.
const Buffers& GetBuffers() {
  static const Buffers* b = [] {
    auto* x = new Buffers;
    x->w.resize(kElems);
    x->m.resize(kElems);
    x->v.resize(kElems);
    uint32_t s = 12345;
    for (uint64_t i = 0; i < kElems; ++i) {
      s = s * 1664525u + 1013904223u;
      const float r = static_cast<float>(s >> 8) * (1.0f / 16777216.0f);  // [0, 1)
      x->w[i] = 2 * r - 1;
      x->m[i] = 1e-2f * (r - 0.5f);
      x->v[i] = 1e-4f * r;
    }
    return x;
  }();
  return *b;
}

TensorTask Task(const Buffers& b, Optimizer opt) {
  TensorTask t;
  t.n = kElems;
  t.w = b.w.data();
  t.m = b.m.data();
  t.v = b.v.data();
  t.optimizer = opt;
  t.lr = 1e-3;
  t.weight_decay = 0.01;
  t.step = 100;
  return t;
}

void BM_DriftAdamW_F32(benchmark::State& state) {
  const Buffers& b = GetBuffers();
  const std::vector<TensorTask> tasks = {Task(b, Optimizer::kAdamW)};
  std::vector<LayerSums> out(1);
  for (auto _ : state) {
    ComputeDriftCpu(tasks, &out, kThreads);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * kElems * sizeof(float));
}

void BM_DriftNone_F32(benchmark::State& state) {
  const Buffers& b = GetBuffers();
  const std::vector<TensorTask> tasks = {Task(b, Optimizer::kNone)};
  std::vector<LayerSums> out(1);
  for (auto _ : state) {
    ComputeDriftCpu(tasks, &out, kThreads);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kElems * sizeof(float));
}

// Sums units [first, first + stride, ...) of the three arrays; four
// accumulators per array keep the f64 add latency out of the way.
double ReadUnits(const Buffers& b, uint64_t first, uint64_t stride) {
  double acc[12] = {};
  const uint64_t units = (kElems + kSplit - 1) / kSplit;
  for (uint64_t u = first; u < units; u += stride) {
    const uint64_t begin = u * kSplit, end = std::min(kElems, begin + kSplit);
    uint64_t k = begin;
    for (; k + 4 <= end; k += 4) {
      for (int j = 0; j < 4; ++j) {
        acc[j] += b.w[k + j];
        acc[4 + j] += b.m[k + j];
        acc[8 + j] += b.v[k + j];
      }
    }
    for (; k < end; ++k) acc[0] += static_cast<double>(b.w[k]) + b.m[k] + b.v[k];
  }
  double s = 0;
  for (double a : acc) s += a;
  return s;
}

void BM_ReadBaseline(benchmark::State& state) {
  const Buffers& b = GetBuffers();
  for (auto _ : state) {
    double other = 0;
    std::thread t([&] { other = ReadUnits(b, 1, kThreads); });
    double sum = ReadUnits(b, 0, kThreads);
    t.join();
    sum += other;
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * kElems * sizeof(float));
}

BENCHMARK(BM_ReadBaseline)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DriftAdamW_F32)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DriftNone_F32)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ckpt::drift

BENCHMARK_MAIN();
