// PosixStore on a temporary directory, and FaultyStore over it.
#include "daemon/remote/posix_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "daemon/remote/faulty_store.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::remote {
namespace {

using ::ckpt::testing::TempDir;

UniqueFd TempFileWith(const std::string& dir, const std::string& data) {
  std::string path = dir + "/src.XXXXXX";
  int fd = mkstemp(path.data());
  EXPECT_GE(fd, 0);
  unlink(path.c_str());
  EXPECT_EQ(pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
  return UniqueFd(fd);
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  off_t off = 0;
  for (;;) {
    ssize_t n = pread(fd, buf, sizeof(buf), off);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += n;
  }
  return out;
}

TEST(PosixStore, PutGetListDeleteRoundTrip) {
  TempDir dir;
  auto store = PosixStore::Open(dir.path() + "/remote");
  ASSERT_TRUE(store.ok()) << store.status();
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  UniqueFd src = TempFileWith(dir.path(), big);
  ASSERT_TRUE((*store)->PutFile("jobs/j/rank-00000000/v/a", src.get(), big.size()).ok());
  ASSERT_TRUE((*store)->PutBytes("jobs/j/rank-00000000/m/S1", "manifest", false).ok());
  ASSERT_TRUE((*store)->PutBytes("jobs/k/rank-00000001/m/S2", "other", false).ok());

  UniqueFd dst = TempFileWith(dir.path(), "");
  auto got = (*store)->GetToFile("jobs/j/rank-00000000/v/a", dst.get(), big.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, big.size());
  EXPECT_EQ(ReadAll(dst.get()), big);
  auto small = (*store)->GetBytes("jobs/j/rank-00000000/m/S1", 100);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(*small, "manifest");

  auto listed = (*store)->List("jobs/j/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].key, "jobs/j/rank-00000000/m/S1");
  EXPECT_EQ((*listed)[1].key, "jobs/j/rank-00000000/v/a");
  EXPECT_EQ((*listed)[1].size, big.size());
  auto all = (*store)->List("jobs/");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);
  // A walk from the root, twice: each lists every object.
  for (const char* prefix : {"", "", "jo", "jo"}) {
    auto from_root = (*store)->List(prefix);
    ASSERT_TRUE(from_root.ok());
    EXPECT_EQ(from_root->size(), 3u) << "prefix '" << prefix << "'";
  }
  auto none = (*store)->List("jobs/zzz/");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());

  ASSERT_TRUE((*store)->Delete("jobs/j/rank-00000000/m/S1").ok());
  EXPECT_TRUE((*store)->Delete("jobs/j/rank-00000000/m/S1").ok());  // missing is fine
  EXPECT_TRUE(absl::IsNotFound((*store)->GetBytes("jobs/j/rank-00000000/m/S1", 100).status()));
}

TEST(PosixStore, ConditionalCreateRefusesAnExistingObject) {
  TempDir dir;
  auto store = PosixStore::Open(dir.path());
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->PutBytes("m/S1", "first", true).ok());
  absl::Status again = (*store)->PutBytes("m/S1", "second", true);
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  EXPECT_EQ(*(*store)->GetBytes("m/S1", 100), "first");
  // No temp file is left behind by the refused create.
  auto listed = (*store)->List("m/");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);
}

TEST(PosixStore, RefusesBadKeysOversizedReadsAndSymlinks) {
  TempDir dir;
  auto store = PosixStore::Open(dir.path() + "/r");
  ASSERT_TRUE(store.ok());
  for (const char* bad : {"", "/abs", "a/../b", "a//b", "a/./b", "dir/", ".tmp.x"}) {
    EXPECT_TRUE(absl::IsInvalidArgument((*store)->PutBytes(bad, "x", false))) << bad;
  }
  ASSERT_TRUE((*store)->PutBytes("a/b", "0123456789", false).ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*store)->GetBytes("a/b", 5).status()));
  UniqueFd dst = TempFileWith(dir.path(), "");
  EXPECT_TRUE(absl::IsInvalidArgument((*store)->GetToFile("a/b", dst.get(), 5).status()));
  EXPECT_EQ(ReadAll(dst.get()), "");  // nothing written past the bound
  // A symbolic link where a directory of a key would be is never followed.
  ASSERT_EQ(mkdir((dir.path() + "/elsewhere").c_str(), 0700), 0);
  ASSERT_EQ(symlink((dir.path() + "/elsewhere").c_str(), (dir.path() + "/r/link").c_str()), 0);
  absl::Status s = (*store)->PutBytes("link/x", "y", false);
  EXPECT_FALSE(s.ok());
  struct stat st;
  EXPECT_NE(stat((dir.path() + "/elsewhere/x").c_str(), &st), 0);
}

// A directory another user could write is refused at open, with what to
// change: a manifest put there could be restored by every node.
TEST(PosixStore, RefusesADirectoryOthersCanWrite) {
  TempDir tmp;
  const std::string shared = tmp.Join("shared");
  ASSERT_EQ(mkdir(shared.c_str(), 0777), 0);
  ASSERT_EQ(chmod(shared.c_str(), 0777), 0);
  absl::StatusOr<std::unique_ptr<PosixStore>> open = PosixStore::Open(shared);
  ASSERT_TRUE(absl::IsFailedPrecondition(open.status())) << open.status();
  EXPECT_NE(open.status().message().find("another user"), absl::string_view::npos);
  ASSERT_EQ(chmod(shared.c_str(), 0770), 0);  // group-writable: refused too
  EXPECT_TRUE(absl::IsFailedPrecondition(PosixStore::Open(shared).status()));
  ASSERT_EQ(chmod(shared.c_str(), 0750), 0);
  EXPECT_TRUE(PosixStore::Open(shared).ok());
  // Under a directory others may change (not sticky): refused.
  const std::string open_parent = tmp.Join("open");
  ASSERT_EQ(mkdir(open_parent.c_str(), 0777), 0);
  ASSERT_EQ(chmod(open_parent.c_str(), 0777), 0);
  const std::string below = open_parent + "/store";
  absl::StatusOr<std::unique_ptr<PosixStore>> under = PosixStore::Open(below);
  EXPECT_TRUE(absl::IsFailedPrecondition(under.status())) << under.status();
  // A sticky one of root's (like /tmp) lets nobody move what is not theirs.
  if (geteuid() == 0) {
    ASSERT_EQ(chmod(open_parent.c_str(), 01777), 0);
    EXPECT_TRUE(PosixStore::Open(below).ok());
  }
}

// What sits in the store and is not an object ckptd wrote is refused as
// DATA_LOSS, at once: a FIFO (never opened for reading, so no thread
// blocks), a file others may write, a subdirectory others may write.
TEST(PosixStore, RefusesFifosAndFilesOthersCanWrite) {
  TempDir tmp;
  CKPT_ASSERT_OK_AND_ASSIGN(auto store, PosixStore::Open(tmp.path()));
  CKPT_ASSERT_OK(store->PutBytes("jobs/j/owner", "ok", /*if_absent=*/false));
  ASSERT_EQ(mkfifo(tmp.Join("jobs/j/fifo").c_str(), 0640), 0);
  absl::StatusOr<std::string> fifo = store->GetBytes("jobs/j/fifo", 1 << 20);
  EXPECT_TRUE(absl::IsDataLoss(fifo.status())) << fifo.status();
  UniqueFd out = TempFileWith(tmp.path(), "");
  EXPECT_TRUE(absl::IsDataLoss(store->GetToFile("jobs/j/fifo", out.get(), 1 << 20).status()));
  CKPT_ASSERT_OK_AND_ASSIGN(std::vector<ObjectInfo> listed, store->List("jobs/"));
  ASSERT_EQ(listed.size(), 1u);  // the FIFO is not an object
  ASSERT_EQ(chmod(tmp.Join("jobs/j/owner").c_str(), 0666), 0);
  EXPECT_TRUE(absl::IsDataLoss(store->GetBytes("jobs/j/owner", 1 << 20).status()));
  ASSERT_EQ(chmod(tmp.Join("jobs/j/owner").c_str(), 0640), 0);
  CKPT_ASSERT_OK_AND_ASSIGN(std::string ok, store->GetBytes("jobs/j/owner", 1 << 20));
  EXPECT_EQ(ok, "ok");
  ASSERT_EQ(chmod(tmp.Join("jobs/j").c_str(), 0777), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(store->GetBytes("jobs/j/owner", 1 << 20).status()));
}

TEST(FaultyStore, DownFailsEveryCallAndCountsThem) {
  TempDir dir;
  auto base = PosixStore::Open(dir.path());
  ASSERT_TRUE(base.ok());
  FaultyStore faulty(base->get());
  ASSERT_TRUE(faulty.PutBytes("a", "1", false).ok());
  faulty.set_down(true);
  EXPECT_TRUE(absl::IsUnavailable(faulty.PutBytes("b", "2", false)));
  EXPECT_TRUE(absl::IsUnavailable(faulty.GetBytes("a", 10).status()));
  EXPECT_TRUE(absl::IsUnavailable(faulty.List("").status()));
  faulty.set_down(false);
  faulty.FailPuts(1, absl::PermissionDeniedError("denied"));
  EXPECT_TRUE(absl::IsPermissionDenied(faulty.PutBytes("b", "2", false)));
  EXPECT_TRUE(faulty.PutBytes("b", "2", false).ok());
  std::string seen;
  faulty.set_before_put([&](const std::string& key) {
    seen = key;
    faulty.set_down(true);  // stopped mid-upload
  });
  EXPECT_TRUE(absl::IsUnavailable(faulty.PutBytes("c", "3", false)));
  EXPECT_EQ(seen, "c");
  EXPECT_EQ(faulty.puts(), 5u);
  EXPECT_TRUE(absl::IsNotFound((*base)->GetBytes("c", 10).status()));
}

}  // namespace
}  // namespace ckpt::remote
