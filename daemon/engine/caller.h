// Who is calling the engine, and the errors every stage returns alike.
//
// A Caller's uid and pid come from SO_PEERCRED (daemon/rpc), never from a
// request field. Used by every engine stage and tier; depends on nothing of
// the engine.
#pragma once

#include <sys/types.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/status.h"

namespace ckpt {

struct Caller {
  uid_t uid = 0;
  pid_t pid = 0;
};

inline bool IsRoot(const Caller& c) { return c.uid == 0; }

// Every call refused because ckptd is stopping carries kShuttingDown, which
// the client treats as the loss of the daemon.
inline absl::Status ShuttingDownError() {
  return WithReason(absl::UnavailableError("ckptd is shutting down"), ErrorReason::kShuttingDown);
}

// A wait that ended because its registration ended: ABORTED, and
// kShuttingDown when ckptd is stopping.
inline absl::Status RegistrationEndedError(bool stopping, absl::string_view what) {
  absl::Status s = absl::AbortedError(what);
  return stopping ? WithReason(std::move(s), ErrorReason::kShuttingDown) : s;
}

}  // namespace ckpt
