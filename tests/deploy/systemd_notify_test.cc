// Tests of daemon/common/systemd_notify: the sd_notify datagrams ckptd sends
// to a test-bound AF_UNIX socket (path and abstract names), the watchdog
// environment, and the watchdog pinger thread.
#include "daemon/common/systemd_notify.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::TempDir;

// A datagram socket bound at `name` (a path, or '@' + an abstract name) that
// plays the service manager.
class FakeManager {
 public:
  explicit FakeManager(const std::string& name) {
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    socklen_t len;
    if (name[0] == '@') {
      std::memcpy(addr.sun_path + 1, name.data() + 1, name.size() - 1);
      len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + name.size());
    } else {
      std::memcpy(addr.sun_path, name.data(), name.size());
      len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + name.size() + 1);
    }
    bound_ = fd_.valid() && ::bind(fd_.get(), reinterpret_cast<struct sockaddr*>(&addr), len) == 0;
  }

  bool bound() const { return bound_; }

  // The next datagram, or nullopt after `timeout`.
  std::optional<std::string> Receive(absl::Duration timeout = absl::Seconds(5)) {
    struct timeval tv = absl::ToTimeval(timeout);
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[4096];
    ssize_t n;
    do {
      n = ::recv(fd_.get(), buf, sizeof(buf), 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return std::nullopt;
    return std::string(buf, static_cast<size_t>(n));
  }

 private:
  UniqueFd fd_;
  bool bound_ = false;
};

// Saves and restores the variables the tests set.
class SystemdNotifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (size_t i = 0; i < kNumVars; ++i) {
      const char* v = std::getenv(kVars[i]);
      if (v != nullptr) saved_[i] = v;
      ::unsetenv(kVars[i]);
    }
  }
  void TearDown() override {
    for (size_t i = 0; i < kNumVars; ++i) {
      if (saved_[i].has_value()) {
        ::setenv(kVars[i], saved_[i]->c_str(), 1);
      } else {
        ::unsetenv(kVars[i]);
      }
    }
  }

  static std::string AbstractName() {
    static std::atomic<int> counter{0};
    return absl::StrCat("@ckpt-notify-test-", ::getpid(), "-", counter.fetch_add(1));
  }

  TempDir dir_;

 private:
  static constexpr size_t kNumVars = 3;
  static constexpr const char* kVars[kNumVars] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};
  std::optional<std::string> saved_[kNumVars];
};

TEST_F(SystemdNotifyTest, ReadySendsReadyAndStatusToPathSocket) {
  const std::string path = dir_.Join("notify");
  FakeManager manager(path);
  ASSERT_TRUE(manager.bound());
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  NotifyReady("serving on /run/ckptd/ckptd.sock");
  std::optional<std::string> msg = manager.Receive();
  ASSERT_TRUE(msg.has_value());
  EXPECT_EQ(*msg, "READY=1\nSTATUS=serving on /run/ckptd/ckptd.sock");
}

TEST_F(SystemdNotifyTest, ReadySendsToAbstractSocket) {
  const std::string name = AbstractName();
  FakeManager manager(name);
  ASSERT_TRUE(manager.bound());
  ::setenv("NOTIFY_SOCKET", name.c_str(), 1);
  NotifyReady("up");
  std::optional<std::string> msg = manager.Receive();
  ASSERT_TRUE(msg.has_value());
  EXPECT_TRUE(absl::StrContains(*msg, "READY=1")) << *msg;
  EXPECT_TRUE(absl::StrContains(*msg, "STATUS=up")) << *msg;
}

TEST_F(SystemdNotifyTest, StoppingStatusAndWatchdogMessages) {
  const std::string name = AbstractName();
  FakeManager manager(name);
  ASSERT_TRUE(manager.bound());
  ::setenv("NOTIFY_SOCKET", name.c_str(), 1);
  NotifyStatus("3 ranks registered");
  NotifyWatchdog();
  NotifyStopping();
  EXPECT_EQ(manager.Receive().value_or("<none>"), "STATUS=3 ranks registered");
  EXPECT_EQ(manager.Receive().value_or("<none>"), "WATCHDOG=1");
  std::string stopping = manager.Receive().value_or("<none>");
  EXPECT_TRUE(absl::StartsWith(stopping, "STOPPING=1")) << stopping;
}

TEST_F(SystemdNotifyTest, UnsetSocketIsANoOp) {
  CKPT_EXPECT_OK(SendServiceNotification("READY=1"));
  ::setenv("NOTIFY_SOCKET", "", 1);
  CKPT_EXPECT_OK(SendServiceNotification("READY=1"));
  NotifyReady("nobody listens");
  NotifyStopping();
  NotifyWatchdog();
}

TEST_F(SystemdNotifyTest, BadAddressesAreErrors) {
  ::setenv("NOTIFY_SOCKET", "relative/path", 1);
  CKPT_EXPECT_CODE(SendServiceNotification("READY=1"), kInvalidArgument);
  ::setenv("NOTIFY_SOCKET", "@", 1);
  CKPT_EXPECT_CODE(SendServiceNotification("READY=1"), kInvalidArgument);
  ::setenv("NOTIFY_SOCKET", ("/" + std::string(200, 'x')).c_str(), 1);
  CKPT_EXPECT_CODE(SendServiceNotification("READY=1"), kInvalidArgument);
  ::setenv("NOTIFY_SOCKET", dir_.Join("nobody-bound-this").c_str(), 1);
  EXPECT_FALSE(SendServiceNotification("READY=1").ok());
  NotifyReady("errors are logged, not fatal");
}

TEST_F(SystemdNotifyTest, WatchdogIntervalForThisProcess) {
  EXPECT_EQ(WatchdogInterval(), absl::ZeroDuration());
  ::setenv("WATCHDOG_USEC", "2000000", 1);
  EXPECT_EQ(WatchdogInterval(), absl::Seconds(2));  // WATCHDOG_PID unset: ours
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  EXPECT_EQ(WatchdogInterval(), absl::Seconds(2));
}

TEST_F(SystemdNotifyTest, WatchdogIntervalForAnotherProcessIsZero) {
  ::setenv("WATCHDOG_USEC", "2000000", 1);
  ::setenv("WATCHDOG_PID", std::to_string(::getpid() + 1).c_str(), 1);
  EXPECT_EQ(WatchdogInterval(), absl::ZeroDuration());
  ::setenv("WATCHDOG_PID", "not-a-pid", 1);
  EXPECT_EQ(WatchdogInterval(), absl::ZeroDuration());
}

TEST_F(SystemdNotifyTest, WatchdogIntervalRejectsBadValues) {
  for (const char* usec : {"0", "", "-5", "12abc", "soon"}) {
    ::setenv("WATCHDOG_USEC", usec, 1);
    EXPECT_EQ(WatchdogInterval(), absl::ZeroDuration()) << "WATCHDOG_USEC=" << usec;
  }
}

TEST_F(SystemdNotifyTest, PingerPingsWhileHealthyAndStops) {
  const std::string name = AbstractName();
  FakeManager manager(name);
  ASSERT_TRUE(manager.bound());
  ::setenv("NOTIFY_SOCKET", name.c_str(), 1);
  std::atomic<int> probes{0};
  WatchdogPinger pinger(absl::Milliseconds(100), [&probes] {
    probes.fetch_add(1);
    return true;
  });
  ASSERT_TRUE(pinger.running());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(manager.Receive().value_or("<none>"), "WATCHDOG=1") << "ping " << i;
  }
  const absl::Time stop_start = absl::Now();
  pinger.Stop();
  EXPECT_LT(absl::Now() - stop_start, absl::Seconds(1));
  EXPECT_FALSE(pinger.running());
  EXPECT_GE(probes.load(), 3);
  // Drain what was sent before Stop(); then nothing more arrives.
  while (manager.Receive(absl::Milliseconds(200)).has_value()) {
  }
  EXPECT_FALSE(manager.Receive(absl::Milliseconds(300)).has_value());
}

TEST_F(SystemdNotifyTest, PingerSilentWhenProbeFails) {
  const std::string name = AbstractName();
  FakeManager manager(name);
  ASSERT_TRUE(manager.bound());
  ::setenv("NOTIFY_SOCKET", name.c_str(), 1);
  WatchdogPinger pinger(absl::Milliseconds(50), [] { return false; });
  EXPECT_FALSE(manager.Receive(absl::Milliseconds(300)).has_value());
}

TEST_F(SystemdNotifyTest, PingerOffWithoutWatchdog) {
  WatchdogPinger pinger(absl::ZeroDuration(), [] { return true; });
  EXPECT_FALSE(pinger.running());
  pinger.Stop();
}

}  // namespace
}  // namespace ckpt
