#include "daemon/recovery/export.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/recovery/restore.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

absl::StatusOr<uint64_t> ExportPlan(const CompositePlan& plan, const store::RankRecord& table, Index* index,
                        LayerStore* store, IoBackend* io, StagingPool* pool,
                        absl::Duration timeout, const std::function<bool()>& cancelled,
                        const ExportSink& sink) {
  if (!plan.complete) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan for step ", plan.target_step, " is incomplete"));
  }
  v1::ExportChunk head;
  v1::ExportHeader* h = head.mutable_header();
  *h->mutable_plan() = ToApi(plan);
  for (const PlannedLayer& lp : plan.layers) {
    if (lp.layer >= static_cast<uint32_t>(table.layers_size())) {
      return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer));
    }
    const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
    for (const store::TensorSpec& t : spec.tensors()) {
      v1::ExportTensor* et = h->add_tensors();
      et->set_layer(lp.layer);
      et->set_layer_name(spec.name());
      et->set_name(t.name());
      et->set_dtype(ToApi(t.dtype()));
      *et->mutable_shape() = t.shape();
      et->set_nbytes(t.nbytes());
      et->set_role(ToApi(t.role()));
      et->set_group(t.group());
      et->set_step(lp.step);
      h->set_total_bytes(h->total_bytes() + t.nbytes());
    }
  }
  if (!sink(head)) return absl::CancelledError("the reader went away");

  // One layer at a time; the plan passed to RestoreInto holds just that one.
  CompositePlan one = plan;
  for (const PlannedLayer& lp : plan.layers) {
    // One layer at a time through the verified restore loop, into a buffer
    // laid out in table order.
    const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
    std::vector<uint64_t> offsets;
    uint64_t layer_bytes = 0;
    for (const store::TensorSpec& t : spec.tensors()) {
      offsets.push_back(layer_bytes);
      layer_bytes += t.nbytes();
    }
    std::string buffer(layer_bytes, '\0');
    one.layers.assign(1, lp);
    TensorDestination dest = [&buffer, &offsets](uint32_t, uint32_t tensor) {
      return buffer.data() + offsets[tensor];
    };
    CKPT_RETURN_IF_ERROR(
        RestoreInto(one, table, dest, index, store, {io}, pool, timeout, cancelled).status());
    for (uint64_t off = 0; off < buffer.size(); off += kExportPieceBytes) {
      v1::ExportChunk chunk;
      chunk.set_data(buffer.substr(off, kExportPieceBytes));
      if (!sink(chunk)) return absl::CancelledError("the reader went away");
    }
  }
  return h->total_bytes();
}

}  // namespace ckpt
