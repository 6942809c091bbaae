#include "daemon/recovery/plan.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ckpt {

absl::Status CheckComplete(const CompositePlan& plan) {
  if (plan.complete) return absl::OkStatus();
  std::vector<std::string> named;
  size_t missing = 0;
  for (const PlannedLayer& lp : plan.layers) {
    if (lp.has_version) continue;
    if (++missing <= 5) named.push_back(absl::StrCat(lp.layer, " '", lp.name, "'"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", plan.target_step, " of job ", plan.job, " cannot be restored whole: ", missing,
      " of ", plan.layers.size(), " registered layers have no version at or before it (layer ",
      absl::StrJoin(named, ", layer "), missing > named.size() ? ", ..." : "",
      "); the model registered has layers the checkpoint was not written with (a module added "
      "since?): restore into the model the job was trained with, or start a new job"));
}

void DropAccepted(Index::LostMap* lost) {
  for (auto it = lost->begin(); it != lost->end();) {
    it = it->second.accepted() ? lost->erase(it) : std::next(it);
  }
}

const Index::LostMap::value_type* LostNeeded(const Index::LostMap& lost, uint32_t layer,
                                             uint64_t tau, std::optional<uint64_t> version_step) {
  auto it = lost.upper_bound(std::make_pair(layer, tau));
  if (it == lost.begin()) return nullptr;
  --it;
  if (it->first.first != layer) return nullptr;
  return !version_step.has_value() || it->first.second > *version_step ? &*it : nullptr;
}

absl::StatusOr<CompositePlan> BuildPlan(Index* index, const std::string& job, uint32_t rank,
                                        uint64_t target_step, const store::RankRecord& table,
                                        uint64_t older_within) {
  const uint64_t max = target_step == 0 ? ~uint64_t{0} : target_step;
  CKPT_ASSIGN_OR_RETURN(auto event, index->EventAtOrBefore(job, rank, max));
  if (!event.has_value()) {
    return absl::NotFoundError(
        target_step == 0 ? absl::StrCat("job ", job, " rank ", rank, " has no durable step")
                         : absl::StrCat("job ", job, " rank ", rank,
                                        " has no durable step at or before ", target_step));
  }
  if (target_step != 0 && event->first != target_step) {
    return absl::NotFoundError(absl::StrCat(
        "step ", target_step, " of job ", job, " rank ", rank,
        " is not restorable (never durable, or removed by retention); the nearest earlier is ",
        event->first));
  }
  const uint64_t tau = event->first;
  CompositePlan plan;
  plan.job = job;
  plan.rank = rank;
  plan.target_step = tau;
  plan.aux = event->second.aux();
  plan.complete = true;
  CKPT_ASSIGN_OR_RETURN(Index::LostMap lost, index->LostVersions(job, rank));
  DropAccepted(&lost);
  std::vector<std::string> refused;
  size_t refusals = 0;
  double weighted = 0, total = 0;
  for (const store::LayerSpec& layer : table.layers()) {
    PlannedLayer& lp = plan.layers.emplace_back();
    lp.layer = layer.id();
    lp.name = layer.name();
    CKPT_ASSIGN_OR_RETURN(auto v, index->VersionAtOrBefore(job, rank, layer.id(), tau));
    const auto* gone =
        LostNeeded(lost, layer.id(), tau, v.has_value() ? std::optional(v->first) : std::nullopt);
    if (gone != nullptr) {
      const uint64_t lost_step = gone->first.second;
      if (!v.has_value() || older_within == 0 || tau - v->first > older_within) {
        if (++refusals <= 5) {
          refused.push_back(
              absl::StrCat("layer ", layer.id(), " '", layer.name(), "' lost its version of step ",
                           lost_step, " (", gone->second.reason(), ")",
                           v.has_value() ? absl::StrCat("; its previous is step ", v->first, ", ",
                                                        tau - v->first, " steps before the target")
                                         : "; it has no older version"));
        }
        continue;
      }
      lp.lost_step = lost_step;
    }
    if (!v.has_value()) {
      plan.complete = false;
      continue;
    }
    lp.has_version = true;
    lp.step = v->first;
    // A frozen layer's bytes at tau are those of its version.
    lp.staleness = layer.frozen() ? 0 : tau - v->first;
    lp.bytes = v->second.payload_bytes();
    lp.file = v->second.file();
    for (const store::GroupStep& g : v->second.group_steps()) {
      lp.group_steps.push_back(GroupStep{g.group(), g.step()});
    }
    plan.total_bytes += lp.bytes;
    plan.max_staleness = std::max(plan.max_staleness, lp.staleness);
    weighted += static_cast<double>(lp.bytes) * static_cast<double>(lp.staleness);
    total += static_cast<double>(lp.bytes);
  }
  if (refusals > 0) {
    return WithReason(
        absl::DataLossError(absl::StrCat(
            "step ", tau, " of job ", job, " rank ", rank, " cannot be restored as it was: ",
            absl::StrJoin(refused, "; "), refusals > refused.size() ? "; ..." : "",
            ". No tier holds an intact copy of the lost versions; to restore each such layer's "
            "previous version instead, ask for it (older_within_steps, ckptctl --older-within)")),
        ErrorReason::kLostVersion);
  }
  plan.size_weighted_staleness = total > 0 ? weighted / total : 0.0;
  return plan;
}

}  // namespace ckpt
