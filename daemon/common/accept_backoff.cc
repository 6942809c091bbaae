#include "daemon/common/accept_backoff.h"

#include <algorithm>
#include <cerrno>

#include "daemon/common/sync_point.h"

namespace ckpt {

bool LogRateLimit::Due(absl::Time now, uint64_t* suppressed) {
  if (now < next_) {
    ++unlogged_;
    return false;
  }
  *suppressed = unlogged_;
  unlogged_ = 0;
  next_ = now + interval_;
  return true;
}

AcceptBackoff::AcceptBackoff(absl::Duration first, const char* sync_point)
    : first_(first),
      max_(std::max(absl::Seconds(1), first)),
      sync_point_(sync_point),
      next_(first) {}

bool AcceptBackoff::OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

AcceptBackoff::Pause AcceptBackoff::Fail(absl::Time now) {
  Pause p;
  p.length = next_;
  resume_ = now + p.length;
  next_ = std::min(next_ * 2, max_);
  p.log = log_.Due(now, &p.unlogged);
  static_cast<void>(sync_point_);  // unused when sync points are compiled out
  CKPT_SYNC_POINT_CALLBACK(sync_point_, &p.length);
  return p;
}

}  // namespace ckpt
