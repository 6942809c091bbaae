// The service-manager side of ckptd: readiness, status, stopping and watchdog
// notifications (the sd_notify protocol), implemented here without libsystemd.
//
// Protocol: when $NOTIFY_SOCKET is set, each notification is one datagram of
// newline-separated `KEY=value` assignments sent to that AF_UNIX address (a
// path, or an abstract name written with a leading '@'). The watchdog is on
// when $WATCHDOG_USEC is a positive number and $WATCHDOG_PID is unset or names
// this process. Without $NOTIFY_SOCKET every call is a no-op, so ckptd run by
// hand or by the tests behaves as before.
//
// The environment is read on every call and never modified. Failures to send
// are logged (once per process) and otherwise ignored: the service manager's
// own timeouts handle a daemon that cannot reach it.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace ckpt {

// Sends `state` (e.g. "READY=1\nSTATUS=...") to $NOTIFY_SOCKET. OK and nothing
// sent when the variable is unset or empty; INVALID_ARGUMENT for an address
// that is neither a path nor '@'-abstract, or too long; otherwise the errno
// of socket/sendto.
absl::Status SendServiceNotification(absl::string_view state);

// READY=1 plus STATUS=`status`.
void NotifyReady(const std::string& status);
// STOPPING=1: the daemon has begun shutting down.
void NotifyStopping();
// STATUS=`status` (shown by `systemctl status`).
void NotifyStatus(const std::string& status);
// WATCHDOG=1: the daemon is alive.
void NotifyWatchdog();

// The watchdog timeout the service manager expects pings within; zero when
// the watchdog is off or meant for another process.
absl::Duration WatchdogInterval();

// Pings the watchdog every `interval / 2` from its own thread, as long as
// `probe` returns true (a probe that blocks or returns false stops the pings,
// and the service manager then restarts the daemon). Does nothing when
// `interval` is zero. Stop() (or the destructor) ends the thread.
class WatchdogPinger {
 public:
  WatchdogPinger(absl::Duration interval, std::function<bool()> probe);
  ~WatchdogPinger();
  WatchdogPinger(const WatchdogPinger&) = delete;
  WatchdogPinger& operator=(const WatchdogPinger&) = delete;

  bool running() const { return thread_.joinable(); }
  void Stop();

 private:
  void Run();

  const absl::Duration period_;
  const std::function<bool()> probe_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace ckpt
