#include "daemon/recovery/plan.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status.h"

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
  for (const v1::LayerSpec& layer : table.layers()) {
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
    *lp->mutable_group_steps() = v->second.group_steps();
    plan.set_total_bytes(plan.total_bytes() + lp->bytes());
    plan.set_max_staleness(std::max(plan.max_staleness(), lp->staleness()));
    weighted += static_cast<double>(lp->bytes()) * static_cast<double>(lp->staleness());
    total += static_cast<double>(lp->bytes());
  }
  plan.set_complete(complete);
  plan.set_size_weighted_staleness(total > 0 ? weighted / total : 0.0);
  return plan;
}

absl::StatusOr<RestoreStats> RestoreInto(const v1::Plan& plan, const store::RankRecord& table,
                                         const TensorDestination& dest, Index* index, LayerStore* store,
                                         IoBackend* io, StagingPool* pool, absl::Duration timeout,
                                         const std::function<bool()>& cancelled,
                                         const CopyToDestination& copy) {
  if (!plan.complete()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan for step ", plan.target_step(), " is incomplete: some layers have no version"));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  RestoreStats stats;
  for (const v1::LayerPlan& lp : plan.layers()) {
    if (cancelled && cancelled()) return absl::CancelledError("the restore was cancelled");
    if (lp.layer() >= static_cast<uint32_t>(table.layers_size())) {
      return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer()));
    }
    const v1::LayerSpec& spec = table.layers(static_cast<int>(lp.layer()));
    CKPT_ASSIGN_OR_RETURN(auto rec, index->VersionAtOrBefore(
                                        plan.job_id(), plan.rank(), lp.layer(), lp.step()));
    if (!rec.has_value() || rec->first != lp.step()) {
      return absl::AbortedError(absl::StrCat("layer ", lp.layer(), " version ", lp.step(),
                                             " vanished during the restore; plan again"));
    }
    VersionKey key{plan.job_id(), plan.rank(), lp.layer(), lp.step()};
    absl::StatusOr<LoadedVersion> loaded = store->Read(key, rec->second, io, pool, deadline);
    if (!loaded.ok()) {
      return absl::Status(loaded.status().code(),
                          absl::StrCat("layer ", lp.layer(), " (", lp.name(), ") step ", lp.step(),
                                       ": ", loaded.status().message()));
    }
    std::map<std::string, const store::TensorEntry*> stored;
    for (const store::TensorEntry& t : loaded->decoded.header.tensors()) stored[t.name()] = &t;
    if (stored.size() != static_cast<size_t>(spec.tensors_size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", lp.layer(), " has ", stored.size(), " tensors in the checkpoint and ",
                       spec.tensors_size(), " registered"));
    }
    for (int i = 0; i < spec.tensors_size(); ++i) {
      const v1::TensorSpec& ts = spec.tensors(i);
      auto it = stored.find(ts.name());
      if (it == stored.end() || it->second->nbytes() != ts.nbytes() ||
          it->second->dtype() != ts.dtype()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor '", ts.name(), "' of layer ", lp.layer(),
            " differs between the checkpoint and the registration (missing, dtype or size)"));
      }
    }
    for (int i = 0; i < spec.tensors_size(); ++i) {
      const store::TensorEntry* t = stored[spec.tensors(i).name()];
      char* out = dest(lp.layer(), static_cast<uint32_t>(i));
      if (copy == nullptr) {
        loaded->lease.CopyOut(loaded->decoded.layout.header_bytes + t->offset(), out, t->nbytes());
      } else {
        absl::Status s;
        loaded->lease.ForEachPiece(loaded->decoded.layout.header_bytes + t->offset(), t->nbytes(),
                                   [&](const char* piece, uint64_t n) {
                                     if (s.ok()) s = copy(out, piece, n);
                                     out += n;
                                   });
        CKPT_RETURN_IF_ERROR(s);
      }
      stats.bytes += t->nbytes();
    }
  }
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return stats;
}

}  // namespace ckpt
