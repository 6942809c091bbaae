// Tests of daemon/shm: memfd regions, the fd-passing wire helpers and the
// HandoverServer.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/handover_wire.h"
#include "base/region.h"
#include "base/unique_fd.h"
#include "daemon/common/sync_point.h"
#include "daemon/shm/handover.h"
#include "daemon/shm/rank_memory.h"
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

// HostMemory::CopyIn streams whole 16-byte blocks past a head copied
// plainly: every alignment of source and destination, and every length
// around the block sizes, copies exactly those bytes and touches nothing
// beside them.
TEST(HostMemoryTest, CopyInCopiesExactlyTheBytesAtAnyAlignment) {
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion region, MemfdRegion::Create("t", 4 * kPage));
  CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion mapped, MappedRegion::Map(Dup(region.fd())));
  std::vector<MappedRegion> regions;
  regions.push_back(std::move(mapped));
  HostMemory memory(std::move(regions));
  char* base = memory.base(0);
  const std::string src = ::ckpt::testing::RandomBytes(3, 3 * kPage);
  for (uint64_t dst_off : {0, 1, 15, 16, 17, 63}) {
    for (uint64_t src_off : {0, 3, 16}) {
      for (uint64_t n : {0, 1, 15, 16, 17, 63, 64, 65, 127, 200, 4096, 2 * 4096 + 77}) {
        std::memset(base, 0x5a, memory.region_size(0));
        CKPT_ASSERT_OK(memory.CopyIn(base + 64 + dst_off, src.data() + src_off, n));
        ASSERT_EQ(std::memcmp(base + 64 + dst_off, src.data() + src_off, n), 0)
            << dst_off << " " << src_off << " " << n;
        for (uint64_t i = 0; i < 64 + dst_off; ++i) ASSERT_EQ(base[i], 0x5a) << i;
        for (uint64_t i = 64 + dst_off + n; i < 64 + dst_off + n + 64; ++i) {
          ASSERT_EQ(base[i], 0x5a) << i;
        }
      }
    }
  }
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

// A sealed memfd of huge pages is a file of hugetlbfs, not shared memory:
// once its pool ran out, a page ckptd touched in a hole its owner punched
// would fault with SIGBUS, which ends ckptd for every user.
TEST(MappedRegionTest, RefusesAHugetlbMemfd) {
  UniqueFd fd(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB));
  if (!fd.valid()) GTEST_SKIP() << "no hugetlbfs memfd here: " << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(2 << 20)), 0);
  ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  const absl::StatusOr<MappedRegion> mapped = MappedRegion::Map(std::move(fd));
  CKPT_EXPECT_CODE(mapped.status(), kInvalidArgument);
  EXPECT_NE(mapped.status().message().find("tmpfs"), std::string::npos) << mapped.status();
}

// An export's window (MemfdRegion open to seals) is sealed against holes by
// ckptd: punching one, or a new writable mapping, is refused from then on,
// while the mappings made before stay writable. Only a span without holes
// is locked. A region closed to seals cannot be sealed.
TEST(MappedRegionTest, SealsAgainstHolesOnlyARegionOpenToSeals) {
  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion open,
                            MemfdRegion::Create("open", 4 * kPage, /*open_to_seals=*/true));
  CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion mapped, MappedRegion::Map(Dup(open.fd())));
  EXPECT_FALSE(mapped.LockWhole(open.size())) << "no page allocated yet";
  std::memset(open.data(), 1, 2 * kPage);
  EXPECT_TRUE(mapped.LockWhole(2 * kPage)) << "the span written is whole";
  EXPECT_FALSE(mapped.LockWhole(open.size())) << "a hole past it";
  std::memset(open.data(), 1, open.size());
  CKPT_ASSERT_OK(mapped.SealAgainstHoles());
  EXPECT_NE(::fallocate(open.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, kPage), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::madvise(open.data(), kPage, MADV_REMOVE), 0);
  mapped.data()[kPage] = 7;
  EXPECT_EQ(static_cast<char*>(open.data())[kPage], 7) << "both old mappings stay writable";
  EXPECT_TRUE(mapped.LockWhole(open.size()));
  // Sealed against writes, a region cannot be mapped writable: refused for
  // what it is, not as a failed mmap.
  CKPT_EXPECT_CODE(MappedRegion::Map(Dup(open.fd())), kInvalidArgument);

  CKPT_ASSERT_OK_AND_ASSIGN(MemfdRegion closed, MemfdRegion::Create("closed", kPage));
  CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion closed_mapped, MappedRegion::Map(Dup(closed.fd())));
  EXPECT_FALSE(closed_mapped.SealAgainstHoles().ok());
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
    HandoverOptions o = TestOptions();
    o.token_ttl = ttl;
    o.max_pending = max_pending;
    StartServerWith(o);
  }

  HandoverOptions TestOptions() {
    HandoverOptions o;
    o.socket_path = Path();
    o.connection_deadline = absl::Seconds(5);
    o.token_ttl = absl::Seconds(60);
    o.clock = &clock_;
    // /dev/null stands in for the NVIDIA driver's device: CUDA page
    // descriptors in these tests are its files.
    o.cuda_device_file = "/dev/null";
    return o;
  }

  // A descriptor of the stand-in device, as a CUDA page export is.
  static UniqueFd DevicePage() { return UniqueFd(::open("/dev/null", O_RDWR | O_CLOEXEC)); }

  void StartServerWith(const HandoverOptions& o) {
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
    EXPECT_TRUE(::ckpt::testing::IsOk(ConnectUnix(fd.get(), Path())));
    EXPECT_TRUE(::ckpt::testing::IsOk(SetSocketTimeout(fd.get(), absl::Seconds(5))));
    return fd;
  }

  // Sends `header` with `fds` by hand and returns the server's reply.
  HandoverReply RawHandover(const HandoverHeader& header, const std::vector<int>& fds) {
    UniqueFd sock = Connect();
    EXPECT_TRUE(::ckpt::testing::IsOk(SendWithFds(sock.get(), &header, sizeof(header), fds)));
    HandoverReply reply;
    std::memset(&reply, 0, sizeof(reply));
    EXPECT_TRUE(::ckpt::testing::IsOk(RecvWithFds(sock.get(), &reply, sizeof(reply), nullptr, 0)));
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

  CKPT_ASSERT_OK_AND_ASSIGN(HandoverClaim claim, server_->Claim(token, ::getuid()));
  std::vector<UniqueFd>& fds = claim.fds();
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

// CUDA page descriptors are their own kind: two descriptors of one file
// pass (exported pages are files of the driver's one device), a token of
// one kind is not claimed as the other, and one registration's tokens
// absorbed into one claim stay counted until it goes.
TEST_F(HandoverServerTest, CudaPageDescriptorsAreTheirOwnKind) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  UniqueFd page = DevicePage();
  ASSERT_TRUE(page.valid());
  UniqueFd dup = Dup(page.get());
  const std::vector<int> fds = {page.get(), dup.get()};
  CKPT_ASSERT_OK_AND_ASSIGN(std::string pages,
                            HandOverFds(Path(), fds, absl::Seconds(5), HandoverKind::kCudaPages));
  CKPT_ASSERT_OK_AND_ASSIGN(std::string more, HandOverFds(Path(), {page.get()}, absl::Seconds(5),
                                                          HandoverKind::kCudaPages));
  CKPT_ASSERT_OK_AND_ASSIGN(std::string memfds, HandOver(regions));
  CKPT_EXPECT_CODE(server_->Claim(pages, ::getuid()), kInvalidArgument);
  CKPT_EXPECT_CODE(server_->Claim(memfds, ::getuid(), HandoverKind::kCudaPages), kInvalidArgument);
  // A token of another uid, or an unknown one, among them fails the whole
  // claim and releases what it had claimed.
  CKPT_EXPECT_CODE(server_->ClaimAll({pages}, ::getuid() + 1, HandoverKind::kCudaPages),
                   kPermissionDenied);
  CKPT_EXPECT_CODE(
      server_->ClaimAll({pages, "no such token000"}, ::getuid(), HandoverKind::kCudaPages),
      kNotFound);
  EXPECT_EQ(server_->stats().fds_held, 2u) << "the claimed first token is released";
  CKPT_ASSERT_OK_AND_ASSIGN(pages,
                            HandOverFds(Path(), fds, absl::Seconds(5), HandoverKind::kCudaPages));
  EXPECT_EQ(server_->stats().fds_held, 4u);
  {
    CKPT_ASSERT_OK_AND_ASSIGN(HandoverClaim claim, server_->ClaimAll({pages, more}, ::getuid(),
                                                                     HandoverKind::kCudaPages));
    ASSERT_EQ(claim.fds().size(), 3u);
    EXPECT_TRUE(SameFile(claim.fds()[2].get(), page.get()));
    EXPECT_EQ(server_->stats().fds_held, 4u);  // and the memfd token's one
  }
  EXPECT_EQ(server_->stats().fds_held, 1u);
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
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << reply.message;
  EXPECT_EQ(server_->pending(), 0u);
  server_->Stop();                       // joins the server thread: the connection is finished
  EXPECT_EQ(CountOpenFds(), before - 2)  // the listening socket and the loop's eventfd
      << "the server kept a refused descriptor";
}

TEST_F(HandoverServerTest, BadMagicAndZeroFdsAreInvalidArgument) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(1);
  HandoverReply reply = RawHandover(HandoverHeader{0xdeadbeef, 1}, Fds(regions));
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << reply.message;
  reply = RawHandover(HandoverHeader{kHandoverMagic, 0}, {});
  EXPECT_EQ(reply.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << reply.message;
  EXPECT_EQ(server_->pending(), 0u);
}

TEST_F(HandoverServerTest, OnlyWhatEachKindCarriesIsTaken) {
  // Host regions are memfds (regular files); CUDA pages are files of the
  // driver's device. Anything else -- a socket, a pipe, a directory, an
  // anonymous inode, an O_PATH handle, a page of the wrong kind -- is
  // refused and closed before the reply, so ckptd never holds the
  // trainer's other ends.
  StartServer();
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd sock_a(sv[0]), sock_b(sv[1]);
  int pp[2];
  ASSERT_EQ(::pipe2(pp, O_CLOEXEC | O_NONBLOCK), 0);
  UniqueFd pipe_r(pp[0]), pipe_w(pp[1]);
  TempDir dir;
  UniqueFd dir_fd(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dir_fd.valid());
  WriteFile(dir.path() + "/f", "x");
  UniqueFd path_fd(::open((dir.path() + "/f").c_str(), O_PATH | O_CLOEXEC));
  ASSERT_TRUE(path_fd.valid());
  UniqueFd event_fd(::eventfd(0, EFD_CLOEXEC));
  ASSERT_TRUE(event_fd.valid());
  UniqueFd page = DevicePage();
  ASSERT_TRUE(page.valid());
  std::vector<MemfdRegion> regions = MakeRegions(1);
  struct Case {
    HandoverKind kind;
    int good;  // a descriptor the kind carries, sent first
    int bad;
    const char* what;
  };
  std::vector<Case> cases;
  for (HandoverKind kind : {HandoverKind::kMemfdRegions, HandoverKind::kCudaPages}) {
    const int good = kind == HandoverKind::kMemfdRegions ? regions[0].fd() : page.get();
    cases.push_back({kind, good, sock_a.get(), "a socket"});
    cases.push_back({kind, good, pipe_w.get(), "a pipe"});
    cases.push_back({kind, good, dir_fd.get(), "a directory"});
    cases.push_back({kind, good, path_fd.get(), "an O_PATH handle"});
    cases.push_back({kind, good, event_fd.get(), "an anonymous inode"});
  }
  cases.push_back({HandoverKind::kCudaPages, page.get(), regions[0].fd(), "a regular file"});
  cases.push_back({HandoverKind::kMemfdRegions, regions[0].fd(), page.get(), "a character device"});
  // A character device of another driver (the pty master's major is not
  // /dev/null's), when this machine lets the test open one.
  UniqueFd pty(::open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC));
  if (pty.valid()) {
    cases.push_back({HandoverKind::kCudaPages, page.get(), pty.get(), "not the NVIDIA driver's"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(
        c.what, c.kind == HandoverKind::kCudaPages ? " as a CUDA page" : " as a memfd region"));
    absl::StatusOr<std::string> token =
        HandOverFds(Path(), {c.good, c.bad}, absl::Seconds(5), c.kind);
    CKPT_EXPECT_CODE(token.status(), kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(token.status().message(), c.what)) << token.status().message();
    EXPECT_EQ(server_->stats().fds_held, 0u);
  }
  // The pipe's write end was never kept: its read end sees EOF at once
  // (EAGAIN if ckptd still held it).
  pipe_w = UniqueFd();
  char byte;
  EXPECT_EQ(::read(pipe_r.get(), &byte, 1), 0);
  // What each kind carries still goes through.
  CKPT_EXPECT_OK(HandOverFds(Path(), {page.get()}, absl::Seconds(5), HandoverKind::kCudaPages));
  CKPT_EXPECT_OK(HandOver(regions));
}

TEST_F(HandoverServerTest, WithoutTheDriversDeviceNoCudaPageIsTaken) {
  HandoverOptions o = TestOptions();
  o.cuda_device_file = tmp_.Join("no-such-device");
  StartServerWith(o);
  UniqueFd page = DevicePage();
  absl::StatusOr<std::string> token =
      HandOverFds(Path(), {page.get()}, absl::Seconds(5), HandoverKind::kCudaPages);
  CKPT_EXPECT_CODE(token.status(), kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(token.status().message(), "sees no NVIDIA driver device"))
      << token.status().message();
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
  EXPECT_EQ(CountOpenFds(), before - 2)
      << "descriptors, the listening socket and the loop's eventfd are closed";
  EXPECT_EQ(server_->pending(), 0u);
  CKPT_EXPECT_CODE(HandOver(regions), kUnavailable);
}

// ---- HandoverServer: one user cannot exhaust the socket or ckptd's fds ----

constexpr uid_t kUserA = 4242;  // no account needed: the kernel only sees numbers
constexpr absl::Duration kWait = absl::Seconds(20);

// A forked child that runs `body` as another uid (the test runs as root).
// The child reports numbers to the parent (Report/Read) and can hold what it
// opened until the parent releases it (WaitForRelease/Release). Every wait
// on either side has a deadline; the destructor releases and reaps the child.
class ChildAs {
 public:
  ChildAs(uid_t uid, const std::function<void(ChildAs&)>& body) {
    int report[2], release[2];
    if (::pipe2(report, O_CLOEXEC) != 0 || ::pipe2(release, O_CLOEXEC) != 0) return;
    report_r_ = UniqueFd(report[0]);
    report_w_ = UniqueFd(report[1]);
    release_r_ = UniqueFd(release[0]);
    release_w_ = UniqueFd(release[1]);
    pid_ = ::fork();
    if (pid_ == 0) {
      report_r_ = UniqueFd();
      release_w_ = UniqueFd();
      ::alarm(60);  // never outlives a stuck test
      if (::setgroups(0, nullptr) != 0 || ::setresgid(uid, uid, uid) != 0 ||
          ::setresuid(uid, uid, uid) != 0) {
        ::_exit(3);
      }
      body(*this);
      ::_exit(0);
    }
    report_w_ = UniqueFd();
    release_r_ = UniqueFd();
  }
  ~ChildAs() {
    Release();
    int status = 0;
    if (pid_ > 0) ::waitpid(pid_, &status, 0);  // bounded by the child's alarm
  }

  bool started() const { return pid_ > 0; }

  // Parent: the next number the child reported, false after `timeout`.
  bool Read(uint32_t* v, absl::Duration timeout = kWait) {
    struct pollfd p = {report_r_.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return false;
    return ::read(report_r_.get(), v, sizeof(*v)) == sizeof(*v);
  }
  void Release() { release_w_ = UniqueFd(); }

  // Child.
  void Report(uint32_t v) {
    if (::write(report_w_.get(), &v, sizeof(v)) != sizeof(v)) ::_exit(4);
  }
  void WaitForRelease() {
    struct pollfd p = {release_r_.get(), POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kWait)));
  }

 private:
  pid_t pid_ = -1;
  UniqueFd report_r_, report_w_, release_r_, release_w_;
};

// A raw connection to `path`, or an invalid fd.
UniqueFd ConnectTo(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!ConnectUnix(fd.get(), path).ok()) return UniqueFd();
  if (!SetSocketTimeout(fd.get(), kWait).ok()) return UniqueFd();
  return fd;
}

// The reply the server sends on `sock` (code 0xffffffff when none came).
HandoverReply ReadReply(int sock) {
  HandoverReply reply;
  std::memset(&reply, 0, sizeof(reply));
  if (!RecvWithFds(sock, &reply, sizeof(reply), nullptr, 0).ok()) reply.code = 0xffffffffu;
  reply.message[sizeof(reply.message) - 1] = '\0';
  return reply;
}

uint32_t CodeOf(const absl::Status& s) { return static_cast<uint32_t>(s.code()); }

// The server's sync points are observed by these tests (arrival counts only;
// no point blocks).
class HandoverLimitsTest : public HandoverServerTest {
 protected:
  void SetUp() override {
    if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS: no sync points";
    sp_->StartTest(kWait);
  }
  void TearDown() override {
    if (!kSyncPointsCompiled) return;
    if (server_ != nullptr) server_->Stop();
    EXPECT_EQ(sp_->timeouts(), 0u);
    sp_->EndTest();
  }

  // Lets another uid reach the socket (the test's temp dir is 0700).
  void OpenSocketToEveryone() {
    ASSERT_EQ(::chmod(tmp_.path().c_str(), 0711), 0);
    ASSERT_EQ(::chmod(Path().c_str(), 0666), 0);
  }

  bool WaitForPasses(const char* point, uint64_t n) {
    return sp_->WaitForPasses(point, n, absl::Now() + kWait);
  }

  SyncPoint* sp_ = SyncPoint::GetInstance();
};

// Three idle connections of one uid (the inline server waited on each for its
// socket timeout) do not delay another uid's handover, and a uid's
// connections beyond its cap are refused at once.
TEST_F(HandoverLimitsTest, IdleConnectionsOfOneUidDoNotDelayAnother) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as a second uid";
  HandoverOptions o = TestOptions();
  o.connection_deadline = absl::Seconds(60);  // far beyond the handover's own timeout
  o.max_connections_per_uid = 3;
  StartServerWith(o);
  OpenSocketToEveryone();

  const std::string path = Path();
  ChildAs idle(kUserA, [&path](ChildAs& self) {
    std::vector<UniqueFd> held;
    for (int i = 0; i < 3; ++i) held.push_back(ConnectTo(path));
    uint32_t connected = 0;
    for (const UniqueFd& fd : held) connected += fd.valid() ? 1 : 0;
    self.Report(connected);
    // A fourth connection is over the cap: answered at once, not left hanging.
    UniqueFd extra = ConnectTo(path);
    self.Report(extra.valid() ? ReadReply(extra.get()).code : 0xfffffffeu);
    self.WaitForRelease();
  });
  ASSERT_TRUE(idle.started());
  uint32_t connected = 0, extra_code = 0;
  ASSERT_TRUE(idle.Read(&connected));
  EXPECT_EQ(connected, 3u);
  ASSERT_TRUE(idle.Read(&extra_code));
  EXPECT_EQ(extra_code, CodeOf(absl::ResourceExhaustedError("")));
  ASSERT_TRUE(WaitForPasses("HandoverServer::Accepted", 3));
  EXPECT_EQ(server_->stats().connections, 3u);

  // root's handover goes through while uid 4242's three connections sit idle.
  std::vector<MemfdRegion> regions = MakeRegions(2);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> token = HandOverFds(Path(), Fds(regions), absl::Seconds(3));
  CKPT_ASSERT_OK(token);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ASSERT_TRUE(WaitForPasses("HandoverServer::ConnectionClosed", 1));  // root's, once answered
  EXPECT_EQ(server_->stats().connections, 3u) << "the idle connections are still open";
  CKPT_EXPECT_OK(server_->Claim(*token, ::getuid()));
}

// A connection that never completes its message is answered
// DEADLINE_EXCEEDED at its deadline and closed.
TEST_F(HandoverLimitsTest, IdleConnectionIsRefusedAtItsDeadline) {
  HandoverOptions o = TestOptions();
  o.connection_deadline = absl::Milliseconds(100);
  StartServerWith(o);
  UniqueFd idle = ConnectTo(Path());
  ASSERT_TRUE(idle.valid());
  HandoverReply reply = ReadReply(idle.get());  // the server's answer is the event
  EXPECT_EQ(reply.code, CodeOf(absl::DeadlineExceededError(""))) << reply.message;
  ASSERT_TRUE(WaitForPasses("HandoverServer::ConnectionClosed", 1));
  EXPECT_EQ(server_->stats().connections, 0u);
}

// One uid at its pending-token limit is refused with a message naming the
// limit; another uid is still served (the node-wide table is far from full).
TEST_F(HandoverLimitsTest, PerUidPendingLimitLeavesOtherUidsServed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as a second uid";
  HandoverOptions o = TestOptions();
  o.max_pending = 1024;
  o.max_pending_per_uid = 2;
  StartServerWith(o);
  OpenSocketToEveryone();

  const std::string path = Path();
  ChildAs flooder(kUserA, [&path](ChildAs& self) {
    absl::StatusOr<MemfdRegion> r = MemfdRegion::Create("flood", kPage);
    if (!r.ok()) ::_exit(5);
    std::vector<int> fds = {r->fd()};
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<std::string> t = HandOverFds(path, fds, kWait);
      self.Report(CodeOf(t.status()));
      if (i == 2) {
        const bool names_limit =
            absl::StrContains(t.status().message(), "handover_max_pending_per_uid");
        self.Report(names_limit ? 1 : 0);
      }
    }
  });
  ASSERT_TRUE(flooder.started());
  uint32_t codes[3] = {99, 99, 99}, names_limit = 0;
  for (uint32_t& c : codes) ASSERT_TRUE(flooder.Read(&c));
  ASSERT_TRUE(flooder.Read(&names_limit));
  EXPECT_EQ(codes[0], 0u);
  EXPECT_EQ(codes[1], 0u);
  EXPECT_EQ(codes[2], CodeOf(absl::ResourceExhaustedError("")));
  EXPECT_EQ(names_limit, 1u) << "the refusal names the option";
  EXPECT_EQ(server_->pending(), 2u);

  // root is a different uid: served, twice, as if uid 4242 did not exist.
  std::vector<MemfdRegion> regions = MakeRegions(1);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string t1, HandOver(regions));
  CKPT_ASSERT_OK_AND_ASSIGN(std::string t2, HandOver(regions));
  EXPECT_EQ(server_->pending(), 4u);
  // A third pending token of root is refused too: the limit is per uid.
  CKPT_EXPECT_CODE(HandOver(regions), kResourceExhausted);
  CKPT_EXPECT_OK(server_->Claim(t1, ::getuid()));
  CKPT_EXPECT_OK(HandOver(regions));
}

// One memfd listed kMaxHandoverFds times in one message is refused, and
// ckptd keeps none of the received descriptors.
TEST_F(HandoverLimitsTest, DuplicateDescriptorsAreRefusedWithoutLeak) {
  StartServer();
  std::vector<MemfdRegion> regions = MakeRegions(2);
  UniqueFd dup = Dup(regions[0].fd());  // another descriptor of region 0
  const std::vector<std::vector<int>> messages = {
      std::vector<int>(kMaxHandoverFds, regions[0].fd()),
      {regions[0].fd(), regions[1].fd(), dup.get()},
  };
  uint64_t closed = 0;
  for (const std::vector<int>& fds : messages) {
    const size_t before = CountOpenFds();
    HandoverReply reply =
        RawHandover(HandoverHeader{kHandoverMagic, static_cast<uint32_t>(fds.size())}, fds);
    EXPECT_EQ(reply.code, CodeOf(absl::InvalidArgumentError(""))) << reply.message;
    EXPECT_TRUE(absl::StrContains(reply.message, "region")) << reply.message;
    ASSERT_TRUE(WaitForPasses("HandoverServer::ConnectionClosed", ++closed));
    EXPECT_EQ(CountOpenFds(), before) << fds.size() << " descriptors sent: the server kept some";
    EXPECT_EQ(server_->pending(), 0u);
    EXPECT_EQ(server_->stats().fds_held, 0u);
  }
  // Distinct regions still pass.
  CKPT_EXPECT_OK(HandOver(regions));
}

// Descriptors count against their uid from handover until the claim is
// released (the registration ran); beyond the cap a handover is refused.
TEST_F(HandoverLimitsTest, PerUidDescriptorCapCountsPendingAndClaimed) {
  HandoverOptions o = TestOptions();
  o.max_fds_per_uid = 4;
  o.max_fds = 1000;
  StartServerWith(o);
  std::vector<MemfdRegion> three = MakeRegions(3);
  std::vector<MemfdRegion> two = MakeRegions(2);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(three));
  EXPECT_EQ(server_->stats().fds_held, 3u);
  absl::StatusOr<std::string> refused = HandOver(two);
  CKPT_EXPECT_CODE(refused, kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "handover_max_fds_per_uid"))
      << refused.status();
  {
    CKPT_ASSERT_OK_AND_ASSIGN(HandoverClaim claim, server_->Claim(token, ::getuid()));
    EXPECT_EQ(server_->pending(), 0u);
    EXPECT_EQ(server_->stats().fds_held, 3u) << "claimed, not yet registered: still held";
    CKPT_EXPECT_CODE(HandOver(two), kResourceExhausted);
    std::vector<UniqueFd> taken = claim.TakeFds();  // what Register does with them
    EXPECT_EQ(taken.size(), 3u);
  }
  EXPECT_EQ(server_->stats().fds_held, 0u);
  CKPT_EXPECT_OK(HandOver(two));
  EXPECT_EQ(server_->stats().fds_held, 2u);
}

// A registration keeps its claim with its memory (HostMemory holds it as a
// Holding): its descriptors stay counted against the uid's cap until the
// memory is released, so live registrations cannot go past the cap (65 of
// 250 memfds each once took ckptd to its RLIMIT_NOFILE).
TEST_F(HandoverLimitsTest, LiveRegistrationsKeepTheirDescriptorsCounted) {
  HandoverOptions o = TestOptions();
  o.max_fds_per_uid = 4;
  o.max_fds = 1000;
  StartServerWith(o);
  std::vector<MemfdRegion> three = MakeRegions(3);
  std::vector<MemfdRegion> two = MakeRegions(2);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(three));
  std::unique_ptr<HostMemory> memory;
  {
    CKPT_ASSERT_OK_AND_ASSIGN(HandoverClaim claim, server_->Claim(token, ::getuid()));
    std::vector<MappedRegion> regions;
    for (UniqueFd& fd : claim.TakeFds()) {
      CKPT_ASSERT_OK_AND_ASSIGN(MappedRegion r, MappedRegion::Map(std::move(fd)));
      regions.push_back(std::move(r));
    }
    memory = std::make_unique<HostMemory>(std::move(regions),
                                          std::make_unique<HandoverClaim>(std::move(claim)));
  }
  EXPECT_EQ(server_->stats().fds_held, 3u) << "registered: still held";
  absl::StatusOr<std::string> refused = HandOver(two);
  CKPT_EXPECT_CODE(refused, kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "handover_max_fds_per_uid"))
      << refused.status();
  memory.reset();  // the trainer exited, or the rank unregistered
  EXPECT_EQ(server_->stats().fds_held, 0u);
  CKPT_EXPECT_OK(HandOver(two));
}

// The node-wide cap holds across uids and is derived from RLIMIT_NOFILE
// when not set.
TEST_F(HandoverLimitsTest, NodeDescriptorCapRefusesBeyondIt) {
  EXPECT_EQ(HandoverServer::DefaultMaxFds(65536, 4096), 61440u);
  EXPECT_EQ(HandoverServer::DefaultMaxFds(1024, 4096), 512u);
  EXPECT_EQ(HandoverServer::DefaultMaxFds(1024, 512), 512u);
  // Each held descriptor is a mapping too: vm.max_map_count bounds the cap.
  EXPECT_EQ(HandoverServer::DefaultMaxFds(1 << 20, 4096, 65530, 8192), 57338u);
  EXPECT_EQ(HandoverServer::DefaultMaxFds(65536, 4096, 1 << 20, 8192), 61440u);
  EXPECT_EQ(HandoverServer::DefaultMaxFds(65536, 4096, 0, 8192), 61440u);
  {
    HandoverOptions o = TestOptions();
    o.max_fds = 0;
    StartServerWith(o);
    struct rlimit rl;
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
    uint64_t max_map_count = 0;
    std::ifstream("/proc/sys/vm/max_map_count") >> max_map_count;
    EXPECT_EQ(
        server_->stats().max_fds,
        HandoverServer::DefaultMaxFds(rl.rlim_cur, o.fd_reserve, max_map_count, o.map_reserve));
    server_.reset();
  }
  HandoverOptions o = TestOptions();
  o.max_fds = 4;
  o.max_fds_per_uid = 100;
  StartServerWith(o);
  std::vector<MemfdRegion> three = MakeRegions(3);
  std::vector<MemfdRegion> two = MakeRegions(2);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string token, HandOver(three));
  absl::StatusOr<std::string> refused = HandOver(two);
  CKPT_EXPECT_CODE(refused, kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "handover_max_fds"))
      << refused.status();
  CKPT_EXPECT_OK(HandOver(MakeRegions(1)));           // exactly at the cap
  CKPT_EXPECT_OK(server_->Claim(token, ::getuid()));  // claimed and released at once
  CKPT_EXPECT_OK(HandOver(two));
}

// Out of descriptors, the accept loop pauses (doubling) instead of spinning
// on the readable listening socket, and serves the waiting client once
// descriptors are free again. Runs in a child whose RLIMIT_NOFILE is lowered.
TEST_F(HandoverLimitsTest, AcceptBacksOffWhenOutOfDescriptors) {
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
    sp_->SetCallBack("HandoverServer::AcceptBackoff", [&](void* arg) {
      absl::MutexLock lock(&mu);
      pauses.push_back(*static_cast<absl::Duration*>(arg));
    });
    HandoverOptions o = TestOptions();
    o.accept_backoff = absl::Milliseconds(20);
    o.max_fds = 100;
    HandoverServer server(o);
    if (!server.Start().ok()) fail(10, "start");
    absl::StatusOr<MemfdRegion> region = MemfdRegion::Create("emfile", kPage);
    if (!region.ok()) fail(11, "memfd");
    UniqueFd client(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    testing::ExhaustedDescriptors exhausted;
    if (!exhausted.error().empty()) fail(12, exhausted.error().c_str());
    if (!ConnectUnix(client.get(), o.socket_path).ok()) fail(14, "connect");
    // Three pauses in a row, each twice the one before.
    if (!sp_->WaitForPasses("HandoverServer::AcceptBackoff", 3, absl::Now() + kWait)) {
      fail(15, "no back-off: the accept loop never paused");
    }
    const uint64_t errors = server.stats().accept_errors;
    {
      absl::MutexLock lock(&mu);
      if (pauses.size() < 3 || pauses[0] != absl::Milliseconds(20) ||
          pauses[1] != absl::Milliseconds(40) || pauses[2] != absl::Milliseconds(80)) {
        fail(16, "pauses are not 20, 40, 80 ms");
      }
      // One failed accept per pause: over ~60 ms of EMFILE, a spinning loop
      // would have failed thousands of times.
      if (errors > pauses.size() + 1) fail(17, "accept failed more often than it paused");
    }
    exhausted.Release();
    HandoverHeader h{kHandoverMagic, 1};
    std::vector<int> fds = {region->fd()};
    if (!SetSocketTimeout(client.get(), kWait).ok()) fail(18, "timeout");
    if (!SendWithFds(client.get(), &h, sizeof(h), fds).ok()) fail(19, "send");
    HandoverReply reply = ReadReply(client.get());
    if (reply.code != 0) fail(20, "the waiting client was not served after the back-off");
    std::fprintf(stderr, "child: %zu pauses, %llu accept errors, served after\n", pauses.size(),
                 static_cast<unsigned long long>(errors));
    server.Stop();
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);  // bounded by the child's alarm
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's message above";
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
