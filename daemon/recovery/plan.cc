#include "daemon/recovery/plan.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

absl::StatusOr<v1::Plan> BuildPlan(Index* index, const std::string& job, uint32_t rank,
                                   uint64_t target_step, const store::RankRecord& table) {
  const uint64_t max = target_step == 0 ? ~uint64_t{0} : target_step;
  CKPT_ASSIGN_OR_RETURN(auto event, index->EventAtOrBefore(job, rank, max));
  if (!event.has_value()) {
    return absl::NotFoundError(target_step == 0
                                   ? absl::StrCat("job ", job, " rank ", rank, " has no durable step")
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
  v1::Plan plan;
  plan.set_job_id(job);
  plan.set_rank(rank);
  plan.set_target_step(tau);
  plan.set_aux(event->second.aux());
  bool complete = true;
  double weighted = 0, total = 0;
  for (const store::LayerSpec& layer : table.layers()) {
    v1::LayerPlan* lp = plan.add_layers();
    lp->set_layer(layer.id());
    lp->set_name(layer.name());
    CKPT_ASSIGN_OR_RETURN(auto v, index->VersionAtOrBefore(job, rank, layer.id(), tau));
    if (!v.has_value()) {
      complete = false;
      continue;
    }
    lp->set_has_version(true);
    lp->set_step(v->first);
    lp->set_staleness(tau - v->first);
    lp->set_bytes(v->second.payload_bytes());
    lp->set_file(v->second.file());
    for (const store::GroupStep& g : v->second.group_steps()) *lp->add_group_steps() = ToApi(g);
    plan.set_total_bytes(plan.total_bytes() + lp->bytes());
    plan.set_max_staleness(std::max(plan.max_staleness(), lp->staleness()));
    weighted += static_cast<double>(lp->bytes()) * static_cast<double>(lp->staleness());
    total += static_cast<double>(lp->bytes());
  }
  plan.set_complete(complete);
  plan.set_size_weighted_staleness(total > 0 ? weighted / total : 0.0);
  return plan;
}

}  // namespace ckpt
