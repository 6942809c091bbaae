// How a call of ckptd's gRPC services enters (internal to server.cc): the
// request size cap of its method, the caller's identity and call limits, and
// the handover tokens a refused call gives back.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "daemon/common/sync_point.h"
#include "daemon/rpc/server.h"
#include "daemon/rpc/status_convert.h"

namespace ckpt::rpc_internal {

// kRegister: the one method whose request may exceed max_request_bytes.
enum class Weight { kNormal, kHeavy, kRegister };

// The key of a call in RpcServer::NoteLargeRequest / FinishCall.
inline const void* CallKey(const grpc::ServerContextBase* ctx) { return ctx; }

// WithCaller without its give-back.
template <typename Fn>
grpc::Status EnterAndRun(RpcServer* server, grpc::ServerContext* ctx,
                         const google::protobuf::MessageLite& req, Fn&& fn, Weight weight) {
  const size_t bytes = req.ByteSizeLong();
  const int max_request = server->options().max_request_bytes;
  const bool large = bytes > static_cast<size_t>(max_request);
  if (large) {
    server->NoteLargeRequest(CallKey(ctx));
    if (weight != Weight::kRegister) {
      return ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat(req.GetTypeName(), " of ", bytes, " bytes exceeds max_request_bytes (",
                       max_request, "); only Register may be larger")));
    }
  }
  absl::StatusOr<Caller> caller = server->CallerOf(*ctx);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  const bool heavy = weight == Weight::kHeavy;
  if (absl::Status s = server->EnterCall(caller->uid, heavy, large); !s.ok()) {
    return ToGrpcStatus(s);
  }
  struct Leave {
    RpcServer* server;
    uid_t uid;
    bool heavy;
    bool large;
    ~Leave() { server->LeaveCall(uid, heavy, large); }
  } leave{server, caller->uid, heavy, large};
  // A heavy call holding its slot: a test of max_heavy_calls against a real
  // ckptd holds calls here (CKPT_DELAY_UNTIL) instead of racing them.
  if (heavy) CKPT_DELAY_POINT("rpc.heavy_call");
  return ToGrpcStatus(fn(*caller));
}

// Runs `fn(caller)` with the caller's identity, within the request size cap
// of its method and the caller's call limits, converting errors. A call
// refused before `fn` runs gives back at once the handover `tokens` its
// request carries (their descriptors are the caller's to claim only
// through this call): a client retrying such refusals, each time with a new
// handover, would otherwise hold them all until they expire and fill its
// uid's handover limits.
template <typename Fn>
grpc::Status WithCaller(RpcServer* server, grpc::ServerContext* ctx,
                        const google::protobuf::MessageLite& req, Fn&& fn,
                        Weight weight = Weight::kNormal,
                        absl::Span<const std::string> tokens = {}) {
  bool ran = false;
  grpc::Status status = EnterAndRun(
      server, ctx, req,
      [&](const Caller& c) {
        ran = true;
        return fn(c);
      },
      weight);
  if (!ran && !tokens.empty()) {
    if (absl::StatusOr<Caller> c = server->CallerOf(*ctx); c.ok()) {
      server->handover()->Discard(tokens, c->uid);
    }
  }
  return status;
}

}  // namespace ckpt::rpc_internal
