// S3Store against a real S3 server: the one-node Ceph RGW that
// run_s3_store_rgw.py starts. The server comes from the environment
// (CKPT_S3_ENDPOINT, CKPT_S3_BUCKET, CKPT_S3_ACCESS_KEY, CKPT_S3_SECRET_KEY,
// optional CKPT_S3_REGION); every test skips without it. Each test works
// below a prefix of its own and removes what it wrote.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/remote/s3_store.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::remote {
namespace {

using ::ckpt::testing::RandomBytes;
using ::ckpt::testing::TempDir;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

bool HaveServer() {
  return !Env("CKPT_S3_ENDPOINT").empty() && !Env("CKPT_S3_BUCKET").empty() &&
         !Env("CKPT_S3_ACCESS_KEY").empty() && !Env("CKPT_S3_SECRET_KEY").empty();
}

// A port on 127.0.0.1 that nothing listens on (bound, then closed).
int ClosedPort() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 1;
  socklen_t len = sizeof(addr);
  ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

UniqueFd OpenFile(const std::string& path, int flags) {
  return UniqueFd(::open(path.c_str(), flags | O_CLOEXEC, 0600));
}

uint64_t FileSize(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : ~uint64_t{0};
}

class S3StoreRgwTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveServer()) GTEST_SKIP() << "no S3 server (CKPT_S3_ENDPOINT etc. unset)";
    std::random_device rd;
    prefix_ = absl::StrFormat("test-%08x%08x/", rd(), rd());
    auto store = S3Store::Create(Options());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(store).value();
  }

  void TearDown() override {
    if (store_ == nullptr) return;
    auto all = store_->List("");
    ASSERT_TRUE(all.ok()) << all.status();
    for (const ObjectInfo& o : *all) EXPECT_TRUE(store_->Delete(o.key).ok()) << o.key;
  }

  S3Options Options() const {
    S3Options o;
    o.endpoint = Env("CKPT_S3_ENDPOINT");
    o.bucket = Env("CKPT_S3_BUCKET");
    o.access_key_id = Env("CKPT_S3_ACCESS_KEY");
    o.secret_access_key = Env("CKPT_S3_SECRET_KEY");
    if (!Env("CKPT_S3_REGION").empty()) o.region = Env("CKPT_S3_REGION");
    o.prefix = prefix_;
    o.part_bytes = 5 * kMiB;
    o.parallel_parts = 3;
    o.request_timeout = absl::Seconds(60);
    return o;
  }

  std::unique_ptr<S3Store> MakeStore(const S3Options& o) {
    auto store = S3Store::Create(o);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(store).value() : nullptr;
  }

  // Writes `data` to a file of the temp dir and opens it for reading.
  UniqueFd FileWith(const std::string& name, const std::string& data) {
    ::ckpt::testing::WriteFile(dir_.Join(name), data);
    return OpenFile(dir_.Join(name), O_RDONLY);
  }

  std::string prefix_;
  std::unique_ptr<S3Store> store_;
  TempDir dir_;
};

TEST_F(S3StoreRgwTest, CheckAccessAcceptsTheCredentials) {
  EXPECT_TRUE(store_->CheckAccess().ok());
  EXPECT_EQ(store_->Describe(), absl::StrCat("s3 ", Env("CKPT_S3_ENDPOINT"), " bucket ",
                                             Env("CKPT_S3_BUCKET"), " prefix ", prefix_));
}

TEST_F(S3StoreRgwTest, SmallObjectRoundTrip) {
  const std::string data = RandomBytes(1, 100000);
  ASSERT_TRUE(store_->PutBytes("small/a.bin", data, false).ok());
  auto got = store_->GetBytes("small/a.bin", data.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == data);

  UniqueFd out = OpenFile(dir_.Join("out"), O_RDWR | O_CREAT | O_TRUNC);
  auto n = store_->GetToFile("small/a.bin", out.get(), 1 << 20);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, data.size());
  EXPECT_TRUE(::ckpt::testing::ReadFile(dir_.Join("out")) == data);

  ASSERT_TRUE(store_->PutBytes("small/empty", "", false).ok());
  auto empty = store_->GetBytes("small/empty", 0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(*empty, "");
}

TEST_F(S3StoreRgwTest, PutFileAtMostOnePartIsOnePut) {
  const std::string data = RandomBytes(2, 5 * kMiB);
  UniqueFd in = FileWith("in", data);
  ASSERT_TRUE(store_->PutFile("file/one", in.get(), data.size()).ok());
  auto got = store_->GetBytes("file/one", data.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == data);
}

TEST_F(S3StoreRgwTest, PutFileMultipartRoundTrip) {
  const std::string data = RandomBytes(3, 23 * kMiB + 12345);  // 5 parts, the last short
  UniqueFd in = FileWith("in", data);
  ASSERT_TRUE(store_->PutFile("file/multi", in.get(), data.size()).ok());

  UniqueFd out = OpenFile(dir_.Join("out"), O_RDWR | O_CREAT | O_TRUNC);
  auto n = store_->GetToFile("file/multi", out.get(), data.size());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, data.size());
  EXPECT_TRUE(::ckpt::testing::ReadFile(dir_.Join("out")) == data);

  auto listed = store_->List("file/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].key, "file/multi");
  EXPECT_EQ((*listed)[0].size, data.size());
}

TEST_F(S3StoreRgwTest, PutFileOfAShortFileFailsAndLeavesNoObject) {
  const std::string data = RandomBytes(4, 7 * kMiB);
  UniqueFd in = FileWith("in", data);
  auto s = store_->PutFile("file/short", in.get(), 12 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(store_->GetBytes("file/short", 1 << 30).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(S3StoreRgwTest, IfAbsentRefusesAnExistingKey) {
  ASSERT_TRUE(store_->PutBytes("cond/k", "first", true).ok());
  auto s = store_->PutBytes("cond/k", "second", true);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(store_->GetBytes("cond/k", 100).value_or(""), "first");
  // Without if_absent the object is replaced.
  ASSERT_TRUE(store_->PutBytes("cond/k", "third", false).ok());
  EXPECT_EQ(store_->GetBytes("cond/k", 100).value_or(""), "third");
}

TEST_F(S3StoreRgwTest, ListPagesSortsAndStripsThePrefix) {
  S3Options o = Options();
  o.list_page_keys = 7;  // 30 keys: five pages
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  std::vector<std::string> keys;
  for (int i = 0; i < 30; ++i) keys.push_back(absl::StrFormat("list/k-%02d", i));
  std::vector<std::string> shuffled = keys;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(7));
  for (const auto& k : shuffled) ASSERT_TRUE(store->PutBytes(k, k, false).ok()) << k;
  ASSERT_TRUE(store->PutBytes("other/x", "x", false).ok());
  ASSERT_TRUE(store->PutBytes("lisz", "not under list/", false).ok());

  auto listed = store->List("list/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ((*listed)[i].key, keys[i]);
    EXPECT_EQ((*listed)[i].size, keys[i].size());
  }
  auto everything = store->List("");
  ASSERT_TRUE(everything.ok()) << everything.status();
  EXPECT_EQ(everything->size(), keys.size() + 2);
  auto none = store->List("nothing/");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
}

TEST_F(S3StoreRgwTest, KeysWithCharactersThatNeedEncoding) {
  const std::vector<std::string> keys = {"odd/a b", "odd/plus+eq=amp&", "odd/tilde~star*",
                                         "odd/caf\xc3\xa9", "odd/lt<gt>quot\"apos'"};
  for (const auto& k : keys) {
    ASSERT_TRUE(store_->PutBytes(k, k, false).ok()) << k;
    EXPECT_EQ(store_->GetBytes(k, 100).value_or("<error>"), k);
  }
  auto listed = store_->List("odd/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> got;
  for (const auto& o : *listed) got.push_back(o.key);
  std::vector<std::string> want = keys;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

TEST_F(S3StoreRgwTest, DeleteAndMissingObjects) {
  ASSERT_TRUE(store_->PutBytes("del/k", "v", false).ok());
  EXPECT_TRUE(store_->Delete("del/k").ok());
  EXPECT_EQ(store_->GetBytes("del/k", 10).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->Delete("del/k").ok());  // already gone: OK
  UniqueFd out = OpenFile(dir_.Join("out"), O_RDWR | O_CREAT | O_TRUNC);
  EXPECT_EQ(store_->GetToFile("del/never", out.get(), 10).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FileSize(out.get()), 0u);
}

TEST_F(S3StoreRgwTest, MaxBytesIsEnforced) {
  const std::string data = RandomBytes(5, 100000);
  ASSERT_TRUE(store_->PutBytes("big/k", data, false).ok());
  EXPECT_EQ(store_->GetBytes("big/k", data.size() - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  UniqueFd out = OpenFile(dir_.Join("out"), O_RDWR | O_CREAT | O_TRUNC);
  auto n = store_->GetToFile("big/k", out.get(), 1000);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << n.status();
  EXPECT_EQ(FileSize(out.get()), 0u);  // nothing written
  EXPECT_TRUE(store_->GetBytes("big/k", data.size()).ok());
}

TEST_F(S3StoreRgwTest, WrongSecretIsPermissionDeniedWithoutTheSecret) {
  S3Options o = Options();
  o.secret_access_key = "WrongSecretKeyThatMustNotAppear0123456789";
  o.max_attempts = 2;
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  const absl::Status check = store->CheckAccess();
  EXPECT_EQ(check.code(), absl::StatusCode::kPermissionDenied) << check;
  EXPECT_NE(check.message().find("refused ckptd's credentials"), absl::string_view::npos);
  EXPECT_NE(check.message().find("SignatureDoesNotMatch"), absl::string_view::npos) << check;
  const absl::Status put = store->PutBytes("denied/k", "v", false);
  EXPECT_EQ(put.code(), absl::StatusCode::kPermissionDenied) << put;
  for (const absl::Status& s : {check, put}) {
    EXPECT_EQ(s.message().find(o.secret_access_key), absl::string_view::npos) << s;
    EXPECT_EQ(s.message().find(Env("CKPT_S3_SECRET_KEY")), absl::string_view::npos) << s;
    EXPECT_EQ(s.message().find(o.access_key_id), absl::string_view::npos) << s;
  }
}

TEST_F(S3StoreRgwTest, UnknownAccessKeyIsPermissionDenied) {
  S3Options o = Options();
  o.access_key_id = "CKPTNOSUCHKEY0000";
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  const absl::Status check = store->CheckAccess();
  EXPECT_EQ(check.code(), absl::StatusCode::kPermissionDenied) << check;
  EXPECT_NE(check.message().find("InvalidAccessKeyId"), absl::string_view::npos) << check;
  EXPECT_EQ(check.message().find(o.access_key_id), absl::string_view::npos) << check;
}

TEST_F(S3StoreRgwTest, MissingBucketIsNotFound) {
  S3Options o = Options();
  o.bucket = "ckpt-no-such-bucket";
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->CheckAccess().code(), absl::StatusCode::kNotFound);
  // Deleting in a missing bucket is not "already deleted".
  EXPECT_EQ(store->Delete("k").code(), absl::StatusCode::kNotFound);
}

TEST_F(S3StoreRgwTest, ServerDownIsUnavailableAfterBoundedRetries) {
  S3Options o = Options();
  o.endpoint = absl::StrCat("http://127.0.0.1:", ClosedPort());
  o.max_attempts = 3;
  o.backoff_base = absl::Milliseconds(50);
  o.connect_timeout = absl::Seconds(2);
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  const absl::Time start = absl::Now();
  const absl::Status s = store->PutBytes("down/k", "v", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("after 3 attempts"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(store->CheckAccess().code(), absl::StatusCode::kUnavailable);
}

TEST_F(S3StoreRgwTest, ConcurrentCallsFromManyThreads) {
  constexpr int kThreads = 8;
  constexpr int kOps = 8;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        const std::string key = absl::StrFormat("conc/t%d/%d", t, i);
        const std::string data = RandomBytes(static_cast<uint64_t>(t * 100 + i), 20000 + i);
        if (!store_->PutBytes(key, data, false).ok()) ++failures[t];
        auto got = store_->GetBytes(key, data.size());
        if (!got.ok() || *got != data) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  auto listed = store_->List("conc/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), static_cast<size_t>(kThreads * kOps));
}

// Not a pass/fail bound: prints the rate of a 64 MiB PutFile and GetToFile
// with the default part size (16 MiB, 4 in flight).
TEST_F(S3StoreRgwTest, Throughput64MiB) {
  S3Options o = Options();
  o.part_bytes = 16 * kMiB;
  o.parallel_parts = 4;
  std::unique_ptr<S3Store> store = MakeStore(o);
  ASSERT_NE(store, nullptr);
  const std::string data = RandomBytes(6, 64 * kMiB);
  UniqueFd in = FileWith("in", data);
  absl::Time start = absl::Now();
  ASSERT_TRUE(store->PutFile("rate/64m", in.get(), data.size()).ok());
  const double put_s = absl::ToDoubleSeconds(absl::Now() - start);
  UniqueFd out = OpenFile(dir_.Join("out"), O_RDWR | O_CREAT | O_TRUNC);
  start = absl::Now();
  auto n = store->GetToFile("rate/64m", out.get(), data.size());
  const double get_s = absl::ToDoubleSeconds(absl::Now() - start);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_TRUE(::ckpt::testing::ReadFile(dir_.Join("out")) == data);
  std::printf("S3 64 MiB: PutFile %.2f s (%.1f MiB/s), GetToFile %.2f s (%.1f MiB/s)\n", put_s,
              64 / put_s, get_s, 64 / get_s);
  RecordProperty("put_mib_per_s", static_cast<int>(64 / put_s));
  RecordProperty("get_mib_per_s", static_cast<int>(64 / get_s));
}

}  // namespace
}  // namespace ckpt::remote
