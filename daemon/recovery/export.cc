#include "daemon/recovery/export.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/export_region.h"
#include "base/status.h"
#include "daemon/recovery/restore.h"
#include "daemon/recovery/schema_convert.h"

namespace ckpt {

namespace {

// The bytes of `layer`'s tensors.
uint64_t LayerBytes(const store::RankRecord& table, uint32_t layer) {
  uint64_t n = 0;
  for (const store::TensorSpec& t : table.layers(static_cast<int>(layer)).tensors()) {
    n += t.nbytes();
  }
  return n;
}

// RestoreInto, and once more when an image of the memory tier did not
// check (it was dropped: the same versions come from disk then).
absl::Status RestoreLayers(const CompositePlan& plan, const store::RankRecord& table,
                           const RestoreTarget& target, const RecoverySources& sources,
                           std::vector<VersionKey>* damaged) {
  std::vector<VersionKey> damaged_images;
  absl::Status s = RestoreInto(plan, table, target, sources, damaged, &damaged_images).status();
  if (!s.ok() && !damaged_images.empty()) {
    s = RestoreInto(plan, table, target, sources, damaged).status();
  }
  return s;
}

// Passes `plan`'s layers through the window of `region` (export_region.h),
// in batches of whole layers, each restored on the sources' readers once
// the reader took the batch before. REQUIRES: the window holds each layer.
absl::Status ExportThroughRegion(const CompositePlan& plan, const store::RankRecord& table,
                                 const RecoverySources& sources, const ExportSink& sink,
                                 std::vector<VersionKey>* damaged, ExportRegion region) {
  char* const window = region.data + kExportRegionControlBytes;
  const uint64_t window_bytes = region.size - kExportRegionControlBytes;
  RestoreTarget target;
  target.tensors.resize(static_cast<size_t>(table.layers_size()));
  CompositePlan batch = plan;
  batch.layers.clear();
  uint64_t used = 0;
  uint32_t sent = 0;  // batches announced
  // All the waits for the reader's acks together, not each.
  absl::Duration ack_budget = sources.timeout;
  auto reader_there = [&] { return sink(v1::ExportChunk()); };
  auto flush = [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(RestoreLayers(batch, table, target, sources, damaged));
    v1::ExportChunk announce;
    announce.set_region_bytes(used);
    if (!sink(announce)) return absl::CancelledError("the reader went away");
    ++sent;
    batch.layers.clear();
    used = 0;
    return absl::OkStatus();
  };
  for (const PlannedLayer& lp : plan.layers) {
    const uint64_t bytes = LayerBytes(table, lp.layer);
    if (used + bytes > window_bytes) CKPT_RETURN_IF_ERROR(flush());
    if (batch.layers.empty() && sent > 0) {
      // The window is ckptd's again only once the reader took the last batch.
      const absl::Time start = absl::Now();
      CKPT_RETURN_IF_ERROR(WaitForExportAck(region.data, sent, start + ack_budget,
                                            absl::Milliseconds(100), reader_there));
      ack_budget -= absl::Now() - start;
    }
    std::vector<char*>& dest = target.tensors[lp.layer];
    dest.clear();
    for (const store::TensorSpec& t : table.layers(static_cast<int>(lp.layer)).tensors()) {
      dest.push_back(window + used);
      used += t.nbytes();
    }
    batch.layers.push_back(lp);
  }
  if (!batch.layers.empty()) CKPT_RETURN_IF_ERROR(flush());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ExportPlan(const CompositePlan& plan, const store::RankRecord& table,
                                    const RecoverySources& sources, const ExportSink& sink,
                                    std::vector<VersionKey>* damaged, ExportRegion region) {
  CKPT_RETURN_IF_ERROR(CheckComplete(plan));
  v1::ExportChunk head;
  v1::ExportHeader* h = head.mutable_header();
  *h->mutable_plan() = ToApi(plan);
  uint64_t largest = 0;  // the bytes of the largest layer's tensors
  for (const PlannedLayer& lp : plan.layers) {
    if (lp.layer >= static_cast<uint32_t>(table.layers_size())) {
      return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer));
    }
    const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
    uint64_t layer_bytes = 0;
    for (const store::TensorSpec& t : spec.tensors()) {
      layer_bytes += t.nbytes();
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
    largest = std::max(largest, layer_bytes);
  }
  const bool through_region = region.data != nullptr && region.size > kExportRegionControlBytes &&
                              largest <= region.size - kExportRegionControlBytes;
  h->set_in_region(through_region);
  if (region.used != nullptr) *region.used = through_region;
  if (!sink(head)) return absl::CancelledError("the reader went away");
  if (through_region) {
    CKPT_RETURN_IF_ERROR(ExportThroughRegion(plan, table, sources, sink, damaged, region));
    return h->total_bytes();
  }

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
    CKPT_RETURN_IF_ERROR(RestoreLayers(one, table, target, one_reader, damaged));
    for (uint64_t off = 0; off < buffer.size(); off += kExportPieceBytes) {
      v1::ExportChunk chunk;
      chunk.set_data(buffer.substr(off, kExportPieceBytes));
      if (!sink(chunk)) return absl::CancelledError("the reader went away");
    }
  }
  return h->total_bytes();
}

}  // namespace ckpt
