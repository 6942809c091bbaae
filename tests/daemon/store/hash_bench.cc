// Throughput of the layer files' checksum (XXH3-64, format.h) against a
// plain read of the same memory, both on one thread: a commit or a restore
// checksums each version on one thread, so the ratio says whether the
// checksum can keep up with memory (near 1 or above: it costs no more than
// reading the bytes once).
//
// bytes_per_second = bytes read per second. BM_ReadBaseline sums the
// buffer as 64-bit words with four independent accumulators (the loads are
// what it waits for). BM_HashBytes is ckptd's checksum (the AVX2 build of
// XXH3 where the CPU has it, xxh3_avx2.h); BM_HashLibrary the same hash
// from the system's libxxhash (built for the x86-64 baseline).
//
// Run: hash_bench --benchmark_min_time=0.5
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <cstdint>
#include <vector>

#include "daemon/store/format.h"

namespace ckpt {
namespace {

constexpr uint64_t kBytes = 256ull << 20;

// Written once, so every page is faulted in before timing.
const std::vector<uint64_t>& Buffer() {
  static const std::vector<uint64_t>* b = [] {
    auto* v = new std::vector<uint64_t>(kBytes / 8);
    uint64_t s = 12345;
    for (uint64_t& x : *v) x = s = s * 6364136223846793005ull + 1442695040888963407ull;
    return v;
  }();
  return *b;
}

void BM_ReadBaseline(benchmark::State& state) {
  const std::vector<uint64_t>& b = Buffer();
  for (auto _ : state) {
    uint64_t a[4] = {0, 0, 0, 0};
    for (size_t i = 0; i + 4 <= b.size(); i += 4) {
      for (int j = 0; j < 4; ++j) a[j] += b[i + j];
    }
    benchmark::DoNotOptimize(a[0] + a[1] + a[2] + a[3]);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
}

void BM_HashBytes(benchmark::State& state) {
  const std::vector<uint64_t>& b = Buffer();
  for (auto _ : state) benchmark::DoNotOptimize(HashBytes(b.data(), kBytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
}

void BM_HashLibrary(benchmark::State& state) {
  const std::vector<uint64_t>& b = Buffer();
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(b.data(), kBytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kBytes));
}

BENCHMARK(BM_ReadBaseline)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_HashLibrary)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_HashBytes)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ckpt

BENCHMARK_MAIN();
