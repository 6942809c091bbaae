// Tests of daemon/shm: memfd regions, the fd-passing wire helpers and the
// HandoverServer.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/shm/handover.h"
#include "base/handover_wire.h"
#include "base/region.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::testing::CountOpenFds;
using ::ckpt::testing::TempDir;
using ::ckpt::testing::WriteFile;

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

UniqueFd Dup(int fd) { return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

// Same open file (inode) behind both descriptors.
bool SameFile(int a, int b) {
  struct stat sa, sb;
  if (::fstat(a, &sa) != 0 || ::fstat(b, &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// ---- MemfdRegion / MappedRegion ----

TEST(MemfdRegionTest, RoundsUpToPageSizeAndSeals) {
  for (uint64_t want : {uint64_t{1}, kPage - 1, kPage, kPage + 1, 3 * kPage + 17}) {
    CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion r, MemfdRegion::Create("t", want));
    EXPECT_EQ(r.size(), (want + kPage - 1) / kPage * kPage) << want;
    ASSERT_NE(r.data(), nullptr);
    struct stat st;
    ASSERT_EQ(::fstat(r.fd(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), r.size());
    int seals = ::fcntl(r.fd(), F_GET_SEALS);
    ASSERT_GE(seals, 0);
    EXPECT_NE(seals & F_SEAL_SHRINK, 0);
    EXPECT_NE(seals & F_SEAL_GROW, 0);
    EXPECT_NE(::ftruncate(r.fd(), 0), 0) << "a sealed region must not shrink";
    EXPECT_NE(::ftruncate(r.fd(), static_cast<off_t>(r.size() * 2)), 0);
    // The mapping is writable over its whole size.
    std::memset(r.data(), 0x5A, r.size());
  }
}

TEST(MemfdRegionTest, RejectsZeroAndHugeSizes) {
  CKPT_EXPECT_CODE(MemfdRegion::Create("t", 0), kInvalidArgument);
  CKPT_EXPECT_CODE(MemfdRegion::Create("t", kMaxRegionBytes + 1), kInvalidArgument);
}

TEST(MemfdRegionTest, MoveTransfersOwnership) {
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion a, MemfdRegion::Create("t", kPage));
  std::memcpy(a.data(), "moved", 6);
  void* data = a.data();
  MemfdRegion b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.fd(), -1);
  MemfdRegion c;
  c = std::move(b);
  EXPECT_STREQ(static_cast<char*>(c.data()), "moved");
}

TEST(MappedRegionTest, SharesMemoryWithTheMemfd) {
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion region, MemfdRegion::Create("t", 2 * kPage));
  CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion mapped, MappedRegion::Map(Dup(region.fd())));
  ASSERT_EQ(mapped.size(), region.size());
  ASSERT_NE(mapped.data(), static_cast<char*>(region.data()));
  std::string a = ::ckpt::testing::RandomBytes(1, region.size());
  std::memcpy(region.data(), a.data(), a.size());
  EXPECT_EQ(std::memcmp(mapped.data(), a.data(), a.size()), 0);
  std::string b = ::ckpt::testing::RandomBytes(2, region.size());
  std::memcpy(mapped.data(), b.data(), b.size());
  EXPECT_EQ(std::memcmp(region.data(), b.data(), b.size()), 0);
}

TEST(MappedRegionTest, RefusesUnsealedMemfd) {
  UniqueFd fd(::memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kPage)), 0);
  CKPT_EXPECT_CODE(MappedRegion::Map(std::move(fd)), kInvalidArgument);

  UniqueFd sealable(::memfd_create("sealable", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(sealable.valid());
  ASSERT_EQ(::ftruncate(sealable.get(), static_cast<off_t>(kPage)), 0);
  CKPT_EXPECT_CODE(MappedRegion::Map(Dup(sealable.get())), kInvalidArgument);
  // Sealed against growing only: still refused.
  ASSERT_EQ(::fcntl(sealable.get(), F_ADD_SEALS, F_SEAL_GROW), 0);
  CKPT_EXPECT_CODE(MappedRegion::Map(Dup(sealable.get())), kInvalidArgument);
  // With the shrink seal it is accepted.
  ASSERT_EQ(::fcntl(sealable.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  CKPT_EXPECT_OK(MappedRegion::Map(Dup(sealable.get())));
}

TEST(MappedRegionTest, RefusesEmptySealedMemfd) {
  UniqueFd fd(::memfd_create("empty", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  CKPT_EXPECT_CODE(MappedRegion::Map(std::move(fd)), kInvalidArgument);
}

TEST(MappedRegionTest, RefusesRegularFilePipeAndDirectory) {
  TempDir tmp;
  const std::string path = tmp.Join("regular");
  WriteFile(path, std::string(kPage, 'r'));
  UniqueFd file(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(file.valid());
  CKPT_EXPECT_CODE(MappedRegion::Map(std::move(file)), kInvalidArgument);

  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd w(p[1]);
  CKPT_EXPECT_CODE(MappedRegion::Map(UniqueFd(p[0])), kInvalidArgument);

  UniqueFd dir(::open(tmp.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dir.valid());
  CKPT_EXPECT_CODE(MappedRegion::Map(std::move(dir)), kInvalidArgument);

  EXPECT_FALSE(MappedRegion::Map(UniqueFd()).ok());
}

TEST(MappedRegionTest, RefusedDescriptorIsClosed) {
  UniqueFd fd(::memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kPage)), 0);
  const size_t before = CountOpenFds();
  CKPT_EXPECT_CODE(MappedRegion::Map(Dup(fd.get())), kInvalidArgument);
  EXPECT_EQ(CountOpenFds(), before);
}

// ---- SendWithFds / RecvWithFds ----

class WireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    a_ = UniqueFd(sv[0]);
    b_ = UniqueFd(sv[1]);
    for (int i = 0; i < 5; ++i) {
      absl::StatusOr<MemfdRegion> r = MemfdRegion::Create("w", kPage);
      ASSERT_TRUE(::ckpt::testing::IsOk(r));
      regions_.push_back(std::move(r).value());
    }
  }

  std::vector<int> RegionFds(size_t n) const {
    std::vector<int> fds;
    for (size_t i = 0; i < n; ++i) fds.push_back(regions_[i].fd());
    return fds;
  }

  UniqueFd a_, b_;
  std::vector<MemfdRegion> regions_;
};

TEST_F(WireTest, PassesDataAndDescriptors) {
  HandoverHeader out{kHandoverMagic, 3};
  CKPT_ASSERT_OK(SendWithFds(a_.get(), &out, sizeof(out), RegionFds(3)));
  HandoverHeader in{};
  std::vector<UniqueFd> fds;
  CKPT_ASSERT_OK(RecvWithFds(b_.get(), &in, sizeof(in), &fds, kMaxHandoverFds));
  EXPECT_EQ(in.magic, kHandoverMagic);
  EXPECT_EQ(in.nfds, 3u);
  ASSERT_EQ(fds.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(fds[i].get(), regions_[i].fd());
    EXPECT_TRUE(SameFile(fds[i].get(), regions_[i].fd())) << i;
    EXPECT_NE(::fcntl(fds[i].get(), F_GETFD) & FD_CLOEXEC, 0) << "received fds are CLOEXEC";
  }
  // A received region maps the sender's memory.
  std::memcpy(regions_[1].data(), "through the socket", 19);
  CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion m, MappedRegion::Map(std::move(fds[1])));
  EXPECT_STREQ(m.data(), "through the socket");
}

TEST_F(WireTest, PassesDataWithoutDescriptors) {
  const char msg[] = "no fds here";
  CKPT_ASSERT_OK(SendWithFds(a_.get(), msg, sizeof(msg), {}));
  char in[sizeof(msg)] = {};
  std::vector<UniqueFd> fds;
  CKPT_ASSERT_OK(RecvWithFds(b_.get(), in, sizeof(in), &fds, 4));
  EXPECT_STREQ(in, msg);
  EXPECT_TRUE(fds.empty());
}

TEST_F(WireTest, TooManyDescriptorsAreClosed) {
  // One more than allowed (fits the control buffer) and many more (truncated).
  for (size_t sent : {size_t{2}, size_t{5}}) {
    const size_t before = CountOpenFds();
    HandoverHeader out{kHandoverMagic, static_cast<uint32_t>(sent)};
    CKPT_ASSERT_OK(SendWithFds(a_.get(), &out, sizeof(out), RegionFds(sent)));
    HandoverHeader in{};
    std::vector<UniqueFd> fds;
    CKPT_EXPECT_CODE(RecvWithFds(b_.get(), &in, sizeof(in), &fds, 1), kInvalidArgument)
        << sent << " fds";
    EXPECT_TRUE(fds.empty());
    EXPECT_EQ(CountOpenFds(), before) << sent << " fds leaked";
  }
  // max_fds == 0 with no output vector.
  const size_t before = CountOpenFds();
  HandoverHeader out{kHandoverMagic, 1};
  CKPT_ASSERT_OK(SendWithFds(a_.get(), &out, sizeof(out), RegionFds(1)));
  HandoverHeader in{};
  CKPT_EXPECT_CODE(RecvWithFds(b_.get(), &in, sizeof(in), nullptr, 0), kInvalidArgument);
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(WireTest, ShortMessageIsRejectedWithoutLeak) {
  const size_t before = CountOpenFds();
  uint32_t half = kHandoverMagic;
  CKPT_ASSERT_OK(SendWithFds(a_.get(), &half, sizeof(half), RegionFds(2)));
  a_ = UniqueFd();  // EOF after 4 of the 8 bytes
  HandoverHeader in{};
  std::vector<UniqueFd> fds;
  CKPT_EXPECT_CODE(RecvWithFds(b_.get(), &in, sizeof(in), &fds, 4), kInvalidArgument);
  EXPECT_TRUE(fds.empty());
  EXPECT_EQ(CountOpenFds(), before - 1);  // only a_ is gone
}

TEST_F(WireTest, SendRefusesTooManyDescriptors) {
  std::vector<int> fds(kMaxHandoverFds + 1, regions_[0].fd());
  HandoverHeader out{kHandoverMagic, static_cast<uint32_t>(fds.size())};
  CKPT_EXPECT_CODE(SendWithFds(a_.get(), &out, sizeof(out), fds), kInvalidArgument);
}

TEST_F(WireTest, ReceiveTimesOut) {
  CKPT_ASSERT_OK(SetSocketTimeout(b_.get(), absl::Milliseconds(20)));
  HandoverHeader in{};
  CKPT_EXPECT_CODE(RecvWithFds(b_.get(), &in, sizeof(in), nullptr, 0), kDeadlineExceeded);
}

// ---- HandoverServer ----

class HandoverServerTest : public ::testing::Test {
 protected:
  void StartServer(absl::Duration ttl = absl::Seconds(60), size_t max_pending = 1024) {
    HandoverOptions o;
    o.socket_path = Path();
    o.io_timeout = absl::Seconds(5);
    o.token_ttl = ttl;
    o.max_pending = max_pending;
    o.clock = &clock_;
    server_ = std::make_unique<HandoverServer>(o);
    CKPT_ASSERT_OK(server_->Start());
  }

  std::string Path() const { return tmp_.Join("handover.sock"); }

  std::vector<MemfdRegion> MakeRegions(size_t n) {
    std::vector<MemfdRegion> out;
    for (size_t i = 0; i < n; ++i) {
      absl::StatusOr<MemfdRegion> r = MemfdRegion::Create("h", (i + 1) * kPage);
      EXPECT_TRUE(::ckpt::testing::IsOk(r));
      if (r.ok()) out.push_back(std::move(r).value());
    }
    return out;
  }

  static std::vector<int> Fds(const std::vector<MemfdRegion>& regions) {
    std::vector<int> fds;
    for (const MemfdRegion& r : regions) fds.push_back(r.fd());
    return fds;
  }

  absl::StatusOr<std::string> HandOver(const std::vector<MemfdRegion>& regions) {
    return HandOverFds(Path(), Fds(regions), absl::Seconds(5));
  }

  UniqueFd Connect() {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, Path().data(), Path().size());
    EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    EXPECT_TRUE(::ckpt::testing::IsOk(SetSocketTimeout(fd.get(), absl::Seconds(5))));
    return fd;
  }

  // Sends `header` with `fds` by hand and returns the server's reply.
  HandoverReply RawHandover(const HandoverHeader& header, const std::vector<int>& fds) {
    UniqueFd sock = Connect();
    EXPECT_TRUE(::ckpt::testing::IsOk(SendWithFds(sock.get(), &header, sizeof(header), fds)));
    HandoverReply reply;
    std::memset(&reply, 0, sizeof(reply));
    EXPECT_TRUE(
        ::ckpt::testing::IsOk(RecvWithFds(sock.get(), &reply, sizeof(reply), nullptr, 0)));
    return reply;
  }

  TempDir tmp_;
  SimulatedClock clock_{absl::FromUnixSeconds(1700000000)};
  std::unique_ptr<HandoverServer> server_;
};

TEST_F(HandoverServerTest, SocketHasMode0660) {
  StartServer();
  struct stat st;
  ASSERT_EQ(::lstat(Path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660u);
}

TEST_F(HandoverServerTest, RefusesRegularFileAtSocketPath) {
  WriteFile(Path(), "keep me");
  HandoverOptions o;
  o.socket_path = Path();
  HandoverServer server(o);
  CKPT_EXPECT_CODE(server.Start(), kFailedPrecondition);
  EXPECT_EQ(::ckpt::testing::ReadFile(Path()), "keep me");
}

TEST_F(HandoverServerTest, HandOverAndClaim) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(3);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(regions));
  EXPECT_EQ(token.size(), kHandoverTokenBytes);
  EXPECT_EQ(server_->pending(), 1u);

  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> fds, server_->Claim(token, ::getuid()));
  ASSERT_EQ(fds.size(), regions.size());
  EXPECT_EQ(server_->pending(), 0u);
  for (size_t i = 0; i < fds.size(); ++i) {
    EXPECT_TRUE(SameFile(fds[i].get(), regions[i].fd())) << i;
    CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion m, MappedRegion::Map(std::move(fds[i])));
    ASSERT_EQ(m.size(), regions[i].size());
    std::string bytes = ::ckpt::testing::RandomBytes(100 + i, m.size());
    std::memcpy(regions[i].data(), bytes.data(), bytes.size());
    EXPECT_EQ(std::memcmp(m.data(), bytes.data(), bytes.size()), 0) << i;
  }
  CKPT_EXPECT_CODE(server_->Claim(token, ::getuid()), kNotFound);
}

TEST_F(HandoverServerTest, TokensAreDistinct) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string t1, HandOver(regions));
  CKPT_ASSERT_OK_AND_ASSIGN(std::string t2, HandOver(regions));
  EXPECT_NE(t1, t2);
  EXPECT_EQ(server_->pending(), 2u);
  CKPT_EXPECT_OK(server_->Claim(t2, ::getuid()));
  CKPT_EXPECT_OK(server_->Claim(t1, ::getuid()));
}

TEST_F(HandoverServerTest, ClaimByAnotherUidIsDenied) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(regions));
  CKPT_EXPECT_CODE(server_->Claim(token, ::getuid() + 1), kPermissionDenied);
}

TEST_F(HandoverServerTest, UnknownTokenIsNotFound) {
  StartServer();
  CKPT_EXPECT_CODE(server_->Claim(std::string(kHandoverTokenBytes, 'x'), ::getuid()), kNotFound);
  CKPT_EXPECT_CODE(server_->Claim("", ::getuid()), kNotFound);
  std::vector<MemfdRegion> regions = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(regions));
  std::string wrong = token;
  wrong[0] = static_cast<char>(wrong[0] ^ 1);
  CKPT_EXPECT_CODE(server_->Claim(wrong, ::getuid()), kNotFound);
  CKPT_EXPECT_CODE(server_->Claim(token.substr(0, 8), ::getuid()), kNotFound);
  CKPT_EXPECT_OK(server_->Claim(token, ::getuid()));
}

TEST_F(HandoverServerTest, HeaderCountMismatchIsInvalidArgument) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  const size_t before = CountOpenFds();
  HandoverReply reply = RawHandover(HandoverHeader{kHandoverMagic, 3}, Fds(regions));
  EXPECT_EQ(reply.magic, kHandoverMagic);
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument))
      << reply.message;
  EXPECT_EQ(server_->pending(), 0u);
  server_->Stop();  // joins the server thread: the connection is finished
  EXPECT_EQ(CountOpenFds(), before - 1) << "the server kept a refused descriptor";
}

TEST_F(HandoverServerTest, BadMagicAndZeroFdsAreInvalidArgument) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  HandoverReply reply = RawHandover(HandoverHeader{0xdeadbeef, 1}, Fds(regions));
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument))
      << reply.message;
  reply = RawHandover(HandoverHeader{kHandoverMagic, 0}, {});
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument))
      << reply.message;
  EXPECT_EQ(server_->pending(), 0u);
}

TEST_F(HandoverServerTest, TokenExpires) {
  constexpr absl::Duration kTtl = absl::Seconds(120);
  StartServer(kTtl);
  std::vector<MemfdRegion> first = MakeRegions(1);
  std::vector<MemfdRegion> second = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string kept, HandOver(first));
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(second));
  // The server's clock is the test's: at the TTL the token is still valid,
  // past it gone.
  clock_.Advance(kTtl);
  CKPT_EXPECT_OK(server_->Claim(kept, ::getuid()));
  clock_.Advance(absl::Milliseconds(1));
  CKPT_EXPECT_CODE(server_->Claim(token, ::getuid()), kNotFound);
}

TEST_F(HandoverServerTest, PendingTableIsBounded) {
  StartServer(absl::Seconds(60), /*max_pending=*/1);
  std::vector<MemfdRegion> regions = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(regions));
  CKPT_EXPECT_CODE(HandOver(regions), kResourceExhausted);
  CKPT_EXPECT_OK(server_->Claim(token, ::getuid()));
  CKPT_EXPECT_OK(HandOver(regions));
}

TEST_F(HandoverServerTest, StopClosesUnclaimedDescriptors) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(2);
  const size_t before = CountOpenFds();
  CKPT_ASSERT_OK(HandOver(regions));
  EXPECT_EQ(server_->pending(), 1u);
  server_->Stop();
  server_->Stop();  // idempotent
  EXPECT_EQ(CountOpenFds(), before - 1) << "descriptors and the listening socket are closed";
  EXPECT_EQ(server_->pending(), 0u);
  CKPT_EXPECT_CODE(HandOver(regions), kUnavailable);
}

TEST(HandOverFdsTest, MissingDaemonIsUnavailable) {
  TempDir tmp;
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion r, MemfdRegion::Create("x", kPage));
  std::vector<int> fds = {r.fd()};
  CKPT_EXPECT_CODE(HandOverFds(tmp.Join("nobody.sock"), fds, absl::Seconds(1)), kUnavailable);
  CKPT_EXPECT_CODE(HandOverFds(tmp.Join("nobody.sock"), {}, absl::Seconds(1)), kInvalidArgument);
}

}  // namespace
}  // namespace ckpt
