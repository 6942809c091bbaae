// Tests of daemon/io: both IoBackend twins (one parameterized suite) and the
// default FileSystem.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/unique_fd.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "gtest/gtest.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {

namespace {

using ::ckpt::testing::BackendParamName;

using ::ckpt::testing::AlignedPtr;
using ::ckpt::testing::AllocAligned;
using ::ckpt::testing::FillRandom;
using ::ckpt::testing::PathExists;
using ::ckpt::testing::ReadFile;
using ::ckpt::testing::TempDir;
using ::ckpt::testing::WriteFile;

constexpr unsigned kQueueDepth = 4;

// A segment together with the aligned memory it points at.
struct OwnedSegment {
  AlignedPtr mem;
  IoSegment seg;
};

class IoBackendTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<IoBackend>> b = MakeIoBackend(GetParam(), kQueueDepth);
    if (GetParam() == IoBackendKind::kUring && absl::IsUnavailable(b.status())) {
      GTEST_SKIP() << "io_uring unavailable here: " << b.status();
    }
    CKPT_ASSERT_OK(b);
    io_ = std::move(b).value();
    CKPT_ASSERT_OK_AND_ASSIGN(dir_, DefaultFileSystem()->MakeDirs(tmp_.path()));
  }

  UniqueFd CreateDirect(const std::string& name) {
    bool direct_used = false;
    absl::StatusOr<UniqueFd> fd =
        DefaultFileSystem()->CreateExclusive(dir_.get(), name, /*direct=*/true, &direct_used);
    EXPECT_TRUE(::ckpt::testing::IsOk(fd));
    return fd.ok() ? std::move(fd).value() : UniqueFd();
  }

  UniqueFd OpenRead(const std::string& name) {
    bool direct_used = false;
    absl::StatusOr<UniqueFd> fd =
        DefaultFileSystem()->OpenForRead(dir_.get(), name, /*direct=*/true, &direct_used);
    EXPECT_TRUE(::ckpt::testing::IsOk(fd));
    return fd.ok() ? std::move(fd).value() : UniqueFd();
  }

  static OwnedSegment MakeSegment(std::mt19937_64* rng, uint64_t len, uint64_t offset) {
    OwnedSegment s;
    s.mem = AllocAligned(len);
    FillRandom(rng, s.mem.get(), len);
    s.seg = IoSegment{s.mem.get(), len, offset};
    return s;
  }

  static std::vector<IoSegment> Segments(const std::vector<OwnedSegment>& owned) {
    std::vector<IoSegment> out;
    for (const OwnedSegment& s : owned) out.push_back(s.seg);
    return out;
  }

  TempDir tmp_;
  UniqueFd dir_;
  std::unique_ptr<IoBackend> io_;
};

TEST_P(IoBackendTest, NameMatchesKind) {
  EXPECT_STREQ(io_->Name(), GetParam() == IoBackendKind::kUring ? "io_uring" : "pwrite");
}

TEST_P(IoBackendTest, ScatteredDirectWritesReadBack) {
  std::mt19937_64 rng(0x5eed01);
  constexpr uint64_t kSlot = 16384;
  constexpr size_t kSlots = 48;
  std::vector<size_t> order(kSlots);
  for (size_t i = 0; i < kSlots; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<OwnedSegment> written;
  for (size_t slot : order) {
    // Every third slot stays a hole; lengths 4096..16384.
    if (slot % 3 == 1) continue;
    written.push_back(MakeSegment(&rng, 4096 * (1 + rng() % 4), slot * kSlot));
  }
  {
    UniqueFd fd = CreateDirect("data");
    ASSERT_TRUE(fd.valid());
    CKPT_ASSERT_OK(io_->WriteAll(fd.get(), Segments(written)));
    CKPT_ASSERT_OK(DefaultFileSystem()->DataSync(fd.get()));
  }

  // The bytes are where the segments said, and holes are zero.
  const std::string file = ReadFile(tmp_.Join("data"));
  uint64_t end = 0;
  for (const OwnedSegment& s : written) end = std::max(end, s.seg.offset + s.seg.len);
  ASSERT_EQ(file.size(), end);
  std::string expected(end, '\0');
  for (const OwnedSegment& s : written) {
    std::memcpy(expected.data() + s.seg.offset, s.seg.buf, s.seg.len);
  }
  EXPECT_TRUE(file == expected) << "file content differs from the written segments";

  // ReadAll through the backend, in another order and into other buffers.
  std::vector<OwnedSegment> read;
  for (auto it = written.rbegin(); it != written.rend(); ++it) {
    OwnedSegment r;
    r.mem = AllocAligned(it->seg.len);
    std::memset(r.mem.get(), 0xAB, it->seg.len);
    r.seg = IoSegment{r.mem.get(), it->seg.len, it->seg.offset};
    read.push_back(std::move(r));
  }
  UniqueFd rfd = OpenRead("data");
  ASSERT_TRUE(rfd.valid());
  CKPT_ASSERT_OK(io_->ReadAll(rfd.get(), Segments(read)));
  for (const OwnedSegment& r : read) {
    EXPECT_EQ(std::memcmp(r.seg.buf, expected.data() + r.seg.offset, r.seg.len), 0)
        << "segment at offset " << r.seg.offset;
  }
}

TEST_P(IoBackendTest, ManySegmentsBeyondQueueDepth) {
  std::mt19937_64 rng(0x5eed02);
  constexpr size_t kCount = 200;
  static_assert(kCount > kQueueDepth);
  std::vector<OwnedSegment> written;
  for (size_t i = 0; i < kCount; ++i) written.push_back(MakeSegment(&rng, 4096, i * 4096));
  std::shuffle(written.begin(), written.end(), rng);
  {
    UniqueFd fd = CreateDirect("many");
    ASSERT_TRUE(fd.valid());
    CKPT_ASSERT_OK(io_->WriteAll(fd.get(), Segments(written)));
  }
  std::vector<OwnedSegment> read;
  for (size_t i = 0; i < kCount; ++i) {
    OwnedSegment r;
    r.mem = AllocAligned(4096);
    r.seg = IoSegment{r.mem.get(), 4096, (kCount - 1 - i) * 4096};
    read.push_back(std::move(r));
  }
  UniqueFd rfd = OpenRead("many");
  ASSERT_TRUE(rfd.valid());
  CKPT_ASSERT_OK(io_->ReadAll(rfd.get(), Segments(read)));
  for (const OwnedSegment& w : written) {
    const OwnedSegment& r = read[kCount - 1 - w.seg.offset / 4096];
    ASSERT_EQ(r.seg.offset, w.seg.offset);
    EXPECT_EQ(std::memcmp(r.seg.buf, w.seg.buf, 4096), 0) << "offset " << w.seg.offset;
  }
}

// A transfer the caller drives: Submit returns, the caller works meanwhile
// (reading the bytes being written, as a commit's checksums do), Wait
// completes it. The segment list is the backend's from Submit on (the
// caller's copy may be gone), more segments than the queue holds all go, and
// an empty transfer waits for nothing.
TEST_P(IoBackendTest, SubmitThenWaitMovesEverySegment) {
  std::mt19937_64 rng(0x5eed06);
  constexpr size_t kCount = 3 * kQueueDepth + 1;
  std::vector<OwnedSegment> written;
  for (size_t i = 0; i < kCount; ++i) written.push_back(MakeSegment(&rng, 8192, i * 8192));
  uint64_t sum = 0;
  {
    UniqueFd fd = CreateDirect("submitted");
    ASSERT_TRUE(fd.valid());
    {
      std::vector<IoSegment> list = Segments(written);
      io_->Submit(IoDirection::kWrite, fd.get(), list);
    }  // the list is gone; the buffers stay
    for (const OwnedSegment& w : written) sum += static_cast<unsigned char>(w.mem.get()[17]);
    CKPT_ASSERT_OK(io_->Wait());
  }
  EXPECT_GT(sum, 0u);
  std::vector<OwnedSegment> read;
  for (size_t i = 0; i < kCount; ++i) {
    OwnedSegment r;
    r.mem = AllocAligned(8192);
    r.seg = IoSegment{r.mem.get(), 8192, i * 8192};
    read.push_back(std::move(r));
  }
  UniqueFd rfd = OpenRead("submitted");
  ASSERT_TRUE(rfd.valid());
  io_->Submit(IoDirection::kRead, rfd.get(), Segments(read));
  CKPT_ASSERT_OK(io_->Wait());
  for (size_t i = 0; i < kCount; ++i) {
    EXPECT_EQ(std::memcmp(read[i].seg.buf, written[i].seg.buf, 8192), 0) << "segment " << i;
  }
  io_->Submit(IoDirection::kRead, rfd.get(), {});
  CKPT_EXPECT_OK(io_->Wait());
  // A read past the end fails in Wait, and the backend is usable after.
  OwnedSegment past;
  past.mem = AllocAligned(8192);
  past.seg = IoSegment{past.mem.get(), 8192, kCount * 8192};
  io_->Submit(IoDirection::kRead, rfd.get(), {past.seg});
  CKPT_EXPECT_CODE(io_->Wait(), kDataLoss);
  CKPT_EXPECT_OK(io_->ReadAll(rfd.get(), Segments(read)));
}

TEST_P(IoBackendTest, ZeroSegmentsAndEmptySegments) {
  UniqueFd fd = CreateDirect("empty");
  ASSERT_TRUE(fd.valid());
  CKPT_EXPECT_OK(io_->WriteAll(fd.get(), {}));
  AlignedPtr mem = AllocAligned(4096);
  IoSegment empty{mem.get(), 0, 0};
  CKPT_EXPECT_OK(io_->WriteAll(fd.get(), absl::MakeConstSpan(&empty, 1)));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t size, DefaultFileSystem()->FileSize(fd.get()));
  EXPECT_EQ(size, 0u);
  UniqueFd rfd = OpenRead("empty");
  ASSERT_TRUE(rfd.valid());
  CKPT_EXPECT_OK(io_->ReadAll(rfd.get(), {}));
  CKPT_EXPECT_OK(io_->ReadAll(rfd.get(), absl::MakeConstSpan(&empty, 1)));
}

TEST_P(IoBackendTest, ReadPastEndOfFileIsDataLoss) {
  std::mt19937_64 rng(0x5eed03);
  std::vector<OwnedSegment> written;
  written.push_back(MakeSegment(&rng, 8192, 0));
  {
    UniqueFd fd = CreateDirect("short");
    ASSERT_TRUE(fd.valid());
    CKPT_ASSERT_OK(io_->WriteAll(fd.get(), Segments(written)));
  }
  UniqueFd rfd = OpenRead("short");
  ASSERT_TRUE(rfd.valid());
  AlignedPtr mem = AllocAligned(1 << 16);
  // Straddles the end: half is there.
  IoSegment straddle{mem.get(), 8192, 4096};
  CKPT_EXPECT_CODE(io_->ReadAll(rfd.get(), absl::MakeConstSpan(&straddle, 1)), kDataLoss);
  // Entirely beyond the end.
  IoSegment beyond{mem.get(), 4096, 1 << 20};
  CKPT_EXPECT_CODE(io_->ReadAll(rfd.get(), absl::MakeConstSpan(&beyond, 1)), kDataLoss);
  // A good segment followed by a bad one still fails.
  AlignedPtr mem2 = AllocAligned(8192);
  std::vector<IoSegment> mixed = {{mem2.get(), 8192, 0}, {mem.get(), 4096, 8192}};
  CKPT_EXPECT_CODE(io_->ReadAll(rfd.get(), mixed), kDataLoss);
  // And the exact file still reads fine afterwards.
  IoSegment exact{mem.get(), 8192, 0};
  CKPT_EXPECT_OK(io_->ReadAll(rfd.get(), absl::MakeConstSpan(&exact, 1)));
  EXPECT_EQ(std::memcmp(mem.get(), written[0].seg.buf, 8192), 0);
}

TEST_P(IoBackendTest, BadDescriptorsFailWithoutCrashing) {
  std::mt19937_64 rng(0x5eed04);
  std::vector<OwnedSegment> segs;
  for (int i = 0; i < 6; ++i) segs.push_back(MakeSegment(&rng, 4096, 4096 * i));

  EXPECT_FALSE(io_->WriteAll(-1, Segments(segs)).ok());
  EXPECT_FALSE(io_->ReadAll(-1, Segments(segs)).ok());

  int closed_fd;
  {
    UniqueFd fd = CreateDirect("closed");
    ASSERT_TRUE(fd.valid());
    closed_fd = fd.get();
  }
  EXPECT_FALSE(io_->WriteAll(closed_fd, Segments(segs)).ok());

  // Writing through a read-only fd and reading through a write-only one.
  {
    UniqueFd fd = CreateDirect("rw");
    ASSERT_TRUE(fd.valid());
    EXPECT_FALSE(io_->ReadAll(fd.get(), Segments(segs)).ok());
    CKPT_ASSERT_OK(io_->WriteAll(fd.get(), Segments(segs)));
  }
  UniqueFd rfd = OpenRead("rw");
  ASSERT_TRUE(rfd.valid());
  EXPECT_FALSE(io_->WriteAll(rfd.get(), Segments(segs)).ok());

  // The backend still works after those errors.
  UniqueFd fd = CreateDirect("after");
  ASSERT_TRUE(fd.valid());
  CKPT_EXPECT_OK(io_->WriteAll(fd.get(), Segments(segs)));
  std::string file = ReadFile(tmp_.Join("after"));
  ASSERT_EQ(file.size(), 6u * 4096);
  for (const OwnedSegment& s : segs) {
    EXPECT_EQ(std::memcmp(file.data() + s.seg.offset, s.seg.buf, 4096), 0);
  }
}

TEST_P(IoBackendTest, BufferedUnalignedSegments) {
  std::mt19937_64 rng(0x5eed05);
  bool direct_used = true;
  FileSystem* fs = DefaultFileSystem();
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd,
                            fs->CreateExclusive(dir_.get(), "buffered", false, &direct_used));
  EXPECT_FALSE(direct_used);
  std::vector<OwnedSegment> written;
  uint64_t off = 3;
  for (int i = 0; i < 20; ++i) {
    uint64_t len = 1 + rng() % 5000;
    written.push_back(MakeSegment(&rng, len, off));
    off += len + rng() % 7;
  }
  CKPT_ASSERT_OK(io_->WriteAll(fd.get(), Segments(written)));
  const std::string file = ReadFile(tmp_.Join("buffered"));
  for (const OwnedSegment& s : written) {
    ASSERT_LE(s.seg.offset + s.seg.len, file.size());
    EXPECT_EQ(std::memcmp(file.data() + s.seg.offset, s.seg.buf, s.seg.len), 0);
  }
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd rfd, fs->OpenForRead(dir_.get(), "buffered", false, nullptr));
  std::vector<OwnedSegment> read;
  for (const OwnedSegment& s : written) {
    OwnedSegment r;
    r.mem = AllocAligned(s.seg.len);
    r.seg = IoSegment{r.mem.get(), s.seg.len, s.seg.offset};
    read.push_back(std::move(r));
  }
  CKPT_ASSERT_OK(io_->ReadAll(rfd.get(), Segments(read)));
  for (size_t i = 0; i < read.size(); ++i) {
    EXPECT_EQ(std::memcmp(read[i].seg.buf, written[i].seg.buf, read[i].seg.len), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, IoBackendTest,
                         ::testing::Values(IoBackendKind::kUring, IoBackendKind::kPwrite),
                         BackendParamName);

TEST(IoBackendFactoryTest, ParseKinds) {
  CKPT_ASSERT_OK_AND_ASSIGN(IoBackendKind k, ParseIoBackendKind("auto"));
  EXPECT_EQ(k, IoBackendKind::kAuto);
  CKPT_ASSERT_OK_AND_ASSIGN(k, ParseIoBackendKind("io_uring"));
  EXPECT_EQ(k, IoBackendKind::kUring);
  CKPT_ASSERT_OK_AND_ASSIGN(k, ParseIoBackendKind("pwrite"));
  EXPECT_EQ(k, IoBackendKind::kPwrite);
  for (const char* bad : {"", "foo", "IO_URING", "pwrite ", "auto\n"}) {
    CKPT_EXPECT_CODE(ParseIoBackendKind(bad), kInvalidArgument) << "'" << bad << "'";
  }
}

TEST(IoBackendFactoryTest, AutoAlwaysGivesABackend) {
  CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<IoBackend> b, MakeIoBackend(IoBackendKind::kAuto, 8));
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(std::string(b->Name()) == "io_uring" || std::string(b->Name()) == "pwrite");
  EXPECT_STREQ(MakePwriteBackend()->Name(), "pwrite");
}

TEST(IoBackendFactoryTest, UringWithTinyQueueDepths) {
  for (unsigned depth : {0u, 1u, 2u}) {
    absl::StatusOr<std::unique_ptr<IoBackend>> b = MakeUringBackend(depth);
    if (absl::IsUnavailable(b.status())) GTEST_SKIP() << b.status();
    CKPT_ASSERT_OK(b);
    TempDir tmp;
    CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd dir, DefaultFileSystem()->MakeDirs(tmp.path()));
    CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd,
                              DefaultFileSystem()->CreateExclusive(dir.get(), "f", true, nullptr));
    std::mt19937_64 rng(depth);
    std::vector<AlignedPtr> mems;
    std::vector<IoSegment> segs;
    for (int i = 0; i < 10; ++i) {
      mems.push_back(AllocAligned(4096));
      FillRandom(&rng, mems.back().get(), 4096);
      segs.push_back(IoSegment{mems.back().get(), 4096, uint64_t{4096} * i});
    }
    CKPT_ASSERT_OK((*b)->WriteAll(fd.get(), segs));
    const std::string file = ReadFile(tmp.Join("f"));
    ASSERT_EQ(file.size(), 10u * 4096);
    for (int i = 0; i < 10; ++i) {
      EXPECT_EQ(std::memcmp(file.data() + 4096 * i, mems[i].get(), 4096), 0) << "depth " << depth;
    }
  }
}

// ---- FileSystem ----

class FileSystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Join("root");
    CKPT_ASSERT_OK_AND_ASSIGN(dir_, fs_->MakeDirs(root_));
  }

  std::string Path(const std::string& name) const { return root_ + "/" + name; }

  // Creates `name` with `data` through the FileSystem (buffered).
  void Create(const std::string& name, const std::string& data) {
    CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, fs_->CreateExclusive(dir_.get(), name, false, nullptr));
    ASSERT_EQ(::write(fd.get(), data.data(), data.size()), static_cast<ssize_t>(data.size()));
  }

  FileSystem* fs_ = DefaultFileSystem();
  TempDir tmp_;
  std::string root_;
  UniqueFd dir_;
};

TEST_F(FileSystemTest, MakeDirsCreatesNestedDirectoriesIdempotently) {
  const std::string deep = tmp_.Join("a/b/c");
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd d, fs_->MakeDirs(deep));
  struct stat st;
  ASSERT_EQ(::stat(deep.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  CKPT_EXPECT_OK(fs_->MakeDirs(deep));
  WriteFile(tmp_.Join("file"), "x");
  EXPECT_FALSE(fs_->MakeDirs(tmp_.Join("file/sub")).ok());
  CKPT_EXPECT_CODE(fs_->MakeDirs(""), kInvalidArgument);
}

TEST_F(FileSystemTest, CreateExclusiveTwiceIsAlreadyExists) {
  bool direct_used = false;
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, fs_->CreateExclusive(dir_.get(), "x", true, &direct_used));
  CKPT_EXPECT_CODE(fs_->CreateExclusive(dir_.get(), "x", true, &direct_used), kAlreadyExists);
  CKPT_EXPECT_CODE(fs_->CreateExclusive(dir_.get(), "x", false, nullptr), kAlreadyExists);
}

TEST_F(FileSystemTest, CreateExclusiveReportsBufferedWhenNotAskedForDirect) {
  bool direct_used = true;
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd,
                            fs_->CreateExclusive(dir_.get(), "b", false, &direct_used));
  EXPECT_FALSE(direct_used);
  int flags = ::fcntl(fd.get(), F_GETFL);
  EXPECT_EQ(flags & O_DIRECT, 0);
  EXPECT_NE(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, 0);
}

TEST_F(FileSystemTest, RenameNoReplaceKeepsBothFiles) {
  Create("from", "source bytes");
  Create("to", "existing bytes");
  CKPT_EXPECT_CODE(fs_->RenameNoReplace(dir_.get(), "from", "to"), kAlreadyExists);
  EXPECT_EQ(ReadFile(Path("from")), "source bytes");
  EXPECT_EQ(ReadFile(Path("to")), "existing bytes");

  CKPT_ASSERT_OK(fs_->RenameNoReplace(dir_.get(), "from", "new"));
  EXPECT_FALSE(PathExists(Path("from")));
  EXPECT_EQ(ReadFile(Path("new")), "source bytes");
  CKPT_EXPECT_CODE(fs_->RenameNoReplace(dir_.get(), "missing", "other"), kNotFound);
}

TEST_F(FileSystemTest, SymlinksAreNotFollowed) {
  const std::string outside = tmp_.Join("outside");
  WriteFile(outside, "secret");
  ASSERT_EQ(::symlink(outside.c_str(), Path("link").c_str()), 0);
  EXPECT_FALSE(fs_->OpenForRead(dir_.get(), "link", false, nullptr).ok());
  EXPECT_FALSE(fs_->OpenForRead(dir_.get(), "link", true, nullptr).ok());
  EXPECT_FALSE(fs_->CreateExclusive(dir_.get(), "link", false, nullptr).ok());
  EXPECT_EQ(ReadFile(outside), "secret");

  // A dangling symlink must not let CreateExclusive create its target.
  const std::string target = tmp_.Join("planted_target");
  ASSERT_EQ(::symlink(target.c_str(), Path("dangling").c_str()), 0);
  EXPECT_FALSE(fs_->CreateExclusive(dir_.get(), "dangling", false, nullptr).ok());
  EXPECT_FALSE(PathExists(target));

  // Symlinked directories are refused too.
  ASSERT_EQ(::mkdir(tmp_.Join("otherdir").c_str(), 0750), 0);
  ASSERT_EQ(::symlink(tmp_.Join("otherdir").c_str(), Path("dirlink").c_str()), 0);
  EXPECT_FALSE(fs_->OpenSubdir(dir_.get(), "dirlink", false).ok());
}

// Regression: a FIFO planted where a layer file is read (quarantine/, read
// by `ckptctl repair` with the index locked) blocked the thread in open()
// until a writer came, forever. Reads and appends now open without blocking
// and refuse anything but a regular file with DATA_LOSS, naming its type;
// a regular file opened so is blocking again for its caller.
TEST_F(FileSystemTest, FifosAndDirectoriesAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  ASSERT_EQ(::mkdir(Path("subdir").c_str(), 0750), 0);
  for (bool direct : {false, true}) {
    absl::StatusOr<UniqueFd> fifo = fs_->OpenForRead(dir_.get(), "fifo", direct, nullptr);
    CKPT_EXPECT_CODE(fifo, kDataLoss);
    EXPECT_NE(fifo.status().message().find("a FIFO"), std::string::npos) << fifo.status();
    CKPT_EXPECT_CODE(fs_->OpenForRead(dir_.get(), "subdir", direct, nullptr), kDataLoss);
  }
  CKPT_EXPECT_CODE(fs_->OpenForAppend(dir_.get(), "fifo"), kDataLoss);
  Create("plain", "bytes");
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, fs_->OpenForRead(dir_.get(), "plain", false, nullptr));
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL) & O_NONBLOCK, 0);
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd app, fs_->OpenForAppend(dir_.get(), "side"));
  EXPECT_NE(::fcntl(app.get(), F_GETFL) & O_APPEND, 0);
  EXPECT_EQ(::fcntl(app.get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST_F(FileSystemTest, RejectsNamesThatAreNotOneComponent) {
  ASSERT_EQ(::mkdir(Path("sub").c_str(), 0750), 0);
  WriteFile(Path("sub/f"), "data");
  WriteFile(tmp_.Join("up"), "data");
  for (const char* name : {"sub/f", "../up", "..", ".", "", "/etc/passwd", "sub/"}) {
    CKPT_EXPECT_CODE(fs_->OpenForRead(dir_.get(), name, false, nullptr), kInvalidArgument)
        << "'" << name << "'";
    CKPT_EXPECT_CODE(fs_->CreateExclusive(dir_.get(), name, false, nullptr), kInvalidArgument)
        << "'" << name << "'";
    CKPT_EXPECT_CODE(fs_->OpenSubdir(dir_.get(), name, false), kInvalidArgument)
        << "'" << name << "'";
  }
}

// Regression: OpenSubdir used to mkdirat before checking the name, so "../escape" with
// create=true made a directory outside dir_fd before failing.
TEST_F(FileSystemTest, OpenSubdirCreateDoesNotEscape) {
  CKPT_EXPECT_CODE(fs_->OpenSubdir(dir_.get(), "../escape", true), kInvalidArgument);
  EXPECT_FALSE(PathExists(tmp_.Join("escape")));
}

// Regression: Unlink, RemoveDir, FileSizeAt and RenameNoReplace took any name,
// and Reconcile and GC pass them the file name stored in an index record, so a
// corrupt record naming "../x" could stat and unlink outside the rank directory
// (found while writing tests/fuzz/index_fuzzer.cc, which runs Reconcile).
TEST_F(FileSystemTest, NamesFromIndexRecordsCannotReachOutsideTheDirectory) {
  WriteFile(tmp_.Join("up"), "data");
  ASSERT_EQ(::mkdir(tmp_.Join("updir").c_str(), 0750), 0);
  Create("f", "x");
  for (const char* name : {"../up", "..", ".", "", "/etc/passwd", "sub/"}) {
    CKPT_EXPECT_CODE(fs_->FileSizeAt(dir_.get(), name), kInvalidArgument) << "'" << name << "'";
    CKPT_EXPECT_CODE(fs_->Unlink(dir_.get(), name), kInvalidArgument) << "'" << name << "'";
    CKPT_EXPECT_CODE(fs_->RenameNoReplace(dir_.get(), "f", name), kInvalidArgument)
        << "'" << name << "'";
    CKPT_EXPECT_CODE(fs_->RenameNoReplace(dir_.get(), name, "g"), kInvalidArgument)
        << "'" << name << "'";
  }
  CKPT_EXPECT_CODE(fs_->RemoveDir(dir_.get(), "../updir"), kInvalidArgument);
  EXPECT_TRUE(PathExists(tmp_.Join("up")));
  EXPECT_TRUE(PathExists(tmp_.Join("updir")));
  EXPECT_TRUE(PathExists(Path("f")));
}

TEST_F(FileSystemTest, OpenSubdirCreatesAndOpens) {
  CKPT_EXPECT_CODE(fs_->OpenSubdir(dir_.get(), "d", false), kNotFound);
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd d, fs_->OpenSubdir(dir_.get(), "d", true));
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd again, fs_->OpenSubdir(dir_.get(), "d", true));
  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd f, fs_->CreateExclusive(d.get(), "inner", false, nullptr));
  EXPECT_TRUE(PathExists(Path("d/inner")));
  Create("plain", "x");
  EXPECT_FALSE(fs_->OpenSubdir(dir_.get(), "plain", false).ok());
}

TEST_F(FileSystemTest, ListReturnsNamesAndKinds) {
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> empty, fs_->List(dir_.get()));
  EXPECT_TRUE(empty.empty());
  Create("a", "1");
  Create("b", "22");
  ASSERT_EQ(::mkdir(Path("d").c_str(), 0750), 0);
  ASSERT_EQ(::symlink("a", Path("l").c_str()), 0);
  for (int round = 0; round < 2; ++round) {  // listing twice sees the same entries
    std::vector<bool> is_dir;
    CKPT_ASSERT_OK_AND_ASSIGN(std::vector<std::string> names, fs_->List(dir_.get(), &is_dir));
    ASSERT_EQ(names.size(), is_dir.size());
    std::vector<std::pair<std::string, bool>> got;
    for (size_t i = 0; i < names.size(); ++i) got.emplace_back(names[i], is_dir[i]);
    std::sort(got.begin(), got.end());
    std::vector<std::pair<std::string, bool>> want = {
        {"a", false}, {"b", false}, {"d", true}, {"l", false}};
    EXPECT_EQ(got, want) << "round " << round;
  }
}

TEST_F(FileSystemTest, SizesAllocateAndUnlink) {
  Create("f", std::string(1234, 'x'));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t size, fs_->FileSizeAt(dir_.get(), "f"));
  EXPECT_EQ(size, 1234u);
  ASSERT_EQ(::mkdir(Path("d").c_str(), 0750), 0);
  CKPT_EXPECT_CODE(fs_->FileSizeAt(dir_.get(), "d"), kFailedPrecondition);
  CKPT_EXPECT_CODE(fs_->FileSizeAt(dir_.get(), "missing"), kNotFound);
  ASSERT_EQ(::symlink("f", Path("l").c_str()), 0);
  CKPT_EXPECT_CODE(fs_->FileSizeAt(dir_.get(), "l"), kFailedPrecondition);

  CKPT_ASSERT_OK_AND_ASSIGN(UniqueFd fd, fs_->CreateExclusive(dir_.get(), "alloc", false, nullptr));
  CKPT_EXPECT_OK(fs_->Allocate(fd.get(), 0));
  CKPT_ASSERT_OK(fs_->Allocate(fd.get(), 3 * 4096));
  CKPT_ASSERT_OK_AND_ASSIGN(size, fs_->FileSize(fd.get()));
  EXPECT_EQ(size, 3u * 4096);
  CKPT_EXPECT_OK(fs_->DataSync(fd.get()));
  CKPT_EXPECT_OK(fs_->SyncDir(dir_.get()));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t free_bytes, fs_->FreeBytes(dir_.get()));
  EXPECT_GT(free_bytes, 0u);

  CKPT_EXPECT_OK(fs_->Unlink(dir_.get(), "f"));
  EXPECT_FALSE(PathExists(Path("f")));
  CKPT_EXPECT_CODE(fs_->Unlink(dir_.get(), "f"), kNotFound);
  CKPT_EXPECT_OK(fs_->RemoveDir(dir_.get(), "d"));
  EXPECT_FALSE(PathExists(Path("d")));
  EXPECT_FALSE(fs_->DataSync(-1).ok());
}

}  // namespace
}  // namespace ckpt
