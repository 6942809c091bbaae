#include "daemon/rpc/convert.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace ckpt {

StepReport StepReportOf(const v1::StepDoneRequest& req) {
  StepReport r;
  r.rank = RankRefOf(req);
  r.step = req.step();
  r.lr = req.lr();
  r.aux = req.aux();
  r.layers.assign(req.layers().begin(), req.layers().end());
  for (const v1::GroupStep& g : req.group_steps()) r.group_steps.push_back({g.group(), g.step()});
  r.client_drift = LayerSumsOf(req.client_drift());
  return r;
}

std::vector<drift::LayerSums> LayerSumsOf(
    const google::protobuf::RepeatedPtrField<v1::LayerDrift>& layers) {
  std::vector<drift::LayerSums> sums;
  sums.reserve(static_cast<size_t>(layers.size()));
  for (const v1::LayerDrift& d : layers) sums.push_back(drift::LayerSums{d.dw2(), d.w2()});
  return sums;
}

absl::Time WaitDeadline(const v1::WaitRequest& req, absl::Time call_deadline) {
  if (req.timeout_ms() == 0) return call_deadline;
  return std::min(call_deadline, absl::Now() + absl::Milliseconds(req.timeout_ms()));
}

v1::WaitSnapshotReply ToProto(const SnapshotTaken& taken) {
  v1::WaitSnapshotReply reply;
  for (uint32_t l : taken.layers) reply.add_layers(l);
  reply.set_skipped(taken.skipped);
  return reply;
}

v1::DriftReply DriftReplyOf(uint64_t step, const std::vector<drift::LayerSums>& sums) {
  v1::DriftReply reply;
  reply.set_step(step);
  for (const drift::LayerSums& s : sums) {
    v1::LayerDrift* d = reply.add_layers();
    d->set_dw2(s.dw2);
    d->set_w2(s.w2);
  }
  return reply;
}

}  // namespace ckpt
