#include "daemon/recovery/restore.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {

absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const TensorDestination& dest, Index* index, LayerStore* store,
                                         IoBackend* io, StagingPool* pool, absl::Duration timeout,
                                         const std::function<bool()>& cancelled,
                                         const CopyToDestination& copy, const MemorySource& memory) {
  if (!plan.complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan for step ", plan.target_step, " is incomplete: some layers have no version"));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  RestoreStats stats;
  for (const PlannedLayer& lp : plan.layers) {
    if (cancelled && cancelled()) return absl::CancelledError("the restore was cancelled");
    if (lp.layer >= static_cast<uint32_t>(table.layers_size())) {
      return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer));
    }
    const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
    CKPT_ASSIGN_OR_RETURN(auto rec, index->VersionAtOrBefore(
                                        plan.job, plan.rank, lp.layer, lp.step));
    if (!rec.has_value() || rec->first != lp.step) {
      return absl::AbortedError(absl::StrCat("layer ", lp.layer, " version ", lp.step,
                                             " vanished during the restore; plan again"));
    }
    VersionKey key{plan.job, plan.rank, lp.layer, lp.step};
    // From memory when the image there checks, else from disk.
    std::shared_ptr<const StagingLease> image = memory ? memory(key, rec->second) : nullptr;
    absl::StatusOr<DecodedHeader> decoded = absl::NotFoundError("not in memory");
    if (image != nullptr) {
      decoded = CheckImage(key, rec->second, LeaseImage(*image));
      if (!decoded.ok()) {
        CKPT_LOG(ERROR) << "memory tier: layer " << lp.layer << " step " << lp.step
                        << " does not check (" << decoded.status() << "); read from disk";
        image = nullptr;
      }
    }
    absl::StatusOr<LoadedVersion> loaded = absl::NotFoundError("not read");
    if (image == nullptr) {
      loaded = store->Read(key, rec->second, io, pool, deadline);
      if (!loaded.ok()) {
        return absl::Status(loaded.status().code(),
                            absl::StrCat("layer ", lp.layer, " (", lp.name, ") step ", lp.step,
                                         ": ", loaded.status().message()));
      }
      decoded = loaded->decoded;
    } else {
      ++stats.memory_layers;
    }
    const StagingLease& src = image != nullptr ? *image : loaded->lease;
    std::map<std::string, const store::TensorEntry*> stored;
    for (const store::TensorEntry& t : decoded->header.tensors()) stored[t.name()] = &t;
    if (stored.size() != static_cast<size_t>(spec.tensors_size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", lp.layer, " has ", stored.size(), " tensors in the checkpoint and ",
                       spec.tensors_size(), " registered"));
    }
    for (int i = 0; i < spec.tensors_size(); ++i) {
      const store::TensorSpec& ts = spec.tensors(i);
      auto it = stored.find(ts.name());
      if (it == stored.end() || it->second->nbytes() != ts.nbytes() ||
          it->second->dtype() != ts.dtype()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor '", ts.name(), "' of layer ", lp.layer,
            " differs between the checkpoint and the registration (missing, dtype or size)"));
      }
    }
    for (int i = 0; i < spec.tensors_size(); ++i) {
      const store::TensorEntry* t = stored[spec.tensors(i).name()];
      char* out = dest(lp.layer, static_cast<uint32_t>(i));
      if (copy == nullptr) {
        src.CopyOut(decoded->layout.header_bytes + t->offset(), out, t->nbytes());
      } else {
        absl::Status s;
        src.ForEachPiece(decoded->layout.header_bytes + t->offset(), t->nbytes(),
                                   [&](const char* piece, uint64_t n) {
                                     if (s.ok()) s = copy(out, piece, n);
                                     out += n;
                                   });
        CKPT_RETURN_IF_ERROR(s);
      }
      stats.bytes += t->nbytes();
      if (image != nullptr) stats.memory_bytes += t->nbytes();
    }
  }
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return stats;
}

}  // namespace ckpt
