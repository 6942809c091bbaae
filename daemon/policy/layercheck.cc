#include "daemon/policy/layercheck.h"

#include <algorithm>

namespace ckpt {

absl::Status LayerCheckConfig::Validate() const {
  if (!(k0 > 0) || !(k0_embedding > 0) || !(k_floor >= 0)) {
    return absl::InvalidArgumentError("layercheck thresholds must be positive");
  }
  if (s_max == 0) return absl::InvalidArgumentError("layercheck s_max must be >= 1");
  if (warmup > 0 && warmup_interval == 0) {
    return absl::InvalidArgumentError("layercheck warmup_interval must be >= 1");
  }
  return absl::OkStatus();
}

const char* PersistReasonName(PersistReason r) {
  switch (r) {
    case PersistReason::kNone:
      return "none";
    case PersistReason::kDrift:
      return "drift";
    case PersistReason::kStaleness:
      return "staleness";
    case PersistReason::kNever:
      return "never";
    case PersistReason::kWarmup:
      return "warmup";
    case PersistReason::kFull:
      return "full";
    case PersistReason::kForced:
      return "forced";
  }
  return "?";
}

LayerCheckPolicy::LayerCheckPolicy(const LayerCheckConfig& config, std::vector<LayerKind> kinds,
                                   std::vector<bool> frozen)
    : config_(config),
      kinds_(std::move(kinds)),
      frozen_(std::move(frozen)),
      last_persisted_(kinds_.size(), 0),
      accumulated_(kinds_.size(), 0.0),
      threshold_(kinds_.size(), 0.0) {}

void LayerCheckPolicy::RaiseLrReference(double lr) { lr_ref_ = std::max(lr_ref_, lr); }

void LayerCheckPolicy::Resume(uint64_t step, const std::vector<uint64_t>& last_persisted) {
  last_step_ = step;
  for (size_t l = 0; l < kinds_.size(); ++l) {
    last_persisted_[l] = l < last_persisted.size() ? last_persisted[l] : 0;
    accumulated_[l] = 0;
  }
}

std::vector<LayerDecision> LayerCheckPolicy::Decide(uint64_t step, double lr,
                                                    const std::vector<drift::LayerSums>& sums,
                                                    const std::vector<bool>& forced) {
  RaiseLrReference(lr);
  const bool first = last_step_ == 0;
  last_step_ = step;
  const double lr_ratio = lr_ref_ > 0 ? lr / lr_ref_ : 1.0;
  const bool in_warmup = step <= config_.warmup;
  const bool warmup_full =
      in_warmup && (first || step % config_.warmup_interval == 0 || step == config_.warmup);
  const bool periodic_full = !in_warmup && config_.full_every > 0 &&
                             (step - config_.warmup) % config_.full_every == 0;
  std::vector<LayerDecision> out(kinds_.size());
  for (size_t l = 0; l < kinds_.size(); ++l) {
    LayerDecision& dec = out[l];
    dec.d = l < sums.size() ? drift::NormalizedDrift(sums[l]) : 0.0;
    accumulated_[l] += dec.d;
    dec.accumulated = accumulated_[l];
    const double k0 = kinds_[l] == LayerKind::kEmbedding ? config_.k0_embedding : config_.k0;
    threshold_[l] = std::max(k0 * lr_ratio, config_.k_floor);
    dec.threshold = threshold_[l];
    if (last_persisted_[l] == 0) {
      dec.reason = PersistReason::kNever;
    } else if (l < forced.size() && forced[l]) {
      dec.reason = PersistReason::kForced;
    } else if (frozen(l)) {
      dec.reason = PersistReason::kNone;  // it never changes
    } else if (warmup_full) {
      dec.reason = PersistReason::kWarmup;
    } else if (in_warmup) {
      dec.reason = PersistReason::kNone;  // selection is off during warm-up
    } else if (periodic_full) {
      dec.reason = PersistReason::kFull;
    } else if (step - last_persisted_[l] >= config_.s_max) {
      dec.reason = PersistReason::kStaleness;
    } else if (accumulated_[l] >= threshold_[l]) {
      dec.reason = PersistReason::kDrift;
    }
    if (dec.reason != PersistReason::kNone) {
      accumulated_[l] = 0;
      last_persisted_[l] = step;
    }
  }
  return out;
}

}  // namespace ckpt
