// Tests of daemon/common: job id validation, errno mapping and Unix sockets.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/common/unix_socket.h"
#include "daemon/common/validate.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::PathExists;
using ::ckpt::testing::ReadFile;
using ::ckpt::testing::TempDir;
using ::ckpt::testing::WriteFile;

// ---- ValidateJobId ----

TEST(ValidateJobIdTest, AcceptsGoodIds) {
  for (const std::string& id :
       {std::string("job"), std::string("a"), std::string("Job-01_x.y"), std::string("..."),
        std::string(".hidden"), std::string("0123456789"), std::string("-_."),
        std::string(kMaxJobIdLength, 'x')}) {
    CKPT_EXPECT_OK(ValidateJobId(id)) << "id '" << id << "'";
  }
}

TEST(ValidateJobIdTest, RejectsBadIds) {
  const std::string bad[] = {
      "",
      ".",
      "..",
      "a/b",
      "../x",
      std::string("a\0b", 3),
      std::string(kMaxJobIdLength + 1, 'x'),
      "j\xc3\xb6"
      "b",  // "jöb" in UTF-8
      "a b",
      "job\n",
      "/abs",
      "a\\b",
  };
  for (const std::string& id : bad) {
    CKPT_EXPECT_CODE(ValidateJobId(id), kInvalidArgument) << "id of " << id.size() << " bytes";
  }
}

TEST(ValidateJobIdTest, MessageNamesOffendingByte) {
  absl::Status s = ValidateJobId("ab/c");
  CKPT_ASSERT_CODE(s, kInvalidArgument);
  EXPECT_NE(s.message().find("0x2f"), absl::string_view::npos) << s;
}

// ---- ErrnoStatus ----

TEST(ErrnoStatusTest, MapsErrnoToCodes) {
  struct Case {
    int err;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {EDQUOT, absl::StatusCode::kResourceExhausted},
      {ENOENT, absl::StatusCode::kNotFound},
      {EEXIST, absl::StatusCode::kAlreadyExists},
      {EINVAL, absl::StatusCode::kInvalidArgument},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied},
      {EAGAIN, absl::StatusCode::kUnavailable},
      {EINTR, absl::StatusCode::kUnavailable},
      {EIO, absl::StatusCode::kInternal},
      {EBADF, absl::StatusCode::kInternal},
  };
  for (const Case& c : cases) {
    absl::Status s = ErrnoStatus(c.err, "op");
    EXPECT_EQ(s.code(), c.code) << "errno " << c.err << ": " << s;
  }
}

TEST(ErrnoStatusTest, MessageNamesOperationAndError) {
  absl::Status s = ErrnoStatus(ENOENT, "open /x/y");
  EXPECT_NE(s.message().find("open /x/y"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(std::strerror(ENOENT)), absl::string_view::npos) << s;
}

// ---- UniqueFd ----

TEST(UniqueFdTest, ClosesOnDestructionAndMoves) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[1]);
  {
    UniqueFd a(fds[0]);
    UniqueFd b(std::move(a));
    EXPECT_FALSE(a.valid());
    EXPECT_EQ(b.get(), fds[0]);
  }
  EXPECT_EQ(::fcntl(fds[0], F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

// ---- Unix sockets ----

class UnixSocketTest : public ::testing::Test {
 protected:
  std::string SockPath() const { return dir_.Join("s.sock"); }

  // Connects to `path`; returns the connected fd or -1.
  static UniqueFd Connect(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return UniqueFd();
    }
    return fd;
  }

  // Leaves a socket file at `path` with nobody listening.
  static void MakeStaleSocket(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
  }

  TempDir dir_;
};

TEST_F(UnixSocketTest, CreatesSocketWithMode0660) {
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, ListenUnixSocket(SockPath(), 0660));
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  UniqueFd client = Connect(SockPath());
  EXPECT_TRUE(client.valid());
}

TEST_F(UnixSocketTest, HonoursOtherModes) {
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, ListenUnixSocket(SockPath(), 0600));
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(UnixSocketTest, ReplacesStaleSocket) {
  MakeStaleSocket(SockPath());
  ASSERT_FALSE(Connect(SockPath()).valid()) << "nobody should listen on the stale socket";
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, ListenUnixSocket(SockPath(), 0660));
  EXPECT_TRUE(Connect(SockPath()).valid());
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
}

TEST_F(UnixSocketTest, RefusesRegularFileAndLeavesIt) {
  WriteFile(SockPath(), "precious");
  CKPT_EXPECT_CODE(ListenUnixSocket(SockPath(), 0660), kFailedPrecondition);
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(ReadFile(SockPath()), "precious");
}

TEST_F(UnixSocketTest, RefusesSymlinkAndLeavesIt) {
  const std::string target = dir_.Join("target");
  WriteFile(target, "target data");
  ASSERT_EQ(::symlink(target.c_str(), SockPath().c_str()), 0);
  CKPT_EXPECT_CODE(ListenUnixSocket(SockPath(), 0660), kFailedPrecondition);
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  char buf[256] = {};
  ASSERT_GT(::readlink(SockPath().c_str(), buf, sizeof(buf) - 1), 0);
  EXPECT_EQ(std::string(buf), target);
  EXPECT_EQ(ReadFile(target), "target data");
}

TEST_F(UnixSocketTest, RefusesSymlinkToStaleSocket) {
  const std::string target = dir_.Join("real.sock");
  MakeStaleSocket(target);
  ASSERT_EQ(::symlink(target.c_str(), SockPath().c_str()), 0);
  CKPT_EXPECT_CODE(ListenUnixSocket(SockPath(), 0660), kFailedPrecondition);
  struct stat st;
  ASSERT_EQ(::lstat(SockPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(::lstat(target.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
}

TEST_F(UnixSocketTest, RefusesDirectory) {
  ASSERT_EQ(::mkdir(SockPath().c_str(), 0700), 0);
  CKPT_EXPECT_CODE(ListenUnixSocket(SockPath(), 0660), kFailedPrecondition);
  EXPECT_TRUE(PathExists(SockPath()));
}

TEST_F(UnixSocketTest, SocketDirectoryMustBeOwnedAndNotWritableByOthers) {
  const std::string d = dir_.Join("run");
  auto check = [&d]() {
    UniqueFd fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    return CheckSocketDirectory(fd.get(), d);
  };
  ASSERT_EQ(::mkdir(d.c_str(), 0750), 0);
  CKPT_EXPECT_OK(check());
  for (mode_t loose : {0770, 0757, 0777, 01777}) {
    ASSERT_EQ(::chmod(d.c_str(), loose), 0);
    absl::Status s = check();
    CKPT_EXPECT_CODE(s, kFailedPrecondition);
    EXPECT_NE(std::string(s.message()).find("writable by group or others"), std::string::npos) << s;
  }
  ASSERT_EQ(::chmod(d.c_str(), 0750), 0);
  if (::geteuid() == 0) {  // another owner can only be set up as root
    ASSERT_EQ(::chown(d.c_str(), 4242, 4242), 0);
    absl::Status s = check();
    CKPT_EXPECT_CODE(s, kFailedPrecondition);
    EXPECT_NE(std::string(s.message()).find("belongs to uid 4242"), std::string::npos) << s;
  }
}

TEST_F(UnixSocketTest, RejectsEmptyAndOverlongPaths) {
  CKPT_EXPECT_CODE(ListenUnixSocket("", 0660), kInvalidArgument);
  CKPT_EXPECT_CODE(ListenUnixSocket(dir_.Join(std::string(200, 'x')), 0660), kInvalidArgument);
}

TEST_F(UnixSocketTest, PeerCredOfAcceptedConnection) {
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd listener, ListenUnixSocket(SockPath(), 0660));
  UniqueFd client = Connect(SockPath());
  ASSERT_TRUE(client.valid());
  UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(conn.valid()) << std::strerror(errno);
  CKPT_ASSERT_OK_AND_ASSIGN(PeerCred cred, GetPeerCred(conn.get()));
  EXPECT_EQ(cred.uid, ::getuid());
  EXPECT_EQ(cred.gid, ::getgid());
  EXPECT_EQ(cred.pid, ::getpid());
}

TEST(PeerCredTest, SocketpairReportsThisProcess) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]);
  UniqueFd b(sv[1]);
  for (int fd : {a.get(), b.get()}) {
    CKPT_ASSERT_OK_AND_ASSIGN(PeerCred cred, GetPeerCred(fd));
    EXPECT_EQ(cred.uid, ::getuid());
    EXPECT_EQ(cred.gid, ::getgid());
    EXPECT_EQ(cred.pid, ::getpid());
  }
}

TEST(PeerCredTest, FailsOnNonSocket) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  UniqueFd r(fds[0]);
  UniqueFd w(fds[1]);
  EXPECT_FALSE(GetPeerCred(r.get()).ok());
  EXPECT_FALSE(GetPeerCred(-1).ok());
}

}  // namespace
}  // namespace ckpt
