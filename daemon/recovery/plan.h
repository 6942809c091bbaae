// Composite plans: for every layer its newest durable version at or below a
// target step (docs/architecture.md, docs/file-format.md).
//
// A composite plan for target step τ names, for every layer of a rank, the
// newest durable version with step <= τ, its staleness τ - t_l, and the
// size-weighted staleness Σ size_l (τ - t_l) / Σ size_l. τ = 0 means the
// rank's latest durable step (its newest checkpoint event).
//
// Restoring a plan is recovery/restore.h.
//
// Thread-safety: a free function; safe to call concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/tensor_types.h"
#include "daemon/store/index.h"

namespace ckpt {

struct PlannedLayer {
  uint32_t layer = 0;
  std::string name;
  bool has_version = false;  // the fields below only when true
  uint64_t step = 0;
  uint64_t staleness = 0;  // target_step - step
  uint64_t bytes = 0;      // the version's payload
  std::string file;
  std::vector<GroupStep> group_steps;
  // Non-zero: the layer's newer version of this step was lost, and `step`
  // is the older one the caller accepted in its place (older_within).
  uint64_t lost_step = 0;
};

struct CompositePlan {
  std::string job;
  uint32_t rank = 0;
  uint64_t target_step = 0;
  bool complete = false;  // every layer has a version at or before target_step
  std::vector<PlannedLayer> layers;
  uint64_t total_bytes = 0;
  double size_weighted_staleness = 0;
  uint64_t max_staleness = 0;
  std::string aux;  // the aux blob stored with target_step
};

// OK when every layer of `plan` has a version; else FAILED_PRECONDITION
// naming the layers that have none (layers the checkpoint was not written
// with: a module added since, say).
absl::Status CheckComplete(const CompositePlan& plan);

// Drops the losses a restore accepted (LostVersion.accepted) from `lost`.
void DropAccepted(Index::LostMap* lost);

// The lost version (in `lost`, Index::LostVersions) a plan of `tau` needs
// for `layer`: the newest at or before `tau`, when it is newer than the
// layer's version there (`version_step`; nullopt: the layer has none).
// nullptr when the plan needs none.
const Index::LostMap::value_type* LostNeeded(const Index::LostMap& lost, uint32_t layer,
                                             uint64_t tau, std::optional<uint64_t> version_step);

// NOT_FOUND when the rank has no durable step, or `target_step` is not one
// (a step is restorable while its checkpoint event exists).
//
// A layer whose newest version at or before the target was lost (its file
// damaged with no intact copy in any tier: Index::MarkLost) makes the plan
// DATA_LOSS with reason kLostVersion, naming the layers, unless the layer's
// previous version is at most `older_within` steps older than the target:
// then that version is planned, with lost_step set. 0 refuses every loss.
absl::StatusOr<CompositePlan> BuildPlan(Index* index, const std::string& job, uint32_t rank,
                                        uint64_t target_step, const store::RankRecord& table,
                                        uint64_t older_within = 0);

}  // namespace ckpt
