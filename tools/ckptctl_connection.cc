// ckptctl's connection to ckptd (ckptctl_connection.h).
#include "tools/ckptctl_connection.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tools/ckptctl_output.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {

AdminConnection::AdminConnection(const Options& o)
    : o_(o),
      channel_(grpc::CreateChannel("unix:" + o.socket, grpc::InsecureChannelCredentials())),
      stub_(v1::Admin::NewStub(channel_)) {}

bool AdminConnection::DaemonListening() const {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (o_.socket.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, o_.socket.data(), o_.socket.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  return rc == 0 || err == EAGAIN;
}

int AdminConnection::Report(const grpc::Status& s) const {
  if (s.ok()) return kExitOk;
  const bool unreachable = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                            channel_->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY);
  if (unreachable) {
    std::fprintf(stderr, "ckptctl: cannot reach ckptd at %s: %s: %s\n",
                 TerminalSafe(o_.socket).c_str(), CodeName(s.error_code()),
                 TerminalSafe(s.error_message()).c_str());
    return kExitUnreachable;
  }
  std::fprintf(stderr, "ckptctl: %s: %s\n", CodeName(s.error_code()),
               TerminalSafe(s.error_message()).c_str());
  return kExitDaemonError;
}

}  // namespace ckpt::ctl
