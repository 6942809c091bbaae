#include "daemon/policy/selection.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ckpt {

absl::Status PolicyConfig::Validate() const {
  switch (kind) {
    case PolicyKind::kEveryN:
      if (every_n == 0) return absl::InvalidArgumentError("policy every_n needs n >= 1");
      return absl::OkStatus();
    case PolicyKind::kAll:
    case PolicyKind::kExplicit:
    case PolicyKind::kNone:
    case PolicyKind::kLayerCheck:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown policy kind ", static_cast<int>(kind)));
}

const char* PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kAll:
      return "all";
    case PolicyKind::kEveryN:
      return "every_n";
    case PolicyKind::kExplicit:
      return "explicit";
    case PolicyKind::kNone:
      return "none";
    case PolicyKind::kLayerCheck:
      return "layercheck";
    default:
      return "unknown";
  }
}

absl::StatusOr<std::vector<uint32_t>> SelectLayers(const PolicyConfig& config, uint64_t step,
                                                   uint32_t num_layers,
                                                   absl::Span<const uint32_t> explicit_layers,
                                                   const std::vector<bool>& never_persisted,
                                                   const std::vector<bool>& retry,
                                                   const std::vector<bool>& frozen) {
  if (!explicit_layers.empty() && config.kind != PolicyKind::kExplicit) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layer list was given but the rank's policy is ", PolicyName(config.kind)));
  }
  std::vector<bool> pick(num_layers, false);
  switch (config.kind) {
    case PolicyKind::kNone:
      return std::vector<uint32_t>();
    case PolicyKind::kAll:
      pick.assign(num_layers, true);
      break;
    case PolicyKind::kEveryN:
      if (step % config.every_n == 0) pick.assign(num_layers, true);
      break;
    case PolicyKind::kExplicit:
      for (uint32_t l : explicit_layers) {
        if (l >= num_layers) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", l, " does not exist; the rank has ", num_layers, " layers"));
        }
        pick[l] = true;
      }
      break;
    default:
      return absl::InvalidArgumentError("unknown policy");
  }
  std::vector<uint32_t> out;
  for (uint32_t l = 0; l < num_layers; ++l) {
    bool forced =
        (l < never_persisted.size() && never_persisted[l]) || (l < retry.size() && retry[l]);
    const bool by_policy = pick[l] && !(l < frozen.size() && frozen[l]);
    if (by_policy || forced) out.push_back(l);
  }
  return out;
}

}  // namespace ckpt
