#include "daemon/policy/layercheck.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace ckpt {

double BudgetMultiplier(double x) {
  const double n = std::floor(x);
  return std::ldexp(1.0 + (x - n), static_cast<int>(n));
}

double BudgetExponent(double m) {
  int e = 0;
  const double mant = std::frexp(m, &e);  // m = mant · 2^e, mant in [0.5, 1)
  return static_cast<double>(e - 1) + (2.0 * mant - 1.0);
}

double LayerCheckBudget::BytesPerStep() const {
  if (bytes_per_step > 0) return bytes_per_step;
  if (bytes_per_s > 0) return bytes_per_s * step_s;
  if (share > 0) return share * device_write_bytes_per_s * step_s;
  return 0;
}

absl::Status LayerCheckBudget::Validate() const {
  auto bad = [](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("layercheck budget: ", what...));
  };
  for (double v : {bytes_per_step, bytes_per_s, share, step_s, device_write_bytes_per_s}) {
    if (!std::isfinite(v) || v < 0) return bad("values must be finite and >= 0");
  }
  const int forms = (bytes_per_step > 0) + (bytes_per_s > 0) + (share > 0);
  if (forms > 1) return bad("give one of bytes_per_step, bytes_per_s and share, not ", forms);
  if (!enabled()) return absl::OkStatus();
  if (share > 1) return bad("share ", share, " is above 1 (a share of the device's bandwidth)");
  if ((bytes_per_s > 0 || share > 0) && !(step_s > 0)) {
    return bad(bytes_per_s > 0 ? "bytes_per_s" : "share",
               " needs step_s, the declared seconds per step (every rank must derive the same "
               "bytes per step; measured step times differ between ranks)");
  }
  if (share > 0 && !(device_write_bytes_per_s > 0)) {
    return bad(
        "a share needs the device's write bandwidth, and this ckptd has none configured "
        "(option device_write_bytes_per_s); give bytes_per_s instead");
  }
  if (!std::isfinite(k_min) || !std::isfinite(k_max) || !(k_min > 0) || !(k_max >= k_min)) {
    return bad("k_min and k_max must be finite with 0 < k_min <= k_max (got ", k_min, ", ", k_max,
               ")");
  }
  if (horizon == 0) return bad("horizon must be >= 1 step");
  if (!(BytesPerStep() >= 1))
    return bad("the budget comes to ", BytesPerStep(), " bytes per step; it must be at least 1");
  for (uint64_t b : layer_bytes) {
    if (b == 0) return bad("layer_bytes must be > 0 for every layer");
  }
  return absl::OkStatus();
}

absl::Status LayerCheckConfig::Validate() const {
  if (!(k0 > 0) || !(k0_embedding > 0) || !(k_floor >= 0)) {
    return absl::InvalidArgumentError("layercheck thresholds must be positive");
  }
  if (s_max == 0) return absl::InvalidArgumentError("layercheck s_max must be >= 1");
  if (warmup > 1 && warmup_interval == 0) {
    return absl::InvalidArgumentError("layercheck warmup_interval must be >= 1");
  }
  return budget.Validate();
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
                                   std::vector<bool> frozen, std::vector<uint64_t> layer_bytes)
    : config_(config),
      kinds_(std::move(kinds)),
      frozen_(std::move(frozen)),
      last_persisted_(kinds_.size(), 0),
      accumulated_(kinds_.size(), 0.0),
      threshold_(kinds_.size(), 0.0),
      layer_bytes_(config.budget.layer_bytes.size() == kinds_.size() ? config.budget.layer_bytes
                                                                     : std::move(layer_bytes)) {
  layer_bytes_.resize(kinds_.size(), 0);
  if (config_.budget.enabled() && config_.budget.Validate().ok()) {
    budget_bytes_ = config_.budget.BytesPerStep();
    x_min_ = BudgetExponent(config_.budget.k_min);
    x_max_ = BudgetExponent(config_.budget.k_max);
  }
}

double LayerCheckPolicy::next_k_multiplier() const {
  if (budget_bytes_ <= 0) return 1.0;
  const double h = static_cast<double>(config_.budget.horizon);
  const double x = std::clamp(ledger_ / (h * budget_bytes_) + integral_, x_min_, x_max_);
  return std::clamp(BudgetMultiplier(x), config_.budget.k_min, config_.budget.k_max);
}

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
  const double multiplier = next_k_multiplier();
  const bool in_warmup = step <= config_.warmup;
  const bool warmup_full =
      in_warmup && (first || step == config_.warmup ||
                    (config_.warmup_interval > 0 && step % config_.warmup_interval == 0));
  const bool periodic_full =
      !in_warmup && config_.full_every > 0 && (step - config_.warmup) % config_.full_every == 0;
  std::vector<LayerDecision> out(kinds_.size());
  uint64_t selected = 0, charged = 0;
  for (size_t l = 0; l < kinds_.size(); ++l) {
    LayerDecision& dec = out[l];
    dec.d = l < sums.size() ? drift::NormalizedDrift(sums[l]) : 0.0;
    accumulated_[l] += dec.d;
    dec.accumulated = accumulated_[l];
    const double k0 = kinds_[l] == LayerKind::kEmbedding ? config_.k0_embedding : config_.k0;
    threshold_[l] = std::max(multiplier * k0 * lr_ratio, config_.k_floor);
    dec.threshold = threshold_[l];
    // What the rules select, then the caller's forcing on top. Forcing
    // (a retry after this rank's failed write) is the rank's own; the budget
    // charges only what the rules select, which ranks fed the same inputs
    // agree on, so a retry on one rank leaves the multiplier alike on all.
    PersistReason rule = PersistReason::kNone;
    if (last_persisted_[l] == 0) {
      rule = PersistReason::kNever;
    } else if (frozen(l)) {
      rule = PersistReason::kNone;  // it never changes
    } else if (warmup_full) {
      rule = PersistReason::kWarmup;
    } else if (in_warmup) {
      rule = PersistReason::kNone;  // selection is off during warm-up
    } else if (periodic_full) {
      rule = PersistReason::kFull;
    } else if (step - last_persisted_[l] >= config_.s_max) {
      rule = PersistReason::kStaleness;
    } else if (accumulated_[l] >= threshold_[l]) {
      rule = PersistReason::kDrift;
    }
    const bool is_forced = l < forced.size() && forced[l];
    dec.reason = rule == PersistReason::kNever ? rule : is_forced ? PersistReason::kForced : rule;
    if (rule != PersistReason::kNone) charged += layer_bytes_[l];
    if (dec.reason != PersistReason::kNone) {
      accumulated_[l] = 0;
      last_persisted_[l] = step;
      selected += layer_bytes_[l];
    }
  }
  last_multiplier_ = multiplier;
  last_selected_bytes_ = selected;
  if (budget_bytes_ > 0) {
    // The controller (top of layercheck.h): ledger, integral, no wind-up.
    const double hb = static_cast<double>(config_.budget.horizon) * budget_bytes_;
    ledger_ += static_cast<double>(charged) - budget_bytes_;
    integral_ = std::clamp(integral_ + ledger_ / (hb * static_cast<double>(config_.budget.horizon)),
                           x_min_, x_max_);
    // Debt is remembered up to the multiplier's whole range (H·B·(x_max -
    // x_min) bytes), so forced writes keep m high until they are repaid;
    // credit is forgotten once m is at k_min, so a quiet stretch does not
    // buy a burst above the budget later.
    ledger_ = std::min(ledger_, (x_max_ - x_min_) * hb);
    if (ledger_ / hb + integral_ < x_min_) ledger_ = (x_min_ - integral_) * hb;
  }
  return out;
}

}  // namespace ckpt
