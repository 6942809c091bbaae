// LayerCheck: drift-based layer selection (docs/layercheck.md).
//
// Per step t, from the global per-layer sums (Σ‖ΔW‖², Σ‖W‖²) of that step:
//   d_l(t) = ‖ΔW_l‖ / (‖W_l‖ + 1e-12)
//   D_l   += d_l(t)                           (accumulated since the last persist)
//   K_l(t) = max(m_t · K0_l · lr_t / lr_ref, K_floor)  (K0_l = k0_embedding for embeddings)
//   lr_ref  = the largest learning rate the rank has stepped with so far
//   m_t     = 1, or the write budget's multiplier (below)
//   persist l when D_l >= K_l(t), or t - t_l >= S_max, or l was never persisted
// Warm-up: for t <= W selection is off: every layer is persisted at the first
// step and every `warmup_interval` steps, and at t == W a full base checkpoint
// is taken. The default W = 1 makes the first step the base checkpoint and
// runs the drift rule from the second step on. Optionally every `full_every`
// steps after W a full checkpoint. Persisting a layer resets D_l to 0 and sets
// t_l = t.
//
// lr_ref differs from the paper's lr_0 ("the first step's learning rate"): with
// a warm-up schedule the first step's rate is a fraction of the peak, and lr_0
// would scale every threshold at the peak up by the warm-up factor (10x for a
// warm-up from 10%). The running maximum equals lr_0 for constant and decaying
// schedules and is the peak once a warm-up is over (README "LayerCheck").
//
// Write budget (LayerCheckBudget, off by default): a target of B bytes per
// step. b_t = the bytes of the layers the rules select at step t (every rule
// counts: the base checkpoint, never-persisted layers, the warm-up, full
// checkpoints and the staleness guard, not only drift; a layer the caller
// forces, a retry after this rank's failed write, only where a rule selects
// it too), each layer weighing LayerCheckBudget::layer_bytes (default: the
// bytes the rank registered for it). A ledger L and an integral I, both 0 at
// the start, give
//   x_t = L / (H·B) + I,   m_t = clamp(P(x_t), k_min, k_max)
// where P(x) = 2^floor(x) · (1 + x - floor(x)) is 2^x linearly interpolated
// between powers of two, and after the step's decision
//   L += b_t - B;   I += L / (H·H·B), clamped to [x_min, x_max];
//   L <= H·B·(x_max - x_min), and L >= (x_min - I)·H·B
// with x_min = P⁻¹(k_min), x_max = P⁻¹(k_max). H is the horizon in steps. A
// ledger that stays bounded makes the average of b_t converge to B; the
// integral holds the multiplier the drift needs, so the ledger returns to 0
// instead of carrying the multiplier's offset. Debt is remembered up to the
// multiplier's whole range, so writes the rules force keep m at k_max until
// repaid rather than letting drift writes add to them; credit is forgotten
// once m is at k_min, so a quiet stretch buys no burst later.
// Writes forced by the never-persisted rule, the warm-up, full checkpoints,
// the caller or the staleness guard are never held back: when they alone
// exceed B (or m is at k_max) the rate exceeds the budget. Only +, -, ×, ÷,
// floor and exact scaling by powers of two are used, so the multiplier is
// the same bit for bit wherever the same inputs are fed.
//
// Decide() is a pure function of (config, layer kinds, layer bytes, the
// sequence of (t, lr_t, sums) fed so far): two engines fed the same vectors
// decide the same (this is what makes ranks that all-reduced the same vector
// agree). Ranks agree on the budget's multiplier only when they count the
// same bytes per layer: ranks that hold shards of different sizes must give
// the same `layer_bytes` (the engine refuses a budget without them there).
//
// Thread-safety: none; the owner serializes calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/tensor_types.h"
#include "kernels/drift.h"

namespace ckpt {

// A write budget for LayerCheck (see the top of this file). Exactly one of
// bytes_per_step, bytes_per_s and share sets it; all 0 = no budget.
struct LayerCheckBudget {
  double bytes_per_step = 0;  // B itself
  double bytes_per_s = 0;     // B = bytes_per_s × step_s
  double share = 0;           // B = share × device_write_bytes_per_s × step_s, 0 < share <= 1
  // The declared seconds between two steps (StepDone calls), needed with
  // bytes_per_s and share. Declared, not measured: every rank of a job must
  // derive the same B, and their clocks and step times differ.
  double step_s = 0;
  // ckptd's configured write bandwidth of its data device (not from the
  // registration); 0 = unknown, which refuses a share.
  double device_write_bytes_per_s = 0;
  double k_min = 0.01;  // bounds of the multiplier m on K0
  double k_max = 1000;
  uint64_t horizon = 10;  // H: the controller's response time in steps
  // The bytes each layer counts for; empty = the bytes the rank registered.
  std::vector<uint64_t> layer_bytes;

  bool enabled() const { return bytes_per_step > 0 || bytes_per_s > 0 || share > 0; }
  // B in bytes per step; 0 when no budget is set. Call Validate() first.
  double BytesPerStep() const;
  absl::Status Validate() const;
};

struct LayerCheckConfig {
  double k0 = 1e-3;            // base threshold, most layers
  double k0_embedding = 1e-2;  // base threshold, embedding layers
  double k_floor = 1e-5;       // lower bound of the LR-scaled threshold
  uint64_t s_max = 200;        // staleness guard: persist when t - t_l >= s_max
  // Steps with selection off; full base at t == warmup. 1: the first step is
  // the base and the drift rule runs from the second (0 behaves the same:
  // the first step persists every layer as never persisted).
  uint64_t warmup = 1;
  uint64_t warmup_interval = 50;  // full checkpoints during a warm-up longer than 1
  uint64_t full_every = 0;        // periodic full checkpoints after warm-up (0 = off)
  // With world_size > 1: decide from this rank's sums alone (its layers are
  // written by no other rank), without waiting for global sums.
  bool local_drift = false;
  LayerCheckBudget budget;

  absl::Status Validate() const;
};

// How the daemon reconstructs a step's weight change for drift accounting.
enum class OptimizerKind : int {
  kUnspecified = 0,  // layercheck needs one of the others
  kAdamW = 1,
  kAdam = 2,
  kSgd = 3,     // non-Nesterov momentum
  kClient = 4,  // the client sends per-layer sums with each step
};

// Why a layer was persisted at a step.
enum class PersistReason : uint8_t {
  kNone = 0,
  kDrift,      // D >= K
  kStaleness,  // t - t_l >= S_max
  kNever,      // never persisted
  kWarmup,     // warm-up interval or base checkpoint
  kFull,       // periodic full checkpoint
  kForced,     // forced by the caller (retry after a failure, new registration)
};
const char* PersistReasonName(PersistReason r);

struct LayerDecision {
  double d = 0;            // this step's normalized drift
  double accumulated = 0;  // D after this step (before a reset by persisting)
  double threshold = 0;    // K(t)
  PersistReason reason = PersistReason::kNone;
};

class LayerCheckPolicy {
 public:
  // `frozen[l]` (may be empty) marks a layer that never changes: it is
  // persisted when never persisted or forced, and never for drift,
  // staleness, warm-up or a periodic full checkpoint.
  // `layer_bytes[l]` (may be empty) is what layer l counts for under a write
  // budget, unless config.budget.layer_bytes gives it.
  LayerCheckPolicy(const LayerCheckConfig& config, std::vector<LayerKind> kinds,
                   std::vector<bool> frozen = {}, std::vector<uint64_t> layer_bytes = {});

  // Feeds step t (> previous step) and returns the decision per layer.
  // `sums` has one entry per layer. `forced[l]` forces layer l (may be empty).
  std::vector<LayerDecision> Decide(uint64_t step, double lr,
                                    const std::vector<drift::LayerSums>& sums,
                                    const std::vector<bool>& forced);

  // Raises lr_ref to `lr` (the largest rate of the rank's earlier
  // registrations, kept with its checkpoint events); lr_ref never decreases.
  void RaiseLrReference(double lr);
  // After a composite restore to `step`: every layer's buffers equal its
  // version at `last_persisted[l]` (0 = none), so its accumulated drift is 0
  // and the next step is an ordinary one, not a first step.
  void Resume(uint64_t step, const std::vector<uint64_t>& last_persisted);

  // Per-layer state after the last Decide.
  uint64_t last_persisted(size_t l) const { return last_persisted_[l]; }
  double accumulated(size_t l) const { return accumulated_[l]; }
  double threshold(size_t l) const { return threshold_[l]; }
  double lr_reference() const { return lr_ref_; }
  // The write budget's state: the multiplier the last Decide used (1 without
  // a budget), the multiplier the next one will use, the bytes that Decide
  // selected (forced layers included), and the ledger L (bytes above the
  // budget so far).
  double k_multiplier() const { return last_multiplier_; }
  double next_k_multiplier() const;
  uint64_t selected_bytes() const { return last_selected_bytes_; }
  double budget_bytes_per_step() const { return budget_bytes_; }
  double budget_ledger() const { return ledger_; }
  uint64_t layer_bytes(size_t l) const { return l < layer_bytes_.size() ? layer_bytes_[l] : 0; }
  size_t layers() const { return kinds_.size(); }
  bool frozen(size_t l) const { return l < frozen_.size() && frozen_[l]; }
  const LayerCheckConfig& config() const { return config_; }

 private:
  const LayerCheckConfig config_;
  const std::vector<LayerKind> kinds_;
  const std::vector<bool> frozen_;
  double lr_ref_ = 0;  // 0 until the first step
  uint64_t last_step_ = 0;
  std::vector<uint64_t> last_persisted_;  // 0 = never
  std::vector<double> accumulated_;
  std::vector<double> threshold_;
  // The write budget (budget_bytes_ == 0: none).
  std::vector<uint64_t> layer_bytes_;
  double budget_bytes_ = 0;
  double x_min_ = 0, x_max_ = 0;  // P⁻¹(k_min), P⁻¹(k_max)
  double ledger_ = 0;             // L, bytes
  double integral_ = 0;           // I, log2 units
  double last_multiplier_ = 1;
  uint64_t last_selected_bytes_ = 0;
};

// The budget's map from the controller's state to the multiplier: 2^x
// interpolated linearly between powers of two, and its inverse (m > 0).
double BudgetMultiplier(double x);
double BudgetExponent(double m);

}  // namespace ckpt
