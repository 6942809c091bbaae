// LayerCheck: drift-based layer selection (SPEC §4).
//
// Per step t, from the global per-layer sums (Σ‖ΔW‖², Σ‖W‖²) of that step:
//   d_l(t) = ‖ΔW_l‖ / (‖W_l‖ + 1e-12)
//   D_l   += d_l(t)                           (accumulated since the last persist)
//   K_l(t) = max(K0_l · lr_t / lr_ref, K_floor)  (K0_l = k0_embedding for embeddings)
//   lr_ref  = the largest learning rate the rank has stepped with so far
//   persist l when D_l >= K_l(t), or t - t_l >= S_max, or l was never persisted
// Warm-up: for t <= W selection is off: every layer is persisted at the first
// step and every `warmup_interval` steps, and at t == W a full base checkpoint
// is taken. Optionally every `full_every` steps after W a full checkpoint.
// Persisting a layer resets D_l to 0 and sets t_l = t.
//
// lr_ref differs from SPEC §4's lr_0 ("the first step's learning rate"): with
// a warm-up schedule the first step's rate is a fraction of the peak, and lr_0
// would scale every threshold at the peak up by the warm-up factor (10x for a
// warm-up from 10%). The running maximum equals lr_0 for constant and decaying
// schedules and is the peak once a warm-up is over (README "LayerCheck").
//
// Decide() is a pure function of (config, layer kinds, the sequence of
// (t, lr_t, sums) fed so far): two engines fed the same vectors decide the same
// (this is what makes ranks that all-reduced the same vector agree).
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

struct LayerCheckConfig {
  double k0 = 1e-3;            // base threshold, most layers
  double k0_embedding = 1e-2;  // base threshold, embedding layers
  double k_floor = 1e-5;       // lower bound of the LR-scaled threshold
  uint64_t s_max = 200;        // staleness guard: persist when t - t_l >= s_max
  uint64_t warmup = 200;       // steps with selection off; full base at t == warmup
  uint64_t warmup_interval = 50;
  uint64_t full_every = 0;     // periodic full checkpoints after warm-up (0 = off)
  // With world_size > 1: decide from this rank's sums alone (its layers are
  // written by no other rank), without waiting for global sums.
  bool local_drift = false;

  absl::Status Validate() const;
};

// How the daemon reconstructs a step's weight change for drift accounting.
enum class OptimizerKind : int {
  kUnspecified = 0,  // layercheck needs one of the others
  kAdamW = 1,
  kAdam = 2,
  kSgd = 3,          // non-Nesterov momentum
  kClient = 4,       // the client sends per-layer sums with each step
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
  double d = 0;          // this step's normalized drift
  double accumulated = 0;  // D after this step (before a reset by persisting)
  double threshold = 0;  // K(t)
  PersistReason reason = PersistReason::kNone;
};

class LayerCheckPolicy {
 public:
  // `frozen[l]` (may be empty) marks a layer that never changes: it is
  // persisted when never persisted or forced, and never for drift,
  // staleness, warm-up or a periodic full checkpoint.
  LayerCheckPolicy(const LayerCheckConfig& config, std::vector<LayerKind> kinds,
                   std::vector<bool> frozen = {});

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
};

}  // namespace ckpt
