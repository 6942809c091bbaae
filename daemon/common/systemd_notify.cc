#include "daemon/common/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/unique_fd.h"

namespace ckpt {
namespace {

// Fills `addr` from a $NOTIFY_SOCKET value; returns the address length.
absl::StatusOr<socklen_t> NotifyAddress(absl::string_view name, struct sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const size_t base = offsetof(struct sockaddr_un, sun_path);
  if (name.size() >= 2 && name[0] == '@') {
    // Abstract namespace: a leading NUL, then the name (not NUL-terminated).
    if (name.size() > sizeof(addr->sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET '", name, "' is too long"));
    }
    std::memcpy(addr->sun_path + 1, name.data() + 1, name.size() - 1);
    return static_cast<socklen_t>(base + name.size());
  }
  if (!name.empty() && name[0] == '/') {
    if (name.size() >= sizeof(addr->sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET '", name, "' is too long"));
    }
    std::memcpy(addr->sun_path, name.data(), name.size());
    return static_cast<socklen_t>(base + name.size() + 1);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("NOTIFY_SOCKET '", name, "' is neither a path nor an @abstract name"));
}

// Logs a failed notification once per process; later failures are silent
// (the watchdog would otherwise log every few seconds).
void Notify(absl::string_view state) {
  static std::atomic<bool> logged{false};
  absl::Status s = SendServiceNotification(state);
  if (!s.ok() && !logged.exchange(true)) {
    CKPT_LOG(WARNING) << "service manager notification failed (further failures not logged): " << s;
  }
}

}  // namespace

absl::Status SendServiceNotification(absl::string_view state) {
  const char* name = std::getenv("NOTIFY_SOCKET");
  if (name == nullptr || name[0] == '\0') return absl::OkStatus();
  struct sockaddr_un addr;
  CKPT_ASSIGN_OR_RETURN(socklen_t addr_len, NotifyAddress(name, &addr));
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus(errno, "notify socket");
  ssize_t n;
  do {
    n = ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
                 reinterpret_cast<const struct sockaddr*>(&addr), addr_len);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, absl::StrCat("send to NOTIFY_SOCKET ", name));
  if (static_cast<size_t>(n) != state.size()) {
    return absl::InternalError(absl::StrCat("short send to NOTIFY_SOCKET ", name));
  }
  return absl::OkStatus();
}

void NotifyReady(const std::string& status) { Notify(absl::StrCat("READY=1\nSTATUS=", status)); }

void NotifyStopping() { Notify("STOPPING=1\nSTATUS=shutting down"); }

void NotifyStatus(const std::string& status) { Notify(absl::StrCat("STATUS=", status)); }

void NotifyWatchdog() { Notify("WATCHDOG=1"); }

absl::Duration WatchdogInterval() {
  const char* usec_text = std::getenv("WATCHDOG_USEC");
  uint64_t usec = 0;
  if (usec_text == nullptr || !absl::SimpleAtoi(usec_text, &usec) || usec == 0) {
    return absl::ZeroDuration();
  }
  if (const char* pid_text = std::getenv("WATCHDOG_PID"); pid_text != nullptr) {
    int64_t pid = 0;
    if (!absl::SimpleAtoi(pid_text, &pid) || pid != static_cast<int64_t>(::getpid())) {
      return absl::ZeroDuration();
    }
  }
  return absl::Microseconds(static_cast<int64_t>(usec));
}

WatchdogPinger::WatchdogPinger(absl::Duration interval, std::function<bool()> probe)
    : period_(interval / 2), probe_(std::move(probe)) {
  if (interval > absl::ZeroDuration()) thread_ = std::thread([this] { Run(); });
}

WatchdogPinger::~WatchdogPinger() { Stop(); }

void WatchdogPinger::Stop() {
  if (!thread_.joinable()) return;
  if (!stop_.HasBeenNotified()) stop_.Notify();
  thread_.join();
}

void WatchdogPinger::Run() {
  bool healthy = true;
  do {
    const bool ok = !probe_ || probe_();
    if (ok) {
      NotifyWatchdog();
    } else if (healthy) {
      CKPT_LOG(ERROR) << "health probe failed: no longer pinging the service manager's watchdog";
    }
    healthy = ok;
  } while (!stop_.WaitForNotificationWithTimeout(period_));
}

}  // namespace ckpt
