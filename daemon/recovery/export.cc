#include "daemon/recovery/export.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/recovery/restore.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

absl::StatusOr<uint64_t> ExportPlan(const CompositePlan& plan, const store::RankRecord& table,
                                    const RecoverySources& sources, const ExportSink& sink,
                                    std::vector<VersionKey>* damaged) {
  CKPT_RETURN_IF_ERROR(CheckComplete(plan));
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

  // One layer at a time; the plan passed to RestoreInto holds just that one,
  // read on one thread.
  CompositePlan one = plan;
  RecoverySources one_reader = sources;
  one_reader.readers.resize(std::min<size_t>(one_reader.readers.size(), 1));
  RestoreTarget target;
  target.tensors.resize(static_cast<size_t>(table.layers_size()));
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
    std::vector<char*>& dest = target.tensors[lp.layer];
    dest.clear();
    for (uint64_t off : offsets) dest.push_back(buffer.data() + off);
    std::vector<VersionKey> damaged_images;
    absl::Status s = RestoreInto(one, table, target, one_reader, damaged, &damaged_images).status();
    // An image of the memory tier that did not check was dropped: the same
    // version from disk.
    if (!s.ok() && !damaged_images.empty()) {
      s = RestoreInto(one, table, target, one_reader, damaged).status();
    }
    CKPT_RETURN_IF_ERROR(s);
    for (uint64_t off = 0; off < buffer.size(); off += kExportPieceBytes) {
      v1::ExportChunk chunk;
      chunk.set_data(buffer.substr(off, kExportPieceBytes));
      if (!sink(chunk)) return absl::CancelledError("the reader went away");
    }
  }
  return h->total_bytes();
}

}  // namespace ckpt
