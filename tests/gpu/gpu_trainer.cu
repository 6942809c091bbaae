// ckpt_gpu_trainer: a synthetic trainer whose layers live in GPU memory, for
// the CUDA IPC handover (tests/gpu/gpu_snapshot_test.cc drives it as a child
// process; tests/gpu/run_on_gpu.sh runs its benchmark).
//
// Every layer is one f32 tensor whose content is a pure function of (layer,
// element, step):
//
//   f(l, i, t) = float((l * 1000003 + i * 7 + t * 13) mod 2^20)
//
// The values are integers below 2^24, so they are exact in f32, and 13 is odd,
// so a value names the step it was written at (mod 2^20). A restored layer is
// checked bit-exactly against its planned step, and a wrong one says which
// step it holds: t + 1 means the daemon copied after the trainer's next
// optimizer step had started, i.e. the fence did not hold.
//
// Layout: layers 0 and 1 share one cudaMalloc allocation, between guard gaps
// (so one IPC handle carries two tensors at non-zero offsets, and a restore
// that writes outside a tensor shows in the gaps); every other layer has its
// own allocation.
//
// Modes (--mode=):
//   train   registers, then per step t: [simulated forward/backward]
//           -> fence WaitSnapshot(t-1) -> kernel writes f(t) into every layer
//           -> StepDone(t) -> cudaStreamSynchronize (like loss.item()).
//           --step-delay-ms=N writes the second half of the layers N ms
//           after the first, so StepDone reaches the daemon while the step
//           still runs: a daemon that does not wait for the step's event
//           copies a mix of t-1 and t, which verify then reports.
//           Waits until the last step is durable and unregisters, or with
//           --no-unregister leaves with _exit(0) right after the last StepDone.
//   verify  registers the same layout in a new process, fills every
//           allocation with a sentinel, Restore(0), and checks each layer
//           against f(layer, *, planned step) and the gaps against the
//           sentinel; with --steps=N also checks each planned step against
//           the policy's schedule for a train run of N steps.
//   bench   big layers: (a) cudaMemcpyAsync D2H peak into pinned memory,
//           (b) ckptd snapshot throughput StepDone(t) -> WaitSnapshot(t),
//           (c) fence wait per step in a loop with --compute-ms of "compute".
//           Prints one JSON line.
//   drift   --layers AdamW-shaped layers (weight, exp_avg, exp_avg_sq, each
//           in its own allocation) under policy layercheck with ckptd's drift
//           trace on. After each step's fence the trainer reads the three
//           tensors back and computes every layer's normalized drift with
//           the CPU reference kernel; it writes them as "d" per step, for
//           comparison with what ckptd's CUDA kernel computed on its IPC
//           mappings (drift.jsonl in the rank's data directory).
//
// --vmm (train, verify): every allocation is CUDA virtual-memory-management
// memory, as PyTorch's expandable segments make it: one reserved range backed
// by pages of the allocation granularity (2 MiB), each its own cuMemCreate
// that allows export as a POSIX descriptor, so a layer spans several physical
// allocations and the client hands them over page by page.
//
// Exit codes: 0 ok, 1 failure, 2 usage, 3 verify found wrong bytes, 77 no
// CUDA device.
#include <cuda.h>  // driver types only: the functions come through the runtime
#include <cuda_runtime.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/cuda_entry.h"
#include "ckpt/client.h"
#include "kernels/drift.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr uint32_t kValueBits = 20;
constexpr uint32_t kValueMask = (1u << kValueBits) - 1;
// Guard gaps around the two layers of the shared allocation. 256 bytes keeps
// every tensor at cudaMalloc's alignment.
constexpr uint64_t kGapBytes = 256;
// Fill byte before a restore: 0xffffffff is a NaN, never a value of f.
constexpr int kSentinelByte = 0xff;
constexpr int kExitMismatch = 3;
constexpr int kExitNoDevice = 77;

struct Args {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string job = "gpu-trainer";
  std::string mode = "train";
  uint32_t layers = 0;       // 0: 6 (train, verify) or 8 (bench)
  uint64_t layer_bytes = 0;  // 0: 4 MiB (train, verify) or 256 MiB (bench)
  uint64_t steps = 30;
  bool steps_given = false;
  std::string policy = "all";
  int64_t compute_ms = -1;     // -1: 0 (train) or 50 (bench)
  uint64_t step_delay_ms = 0;  // train: the step's second half of layers is written this late
  bool no_unregister = false;
  bool vmm = false;  // allocations of the virtual memory management API
  std::string json_out;
  std::string ready_file;  // written once the last step was reported (or after Restore)
  std::string hold_until;  // then wait (at most 120 s) until this file exists
  // bench only
  uint32_t snapshot_steps = 5;  // (b): measured steps, after one warm-up step
  uint64_t fence_steps = 20;    // (c): at least this many steps
  uint64_t fence_every = 5;     // (c): checkpoint every K steps, K >= this
};

// 4K, 4M, 4G suffixes (powers of two).
bool ParseBytes(const std::string& s, uint64_t* out) {
  uint64_t mult = 1;
  std::string n = s;
  if (!n.empty()) {
    switch (n.back()) {
      case 'K':
      case 'k':
        mult = uint64_t{1} << 10;
        break;
      case 'M':
      case 'm':
        mult = uint64_t{1} << 20;
        break;
      case 'G':
      case 'g':
        mult = uint64_t{1} << 30;
        break;
      default:
        break;
    }
  }
  if (mult != 1) n.pop_back();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(n, &v)) return false;
  *out = v * mult;
  return true;
}

int Usage() {
  std::fprintf(
      stderr,
      "usage: ckpt_gpu_trainer --socket=PATH [--job=ID] [--mode=train|verify|bench|drift]\n"
      "  [--layers=N] [--layer-bytes=SIZE] [--steps=S] [--policy=all|every_n:K|explicit]\n"
      "  [--compute-ms=MS] [--step-delay-ms=MS] [--no-unregister] [--vmm] [--json-out=FILE]\n"
      "  [--ready-file=FILE] [--hold-until=FILE]\n"
      "  bench: [--snapshot-steps=N] [--fence-steps=N] [--fence-every=K]\n");
  return 2;
}

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const size_t eq = s.find('=');
    const std::string k = s.substr(0, eq);
    const std::string v = eq == std::string::npos ? "" : s.substr(eq + 1);
    bool ok = true;
    if (k == "--socket") {
      a->socket = v;
    } else if (k == "--job") {
      a->job = v;
    } else if (k == "--mode") {
      a->mode = v;
      ok = v == "train" || v == "verify" || v == "bench" || v == "drift";
    } else if (k == "--layers") {
      ok = absl::SimpleAtoi(v, &a->layers) && a->layers >= 2;
    } else if (k == "--layer-bytes") {
      ok = ParseBytes(v, &a->layer_bytes) && a->layer_bytes >= 256;
    } else if (k == "--steps") {
      ok = absl::SimpleAtoi(v, &a->steps);
      a->steps_given = true;
    } else if (k == "--policy") {
      a->policy = v;
    } else if (k == "--compute-ms") {
      ok = absl::SimpleAtoi(v, &a->compute_ms) && a->compute_ms >= 0;
    } else if (k == "--step-delay-ms") {
      ok = absl::SimpleAtoi(v, &a->step_delay_ms);
    } else if (k == "--vmm") {
      a->vmm = true;
    } else if (k == "--no-unregister") {
      a->no_unregister = true;
    } else if (k == "--json-out") {
      a->json_out = v;
    } else if (k == "--ready-file") {
      a->ready_file = v;
    } else if (k == "--hold-until") {
      a->hold_until = v;
    } else if (k == "--snapshot-steps") {
      ok = absl::SimpleAtoi(v, &a->snapshot_steps) && a->snapshot_steps > 0;
    } else if (k == "--fence-steps") {
      ok = absl::SimpleAtoi(v, &a->fence_steps) && a->fence_steps > 1;
    } else if (k == "--fence-every") {
      ok = absl::SimpleAtoi(v, &a->fence_every) && a->fence_every > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "ckpt_gpu_trainer: bad argument '%s'\n", s.c_str());
      return false;
    }
  }
  const bool bench = a->mode == "bench";
  if (a->layers == 0) a->layers = bench ? 8 : 6;
  if (a->layer_bytes == 0) a->layer_bytes = uint64_t{bench ? 256u : 4u} << 20;
  if (a->compute_ms < 0) a->compute_ms = bench ? 50 : 0;
  // Whole 256-byte units keep every tensor of the shared allocation aligned.
  a->layer_bytes = a->layer_bytes / 256 * 256;
  return true;
}

bool CudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "ckpt_gpu_trainer: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---- the content function and its kernels ----

__host__ __device__ inline uint32_t Value(uint32_t layer, uint64_t i, uint64_t step) {
  return static_cast<uint32_t>((uint64_t{layer} * 1000003u + i * 7u + step * 13u) & kValueMask);
}

__global__ void FillKernel(float* p, uint64_t n, uint32_t layer, uint64_t step) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    p[i] = static_cast<float>(Value(layer, i, step));
  }
}

// Stands in for forward/backward: occupies the stream for `ns` nanoseconds
// (globaltimer) without touching the layers or memory bandwidth.
__global__ void SpinKernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// 13^-1 mod 2^20 by Newton's iteration (each round doubles the correct bits).
uint32_t InverseOf13() {
  uint32_t x = 13;  // 13 * 13 = 169 = 1 mod 8: three bits right
  for (int i = 0; i < 4; ++i) x *= 2u - 13u * x;
  return x & kValueMask;
}

// The step (mod 2^20) whose f produced `v` at (layer, i); -1 when `v` is no
// value of f at all (the sentinel: the element was not restored).
int64_t DecodeStep(uint32_t layer, uint64_t i, float v) {
  if (!(v >= 0.0f && v <= static_cast<float>(kValueMask)) || std::floor(v) != v) return -1;
  const uint32_t base = Value(layer, i, 0);
  return static_cast<int64_t>(((static_cast<uint32_t>(v) - base) * InverseOf13()) & kValueMask);
}

// ---- buffers ----

// Allocations of CUDA's virtual memory management API, made page by page as
// PyTorch's expandable segments are (--vmm).
class VmmPages {
 public:
  ~VmmPages() {
    for (const Range& r : ranges_) {
      for (size_t i = 0; i < r.pages.size(); ++i) {
        unmap_(r.base + i * granularity_, granularity_);
        release_(r.pages[i]);
      }
      address_free_(r.base, r.bytes);
    }
  }

  // `bytes` rounded up to whole pages, readable and writable by the
  // current device.
  bool Allocate(uint64_t bytes, void** p) {
    if (!Load()) return false;
    Range r;
    r.bytes = (bytes + granularity_ - 1) / granularity_ * granularity_;
    if (!Ok(reserve_(&r.base, r.bytes, 0, 0, 0), "cuMemAddressReserve")) return false;
    for (uint64_t off = 0; off < r.bytes; off += granularity_) {
      CUmemGenericAllocationHandle h = 0;
      if (!Ok(create_(&h, granularity_, &prop_, 0), "cuMemCreate")) return false;
      r.pages.push_back(h);
      if (!Ok(map_(r.base + off, granularity_, 0, h, 0), "cuMemMap")) return false;
    }
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (!Ok(set_access_(r.base, r.bytes, &access, 1), "cuMemSetAccess")) return false;
    *p = reinterpret_cast<void*>(r.base);
    ranges_.push_back(std::move(r));
    return true;
  }

 private:
  struct Range {
    CUdeviceptr base = 0;
    uint64_t bytes = 0;
    std::vector<CUmemGenericAllocationHandle> pages;
  };

  template <typename Fn>
  static bool Entry(const char* symbol, Fn* fn) {
    std::string why;
    if (ckpt::CudaDriverEntry(symbol, fn, &why)) return true;
    std::fprintf(stderr, "ckpt_gpu_trainer: %s\n", why.c_str());
    return false;
  }
  static bool Ok(CUresult r, const char* what) {
    if (r == CUDA_SUCCESS) return true;
    std::fprintf(stderr, "ckpt_gpu_trainer: %s: CUresult %d\n", what, static_cast<int>(r));
    return false;
  }
  bool Load() {
    if (granularity_ != 0) return true;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return false;
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) =
        nullptr;
    if (!Entry("cuMemCreate", &create_) || !Entry("cuMemAddressReserve", &reserve_) ||
        !Entry("cuMemMap", &map_) || !Entry("cuMemSetAccess", &set_access_) ||
        !Entry("cuMemUnmap", &unmap_) || !Entry("cuMemRelease", &release_) ||
        !Entry("cuMemAddressFree", &address_free_) ||
        !Entry("cuMemGetAllocationGranularity", &granularity)) {
      return false;
    }
    size_t g = 0;
    if (!Ok(granularity(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity")) {
      return false;
    }
    granularity_ = g;
    return true;
  }

  CUmemAllocationProp prop_{};
  uint64_t granularity_ = 0;
  CUresult (*create_)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                      unsigned long long) = nullptr;
  CUresult (*reserve_)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*map_)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                   unsigned long long) = nullptr;
  CUresult (*set_access_)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_free_)(CUdeviceptr, size_t) = nullptr;
  std::vector<Range> ranges_;
};

struct Layer {
  float* ptr = nullptr;
  uint64_t bytes = 0;
  uint32_t region = 0;  // from AddGpuTensor
  uint64_t offset = 0;
};

// The trainer's device allocations; layers 0 and 1 share allocations[0].
class Buffers {
 public:
  explicit Buffers(bool vmm) : vmm_(vmm ? std::make_unique<VmmPages>() : nullptr) {}
  ~Buffers() {
    if (vmm_ == nullptr) {
      for (void* p : allocations_) cudaFree(p);
    }
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;

  bool Allocate(uint32_t layers, uint64_t layer_bytes) {
    layers_.resize(layers);
    // [gap][layer 0][gap][layer 1][gap]
    const uint64_t shared = 3 * kGapBytes + 2 * layer_bytes;
    char* base = nullptr;
    if (!Malloc(shared, reinterpret_cast<void**>(&base))) return false;
    layers_[0] = {reinterpret_cast<float*>(base + kGapBytes), layer_bytes};
    layers_[1] = {reinterpret_cast<float*>(base + 2 * kGapBytes + layer_bytes), layer_bytes};
    gaps_ = {{base, kGapBytes},
             {base + kGapBytes + layer_bytes, kGapBytes},
             {base + 2 * kGapBytes + 2 * layer_bytes, kGapBytes}};
    for (uint32_t l = 2; l < layers; ++l) {
      void* p = nullptr;
      if (!Malloc(layer_bytes, &p)) return false;
      layers_[l] = {static_cast<float*>(p), layer_bytes};
    }
    return true;
  }

  // Writes f(l, *, step) into every layer on `stream` (asynchronous). With
  // `delay_ns`, the second half of the layers is written that much later
  // (a long optimizer step), so a StepDone issued right after Fill reaches
  // the daemon while the step is still running on the device.
  bool Fill(uint64_t step, cudaStream_t stream, uint64_t delay_ns = 0) {
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      if (delay_ns > 0 && l == layers_.size() / 2) SpinKernel<<<1, 32, 0, stream>>>(delay_ns);
      const uint64_t n = layers_[l].bytes / 4;
      const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + 255) / 256, 2048));
      FillKernel<<<blocks, 256, 0, stream>>>(layers_[l].ptr, n, l, step);
    }
    return CudaOk(cudaGetLastError(), "FillKernel");
  }

  // Every byte of every allocation, gaps included, becomes kSentinelByte.
  bool FillSentinel() {
    for (size_t i = 0; i < allocations_.size(); ++i) {
      if (!CudaOk(cudaMemset(allocations_[i], kSentinelByte, allocation_bytes_[i]), "cudaMemset")) {
        return false;
      }
    }
    return CudaOk(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  std::vector<Layer>& layers() { return layers_; }
  const std::vector<std::pair<char*, uint64_t>>& gaps() const { return gaps_; }
  uint64_t tensor_bytes() const {
    uint64_t b = 0;
    for (const Layer& l : layers_) b += l.bytes;
    return b;
  }

 private:
  bool Malloc(uint64_t bytes, void** p) {
    if (vmm_ != nullptr) {
      if (!vmm_->Allocate(bytes, p)) return false;
    } else if (!CudaOk(cudaMalloc(p, bytes), "cudaMalloc")) {
      return false;
    }
    allocations_.push_back(*p);
    allocation_bytes_.push_back(bytes);
    return true;
  }

  std::unique_ptr<VmmPages> vmm_;  // --vmm: freed by its destructor
  std::vector<void*> allocations_;
  std::vector<uint64_t> allocation_bytes_;
  std::vector<Layer> layers_;
  std::vector<std::pair<char*, uint64_t>> gaps_;
};

// ---- policy ----

struct Policy {
  ckpt::v1::PolicySpec spec;
  bool explicit_schedule = false;
};

bool ParsePolicy(const std::string& s, Policy* p) {
  if (s == "all") {
    p->spec.set_kind(ckpt::v1::POLICY_ALL);
  } else if (s == "explicit") {
    p->spec.set_kind(ckpt::v1::POLICY_EXPLICIT);
    p->explicit_schedule = true;
  } else if (s.rfind("every_n:", 0) == 0) {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(s.substr(8), &n) || n == 0) return false;
    p->spec.set_kind(ckpt::v1::POLICY_EVERY_N);
    p->spec.set_every_n(n);
  } else {
    return false;
  }
  return true;
}

// --policy=explicit: layer l is listed every (l % 5) + 2 steps, so a
// composite restore mixes several steps.
bool ExplicitSelects(uint32_t layer, uint64_t step) { return step % ((layer % 5) + 2) == 0; }

bool Selects(const Policy& p, uint32_t layer, uint64_t step) {
  if (step == 1) return true;  // the first step after registration persists every layer
  if (p.explicit_schedule) return ExplicitSelects(layer, step);
  if (p.spec.kind() == ckpt::v1::POLICY_EVERY_N) return step % p.spec.every_n() == 0;
  return true;
}

// The newest step <= steps at which the schedule persists `layer`.
uint64_t ExpectedStep(const Policy& p, uint32_t layer, uint64_t steps) {
  for (uint64_t t = steps; t >= 1; --t) {
    if (Selects(p, layer, t)) return t;
  }
  return 0;
}

std::vector<uint32_t> ExplicitLayers(const Policy& p, uint32_t layers, uint64_t step) {
  std::vector<uint32_t> out;
  if (!p.explicit_schedule) return out;
  for (uint32_t l = 0; l < layers; ++l) {
    if (ExplicitSelects(l, step)) out.push_back(l);
  }
  return out;
}

// ---- registration ----

// Adds every layer with AddGpuTensor and registers the rank. Checks the
// places AddGpuTensor returned for the shared allocation: one region, and
// offsets that differ by exactly what separates the two tensors.
absl::Status RegisterLayers(ckpt::Client* client, const Args& a, const Policy& policy,
                            Buffers* buffers, uint32_t* regions) {
  ckpt::RankSpec spec;
  spec.job_id = a.job;
  spec.policy = policy.spec;
  std::vector<uint32_t> seen;
  for (uint32_t l = 0; l < buffers->layers().size(); ++l) {
    Layer& layer = buffers->layers()[l];
    const std::string name = absl::StrCat("layers.", l, ".weight");
    absl::StatusOr<ckpt::Client::GpuPlace> place =
        client->AddGpuTensor(layer.ptr, layer.bytes, name);
    if (!place.ok()) return place.status();
    layer.region = place->region;
    layer.offset = place->offset;
    if (std::find(seen.begin(), seen.end(), place->region) == seen.end()) {
      seen.push_back(place->region);
    }
    ckpt::LayerDesc ld;
    ld.name = absl::StrCat("layers.", l);
    ckpt::TensorDesc td;
    td.name = name;
    td.dtype = ckpt::v1::DTYPE_F32;
    td.shape = {layer.bytes / 4};
    td.region = place->region;
    td.offset = place->offset;
    ld.tensors.push_back(td);
    spec.layers.push_back(ld);
  }
  const Layer& l0 = buffers->layers()[0];
  const Layer& l1 = buffers->layers()[1];
  if (l0.region != l1.region || l1.offset - l0.offset != l0.bytes + kGapBytes) {
    return absl::InternalError(absl::StrCat(
        "AddGpuTensor: layers 0 and 1 share one allocation but got (region ", l0.region,
        ", offset ", l0.offset, ") and (region ", l1.region, ", offset ", l1.offset,
        "); expected one region and offsets ", l0.bytes + kGapBytes, " apart"));
  }
  *regions = static_cast<uint32_t>(seen.size());
  return client->Register(spec);
}

bool WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// Tells a waiting test that the registration is live, then holds it until the
// test creates --hold-until (bounded, so an abandoned trainer cannot hang).
void ReadyAndHold(const Args& a, uint32_t regions, uint64_t tensor_bytes) {
  if (!a.ready_file.empty()) {
    Json j{{"regions", regions}, {"tensor_bytes", tensor_bytes}};
    if (!WriteFile(a.ready_file, j.dump() + "\n")) {
      std::fprintf(stderr, "ckpt_gpu_trainer: cannot write %s\n", a.ready_file.c_str());
    }
  }
  if (a.hold_until.empty()) return;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);
  struct stat st;
  while (::stat(a.hold_until.c_str(), &st) != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Json Summary(std::vector<double> v) {
  if (v.empty()) return Json{{"n", 0}};
  double sum = 0;
  for (double x : v) sum += x;
  std::sort(v.begin(), v.end());
  return Json{{"n", v.size()},
              {"median", v[v.size() / 2]},
              {"mean", sum / v.size()},
              {"max", v.back()},
              {"sum", sum}};
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Emit(const Args& a, const Json& j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  if (!a.json_out.empty() && !WriteFile(a.json_out, j.dump(2) + "\n")) {
    std::fprintf(stderr, "ckpt_gpu_trainer: cannot write %s\n", a.json_out.c_str());
  }
}

// ---- drift mode ----

// Deterministic AdamW state of `layer` at `step`: weights around 0.5, exp_avg
// of both signs scaled by the layer (so the layers drift by different
// amounts), exp_avg_sq positive.
__global__ void AdamStateKernel(float* w, float* m, float* v, uint64_t n, uint32_t layer,
                                uint64_t step) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h = static_cast<uint32_t>(i * 2654435761u) ^ (layer * 97u) ^
                       static_cast<uint32_t>(step * 40503u);
    w[i] = 0.5f + static_cast<float>(h % 1000) * 1e-3f;
    m[i] = static_cast<float>(static_cast<int>((h >> 10) % 2001) - 1000) * 1e-6f *
           static_cast<float>(layer + 1);
    v[i] = 1e-8f * static_cast<float>(1 + (h >> 20) % 1000);
  }
}

constexpr double kDriftLr = 1e-3;
constexpr double kDriftWeightDecay = 0.01;

int Drift(const Args& a, ckpt::Client* client, cudaStream_t stream) {
  const uint32_t layers = a.layers;
  const uint64_t n = a.layer_bytes / 4;
  std::vector<std::array<float*, 3>> dev(layers, {nullptr, nullptr, nullptr});
  struct Free {
    std::vector<std::array<float*, 3>>* d;
    ~Free() {
      for (auto& t : *d) {
        for (float* p : t) cudaFree(p);
      }
    }
  } free_all{&dev};
  ckpt::RankSpec spec;
  spec.job_id = a.job;
  spec.policy.set_kind(ckpt::v1::POLICY_LAYERCHECK);
  spec.policy.set_optimizer(ckpt::v1::OPTIMIZER_ADAMW);
  spec.policy.set_record_trace(true);
  spec.policy.mutable_layercheck()->set_warmup(0);
  const char* names[3] = {"weight", "exp_avg", "exp_avg_sq"};
  const ckpt::v1::TensorRole roles[3] = {ckpt::v1::ROLE_PARAM, ckpt::v1::ROLE_EXP_AVG,
                                         ckpt::v1::ROLE_EXP_AVG_SQ};
  for (uint32_t l = 0; l < layers; ++l) {
    ckpt::LayerDesc ld;
    ld.name = absl::StrCat("layers.", l);
    for (int k = 0; k < 3; ++k) {
      if (!CudaOk(cudaMalloc(&dev[l][k], a.layer_bytes), "cudaMalloc")) return 1;
      const std::string name = absl::StrCat("layers.", l, ".", names[k]);
      absl::StatusOr<ckpt::Client::GpuPlace> place =
          client->AddGpuTensor(dev[l][k], a.layer_bytes, name);
      if (!place.ok()) {
        std::fprintf(stderr, "add %s: %s\n", name.c_str(), place.status().ToString().c_str());
        return 1;
      }
      ckpt::TensorDesc td;
      td.name = name;
      td.shape = {n};
      td.role = roles[k];
      td.region = place->region;
      td.offset = place->offset;
      if (k == 0) {
        td.weight_decay = kDriftWeightDecay;
      } else {
        td.param = absl::StrCat("layers.", l, ".weight");
      }
      ld.tensors.push_back(td);
    }
    spec.layers.push_back(ld);
  }
  if (absl::Status s = client->Register(spec); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + 255) / 256, 2048));
  std::vector<std::array<std::vector<float>, 3>> host(layers);
  Json per_step = Json::array();
  auto drift_cpu = ckpt::drift::MakeCpuDriftKernel(2);
  for (uint64_t t = 1; t <= a.steps; ++t) {
    for (uint32_t l = 0; l < layers; ++l) {
      AdamStateKernel<<<blocks, 256, 0, stream>>>(dev[l][0], dev[l][1], dev[l][2], n, l, t);
    }
    if (!CudaOk(cudaGetLastError(), "AdamStateKernel")) return 1;
    if (absl::Status s = client->StepDone(t, kDriftLr); !s.ok()) {
      std::fprintf(stderr, "step done %" PRIu64 ": %s\n", t, s.ToString().c_str());
      return 1;
    }
    // The fence: ckptd has computed this step's drift from its mappings.
    absl::StatusOr<ckpt::SnapshotInfo> snap = client->WaitSnapshot(t);
    if (!snap.ok()) {
      std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", t, snap.status().ToString().c_str());
      return 1;
    }
    std::vector<ckpt::drift::TensorTask> tasks;
    for (uint32_t l = 0; l < layers; ++l) {
      for (int k = 0; k < 3; ++k) {
        host[l][k].resize(n);
        if (!CudaOk(cudaMemcpy(host[l][k].data(), dev[l][k], a.layer_bytes, cudaMemcpyDeviceToHost),
                    "cudaMemcpy")) {
          return 1;
        }
      }
      ckpt::drift::TensorTask task;
      task.layer = l;
      task.n = n;
      task.w = host[l][0].data();
      task.m = host[l][1].data();
      task.v = host[l][2].data();
      task.optimizer = ckpt::drift::Optimizer::kAdamW;
      task.lr = kDriftLr;
      task.weight_decay = kDriftWeightDecay;
      task.step = t;
      tasks.push_back(task);
    }
    std::vector<ckpt::drift::LayerSums> sums(layers);
    std::string error;
    if (!drift_cpu->Compute(tasks, &sums, &error)) {
      std::fprintf(stderr, "cpu drift: %s\n", error.c_str());
      return 1;
    }
    Json d = Json::array();
    for (const ckpt::drift::LayerSums& ls : sums) d.push_back(ckpt::drift::NormalizedDrift(ls));
    per_step.push_back(Json{{"step", t}, {"d", d}, {"persisted", snap->layers}});
  }
  absl::StatusOr<uint64_t> durable = client->WaitDurable(a.steps);
  if (!durable.ok()) {
    std::fprintf(stderr, "wait durable: %s\n", durable.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = client->Unregister(); !s.ok()) {
    std::fprintf(stderr, "unregister: %s\n", s.ToString().c_str());
    return 1;
  }
  Emit(a, Json{{"mode", "drift"},
               {"job", a.job},
               {"layers", layers},
               {"steps", a.steps},
               {"durable_step", *durable},
               {"cpu", per_step}});
  return 0;
}

// ---- modes ----

int Train(const Args& a, const Policy& policy, ckpt::Client* client, Buffers* buffers,
          cudaStream_t stream, uint32_t regions) {
  const uint32_t layers = static_cast<uint32_t>(buffers->layers().size());
  std::vector<double> fence_s, stepdone_s, step_s;
  std::vector<uint64_t> staged(layers, 0);  // newest step whose snapshot held the layer
  uint64_t skipped = 0;
  for (uint64_t t = 1; t <= a.steps; ++t) {
    const Clock::time_point t0 = Clock::now();
    if (a.compute_ms > 0) {
      SpinKernel<<<1, 32, 0, stream>>>(static_cast<uint64_t>(a.compute_ms) * 1000000);
      // The host waits for forward/backward here (the loss), as a trainer
      // does before its optimizer step; the snapshot of t-1 overlaps this.
      if (!CudaOk(cudaStreamSynchronize(stream), "compute")) return 1;
    }
    const uint64_t delay_ns = a.step_delay_ms * 1000000;
    if (t > 1) {
      const Clock::time_point f0 = Clock::now();
      absl::StatusOr<ckpt::SnapshotInfo> snap = client->WaitSnapshot(t - 1);
      const Clock::time_point f1 = Clock::now();
      // Mutate at once, before even looking at the reply: a copy of t-1 still
      // reading now would see f(t), and the restore would find step t.
      const bool launched = buffers->Fill(t, stream, delay_ns);
      fence_s.push_back(Seconds(f1 - f0));
      if (!snap.ok()) {
        std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", t - 1,
                     snap.status().ToString().c_str());
        return 1;
      }
      for (uint32_t l : snap->layers) staged[l] = t - 1;
      skipped += snap->skipped;
      if (!launched) return 1;
    } else if (!buffers->Fill(t, stream, delay_ns)) {
      return 1;
    }
    const Clock::time_point s0 = Clock::now();
    absl::Status s = client->StepDone(t, 1e-4, "", ExplicitLayers(policy, layers, t));
    stepdone_s.push_back(Seconds(Clock::now() - s0));
    if (!s.ok()) {
      std::fprintf(stderr, "step done %" PRIu64 ": %s\n", t, s.ToString().c_str());
      return 1;
    }
    if (!CudaOk(cudaStreamSynchronize(stream), "end of step")) return 1;
    step_s.push_back(Seconds(Clock::now() - t0));
  }

  Json j{{"mode", "train"},    {"job", a.job},
         {"layers", layers},   {"layer_bytes", a.layer_bytes},
         {"regions", regions}, {"steps", a.steps},
         {"policy", a.policy}, {"compute_ms", a.compute_ms}};
  auto add_timings = [&](Json* out) {
    (*out)["fence_wait_s"] = Summary(fence_s);
    (*out)["stepdone_s"] = Summary(stepdone_s);
    (*out)["step_s"] = Summary(step_s);
    double fence_sum = 0, step_sum = 0;
    for (double x : fence_s) fence_sum += x;
    for (double x : step_s) step_sum += x;
    (*out)["fence_pct_of_step"] = step_sum > 0 ? 100.0 * fence_sum / step_sum : 0.0;
    (*out)["fence_wait_s_per_step"] = fence_s;
  };
  if (a.no_unregister) {
    // The trainer vanishes: no final fence, no durable wait, no Unregister.
    j["unregistered"] = false;
    j["skipped"] = skipped;
    add_timings(&j);
    Emit(a, j);
    ReadyAndHold(a, regions, buffers->tensor_bytes());
    std::fflush(nullptr);
    ::_exit(0);
  }
  if (a.steps > 0) {
    absl::StatusOr<ckpt::SnapshotInfo> snap = client->WaitSnapshot(a.steps);
    if (!snap.ok()) {
      std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", a.steps,
                   snap.status().ToString().c_str());
      return 1;
    }
    for (uint32_t l : snap->layers) staged[l] = a.steps;
    skipped += snap->skipped;
    absl::StatusOr<uint64_t> durable = client->WaitDurable(a.steps);
    if (!durable.ok()) {
      std::fprintf(stderr, "wait durable %" PRIu64 ": %s\n", a.steps,
                   durable.status().ToString().c_str());
      return 1;
    }
    j["durable_step"] = *durable;
  }
  j["skipped"] = skipped;
  j["staged_steps"] = staged;
  add_timings(&j);
  ReadyAndHold(a, regions, buffers->tensor_bytes());
  if (absl::Status s = client->Unregister(); !s.ok()) {
    std::fprintf(stderr, "unregister: %s\n", s.ToString().c_str());
    return 1;
  }
  j["unregistered"] = true;
  Emit(a, j);
  return 0;
}

int Verify(const Args& a, const Policy& policy, ckpt::Client* client, Buffers* buffers,
           uint32_t regions) {
  absl::StatusOr<ckpt::v1::RestoreReply> r = client->Restore(0);
  if (!r.ok()) {
    std::fprintf(stderr, "restore: %s\n", r.status().ToString().c_str());
    return 1;
  }
  const ckpt::v1::Plan& plan = r->plan();
  std::printf("restored job %s to step %" PRIu64 ": %" PRIu64 " bytes in %.3f s\n",
              plan.job_id().c_str(), plan.target_step(), r->bytes_restored(), r->seconds());
  std::vector<Layer>& layers = buffers->layers();
  int bad = 0;
  auto fail = [&bad](const std::string& msg) {
    ++bad;
    std::printf("MISMATCH %s\n", msg.c_str());
  };
  if (!plan.complete()) fail("the plan is not complete");
  if (plan.layers_size() != static_cast<int>(layers.size())) {
    fail(absl::StrCat("the plan has ", plan.layers_size(), " layers, the rank ", layers.size()));
  }
  if (r->bytes_restored() != buffers->tensor_bytes()) {
    fail(absl::StrCat("bytes_restored ", r->bytes_restored(), ", tensors hold ",
                      buffers->tensor_bytes()));
  }
  std::vector<float> host;
  Json layer_steps = Json::array();
  for (const ckpt::v1::LayerPlan& lp : plan.layers()) {
    const uint32_t l = lp.layer();
    layer_steps.push_back(lp.step());
    if (l >= layers.size() || !lp.has_version()) {
      fail(absl::StrCat("layer ", l, ": no version in the plan"));
      continue;
    }
    if (a.steps_given && a.steps > 0 && lp.step() != ExpectedStep(policy, l, a.steps)) {
      fail(absl::StrCat("layer ", l, ": planned step ", lp.step(), ", the policy schedule of a ",
                        a.steps, "-step run persists it last at step ",
                        ExpectedStep(policy, l, a.steps)));
    }
    const uint64_t n = layers[l].bytes / 4;
    host.assign(n, 0.0f);
    if (!CudaOk(cudaMemcpy(host.data(), layers[l].ptr, layers[l].bytes, cudaMemcpyDeviceToHost),
                "cudaMemcpy")) {
      return 1;
    }
    uint64_t wrong = 0, first = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(Value(l, i, lp.step()));
      if (std::memcmp(&host[i], &want, 4) != 0 && wrong++ == 0) first = i;
    }
    if (wrong > 0) {
      const int64_t held = DecodeStep(l, first, host[first]);
      fail(absl::StrCat("layer ", l, ": ", wrong, " of ", n, " elements differ from step ",
                        lp.step(), "; element ", first, " holds ",
                        held < 0 ? std::string("no value of f (not restored)")
                                 : absl::StrCat("step ", held, " (mod 2^20)")));
    }
  }
  // The restore writes tensors only: every gap still holds the sentinel.
  for (const auto& [ptr, bytes] : buffers->gaps()) {
    std::vector<unsigned char> g(bytes);
    if (!CudaOk(cudaMemcpy(g.data(), ptr, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy")) return 1;
    for (unsigned char c : g) {
      if (c != kSentinelByte) {
        fail("a guard gap of the shared allocation was overwritten");
        break;
      }
    }
  }
  std::printf("verify: %d problem(s) in %d layers\n", bad, plan.layers_size());
  Json j{{"mode", "verify"},
         {"job", a.job},
         {"target_step", plan.target_step()},
         {"layer_steps", layer_steps},
         {"bytes_restored", r->bytes_restored()},
         {"restore_s", r->seconds()},
         {"regions", regions},
         {"problems", bad}};
  ReadyAndHold(a, regions, buffers->tensor_bytes());
  if (!a.no_unregister) {
    if (absl::Status s = client->Unregister(); !s.ok()) {
      std::fprintf(stderr, "unregister: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  Emit(a, j);
  return bad == 0 ? 0 : kExitMismatch;
}

// (a) + (b) + (c); see the file comment. Registered with POLICY_EXPLICIT so
// that one registration serves both the every-step snapshots of (b) and the
// every-K-steps checkpoints of (c).
int Bench(const Args& a, ckpt::Client* client, Buffers* buffers, cudaStream_t stream) {
  std::vector<Layer>& layers = buffers->layers();
  const uint32_t num_layers = static_cast<uint32_t>(layers.size());
  const uint64_t total = buffers->tensor_bytes();
  std::vector<uint32_t> all(num_layers);
  for (uint32_t l = 0; l < num_layers; ++l) all[l] = l;
  Json j{{"mode", "bench"},
         {"layers", num_layers},
         {"layer_bytes", a.layer_bytes},
         {"snapshot_bytes", total}};

  // (a) The ceiling: the same bytes D2H into one cudaHostAlloc'ed buffer.
  {
    char* pinned = nullptr;
    if (!CudaOk(cudaHostAlloc(reinterpret_cast<void**>(&pinned), total, cudaHostAllocDefault),
                "cudaHostAlloc")) {
      return 1;
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best_ms = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      cudaEventRecord(e0, stream);
      uint64_t off = 0;
      for (const Layer& l : layers) {
        cudaMemcpyAsync(pinned + off, l.ptr, l.bytes, cudaMemcpyDeviceToHost, stream);
        off += l.bytes;
      }
      cudaEventRecord(e1, stream);
      if (!CudaOk(cudaEventSynchronize(e1), "baseline D2H")) return 1;
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      best_ms = std::min(best_ms, ms);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFreeHost(pinned);
    j["d2h_pinned_peak_bytes_per_s"] = total / (best_ms / 1e3);
  }

  // (b) Snapshot throughput: StepDone(t) -> WaitSnapshot(t) with the step's
  // kernel already finished, so only the daemon's copy (and two RPCs) count.
  // Each step is made durable before the next so the pool is empty.
  uint64_t t = 0;
  std::vector<double> snap_s, durable_s;
  uint64_t incomplete = 0;
  for (uint32_t i = 0; i <= a.snapshot_steps; ++i) {
    ++t;
    if (!buffers->Fill(t, stream) || !CudaOk(cudaStreamSynchronize(stream), "fill")) return 1;
    const Clock::time_point s0 = Clock::now();
    absl::Status s = client->StepDone(t, 1e-4, "", all);
    absl::StatusOr<ckpt::SnapshotInfo> snap =
        s.ok() ? client->WaitSnapshot(t) : absl::StatusOr<ckpt::SnapshotInfo>(s);
    const Clock::time_point s1 = Clock::now();
    if (!snap.ok()) {
      std::fprintf(stderr, "snapshot %" PRIu64 ": %s\n", t, snap.status().ToString().c_str());
      return 1;
    }
    absl::StatusOr<uint64_t> d = client->WaitDurable(t);
    if (!d.ok()) {
      std::fprintf(stderr, "durable %" PRIu64 ": %s\n", t, d.status().ToString().c_str());
      return 1;
    }
    if (i == 0) continue;  // warm-up
    if (snap->layers.size() != num_layers || snap->skipped > 0) ++incomplete;
    snap_s.push_back(Seconds(s1 - s0));
    durable_s.push_back(Seconds(Clock::now() - s1));
  }
  const double snap_bps = total / Median(snap_s);
  const double durable_bps = total / Median(durable_s);
  j["snapshot_bytes_per_s"] = snap_bps;
  j["snapshot_vs_d2h_peak"] = snap_bps / j["d2h_pinned_peak_bytes_per_s"].get<double>();
  j["snapshot_s"] = Summary(snap_s);
  j["snapshots_incomplete"] = incomplete;  // fewer layers than asked or skipped: pool too small
  j["durable_bytes_per_s"] = durable_bps;

  // (c0) The same loop without ckptd: the step time the fence is measured
  // against, and the overhead the trainer sees.
  const uint64_t compute_ns = static_cast<uint64_t>(a.compute_ms) * 1000000;
  std::vector<double> plain_s;
  for (int i = 0; i < 10; ++i) {
    const Clock::time_point t0 = Clock::now();
    SpinKernel<<<1, 32, 0, stream>>>(compute_ns);
    if (!CudaOk(cudaStreamSynchronize(stream), "compute")) return 1;
    buffers->Fill(t, stream);  // no StepDone: the daemon is not reading
    if (!CudaOk(cudaStreamSynchronize(stream), "end of step")) return 1;
    plain_s.push_back(Seconds(Clock::now() - t0));
  }
  const double plain_step = Median(plain_s);

  // (c) The realistic loop: compute, fence, optimizer kernel, StepDone, sync.
  // A checkpoint every K steps, K large enough that the disk drains one
  // snapshot before the next is taken, so a fence measures the D2H overlap
  // and not admission waits for a full pool.
  const double per_ckpt_s = total / durable_bps;
  uint64_t every = std::max<uint64_t>(
      a.fence_every, static_cast<uint64_t>(std::ceil(1.5 * per_ckpt_s / plain_step)));
  every = std::min<uint64_t>(every, 100);
  const uint64_t steps = std::max<uint64_t>(a.fence_steps, every + 2);
  std::vector<double> fence_s, step_s, after_ckpt_pct;
  bool previous_was_checkpoint = false;
  for (uint64_t i = 0; i < steps; ++i) {
    ++t;
    const Clock::time_point t0 = Clock::now();
    SpinKernel<<<1, 32, 0, stream>>>(compute_ns);
    if (!CudaOk(cudaStreamSynchronize(stream), "compute")) return 1;
    const Clock::time_point f0 = Clock::now();
    absl::StatusOr<ckpt::SnapshotInfo> snap = client->WaitSnapshot(t - 1);
    const double fence = Seconds(Clock::now() - f0);
    const bool launched = buffers->Fill(t, stream);
    if (!snap.ok() || !launched) {
      std::fprintf(stderr, "fence %" PRIu64 ": %s\n", t - 1, snap.status().ToString().c_str());
      return 1;
    }
    const bool checkpoint = i % every == 0;
    absl::Status s = client->StepDone(t, 1e-4, "", checkpoint ? all : std::vector<uint32_t>());
    if (!s.ok()) {
      std::fprintf(stderr, "step done %" PRIu64 ": %s\n", t, s.ToString().c_str());
      return 1;
    }
    if (!CudaOk(cudaStreamSynchronize(stream), "end of step")) return 1;
    const double step = Seconds(Clock::now() - t0);
    fence_s.push_back(fence);
    step_s.push_back(step);
    if (previous_was_checkpoint) after_ckpt_pct.push_back(100.0 * fence / step);
    previous_was_checkpoint = checkpoint;
  }
  if (absl::StatusOr<ckpt::SnapshotInfo> snap = client->WaitSnapshot(t); !snap.ok()) {
    std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", t, snap.status().ToString().c_str());
    return 1;
  }
  if (absl::StatusOr<uint64_t> d = client->WaitDurable(t); !d.ok()) {
    std::fprintf(stderr, "wait durable %" PRIu64 ": %s\n", t, d.status().ToString().c_str());
    return 1;
  }
  double fence_sum = 0, step_sum = 0, plain_sum = 0;
  for (double x : fence_s) fence_sum += x;
  for (double x : step_s) step_sum += x;
  for (double x : plain_s) plain_sum += x;
  double after_ckpt_mean = 0;
  for (double x : after_ckpt_pct) after_ckpt_mean += x / after_ckpt_pct.size();
  j["compute_ms"] = a.compute_ms;
  j["checkpoint_every"] = every;
  j["loop_steps"] = steps;
  j["step_ms_no_ckpt"] = 1e3 * plain_step;
  j["step_ms"] = 1e3 * Median(step_s);
  j["fence_ms_mean"] = 1e3 * fence_sum / fence_s.size();
  j["fence_ms_max"] = 1e3 * *std::max_element(fence_s.begin(), fence_s.end());
  j["fence_pct_of_step"] = 100.0 * fence_sum / step_sum;
  j["fence_pct_after_checkpoint"] = after_ckpt_mean;
  j["step_overhead_pct"] = 100.0 * (step_sum / step_s.size() - plain_sum / plain_s.size()) /
                           (plain_sum / plain_s.size());
  if (absl::Status s = client->Unregister(); !s.ok()) {
    std::fprintf(stderr, "unregister: %s\n", s.ToString().c_str());
    return 1;
  }
  Emit(a, j);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) return Usage();
  Policy policy;
  if (a.mode == "bench") {
    policy.spec.set_kind(ckpt::v1::POLICY_EXPLICIT);
  } else if (!ParsePolicy(a.policy, &policy)) {
    std::fprintf(stderr, "ckpt_gpu_trainer: unknown policy '%s'\n", a.policy.c_str());
    return Usage();
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "ckpt_gpu_trainer: no CUDA device\n");
    return kExitNoDevice;
  }

  cudaStream_t stream = nullptr;
  if (!CudaOk(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) {
    return 1;
  }
  // A client whose steps are recorded on `stream`; null after printing why.
  auto connect = [&a, stream]() -> std::unique_ptr<ckpt::Client> {
    ckpt::ClientOptions co;
    co.socket_path = a.socket;
    absl::StatusOr<std::unique_ptr<ckpt::Client>> client = ckpt::Client::Connect(co);
    if (!client.ok()) {
      std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
      return nullptr;
    }
    (*client)->SetCudaStream(static_cast<void*>(stream));
    return std::move(*client);
  };
  if (a.mode == "drift") {
    std::unique_ptr<ckpt::Client> client = connect();
    const int rc = client == nullptr ? 1 : Drift(a, client.get(), stream);
    client.reset();  // before the stream it may record on is destroyed
    cudaStreamDestroy(stream);
    return rc;
  }
  Buffers buffers(a.vmm);
  if (!buffers.Allocate(a.layers, a.layer_bytes)) return 1;
  if (a.mode == "verify") {
    if (!buffers.FillSentinel()) return 1;
  } else if (!buffers.Fill(0, stream) || !CudaOk(cudaStreamSynchronize(stream), "fill")) {
    return 1;
  }

  std::unique_ptr<ckpt::Client> client = connect();
  if (client == nullptr) return 1;
  uint32_t regions = 0;
  if (absl::Status s = RegisterLayers(client.get(), a, policy, &buffers, &regions); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }
  int rc = 0;
  if (a.mode == "train") {
    rc = Train(a, policy, client.get(), &buffers, stream, regions);
  } else if (a.mode == "verify") {
    rc = Verify(a, policy, client.get(), &buffers, regions);
  } else {
    rc = Bench(a, client.get(), &buffers, stream);
  }
  client.reset();  // before the stream it may record on is destroyed
  cudaStreamDestroy(stream);
  return rc;
}
