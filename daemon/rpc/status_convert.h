// absl::Status -> grpc::Status, in one place on the daemon side. The
// status's ErrorReason (base/status.h) travels in the gRPC status details as
// an RpcStatus (the shape of google.rpc.Status) holding a packed
// ckpt.v1.ErrorInfo; the client converts it back in one place
// (client/src/client.cc). Every error ckptd answers carries the details,
// with ERROR_REASON_UNSPECIFIED when it has no reason: a status without them
// was made by the gRPC runtime (a call cancelled as ckptd stopped, a broken
// connection), which the client takes as the loss of ckptd.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "base/status.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

static_assert(static_cast<int>(ErrorReason::kQuota) == v1::ERROR_REASON_QUOTA &&
                  kErrorReasonCount == v1::ErrorReason_ARRAYSIZE,
              "ErrorReason and ckpt.v1.ErrorReason must list the same reasons");

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message(s.message());
#ifdef CKPT_KILL_POINTS
  // Test builds: CKPT_REWORD_ERRORS=1 replaces every message, so tests show
  // that no caller depends on the wording.
  static const bool reword = std::getenv("CKPT_REWORD_ERRORS") != nullptr;
  if (reword) message = "(message reworded for a test)";
#endif
  const ErrorReason reason = ReasonOf(s);
  v1::ErrorInfo info;
  info.set_reason(static_cast<v1::ErrorReason>(reason));
  v1::RpcStatus details;
  details.set_code(static_cast<int32_t>(s.code()));
  details.set_message(message);
  details.add_details()->PackFrom(info);
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), message,
                      details.SerializeAsString());
}

}  // namespace ckpt
