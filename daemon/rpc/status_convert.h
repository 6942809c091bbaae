// absl::Status <-> grpc::Status, in one place on the daemon side.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace ckpt {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace ckpt
