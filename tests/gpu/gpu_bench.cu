// ckpt_gpu_bench: throughput of the CUDA drift kernel (kernels/cuda/drift.cu)
// against what the device's memory can do, measured in the same run.
//
// The drift kernel reads W, m and v (AdamW, f32: 12 bytes per element) once
// and writes nothing worth counting, so its ceiling is the device's read
// bandwidth. The baseline is a cudaMemcpyAsync device-to-device copy of a
// buffer as large as W, m and v together, counted as bytes read PLUS bytes
// written (a copy moves each byte twice); the ratio drift / copy is therefore
// "fraction of the memory traffic a copy achieves".
//
// The result is also checked against ComputeDriftCpu on a host copy of a few
// layers (max relative difference per layer sum), so a fast wrong kernel does
// not pass for a fast one.
//
//   ckpt_gpu_bench [--elements=N] [--layers=L] [--reps=R]
//
// Prints one JSON line. Exit codes: 0 ok, 1 failure (CUDA error or the check
// against the CPU reference failed), 77 no CUDA drift kernel (no device).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/drift.h"

namespace {

using ckpt::drift::DriftKernel;
using ckpt::drift::LayerSums;
using ckpt::drift::TensorTask;

constexpr int kExitNoDevice = 77;
// The CPU check covers this many layers, at most this many elements of each.
constexpr uint32_t kCheckLayers = 4;
constexpr uint64_t kCheckElements = uint64_t{1} << 22;
// The CUDA kernel sums with double atomics in no fixed order; the drift tests
// accept 1e-9. A larger difference here means a broken kernel, not rounding.
constexpr double kMaxRelDiff = 1e-9;

bool CudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "ckpt_gpu_bench: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Uniform in [0, 1) from a hash.
__device__ __forceinline__ float Unit(uint64_t x) {
  return static_cast<float>(Mix(x) >> 40) * (1.0f / 16777216.0f);
}

// Plausible AdamW state: weights in [-1, 1), first moments ~1e-3, second
// moments positive ~1e-6.
__global__ void InitKernel(float* w, float* m, float* v, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    w[i] = 2.0f * Unit(3 * i) - 1.0f;
    m[i] = 1e-3f * (2.0f * Unit(3 * i + 1) - 1.0f);
    v[i] = 1e-6f * (Unit(3 * i + 2) + 0.01f);
  }
}

double RelErr(double got, double want) {
  const double scale = std::max(std::fabs(got), std::fabs(want));
  return scale == 0 ? 0.0 : std::fabs(got - want) / scale;
}

TensorTask AdamWTask(uint32_t layer, uint64_t n, const float* w, const float* m, const float* v) {
  TensorTask t;
  t.layer = layer;
  t.n = n;
  t.w = w;
  t.m = m;
  t.v = v;
  t.optimizer = ckpt::drift::Optimizer::kAdamW;
  t.lr = 1e-3;
  t.weight_decay = 0.01;
  t.step = 10;
  return t;
}

// Device buffers freed on every exit path.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p != nullptr) cudaFree(p);
  }
};

}  // namespace

int main(int argc, char** argv) {
  uint64_t n = uint64_t{1} << 28;  // elements of each of W, m, v (1 GiB each)
  uint32_t layers = 32;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--elements=", 0) == 0) {
      n = std::strtoull(a.c_str() + 11, nullptr, 10);
    } else if (a.rfind("--layers=", 0) == 0) {
      layers = static_cast<uint32_t>(std::strtoul(a.c_str() + 9, nullptr, 10));
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::atoi(a.c_str() + 7);
    } else {
      std::fprintf(stderr, "usage: ckpt_gpu_bench [--elements=N] [--layers=L] [--reps=R]\n");
      return 2;
    }
  }
  if (n < layers || layers == 0 || reps <= 0) {
    std::fprintf(stderr, "ckpt_gpu_bench: need elements >= layers > 0 and reps > 0\n");
    return 2;
  }

  std::string why;
  std::unique_ptr<DriftKernel> kernel = ckpt::drift::MakeCudaDriftKernel(&why);
  if (kernel == nullptr) {
    std::printf("{\"skipped\":\"no CUDA drift kernel: %s\"}\n", why.c_str());
    return kExitNoDevice;
  }
  int device = 0;
  cudaDeviceProp prop{};
  cudaGetDevice(&device);
  cudaGetDeviceProperties(&prop, device);

  // W, m and v back to back in one allocation, so that the copy baseline
  // reads exactly the bytes the drift kernel reads.
  const uint64_t state_bytes = 3 * n * sizeof(float);
  DeviceBuffer state, copy;
  if (!CudaOk(cudaMalloc(&state.p, state_bytes), "cudaMalloc") ||
      !CudaOk(cudaMalloc(&copy.p, state_bytes), "cudaMalloc")) {
    return 1;
  }
  float* w = static_cast<float*>(state.p);
  float* m = w + n;
  float* v = w + 2 * n;
  InitKernel<<<4096, 256>>>(w, m, v, n);
  if (!CudaOk(cudaDeviceSynchronize(), "init")) return 1;

  // Layers of equal size; the last one takes the remainder.
  std::vector<TensorTask> tasks;
  const uint64_t per_layer = n / layers;
  for (uint32_t l = 0; l < layers; ++l) {
    const uint64_t off = l * per_layer;
    const uint64_t len = l + 1 == layers ? n - off : per_layer;
    tasks.push_back(AdamWTask(l, len, w + off, m + off, v + off));
  }

  // (1) The drift kernel; Compute() returns with the sums on the host.
  std::vector<LayerSums> sums(layers);
  std::string error;
  if (!kernel->Compute(tasks, &sums, &error)) {  // warm-up
    std::fprintf(stderr, "ckpt_gpu_bench: drift: %s\n", error.c_str());
    return 1;
  }
  double drift_best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!kernel->Compute(tasks, &sums, &error)) {
      std::fprintf(stderr, "ckpt_gpu_bench: drift: %s\n", error.c_str());
      return 1;
    }
    drift_best = std::min(
        drift_best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double drift_bytes = static_cast<double>(state_bytes);  // 12 bytes per element

  // (2) The baseline: the same bytes copied device to device.
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  if (!CudaOk(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) {
    return 1;
  }
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpyAsync(copy.p, state.p, state_bytes, cudaMemcpyDeviceToDevice, stream);  // warm-up
  float copy_best_ms = 1e30f;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(e0, stream);
    cudaMemcpyAsync(copy.p, state.p, state_bytes, cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(e1, stream);
    if (!CudaOk(cudaEventSynchronize(e1), "D2D copy")) return 1;
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    copy_best_ms = std::min(copy_best_ms, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  const double copy_bytes = 2.0 * static_cast<double>(state_bytes);  // read + written

  // (3) The check: the first layers' leading elements on the CPU reference.
  const uint32_t check_layers = std::min(layers, kCheckLayers);
  std::vector<std::vector<float>> host(3 * check_layers);
  std::vector<TensorTask> host_tasks, dev_tasks;
  for (uint32_t l = 0; l < check_layers; ++l) {
    const TensorTask& t = tasks[l];
    const uint64_t len = std::min(t.n, kCheckElements);
    const float* src[3] = {static_cast<const float*>(t.w), static_cast<const float*>(t.m),
                           static_cast<const float*>(t.v)};
    for (int k = 0; k < 3; ++k) {
      host[3 * l + k].resize(len);
      if (!CudaOk(cudaMemcpy(host[3 * l + k].data(), src[k], len * sizeof(float),
                             cudaMemcpyDeviceToHost),
                  "cudaMemcpy")) {
        return 1;
      }
    }
    host_tasks.push_back(
        AdamWTask(l, len, host[3 * l].data(), host[3 * l + 1].data(), host[3 * l + 2].data()));
    dev_tasks.push_back(AdamWTask(l, len, src[0], src[1], src[2]));
  }
  std::vector<LayerSums> want(check_layers), got(check_layers);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ckpt::drift::ComputeDriftCpu(host_tasks, &want, threads);
  if (!kernel->Compute(dev_tasks, &got, &error)) {
    std::fprintf(stderr, "ckpt_gpu_bench: drift (check): %s\n", error.c_str());
    return 1;
  }
  double max_rel = 0;
  for (uint32_t l = 0; l < check_layers; ++l) {
    max_rel = std::max({max_rel, RelErr(got[l].dw2, want[l].dw2), RelErr(got[l].w2, want[l].w2)});
  }
  const bool agrees = max_rel <= kMaxRelDiff;

  const double drift_bps = drift_bytes / drift_best;
  const double copy_bps = copy_bytes / (copy_best_ms / 1e3);
  std::printf(
      "{\"device\":\"%s\",\"elements\":%llu,\"layers\":%u,"
      "\"drift_bytes_read\":%.0f,\"drift_s_best\":%.6f,\"drift_bytes_per_s\":%.6e,"
      "\"d2d_bytes_read_plus_written\":%.0f,\"d2d_s_best\":%.6f,\"d2d_bytes_per_s\":%.6e,"
      "\"drift_vs_d2d\":%.4f,"
      "\"cpu_check_layers\":%u,\"cpu_check_elements_per_layer\":%llu,"
      "\"cpu_check_max_rel_diff\":%.3e,\"cpu_check_ok\":%s}\n",
      prop.name, static_cast<unsigned long long>(n), layers, drift_bytes, drift_best, drift_bps,
      copy_bytes, copy_best_ms / 1e3, copy_bps, drift_bps / copy_bps, check_layers,
      static_cast<unsigned long long>(std::min(per_layer, kCheckElements)), max_rel,
      agrees ? "true" : "false");
  if (!agrees) {
    std::fprintf(stderr,
                 "ckpt_gpu_bench: the CUDA drift sums differ from the CPU reference by %.3e"
                 " (allowed %.0e)\n",
                 max_rel, kMaxRelDiff);
    return 1;
  }
  return 0;
}
