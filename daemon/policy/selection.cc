#include "daemon/policy/selection.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ckpt {

absl::StatusOr<PolicyConfig> PolicyFromProto(const v1::PolicySpec& spec) {
  PolicyConfig c;
  switch (spec.kind()) {
    case v1::POLICY_UNSPECIFIED:
    case v1::POLICY_ALL:
      c.kind = v1::POLICY_ALL;
      return c;
    case v1::POLICY_EVERY_N:
      if (spec.every_n() == 0) return absl::InvalidArgumentError("policy every_n needs n >= 1");
      c.kind = v1::POLICY_EVERY_N;
      c.every_n = spec.every_n();
      return c;
    case v1::POLICY_EXPLICIT:
    case v1::POLICY_NONE:
    case v1::POLICY_LAYERCHECK:
      c.kind = spec.kind();
      return c;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown policy kind ", spec.kind()));
  }
}

const char* PolicyName(v1::PolicyKind kind) {
  switch (kind) {
    case v1::POLICY_ALL:
      return "all";
    case v1::POLICY_EVERY_N:
      return "every_n";
    case v1::POLICY_EXPLICIT:
      return "explicit";
    case v1::POLICY_NONE:
      return "none";
    case v1::POLICY_LAYERCHECK:
      return "layercheck";
    default:
      return "unknown";
  }
}

absl::StatusOr<std::vector<uint32_t>> SelectLayers(const PolicyConfig& config, uint64_t step,
                                                   uint32_t num_layers,
                                                   absl::Span<const uint32_t> explicit_layers,
                                                   const std::vector<bool>& never_persisted,
                                                   const std::vector<bool>& retry) {
  if (!explicit_layers.empty() && config.kind != v1::POLICY_EXPLICIT) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layer list was given but the rank's policy is ", PolicyName(config.kind)));
  }
  std::vector<bool> pick(num_layers, false);
  switch (config.kind) {
    case v1::POLICY_NONE:
      return std::vector<uint32_t>();
    case v1::POLICY_ALL:
      pick.assign(num_layers, true);
      break;
    case v1::POLICY_EVERY_N:
      if (step % config.every_n == 0) pick.assign(num_layers, true);
      break;
    case v1::POLICY_EXPLICIT:
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
    bool forced = (l < never_persisted.size() && never_persisted[l]) || (l < retry.size() && retry[l]);
    if (pick[l] || forced) out.push_back(l);
  }
  return out;
}

}  // namespace ckpt
