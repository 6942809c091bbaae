// Layer selection for one step: which layers of a rank are persisted.
//
// Policies (ckpt.v1.PolicyKind):
//   all       every layer every step (the baseline and the bit-exact test)
//   every_n   every layer at steps that are multiples of n
//   explicit  exactly the layers the client lists in StepDone
//   none      nothing
// Independently of the policy (except none), a layer is selected when it has
// never been persisted (`never_persisted`) or when its last selected version
// failed or was skipped (`retry`), so a composite plan is complete as early as
// possible and a failure is repaired at the next step.
//
// Decisions are a pure function of the arguments. LayerCheck (drift-based
// selection) plugs in here as another kind.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

struct PolicyConfig {
  v1::PolicyKind kind = v1::POLICY_ALL;
  uint64_t every_n = 1;
};

// INVALID_ARGUMENT for an unknown kind or every_n == 0 with POLICY_EVERY_N.
absl::StatusOr<PolicyConfig> PolicyFromProto(const v1::PolicySpec& spec);
const char* PolicyName(v1::PolicyKind kind);

// Sorted, unique layer ids to persist at `step`. INVALID_ARGUMENT when an
// explicit layer id is >= num_layers, or when a list is given under a policy
// other than explicit.
absl::StatusOr<std::vector<uint32_t>> SelectLayers(const PolicyConfig& config, uint64_t step,
                                                   uint32_t num_layers,
                                                   absl::Span<const uint32_t> explicit_layers,
                                                   const std::vector<bool>& never_persisted,
                                                   const std::vector<bool>& retry);

}  // namespace ckpt
