// ckpt.v1 messages <-> the engine's per-step types (engine/step_types.h), in
// one place on the daemon side. The handlers in server.cc validate nothing
// themselves: they convert, call the engine, and convert back.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/engine/step_types.h"

namespace ckpt {

// The registration a per-step request names.
template <typename Request>
RankRef RankRefOf(const Request& req) {
  return RankRef{req.job_id(), req.rank(), req.generation()};
}

StepReport StepReportOf(const v1::StepDoneRequest& req);
std::vector<drift::LayerSums> LayerSumsOf(
    const google::protobuf::RepeatedPtrField<v1::LayerDrift>& layers);
// The earlier of the call's deadline and the request's own timeout_ms.
absl::Time WaitDeadline(const v1::WaitRequest& req, absl::Time call_deadline);

v1::WaitSnapshotReply ToProto(const SnapshotTaken& taken);
v1::DriftReply DriftReplyOf(uint64_t step, const std::vector<drift::LayerSums>& sums);

}  // namespace ckpt
