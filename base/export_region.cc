#include "base/export_region.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ckpt {
namespace {

// The ack word: the first four bytes of the control page. A shared
// (not FUTEX_PRIVATE) futex, as the two sides are two processes.
uint32_t* AckWord(const void* region) { return static_cast<uint32_t*>(const_cast<void*>(region)); }

}  // namespace

uint32_t ExportAcks(const void* region) {
  return __atomic_load_n(AckWord(region), __ATOMIC_ACQUIRE);
}

void BumpExportAck(void* region) {
  __atomic_fetch_add(AckWord(region), 1, __ATOMIC_RELEASE);
  ::syscall(SYS_futex, AckWord(region), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

absl::Status WaitForExportAck(const void* region, uint32_t want, absl::Time deadline,
                              absl::Duration slice, const std::function<bool()>& reader_there) {
  absl::Time next_probe = absl::Now() + slice;
  for (;;) {
    const uint32_t seen = ExportAcks(region);
    // Counted modulo 2^32 like the word; a reader that wrote a larger
    // number lets the next batch in at once (its own loss).
    if (static_cast<int32_t>(seen - want) >= 0) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the reader took ", seen, " of ", want,
                       " batches of the export from its region before the deadline"));
    }
    if (now >= next_probe) {
      if (!reader_there()) return absl::CancelledError("the reader went away");
      next_probe = now + slice;
    }
    const timespec wait = absl::ToTimespec(std::min(next_probe, deadline) - now);
    // Returns at once when the word moved since it was read (EAGAIN): a
    // reader that keeps moving it below `want` gets a millisecond's pause
    // each time, not a spinning thread.
    const long r = ::syscall(SYS_futex, AckWord(region), FUTEX_WAIT, seen, &wait, nullptr, 0);
    if (r != 0 && errno == EAGAIN) absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace ckpt
