// Drift kernels: per-layer sums of squares for LayerCheck (docs/layercheck.md).
//
// For every layer l the kernels compute, in f64,
//   dw2[l] = Σ ‖ΔW‖²   over the layer's weight tensors
//   w2[l]  = Σ ‖W‖²
// where W is the weight after optimizer step t (the `master` copy when there
// is one, else the `param`) and ΔW = W_t - W_{t-1} is reconstructed from the
// optimizer state after the step, without any copy of the previous weights:
//
//   adamw: u = m̂ / (√v̂ + ε),  m̂ = m / (1 - β1^t),  v̂ = v / (1 - β2^t)
//          (u alone in f32, as the optimizer computes it: adam_update.h)
//          (PyTorch order: decay first) W_{t-1} = (W_t + lr·u) / (1 - lr·wd), so
//          ΔW = -lr · (wd·W_t + u) / (1 - lr·wd)
//   adam:  ΔW = -lr · u            (decay is folded into the gradient)
//   sgd:   ΔW = -lr · buf          (momentum buffer, non-Nesterov)
//   none:  ΔW = 0                  (only ‖W‖² is accumulated)
//
// Inputs may be f32, bf16 or f16 (each array its own dtype). This header has
// no CUDA types: the CPU reference is always built; the CUDA twin
// (kernels/cuda/) is compiled when the toolkit is found and used only after a
// known-answer self-test on the device (MakeDriftKernel).
//
// Thread-safety: kernels are stateless apart from their thread pool / stream;
// one Compute() at a time per DriftKernel object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ckpt::drift {

// The element types the kernels read, in the kernels' own numbering, not
// ckpt.v1.DType's: the kernels include nothing of ours (docs/architecture.md),
// the CUDA twin packs these values into its device tasks and checks them by
// range (cuda/drift.cu), and they never leave the process. The daemon's
// element-type table (base/dtype.h) names each type's code here in its
// drift_code column; the engine converts in one place
// (daemon/engine/engine_layercheck.cc, checked at compile time) and
// tests/base/dtype_test.cc checks that the codes round-trip.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Optimizer : uint8_t { kNone = 0, kAdamW = 1, kAdam = 2, kSgd = 3 };

// One weight tensor and the optimizer state that belongs to it, as a kernel
// reads them: addresses it can read, an element count, the optimizer and its
// hyper-parameters with every default filled in. It exists because the
// kernels see no type of ours; the daemon builds one per weight tensor when a
// rank registers and sets lr and step at each step
// (daemon/engine/engine_layercheck.cc).
struct TensorTask {
  uint32_t layer = 0;  // index into the output array
  uint64_t n = 0;      // elements
  const void* w = nullptr;
  DType w_dtype = DType::kF32;
  const void* m = nullptr;  // adam/adamw: exp_avg; sgd: momentum buffer
  DType m_dtype = DType::kF32;
  const void* v = nullptr;  // adam/adamw: exp_avg_sq
  DType v_dtype = DType::kF32;
  Optimizer optimizer = Optimizer::kNone;
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  uint64_t step = 1;  // the parameter group's step count after this step (>= 1)
};

struct LayerSums {
  double dw2 = 0;
  double w2 = 0;
};

// d = ‖ΔW‖ / (‖W‖ + 1e-12)
double NormalizedDrift(const LayerSums& s);

// The reference: `threads` workers split every tensor into 64K-element units
// taken in a fixed round-robin order; each accumulates per layer in f64 and
// the workers' sums are added in order, so the result depends only on the
// inputs and `threads`. Extra memory: O(threads x layers). `out` has one entry
// per layer and is overwritten; tasks whose layer is >= out->size() are ignored.
// On x86-64 with AVX2 the inner loops run 4 f64 lanes wide (bit-identical to
// the portable path).
void ComputeDriftCpu(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out,
                     int threads);

// Scalar f64 reference used by tests: one element at a time, no blocking.
void ComputeDriftScalar(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out);

// Element conversions (round-to-nearest-even for the narrowing ones).
float Bf16ToF32(uint16_t h);
float F16ToF32(uint16_t h);
uint16_t F32ToBf16(float f);
uint16_t F32ToF16(float f);

// A drift implementation picked at run time.
class DriftKernel {
 public:
  virtual ~DriftKernel() = default;
  virtual const char* name() const = 0;
  // Tensors must be readable by this kernel (host memory for "cpu", device
  // memory for "cuda"). Returns false with *error set on failure.
  virtual bool Compute(const std::vector<TensorTask>& tasks, std::vector<LayerSums>* out,
                       std::string* error) = 0;
};

// "cpu" always; "cuda" when built with CUDA, a device exists and the
// known-answer self-test passed (otherwise nullptr and *why says why).
std::unique_ptr<DriftKernel> MakeCpuDriftKernel(int threads);
std::unique_ptr<DriftKernel> MakeCudaDriftKernel(std::string* why);

}  // namespace ckpt::drift
