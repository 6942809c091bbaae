// CUDA twin of the drift kernels (kernels/drift.h).
//
// One launch covers all tasks: every tensor is cut into chunks of kChunk
// elements, the chunks of all tensors are numbered consecutively and a task
// table in device memory records each tensor's first chunk. Blocks walk the
// chunks grid-stride, find their tensor by binary search, accumulate ΔW² and
// W² in f64 and, whenever the layer changes (and at the end), reduce over the
// block and add the result to the per-layer sums with one double atomicAdd.
// The order of the atomics is not fixed, so results may differ from run to
// run in the last bits (callers compare with a relative tolerance).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adam_update.h"
#include "kernels/drift.h"

namespace ckpt::drift {
namespace {

constexpr int kThreads = 256;  // threads per block (a multiple of 32)
constexpr int kWarps = kThreads / 32;
constexpr uint64_t kChunk = 8192;  // elements per chunk: 32 per thread
// No wait for the device is unbounded: a kernel of ckptd's that has not
// finished after this long means a dead device, and the snapshot thread
// must go on (daemon/gpu/ipc_memory.h polls the trainer's events the same
// way). A kernel that timed out is never used again.
constexpr std::chrono::seconds kDeviceWaitLimit(120);

// Polls `stream` until its work is done or `limit` has passed
// (cudaErrorNotReady then).
cudaError_t PollStream(cudaStream_t stream, std::chrono::steady_clock::duration limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::chrono::microseconds pause(20);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaErrorNotReady || std::chrono::steady_clock::now() >= deadline) return e;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(2));
  }
}
constexpr uint32_t kNoLayer = 0xffffffffu;

// One tensor as the device sees it; the coefficients are computed on the host
// with the same formulas as the CPU reference.
struct DevTask {
  const void* w;
  const void* m;
  const void* v;
  uint64_t n;
  uint64_t first_chunk;
  double lr, wd, adamw_scale;
  AdamConstants adam;  // f32 (adam_update.h)
  uint32_t layer;
  uint8_t w_dtype, m_dtype, v_dtype, optimizer;
  uint8_t vec4;  // Adam(W) on f32 w, m, v that are all 16-byte aligned
};

__device__ __forceinline__ float LoadElem(const void* p, uint8_t dtype, uint64_t i) {
  switch (static_cast<DType>(dtype)) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
    case DType::kF16:
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
  }
  return 0.0f;
}

__device__ __forceinline__ double WarpSum(double x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  return x;
}

// Block-wide sum of (a, b) added to sums[2*layer], sums[2*layer+1]. Every
// thread of the block must call it (it synchronizes).
__device__ void FlushBlock(double a, double b, double* sums, uint32_t layer) {
  __shared__ double sa[kWarps];
  __shared__ double sb[kWarps];
  a = WarpSum(a);
  b = WarpSum(b);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier flush has finished reading sa/sb
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? sa[lane] : 0.0;
    b = lane < kWarps ? sb[lane] : 0.0;
    a = WarpSum(a);
    b = WarpSum(b);
    if (lane == 0) {
      if (a != 0.0) atomicAdd(&sums[2 * layer], a);
      if (b != 0.0) atomicAdd(&sums[2 * layer + 1], b);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    DriftReduceKernel(const DevTask* __restrict__ tasks, uint32_t num_tasks, uint64_t total_chunks,
                      double* __restrict__ sums) {
  double a = 0.0, b = 0.0;
  uint32_t layer = kNoLayer;
  for (uint64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    // The last task whose first chunk is <= c (the host drops empty tensors).
    uint32_t lo = 0, hi = num_tasks;
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (tasks[mid].first_chunk <= c) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const DevTask& t = tasks[lo];
    if (t.layer != layer) {  // uniform over the block: c is the same for all threads
      if (layer != kNoLayer) FlushBlock(a, b, sums, layer);
      a = b = 0.0;
      layer = t.layer;
    }
    const uint64_t begin = (c - t.first_chunk) * kChunk;
    const uint64_t end = begin + kChunk < t.n ? begin + kChunk : t.n;
    const Optimizer opt = static_cast<Optimizer>(t.optimizer);
    if (t.vec4 != 0 && end - begin == kChunk) {
      // The common case, bound by memory: a whole chunk of f32 Adam(W) state
      // read as float4, several loads of each array in flight per thread
      // before any arithmetic. Same per-element formulas as below.
      const auto* w4 = reinterpret_cast<const float4*>(static_cast<const float*>(t.w) + begin);
      const auto* m4 = reinterpret_cast<const float4*>(static_cast<const float*>(t.m) + begin);
      const auto* v4 = reinterpret_cast<const float4*>(static_cast<const float*>(t.v) + begin);
      constexpr int kBatch = 4;  // float4 of each array per thread per batch
      static_assert(kChunk / 4 % (kBatch * kThreads) == 0, "whole batches per chunk");
      for (int base = threadIdx.x; base < static_cast<int>(kChunk / 4); base += kBatch * kThreads) {
        float4 wv[kBatch], mv[kBatch], vv[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          wv[k] = w4[base + k * kThreads];
          mv[k] = m4[base + k * kThreads];
          vv[k] = v4[base + k * kThreads];
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const float ws[4] = {wv[k].x, wv[k].y, wv[k].z, wv[k].w};
          const float ms[4] = {mv[k].x, mv[k].y, mv[k].z, mv[k].w};
          const float vs[4] = {vv[k].x, vv[k].y, vv[k].z, vv[k].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const double w = ws[e];
            const double u = AdamUpdate(ms[e], vs[e], t.adam);
            const double d = opt == Optimizer::kAdamW ? t.adamw_scale * (t.wd * w + u) : -t.lr * u;
            a += d * d;
            b += w * w;
          }
        }
      }
      continue;
    }
    for (uint64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const double w = LoadElem(t.w, t.w_dtype, i);
      double d = 0.0;
      if (opt == Optimizer::kAdamW || opt == Optimizer::kAdam) {
        const double u =
            AdamUpdate(LoadElem(t.m, t.m_dtype, i), LoadElem(t.v, t.v_dtype, i), t.adam);
        d = opt == Optimizer::kAdamW ? t.adamw_scale * (t.wd * w + u) : -t.lr * u;
      } else if (opt == Optimizer::kSgd) {
        d = -t.lr * static_cast<double>(LoadElem(t.m, t.m_dtype, i));
      }
      a += d * d;
      b += w * w;
    }
  }
  if (layer != kNoLayer) FlushBlock(a, b, sums, layer);
}

std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Sets *where (when given) and returns false.
bool Fail(std::string* where, const std::string& what) {
  if (where != nullptr) *where = what;
  return false;
}

// Makes `device` current for the lifetime of the guard, then restores the
// caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ == device) return;
    ok_ = cudaSetDevice(device) == cudaSuccess;
    restore_ = ok_ && prev_ >= 0;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = true;
  bool restore_ = false;
};

class CudaKernel final : public DriftKernel {
 public:
  CudaKernel() = default;
  ~CudaKernel() override {
    DeviceGuard guard(device_);
    if (stuck_ ||
        (stream_ != nullptr && PollStream(stream_, std::chrono::seconds(5)) == cudaErrorNotReady)) {
      // Work still queued may write into these: leak them rather than wait.
      new std::vector<double>(std::move(host_sums_));
      new std::vector<DevTask>(std::move(host_tasks_));
      return;
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (d_tasks_ != nullptr) cudaFree(d_tasks_);
    if (d_sums_ != nullptr) cudaFree(d_sums_);
  }
  CudaKernel(const CudaKernel&) = delete;
  CudaKernel& operator=(const CudaKernel&) = delete;

  // Creates the stream and the initial buffers on the current device.
  bool Init(std::string* why) {
    cudaError_t e = cudaGetDevice(&device_);
    if (e != cudaSuccess) return Fail(why, CudaError("cudaGetDevice", e));
    e = cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device_);
    if (e != cudaSuccess) return Fail(why, CudaError("cudaDeviceGetAttribute", e));
    int per_sm = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, DriftReduceKernel, kThreads, 0);
    if (e != cudaSuccess)
      return Fail(why, CudaError("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e));
    max_grid_ =
        static_cast<uint64_t>(std::max(1, sms_)) * static_cast<uint64_t>(std::max(1, per_sm));
    e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return Fail(why, CudaError("cudaStreamCreateWithFlags", e));
    std::string err;
    if (!Reserve(64, 64, &err)) return Fail(why, err);
    return true;
  }

  const char* name() const override { return "cuda"; }

  bool Compute(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out,
               std::string* error) override {
    for (LayerSums& s : *out) s = LayerSums();
    if (stuck_) return Fail(error, "an earlier drift kernel never finished on this device");
    const size_t layers = out->size();
    host_tasks_.clear();
    uint64_t chunks = 0;
    for (const TensorTask& t : tasks) {
      if (t.layer >= layers) return Fail(error, "task layer out of range");
      if (t.n == 0) continue;
      const bool needs_m = t.optimizer != Optimizer::kNone;
      const bool needs_v = t.optimizer == Optimizer::kAdamW || t.optimizer == Optimizer::kAdam;
      if (t.w == nullptr || (needs_m && t.m == nullptr) || (needs_v && t.v == nullptr)) {
        return Fail(error, "task has a null tensor pointer");
      }
      if (!ValidDType(t.w_dtype) || (needs_m && !ValidDType(t.m_dtype)) ||
          (needs_v && !ValidDType(t.v_dtype)) || static_cast<uint8_t>(t.optimizer) > 3) {
        return Fail(error, "task has an unknown dtype or optimizer");
      }
      DevTask d;
      d.w = t.w;
      d.m = t.m;
      d.v = t.v;
      d.n = t.n;
      d.first_chunk = chunks;
      const double step = static_cast<double>(std::max<uint64_t>(1, t.step));
      d.lr = t.lr;
      d.wd = t.weight_decay;
      d.adam.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(t.beta1, step)));
      d.adam.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(t.beta2, step)));
      d.adam.eps = static_cast<float>(t.eps);
      d.adamw_scale = -t.lr / (1.0 - t.lr * t.weight_decay);
      d.layer = t.layer;
      d.w_dtype = static_cast<uint8_t>(t.w_dtype);
      d.m_dtype = static_cast<uint8_t>(t.m_dtype);
      d.v_dtype = static_cast<uint8_t>(t.v_dtype);
      d.optimizer = static_cast<uint8_t>(t.optimizer);
      auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      d.vec4 = (t.optimizer == Optimizer::kAdamW || t.optimizer == Optimizer::kAdam) &&
               t.w_dtype == DType::kF32 && t.m_dtype == DType::kF32 && t.v_dtype == DType::kF32 &&
               aligned(t.w) && aligned(t.m) && aligned(t.v);
      host_tasks_.push_back(d);
      chunks += (t.n + kChunk - 1) / kChunk;
    }
    if (host_tasks_.empty()) return true;
    if (host_tasks_.size() > 0xffffffffu) return Fail(error, "too many tasks");

    DeviceGuard guard(device_);
    if (!guard.ok()) return Fail(error, "cudaSetDevice failed");
    if (!Reserve(host_tasks_.size(), 2 * layers, error)) return false;
    cudaError_t e =
        cudaMemcpyAsync(d_tasks_, host_tasks_.data(), host_tasks_.size() * sizeof(DevTask),
                        cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return Fail(error, CudaError("cudaMemcpyAsync (tasks)", e));
    e = cudaMemsetAsync(d_sums_, 0, 2 * layers * sizeof(double), stream_);
    if (e != cudaSuccess) return Fail(error, CudaError("cudaMemsetAsync", e));
    const unsigned grid = static_cast<unsigned>(std::min(chunks, max_grid_));
    DriftReduceKernel<<<grid, kThreads, 0, stream_>>>(
        d_tasks_, static_cast<uint32_t>(host_tasks_.size()), chunks, d_sums_);
    e = cudaGetLastError();
    if (e != cudaSuccess) return Fail(error, CudaError("kernel launch", e));
    host_sums_.assign(2 * layers, 0.0);
    e = cudaMemcpyAsync(host_sums_.data(), d_sums_, 2 * layers * sizeof(double),
                        cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return Fail(error, CudaError("cudaMemcpyAsync (sums)", e));
    e = PollStream(stream_, kDeviceWaitLimit);
    if (e == cudaErrorNotReady) {
      stuck_ = true;
      return Fail(error,
                  "the drift kernel did not finish within 120 s (a hung device?); it "
                  "is not used again");
    }
    if (e != cudaSuccess) return Fail(error, CudaError("drift kernel", e));
    for (size_t l = 0; l < layers; ++l) {
      (*out)[l].dw2 = host_sums_[2 * l];
      (*out)[l].w2 = host_sums_[2 * l + 1];
    }
    return true;
  }

 private:
  static bool ValidDType(DType t) { return static_cast<uint8_t>(t) <= 2; }

  // Grows the device task table and sums array to at least the given sizes.
  bool Reserve(size_t tasks, size_t sums, std::string* error) {
    if (tasks > task_cap_) {
      if (d_tasks_ != nullptr) {
        // Idle: every Compute waited for its work (cudaFree would wait too).
        if (PollStream(stream_, kDeviceWaitLimit) == cudaErrorNotReady) {
          stuck_ = true;
          return Fail(error, "the device did not finish earlier work");
        }
        cudaFree(d_tasks_);
        d_tasks_ = nullptr;
        task_cap_ = 0;
      }
      const size_t cap = std::max(tasks, 2 * task_cap_);
      const cudaError_t e = cudaMalloc(&d_tasks_, cap * sizeof(DevTask));
      if (e != cudaSuccess) return Fail(error, CudaError("cudaMalloc (tasks)", e));
      task_cap_ = cap;
    }
    if (sums > sums_cap_) {
      if (d_sums_ != nullptr) {
        if (PollStream(stream_, kDeviceWaitLimit) == cudaErrorNotReady) {
          stuck_ = true;
          return Fail(error, "the device did not finish earlier work");
        }
        cudaFree(d_sums_);
        d_sums_ = nullptr;
        sums_cap_ = 0;
      }
      const cudaError_t e = cudaMalloc(&d_sums_, sums * sizeof(double));
      if (e != cudaSuccess) return Fail(error, CudaError("cudaMalloc (sums)", e));
      sums_cap_ = sums;
    }
    return true;
  }

  int device_ = 0;
  int sms_ = 1;
  uint64_t max_grid_ = 1;  // resident blocks on the whole device
  cudaStream_t stream_ = nullptr;
  DevTask* d_tasks_ = nullptr;
  size_t task_cap_ = 0;
  double* d_sums_ = nullptr;
  size_t sums_cap_ = 0;
  std::vector<DevTask> host_tasks_;
  std::vector<double> host_sums_;
  bool stuck_ = false;  // a wait timed out: work may still be queued
};

// ---- known-answer self-test ----

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [lo, hi).
float Uniform(uint64_t* s, float lo, float hi) {
  const double u = static_cast<double>(SplitMix(s) >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>(lo + (hi - lo) * u);
}

// `n` values in [lo, hi) encoded as `dtype`, as raw bytes.
std::vector<uint8_t> RandomArray(uint64_t* seed, uint64_t n, DType dtype, float lo, float hi) {
  const size_t width = dtype == DType::kF32 ? 4 : 2;
  std::vector<uint8_t> bytes(n * width);
  for (uint64_t i = 0; i < n; ++i) {
    const float f = Uniform(seed, lo, hi);
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(f) : F32ToF16(f);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

bool Close(double got, double want, double rel) {
  return std::fabs(got - want) <= rel * std::max(std::fabs(got), std::fabs(want)) + 1e-300;
}

// Runs `kernel` on a fixed set of tensors covering every dtype and optimizer
// at awkward sizes and compares with ComputeDriftScalar on the host copies.
bool SelfTest(CudaKernel* kernel, std::string* why) {
  constexpr uint64_t kSizes[] = {1, 4097, 100003};
  constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  constexpr Optimizer kOpts[] = {Optimizer::kAdamW, Optimizer::kAdam, Optimizer::kSgd,
                                 Optimizer::kNone};
  constexpr uint32_t kLayers = 5;
  uint64_t seed = 0x5eed5eedull;
  std::vector<std::vector<uint8_t>> host;  // w, m, v per task
  std::vector<TensorTask> tasks;
  int k = 0;
  for (DType dt : kDTypes) {
    for (Optimizer opt : kOpts) {
      TensorTask t;
      t.layer = static_cast<uint32_t>(k % kLayers);
      t.n = kSizes[k % 3];
      t.optimizer = opt;
      t.w_dtype = dt;
      t.m_dtype = kDTypes[(k + 1) % 3];  // mix dtypes within a task too
      t.v_dtype = dt;
      t.lr = opt == Optimizer::kSgd ? 0.05 : 1e-3;
      t.weight_decay = opt == Optimizer::kSgd ? 0.0 : 0.01;
      t.step = 1 + static_cast<uint64_t>(k) * 3;
      host.push_back(RandomArray(&seed, t.n, t.w_dtype, -1.0f, 1.0f));
      host.push_back(RandomArray(&seed, t.n, t.m_dtype, -1e-2f, 1e-2f));
      host.push_back(RandomArray(&seed, t.n, t.v_dtype, 0.0f, 1e-4f));
      tasks.push_back(t);
      ++k;
    }
  }
  std::vector<TensorTask> host_tasks = tasks;
  std::vector<void*> dev(host.size(), nullptr);
  bool ok = true;
  for (size_t i = 0; i < host.size() && ok; ++i) {
    cudaError_t e = cudaMalloc(&dev[i], host[i].size());
    if (e == cudaSuccess) {
      e = cudaMemcpy(dev[i], host[i].data(), host[i].size(), cudaMemcpyHostToDevice);
    }
    if (e != cudaSuccess) {
      ok = Fail(why, CudaError("self-test upload", e));
      cudaGetLastError();
    }
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    host_tasks[i].w = host[3 * i].data();
    host_tasks[i].m = host[3 * i + 1].data();
    host_tasks[i].v = host[3 * i + 2].data();
    tasks[i].w = dev[3 * i];
    tasks[i].m = dev[3 * i + 1];
    tasks[i].v = dev[3 * i + 2];
  }
  if (ok) {
    std::vector<LayerSums> want(kLayers), got(kLayers);
    ComputeDriftScalar(host_tasks, &want);
    std::string err;
    if (!kernel->Compute(tasks, &got, &err)) {
      ok = Fail(why, "self-test: " + err);
    } else {
      for (uint32_t l = 0; l < kLayers && ok; ++l) {
        if (!Close(got[l].dw2, want[l].dw2, 1e-9) || !Close(got[l].w2, want[l].w2, 1e-9)) {
          ok = Fail(why, "self-test: device sums differ from the scalar reference at layer " +
                             std::to_string(l));
        }
      }
    }
  }
  for (void* p : dev) {
    if (p != nullptr) cudaFree(p);
  }
  return ok;
}

}  // namespace

std::unique_ptr<DriftKernel> MakeCudaDriftKernel(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    cudaGetLastError();  // clear the error so that later runtime calls start clean
    if (why != nullptr) {
      *why = e != cudaSuccess ? CudaError("no CUDA device", e) : "no CUDA device";
    }
    return nullptr;
  }
  auto kernel = std::make_unique<CudaKernel>();
  if (!kernel->Init(why) || !SelfTest(kernel.get(), why)) {
    cudaGetLastError();
    return nullptr;
  }
  return kernel;
}

}  // namespace ckpt::drift
