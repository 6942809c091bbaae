// Tests of daemon/rpc: call admission (RpcServerOptions limits), the
// release of memory after large requests, and the accept loop (connection
// caps, back-off when out of descriptors).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/handover_wire.h"
#include "base/unique_fd.h"
#include "daemon/common/sync_point.h"
#include "daemon/rpc/server.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

RpcServerOptions Limits(int per_uid, int heavy) {
  RpcServerOptions o;
  o.max_calls_per_uid = per_uid;
  o.max_heavy_calls = heavy;
  return o;
}

constexpr absl::Duration kWait = absl::Seconds(20);

// A raw client of the gRPC socket: connects, sends the HTTP/2 preface and an
// empty SETTINGS frame, and reads what comes back. gRPC answers a connection
// it serves with its own SETTINGS (bytes); a connection the accept loop
// closed reads end-of-file or a reset (0).
UniqueFd ConnectRaw(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid() || !ConnectUnix(fd.get(), path).ok()) return UniqueFd();
  struct timeval tv = {static_cast<time_t>(absl::ToInt64Seconds(kWait)), 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// -1: error or timeout; 0: closed by the server; >0: served by gRPC.
ssize_t Exchange(int fd) {
  static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  static const char kSettings[9] = {0, 0, 0, 4, 0, 0, 0, 0, 0};
  ::send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL);  // fails once closed: fine
  ::send(fd, kSettings, sizeof(kSettings), MSG_NOSIGNAL);
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  // Closed with our bytes unread: a unix socket reports a reset.
  return n < 0 && errno == ECONNRESET ? 0 : n;
}

// The accept loop's sync points are observed (arrival counts only; no point
// blocks).
class AcceptLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
    sp_->StartTest(kWait);
  }
  void TearDown() override {
    if (!kSyncPointsCompiled) return;
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
    EXPECT_EQ(sp_->timeouts(), 0u);
    sp_->EndTest();
  }

  std::string Path() const { return tmp_.path() + "/ckptd.sock"; }
  RpcServerOptions Options() const {
    RpcServerOptions o;
    o.socket_path = Path();
    return o;
  }
  void StartServer(const RpcServerOptions& o) {
    server_ = std::make_unique<RpcServer>(o, nullptr, nullptr);
    CKPT_ASSERT_OK(server_->Start());
    // Lets another uid reach the socket (the test's temp dir is 0700).
    ASSERT_EQ(::chmod(tmp_.path().c_str(), 0711), 0);
    ASSERT_EQ(::chmod(Path().c_str(), 0666), 0);
  }
  bool WaitForPasses(const char* point, uint64_t n) {
    return sp_->WaitForPasses(point, n, absl::Now() + kWait);
  }
  // Waits until the server counts `n` open connections (gRPC closes the
  // descriptor of an ended connection on its own threads).
  bool WaitForOpen(size_t n) {
    const absl::Time deadline = absl::Now() + kWait;
    while (server_->connection_stats().open != n) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  testing::TempDir tmp_;
  SyncPoint* sp_ = SyncPoint::GetInstance();
  std::unique_ptr<RpcServer> server_;
};

// Defined first: it forks, and the gRPC server it runs lives only in the
// child.
TEST_F(AcceptLoopTest, BacksOffWhenOutOfDescriptors) {
  if (testing::kSanitizerBuild)
    GTEST_SKIP() << "the sanitizer must be able to open its report file";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(60);
    auto fail = [](int code, const char* what) {
      std::fprintf(stderr, "child: %s\n", what);
      std::fflush(stderr);
      ::_exit(code);
    };
    std::vector<absl::Duration> pauses;
    absl::Mutex mu;
    sp_->SetCallBack("RpcServer::AcceptBackoff", [&](void* arg) {
      absl::MutexLock lock(&mu);
      pauses.push_back(*static_cast<absl::Duration*>(arg));
    });
    RpcServerOptions o = Options();
    o.accept_backoff = absl::Milliseconds(20);
    RpcServer server(o, nullptr, nullptr);
    if (!server.Start().ok()) fail(10, "start");
    UniqueFd client(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    testing::ExhaustedDescriptors exhausted;
    if (!exhausted.error().empty()) fail(12, exhausted.error().c_str());
    if (!ConnectUnix(client.get(), o.socket_path).ok()) fail(14, "connect");
    // Three pauses in a row, each twice the one before.
    if (!sp_->WaitForPasses("RpcServer::AcceptBackoff", 3, absl::Now() + kWait)) {
      fail(15, "no back-off: the accept loop never paused");
    }
    const uint64_t errors = server.connection_stats().accept_errors;
    {
      absl::MutexLock lock(&mu);
      if (pauses.size() < 3 || pauses[0] != absl::Milliseconds(20) ||
          pauses[1] != absl::Milliseconds(40) || pauses[2] != absl::Milliseconds(80)) {
        fail(16, "pauses are not 20, 40, 80 ms");
      }
      // One failed accept per pause: a spinning loop fails thousands of times.
      if (errors > pauses.size() + 1) fail(17, "accept failed more often than it paused");
    }
    exhausted.Release();
    struct timeval tv = {static_cast<time_t>(absl::ToInt64Seconds(kWait)), 0};
    ::setsockopt(client.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (Exchange(client.get()) <= 0)
      fail(18, "the waiting client was not served after the back-off");
    std::fprintf(stderr, "child: %zu pauses, %llu accept errors, served after\n", pauses.size(),
                 static_cast<unsigned long long>(errors));
    server.Shutdown(absl::ZeroDuration());
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);  // bounded by the child's alarm
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's message above";
}

TEST_F(AcceptLoopTest, PerUidCapClosesOnlyThatUsersNextConnection) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  RpcServerOptions o = Options();
  o.max_connections_per_uid = 3;
  StartServer(o);
  std::vector<UniqueFd> mine;
  for (int i = 0; i < 3; ++i) {
    mine.push_back(ConnectRaw(Path()));
    ASSERT_TRUE(mine.back().valid());
  }
  ASSERT_TRUE(WaitForPasses("RpcServer::Accepted", 3));
  for (const UniqueFd& c : mine) EXPECT_GT(Exchange(c.get()), 0);  // served
  // A fourth connection of uid 0 is closed at once.
  UniqueFd fourth = ConnectRaw(Path());
  ASSERT_TRUE(fourth.valid());
  EXPECT_EQ(Exchange(fourth.get()), 0) << "the connection over the cap was not closed";
  ASSERT_TRUE(WaitForPasses("RpcServer::Refused", 1));
  EXPECT_EQ(server_->connection_stats().refused, 1u);

  // Another uid is not starved.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(60);
    if (::setresgid(4242, 4242, 4242) != 0 || ::setresuid(4242, 4242, 4242) != 0) ::_exit(10);
    UniqueFd c = ConnectRaw(Path());
    if (!c.valid()) ::_exit(11);
    ::_exit(Exchange(c.get()) > 0 ? 0 : 12);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "uid 4242 was refused (12) or could not connect";
  ASSERT_TRUE(WaitForPasses("RpcServer::Accepted", 4));

  // Once one of uid 0's connections has ended, the next accept sees it gone.
  mine.erase(mine.begin());
  ASSERT_TRUE(WaitForOpen(2)) << "gRPC did not close the ended connections";
  UniqueFd again = ConnectRaw(Path());
  ASSERT_TRUE(again.valid());
  EXPECT_GT(Exchange(again.get()), 0) << "a slot freed by a closed connection was not reused";
  ASSERT_TRUE(WaitForPasses("RpcServer::Accepted", 5));
  const RpcServer::ConnectionStats stats = server_->connection_stats();
  EXPECT_EQ(stats.refused, 1u);
  EXPECT_EQ(stats.open, 3u);
}

TEST_F(AcceptLoopTest, NodeWideCapClosesTheNextConnection) {
  RpcServerOptions o = Options();
  o.max_connections = 2;
  StartServer(o);
  UniqueFd a = ConnectRaw(Path());
  UniqueFd b = ConnectRaw(Path());
  ASSERT_TRUE(a.valid() && b.valid());
  ASSERT_TRUE(WaitForPasses("RpcServer::Accepted", 2));
  UniqueFd c = ConnectRaw(Path());
  ASSERT_TRUE(c.valid());
  EXPECT_EQ(Exchange(c.get()), 0) << "the connection over max_connections was not closed";
  EXPECT_GT(Exchange(a.get()), 0);  // the first two are served
  EXPECT_EQ(server_->connection_stats().refused, 1u);
}

TEST(CallLimitsTest, PerUidCapLeavesOtherUsersAlone) {
  RpcServer server(Limits(3, 2), nullptr, nullptr);
  for (int i = 0; i < 3; ++i) CKPT_EXPECT_OK(server.EnterCall(1000, false));
  absl::Status s = server.EnterCall(1000, false);
  CKPT_EXPECT_CODE(s, kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("max_calls_per_uid"), std::string::npos) << s;
  CKPT_EXPECT_OK(server.EnterCall(1001, false));  // another user is not starved
  server.LeaveCall(1000, false);
  CKPT_EXPECT_OK(server.EnterCall(1000, false));  // a slot came back
}

TEST(CallLimitsTest, HeavyCallsAreCappedNodeWide) {
  RpcServer server(Limits(10, 2), nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(1000, true));
  CKPT_EXPECT_OK(server.EnterCall(1001, true));
  CKPT_EXPECT_CODE(server.EnterCall(1002, true), kResourceExhausted);
  CKPT_EXPECT_OK(server.EnterCall(1002, false));  // ordinary calls still pass
  server.LeaveCall(1000, true);
  CKPT_EXPECT_OK(server.EnterCall(1002, true));
}

TEST(CallLimitsTest, RefusedCallsTakeNoSlot) {
  RpcServer server(Limits(1, 1), nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(7, true));
  for (int i = 0; i < 10; ++i) CKPT_EXPECT_CODE(server.EnterCall(7, true), kResourceExhausted);
  server.LeaveCall(7, true);
  CKPT_EXPECT_OK(server.EnterCall(7, true));
}

TEST(CallLimitsTest, LargeRegisterCallsAreCappedNodeWide) {
  RpcServerOptions o = Limits(10, 2);
  o.max_large_calls = 2;
  RpcServer server(o, nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(1000, false, true));
  CKPT_EXPECT_OK(server.EnterCall(1001, false, true));
  absl::Status s = server.EnterCall(1002, false, true);
  CKPT_EXPECT_CODE(s, kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("max_large_calls"), std::string::npos) << s;
  CKPT_EXPECT_OK(server.EnterCall(1002, false, false));  // small calls still pass
  server.LeaveCall(1000, false, true);
  CKPT_EXPECT_OK(server.EnterCall(1002, false, true));  // a slot came back
}

TEST(MemoryReleaseTest, ReleasesWhenTheLastLargeRequestOfABurstFinishes) {
  RpcServer server(RpcServerOptions(), nullptr, nullptr);
  int a, b, c, small;
  server.NoteLargeRequest(&a);
  server.NoteLargeRequest(&b);
  EXPECT_FALSE(server.FinishCall(&small));  // not noted: nothing to release
  EXPECT_FALSE(server.FinishCall(&a));      // b still holds its request
  server.NoteLargeRequest(&c);
  EXPECT_FALSE(server.FinishCall(&b));
  EXPECT_EQ(server.memory_releases(), 0u);
  EXPECT_TRUE(server.FinishCall(&c));  // the last one of the burst
  EXPECT_EQ(server.memory_releases(), 1u);
  EXPECT_FALSE(server.FinishCall(&c));  // finished once only
  server.NoteLargeRequest(&a);
  EXPECT_TRUE(server.FinishCall(&a));
  EXPECT_EQ(server.memory_releases(), 2u);
}

}  // namespace
}  // namespace ckpt
