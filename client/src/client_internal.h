// What the Client's source files share (not installed): the channel and
// stubs behind a Client, and the conversion of gRPC statuses.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/region.h"
#include "ckpt/client.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "gpu_export.h"

namespace ckpt {
namespace internal {

// ckptd's status as absl::Status, its ErrorReason kept (client.cc).
absl::Status FromGrpc(const grpc::Status& s);
void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout);

}  // namespace internal

struct Client::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Trainer::Stub> stub;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::vector<MemfdRegion> regions;
  std::unique_ptr<internal::GpuExport> gpu;  // GPU tensors, instead of regions

  // A fresh channel connects at once; a channel that saw the daemon die may
  // sit in reconnect backoff and fail calls fast for a while.
  void Reconnect(const std::string& socket_path) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    // Own subchannels: the global pool would hand a new channel the old,
    // broken connection to a daemon that has since restarted.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    channel =
        grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
    stub = v1::Trainer::NewStub(channel);
    admin = v1::Admin::NewStub(channel);
  }
};

}  // namespace ckpt
