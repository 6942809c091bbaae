// ckpt.v1 messages <-> the engine's own types (engine/step_types.h,
// engine/registration.h, recovery/plan.h), in one place on the daemon side. The handlers in
// server.cc validate nothing themselves: they convert, call the engine, and convert back.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/registration.h"
#include "daemon/engine/step_types.h"
#include "daemon/recovery/schema_convert.h"  // ToApi(CompositePlan), shared with export

namespace ckpt {

// The registration a per-step request names.
template <typename Request>
RankRef RankRefOf(const Request& req) {
  return RankRef{req.job_id(), req.rank(), req.generation()};
}

// INVALID_ARGUMENT for a policy or optimizer kind this daemon does not know;
// everything else is checked by the engine (ValidateRegistration).
absl::StatusOr<Registration> RegistrationOf(const v1::RegisterRequest& req);
GpuHandover GpuHandoverOf(const v1::GpuHandover& gpu);
v1::RegisterReply ToProto(const Registered& registered);
v1::RestoreReply ToProto(const Restored& restored);
v1::DeleteJobReply ToProto(const JobDeleted& deleted);

StepReport StepReportOf(const v1::StepDoneRequest& req);
std::vector<drift::LayerSums> LayerSumsOf(
    const google::protobuf::RepeatedPtrField<v1::LayerDrift>& layers);
// The earlier of the call's deadline and the request's own timeout_ms.
absl::Time WaitDeadline(const v1::WaitRequest& req, absl::Time call_deadline);

v1::WaitSnapshotReply ToProto(const SnapshotTaken& taken);
// The engine's name of a durability tier ("" for the local store).
std::string_view TierName(v1::DurabilityTier tier);
v1::DriftReply DriftReplyOf(uint64_t step, const std::vector<drift::LayerSums>& sums);

}  // namespace ckpt
