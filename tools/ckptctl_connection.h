// The connection of one ckptctl run to ckptd's ckpt.v1.Admin service over its
// Unix socket: unary calls under the run's deadline, retried while ckptd is
// there but busy, and a failed call's status printed and turned into the
// exit code. One per run (ckptctl.cc makes it; repair makes none);
// single-threaded.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "tools/ckptctl_args.h"

namespace ckpt::ctl {

class AdminConnection {
 public:
  // A channel to "unix:" + o.socket; nothing connects before the first call.
  // REQUIRES: `o` outlives the connection.
  explicit AdminConnection(const Options& o);

  AdminConnection(const AdminConnection&) = delete;
  AdminConnection& operator=(const AdminConnection&) = delete;

  // Runs one unary Admin call (`fn`, a v1::Admin::Stub method) with the
  // run's deadline; returns kExitOk, or the exit code after Report().
  // A call that could not connect is tried again, until the deadline, while
  // ckptd is there but busy: its listen queue full for a moment (another
  // user connecting faster than ckptd accepts), or this connection closed at
  // once for a connection cap. A socket nobody listens on fails at once.
  template <typename Req, typename Reply, typename Fn>
  int Call(Fn fn, const Req& req, Reply* reply) const {
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(o_.timeout_seconds * 1e6));
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline);
      const grpc::Status s = (stub_.get()->*fn)(&ctx, req, reply);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE || !DaemonListening() ||
          std::chrono::system_clock::now() + pause >= deadline) {
        return Report(s);
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
    }
  }

  // Prints a failed call's status on stderr; returns kExitOk for an OK
  // status, kExitUnreachable when ckptd could not be reached (UNAVAILABLE,
  // or DEADLINE_EXCEEDED before a connection was made), else
  // kExitDaemonError.
  int Report(const grpc::Status& s) const;

  // For the streaming calls (export), which set their own deadline.
  v1::Admin::Stub* stub() const { return stub_.get(); }

 private:
  // True when something listens on the socket, even with a full queue
  // (a non-blocking connect then fails with EAGAIN).
  bool DaemonListening() const;

  const Options& o_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> stub_;
};

}  // namespace ckpt::ctl
