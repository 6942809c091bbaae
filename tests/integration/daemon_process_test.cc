// DaemonProcess, the tests' ckptd child: it must not outlive a test that
// dies without running its destructors.
#include "tests/integration/daemon_process.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace ckpt::testing {
namespace {

TEST(DaemonProcessTest, ACkptdGoesWithTheTestThatStartedIt) {
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  const std::string root = MakeTempDir("ckpt-daemonproc-");
  ASSERT_FALSE(root.empty());
  // The "test": starts a ckptd, says which, and dies as an abort would,
  // without destructors.
  const pid_t test = ::fork();
  ASSERT_GE(test, 0);
  if (test == 0) {
    ::close(report[0]);
    DaemonProcess daemon(root, {});
    pid_t pid = daemon.Start() ? daemon.pid() : -1;
    (void)!::write(report[1], &pid, sizeof(pid));
    ::_exit(0);
  }
  ::close(report[1]);
  pid_t daemon = -1;
  ASSERT_EQ(::read(report[0], &daemon, sizeof(daemon)), static_cast<ssize_t>(sizeof(daemon)));
  ::close(report[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(test, &status, 0), test);
  ASSERT_GT(daemon, 0) << "ckptd did not start";

  // The ckptd is not this process's child: a pidfd tells when it is gone.
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, daemon, 0));
  bool gone = fd < 0 && errno == ESRCH;
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    gone = ::poll(&p, 1, /*timeout_ms=*/30000) == 1;
    ::close(fd);
  }
  if (!gone) ::kill(daemon, SIGKILL);  // what the harness failed to do
  EXPECT_TRUE(gone) << "ckptd " << daemon << " outlived the test that started it";
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace ckpt::testing
