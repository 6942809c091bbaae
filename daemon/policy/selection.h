// Layer selection for one step: which layers of a rank are persisted.
//
// Policies (PolicyKind):
//   all       every layer every step (the baseline and the bit-exact test)
//   every_n   every layer at steps that are multiples of n
//   explicit  exactly the layers the client lists in StepDone
//   none      nothing
// Independently of the policy (except none), a layer is selected when it has
// never been persisted (`never_persisted`) or when its last selected version
// failed or was skipped (`retry`), so a composite plan is complete as early as
// possible and a failure is repaired at the next step. A `frozen` layer (one
// that never changes) is selected only then, never by the policy.
//
// Decisions are a pure function of the arguments. LayerCheck (drift-based
// selection) plugs in here as another kind.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace ckpt {

enum class PolicyKind : int {
  kAll = 1,
  kEveryN = 2,
  kExplicit = 3,
  kNone = 4,
  kLayerCheck = 5,
};

struct PolicyConfig {
  PolicyKind kind = PolicyKind::kAll;
  uint64_t every_n = 1;

  // INVALID_ARGUMENT for a kind outside the list or every_n == 0 with kEveryN.
  absl::Status Validate() const;
};

const char* PolicyName(PolicyKind kind);

// Sorted, unique layer ids to persist at `step`. INVALID_ARGUMENT when an
// explicit layer id is >= num_layers, or when a list is given under a policy
// other than explicit.
absl::StatusOr<std::vector<uint32_t>> SelectLayers(const PolicyConfig& config, uint64_t step,
                                                   uint32_t num_layers,
                                                   absl::Span<const uint32_t> explicit_layers,
                                                   const std::vector<bool>& never_persisted,
                                                   const std::vector<bool>& retry,
                                                   const std::vector<bool>& frozen = {});

}  // namespace ckpt
