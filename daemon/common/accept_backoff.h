// AcceptBackoff: what an accept loop does when accept() fails for lack of
// descriptors or memory.
//
// Retrying at once would spin: the listening socket stays readable while its
// backlog holds the connection that could not be accepted. Instead the loop
// stops accepting for a pause that starts at `first` and doubles on each
// failure in a row up to one second (or `first`, if longer); a successful
// accept resets it. Failures are reported at most once per ten seconds, with
// the count of those not reported. Each pause passes the sync point named at
// construction with a pointer to the pause (absl::Duration) as its argument.
//
// Thread-safety: none; owned by the one thread that runs the accept loop.
#pragma once

#include <cstdint>

#include "absl/time/time.h"

namespace ckpt {

// Decides when a recurring event is logged again: at most once per interval.
class LogRateLimit {
 public:
  explicit LogRateLimit(absl::Duration interval = absl::Seconds(10)) : interval_(interval) {}
  // Counts one event at `now`; true when it is to be logged, and then
  // `*suppressed` is how many events were not logged since the last one.
  bool Due(absl::Time now, uint64_t* suppressed);

 private:
  const absl::Duration interval_;
  absl::Time next_ = absl::InfinitePast();
  uint64_t unlogged_ = 0;
};

class AcceptBackoff {
 public:
  // `sync_point` must outlive the object (a string literal).
  AcceptBackoff(absl::Duration first, const char* sync_point);

  // Whether accept() failed for want of a descriptor or memory (EMFILE,
  // ENFILE, ENOBUFS, ENOMEM): the failures that start a pause.
  static bool OutOfResources(int err);

  // Whether the loop may accept at `now` (no pause running).
  bool Accepting(absl::Time now) const { return now >= resume_; }
  // When the current pause ends (the past when none runs).
  absl::Time resume_at() const { return resume_; }

  struct Pause {
    absl::Duration length;  // no accept before now + length
    bool log = false;       // report this failure (rate-limited)
    uint64_t unlogged = 0;  // failures not reported since the last report
  };
  // accept() failed with an OutOfResources error at `now`: starts a pause,
  // doubles the next one, and passes the sync point.
  Pause Fail(absl::Time now);
  // accept() succeeded: the next pause is `first` again.
  void Reset() { next_ = first_; }

 private:
  const absl::Duration first_;
  const absl::Duration max_;
  const char* const sync_point_;
  absl::Duration next_;
  absl::Time resume_ = absl::InfinitePast();
  LogRateLimit log_;
};

}  // namespace ckpt
