// S3Store without an S3 server: a scripted HTTP/1.1 server on 127.0.0.1
// answers each request with what the test says, and records what it got.
// Covers what a real server will not do on demand: 5xx and throttling,
// damaged and short bodies, slow answers, a 200 answer carrying an <Error>,
// retried parts, and the abort of a failed multipart upload. Also the
// options, the credentials file and key validation.
#include "daemon/remote/s3_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/remote/sigv4.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::remote {
namespace {

using ::ckpt::testing::RandomBytes;
using ::ckpt::testing::TempDir;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr char kAccessKey[] = "AKIDTESTONLY0001";
constexpr char kSecret[] = "SecretThatMustNeverBeShown/123+abc";
constexpr char kBucket[] = "bkt";

// ---------------------------------------------------------------------------
// The scripted server.

struct HttpRequest {
  std::string method;
  std::string path;                                          // as sent (percent-encoded)
  std::string query;                                         // as sent, without '?'
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercased
  std::string body;  // empty when over 1 MiB; see body_sha256
  std::string body_sha256;
  size_t body_size = 0;

  std::string Header(const std::string& name) const {
    for (const auto& [n, v] : headers) {
      if (n == name) return v;
    }
    return "";
  }
  bool HasHeader(const std::string& name) const {
    for (const auto& [n, v] : headers) {
      if (n == name) return true;
    }
    return false;
  }
};

struct HttpResponse {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  int64_t content_length = -1;  // -1: body.size(); otherwise declared (and the connection closed)
  bool omit_length = false;     // no Content-Length: the body ends when the connection closes
  absl::Duration delay = absl::ZeroDuration();  // before answering

  static HttpResponse Xml(int status, const std::string& code, const std::string& extra = "") {
    HttpResponse r;
    r.status = status;
    r.headers = {{"Content-Type", "application/xml"}};
    r.body = absl::StrCat("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>", code,
                          "</Code><Message>scripted ", code, "</Message>", extra,
                          "<RequestId>tx1</RequestId></Error>");
    return r;
  }
};

class FakeS3Server {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  explicit FakeS3Server(Handler handler) : handler_(std::move(handler)) {
    listen_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int one = 1;
    ::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_.get(), 64) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
      return;
    }
    socklen_t len = sizeof(addr);
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  ~FakeS3Server() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& t : connections_) t.join();
  }

  FakeS3Server(const FakeS3Server&) = delete;
  FakeS3Server& operator=(const FakeS3Server&) = delete;

  int port() const { return port_; }
  std::string endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }

  std::vector<HttpRequest> requests() const {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listen_.get(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      connections_.emplace_back([this, fd] { Serve(UniqueFd(fd)); });
    }
  }

  // Appends what `fd` has to *buf; false at EOF, on an error, or when stopping.
  bool ReadMore(int fd, std::string* buf) {
    while (!stop_) {
      pollfd p{fd, POLLIN, 0};
      const int r = ::poll(&p, 1, 20);
      if (r == 0) continue;
      if (r < 0) return false;
      char chunk[1 << 16];
      const ssize_t n = ::read(fd, chunk, sizeof(chunk));
      if (n <= 0) return false;
      buf->append(chunk, static_cast<size_t>(n));
      return true;
    }
    return false;
  }

  static bool WriteAll(int fd, absl::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  void Serve(UniqueFd fd) {
    std::string buf;
    while (!stop_) {
      size_t head_end;
      while ((head_end = buf.find("\r\n\r\n")) == std::string::npos) {
        if (!ReadMore(fd.get(), &buf)) return;
      }
      HttpRequest req;
      std::vector<absl::string_view> lines =
          absl::StrSplit(absl::string_view(buf).substr(0, head_end), "\r\n");
      std::vector<std::string> first = absl::StrSplit(lines[0], ' ');
      if (first.size() != 3) return;
      req.method = first[0];
      const size_t q = first[1].find('?');
      req.path = first[1].substr(0, q);
      if (q != std::string::npos) req.query = first[1].substr(q + 1);
      size_t length = 0;
      for (size_t i = 1; i < lines.size(); ++i) {
        const size_t colon = lines[i].find(':');
        if (colon == absl::string_view::npos) continue;
        std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
        std::string value(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
        if (name == "content-length") (void)absl::SimpleAtoi(value, &length);
        req.headers.emplace_back(std::move(name), std::move(value));
      }
      const size_t body_start = head_end + 4;
      while (buf.size() < body_start + length) {
        if (!ReadMore(fd.get(), &buf)) return;
      }
      const absl::string_view body = absl::string_view(buf).substr(body_start, length);
      req.body_size = body.size();
      req.body_sha256 = Sha256Hex(body);
      if (body.size() <= kMiB) req.body = std::string(body);
      buf.erase(0, body_start + length);

      {
        absl::MutexLock lock(&mu_);
        requests_.push_back(req);
      }
      HttpResponse r = handler_(req);
      if (r.delay > absl::ZeroDuration()) absl::SleepFor(r.delay);
      const bool close = r.omit_length || r.content_length >= 0;
      std::string head = absl::StrFormat("HTTP/1.1 %d Scripted\r\n", r.status);
      for (const auto& [n, v] : r.headers) absl::StrAppend(&head, n, ": ", v, "\r\n");
      if (!r.omit_length) {
        absl::StrAppend(
            &head, "Content-Length: ",
            r.content_length >= 0 ? static_cast<uint64_t>(r.content_length) : r.body.size(),
            "\r\n");
      }
      if (close) absl::StrAppend(&head, "Connection: close\r\n");
      absl::StrAppend(&head, "\r\n");
      if (req.method != "HEAD") head += r.body;
      if (!WriteAll(fd.get(), head) || close) return;
    }
  }

  Handler handler_;
  UniqueFd listen_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::vector<std::thread> connections_;  // touched by the acceptor, then the destructor

  mutable absl::Mutex mu_;
  std::vector<HttpRequest> requests_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------
// Helpers.

std::string PercentDecode(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    int v = 0;
    if (s[i] == '%' && i + 2 < s.size() && absl::SimpleHexAtoi(s.substr(i + 1, 2), &v)) {
      out.push_back(static_cast<char>(v));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::map<std::string, std::string> QueryMap(const std::string& query) {
  std::map<std::string, std::string> out;
  if (query.empty()) return out;
  for (absl::string_view kv : absl::StrSplit(query, '&')) {
    const size_t eq = kv.find('=');
    out[PercentDecode(kv.substr(0, eq))] =
        eq == absl::string_view::npos ? "" : PercentDecode(kv.substr(eq + 1));
  }
  return out;
}

// Re-signs what arrived, with the headers it names as signed, and compares:
// what curl sent is what was signed.
void ExpectValidSignature(const HttpRequest& req) {
  const std::string auth = req.Header("authorization");
  const size_t sh = auth.find("SignedHeaders=");
  ASSERT_NE(sh, std::string::npos) << auth;
  const std::string signed_names = auth.substr(sh + 14, auth.find(',', sh) - sh - 14);
  SigV4Request r;
  r.method = req.method;
  r.path = PercentDecode(req.path);
  for (const auto& [k, v] : QueryMap(req.query)) r.query.emplace_back(k, v);
  for (absl::string_view name : absl::StrSplit(signed_names, ';')) {
    r.headers.emplace_back(std::string(name), req.Header(std::string(name)));
  }
  r.payload_sha256 = req.Header("x-amz-content-sha256");
  auto s = SignV4(r, {kAccessKey, kSecret, ""}, "us-east-1", "s3", req.Header("x-amz-date"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->authorization, auth) << req.method << " " << req.path;
}

S3Options OptionsFor(const FakeS3Server& server) {
  S3Options o;
  o.endpoint = server.endpoint();
  o.bucket = kBucket;
  o.prefix = "pre/";
  o.access_key_id = kAccessKey;
  o.secret_access_key = kSecret;
  o.part_bytes = 5 * kMiB;
  o.parallel_parts = 2;
  o.max_attempts = 3;
  o.backoff_base = absl::Milliseconds(1);
  o.request_timeout = absl::Seconds(20);
  return o;
}

std::unique_ptr<S3Store> StoreFor(const S3Options& o) {
  auto store = S3Store::Create(o);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(store).value() : nullptr;
}

void ExpectNoCredential(const absl::Status& s) {
  EXPECT_EQ(s.message().find(kSecret), absl::string_view::npos) << s;
  EXPECT_EQ(s.message().find(kAccessKey), absl::string_view::npos) << s;
}

uint64_t FileSize(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : ~uint64_t{0};
}

HttpResponse Ok(std::string body = "") {
  HttpResponse r;
  r.body = std::move(body);
  return r;
}

// ---------------------------------------------------------------------------
// Options, credentials, keys.

TEST(S3OptionsTest, ValidateNamesTheBadFieldAndNeverACredential) {
  S3Options o;
  o.endpoint = "http://127.0.0.1:7480";
  o.bucket = kBucket;
  o.access_key_id = kAccessKey;
  o.secret_access_key = kSecret;
  EXPECT_TRUE(o.Validate().ok());

  struct Case {
    std::function<void(S3Options*)> change;
    absl::StatusCode code;
    std::string mentions;
  };
  const std::vector<Case> cases = {
      {[](S3Options* x) { x->endpoint = "ftp://h"; }, absl::StatusCode::kInvalidArgument,
       "endpoint"},
      {[](S3Options* x) { x->endpoint = "http://h/path"; }, absl::StatusCode::kInvalidArgument,
       "endpoint"},
      {[](S3Options* x) { x->endpoint = "http://user:pw@h"; }, absl::StatusCode::kInvalidArgument,
       "endpoint"},
      {[](S3Options* x) { x->bucket = ""; }, absl::StatusCode::kInvalidArgument, "bucket"},
      {[](S3Options* x) {
         x->bucket = "Upper_Case";
         x->path_style = false;
       },
       absl::StatusCode::kInvalidArgument, "bucket"},
      {[](S3Options* x) { x->prefix = "/abs"; }, absl::StatusCode::kInvalidArgument, "prefix"},
      {[](S3Options* x) { x->part_bytes = kMiB; }, absl::StatusCode::kInvalidArgument,
       "part_bytes"},
      {[](S3Options* x) { x->parallel_parts = 0; }, absl::StatusCode::kInvalidArgument,
       "parallel_parts"},
      {[](S3Options* x) { x->max_attempts = 0; }, absl::StatusCode::kInvalidArgument,
       "max_attempts"},
      {[](S3Options* x) { x->list_page_keys = 1001; }, absl::StatusCode::kInvalidArgument,
       "list_page_keys"},
      {[](S3Options* x) { x->secret_access_key.clear(); }, absl::StatusCode::kUnauthenticated,
       "secret"},
      {[](S3Options* x) { x->access_key_id.clear(); }, absl::StatusCode::kUnauthenticated,
       "access key"},
  };
  for (const Case& c : cases) {
    S3Options bad = o;
    c.change(&bad);
    const absl::Status s = bad.Validate();
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.mentions), absl::string_view::npos) << s;
    ExpectNoCredential(s);
    EXPECT_EQ(S3Store::Create(bad).status().code(), c.code);
  }
}

TEST(S3OptionsTest, DescribeNamesTheStoreAndNoCredential) {
  S3Options o;
  o.endpoint = "http://127.0.0.1:7480";
  o.bucket = kBucket;
  o.prefix = "node-a/";
  o.access_key_id = kAccessKey;
  o.secret_access_key = kSecret;
  o.session_token = "TokenValue";
  auto store = S3Store::Create(o);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Describe(), "s3 http://127.0.0.1:7480 bucket bkt prefix node-a/");
}

class CredentialsFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text, mode_t mode) {
    const std::string path = dir_.Join("credentials");
    ::ckpt::testing::WriteFile(path, text);
    ::chmod(path.c_str(), mode);
    return path;
  }
  TempDir dir_;
};

TEST_F(CredentialsFileTest, ReadsKeysCommentsAndBlankLines) {
  const std::string path = Write(
      "# ckptd's S3 user\n\n  access_key_id = AKIDFILE\r\nsecret_access_key=abc/def+ghi==\n"
      "session_token = tok # not a comment\n",
      0600);
  S3Options o;
  ASSERT_TRUE(ReadS3Credentials(path, &o).ok());
  EXPECT_EQ(o.access_key_id, "AKIDFILE");
  EXPECT_EQ(o.secret_access_key, "abc/def+ghi==");
  EXPECT_EQ(o.session_token, "tok # not a comment");
}

TEST_F(CredentialsFileTest, RefusesAFileOthersCanRead) {
  const std::string path = Write("access_key_id = A\nsecret_access_key = TopSecretValue\n", 0640);
  S3Options o;
  const absl::Status s = ReadS3Credentials(path, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find(path), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("0640"), absl::string_view::npos) << s;
  EXPECT_EQ(s.message().find("TopSecretValue"), absl::string_view::npos) << s;
  EXPECT_TRUE(o.secret_access_key.empty());
}

TEST_F(CredentialsFileTest, RefusesSymlinksAndDirectories) {
  const std::string target = Write("access_key_id = A\nsecret_access_key = B\n", 0600);
  const std::string link = dir_.Join("link");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  S3Options o;
  EXPECT_EQ(ReadS3Credentials(link, &o).code(), absl::StatusCode::kPermissionDenied);
  const std::string sub = dir_.Join("sub");
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  const absl::Status s = ReadS3Credentials(sub, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("not a regular file"), absl::string_view::npos) << s;
  EXPECT_EQ(ReadS3Credentials(dir_.Join("missing"), &o).code(), absl::StatusCode::kNotFound);
}

TEST_F(CredentialsFileTest, MalformedLinesNameTheLineNotItsText) {
  S3Options o;
  o.access_key_id = "unchanged";
  const struct {
    std::string text;
    std::string mentions;
  } cases[] = {
      {"access_key_id = A\n# c\nSecretWithoutEquals\n", "line 3"},
      {"access_key_id = A\nsecret_key = SecretUnknownKey\n", "line 2"},
      {"access_key_id = A\naccess_key_id = B\nsecret_access_key = S\n", "line 2"},
      {"access_key_id =\nsecret_access_key = S\n", "line 1"},
      {"access_key_id = A\n", "secret_access_key"},
      {"secret_access_key = SecretOnly\n", "access_key_id"},
  };
  for (const auto& c : cases) {
    const absl::Status s = ReadS3Credentials(Write(c.text, 0600), &o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.mentions), absl::string_view::npos) << s;
    EXPECT_EQ(s.message().find("Secret"), absl::string_view::npos) << s;
    EXPECT_EQ(o.access_key_id, "unchanged");
  }
}

TEST(S3StoreTest, BadKeysAreRefusedBeforeAnyRequest) {
  FakeS3Server server([](const HttpRequest&) { return Ok(); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  for (const std::string key : {"", "/abs", "a//b", "a/./b", "a/../b", "dir/", "ctl\x01"}) {
    EXPECT_EQ(store->PutBytes(key, "v", false).code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_EQ(store->GetBytes(key, 10).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(store->List("/x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(server.requests().empty());
}

// ---------------------------------------------------------------------------
// Requests on the wire.

TEST(S3StoreTest, PutBytesSendsASignedPathStyleRequest) {
  FakeS3Server server([](const HttpRequest&) { return Ok(); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->PutBytes("dir/a b+c~d*", "payload", false).ok());
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 1u);
  const HttpRequest& r = reqs[0];
  EXPECT_EQ(r.method, "PUT");
  EXPECT_EQ(r.path, "/bkt/pre/dir/a%20b%2Bc~d%2A");
  EXPECT_EQ(r.body, "payload");
  EXPECT_EQ(r.Header("x-amz-content-sha256"), Sha256Hex("payload"));
  EXPECT_EQ(r.Header("host"), absl::StrCat("127.0.0.1:", server.port()));
  EXPECT_FALSE(r.HasHeader("if-none-match"));
  EXPECT_FALSE(r.HasHeader("expect"));
  EXPECT_TRUE(absl::StartsWith(r.Header("authorization"),
                               absl::StrCat("AWS4-HMAC-SHA256 Credential=", kAccessKey, "/")));
  ExpectValidSignature(r);
}

TEST(S3StoreTest, VirtualHostedStylePutsTheBucketInTheHost) {
  FakeS3Server server([](const HttpRequest&) { return Ok(); });
  S3Options o = OptionsFor(server);
  o.endpoint = absl::StrCat("http://localhost:", server.port());  // curl resolves *.localhost
  o.path_style = false;
  auto store = StoreFor(o);
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutBytes("k", "v", false);
  ASSERT_TRUE(s.ok()) << s;
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].path, "/pre/k");
  EXPECT_EQ(reqs[0].Header("host"), absl::StrCat("bkt.localhost:", server.port()));
  ExpectValidSignature(reqs[0]);
}

TEST(S3StoreTest, IfAbsentSendsIfNoneMatchAnd412IsAlreadyExists) {
  FakeS3Server server(
      [](const HttpRequest&) { return HttpResponse::Xml(412, "PreconditionFailed"); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutBytes("k", "v", true);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].Header("if-none-match"), "*");
  ExpectValidSignature(reqs[0]);
}

TEST(S3StoreTest, ThrottlingIsRetriedUntilItPasses) {
  std::atomic<int> calls{0};
  FakeS3Server server([&](const HttpRequest&) {
    const int n = calls++;
    if (n == 0) return HttpResponse::Xml(503, "SlowDown");
    if (n == 1) return HttpResponse::Xml(429, "TooManyRequests");
    return Ok();
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->PutBytes("k", "v", false).ok());
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 3u);
  // Each attempt is signed afresh.
  for (const auto& r : reqs) ExpectValidSignature(r);
}

TEST(S3StoreTest, PersistentServerErrorsAreUnavailableAfterMaxAttempts) {
  FakeS3Server server([](const HttpRequest&) { return HttpResponse::Xml(500, "InternalError"); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutBytes("k", "v", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("500 InternalError"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("after 3 attempts"), absl::string_view::npos) << s;
  EXPECT_EQ(server.requests().size(), 3u);
}

TEST(S3StoreTest, ForbiddenIsPermissionDeniedWithTheCodeAndNoCredential) {
  // RGW and S3 echo the access key id (and the string to sign) in this body.
  FakeS3Server server([](const HttpRequest&) {
    return HttpResponse::Xml(403, "SignatureDoesNotMatch",
                             absl::StrCat("<AWSAccessKeyId>", kAccessKey,
                                          "</AWSAccessKeyId><StringToSign>x"
                                          "</StringToSign>"));
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status check = store->CheckAccess();
  EXPECT_EQ(check.code(), absl::StatusCode::kPermissionDenied) << check;
  EXPECT_NE(check.message().find("refused ckptd's credentials"), absl::string_view::npos);
  EXPECT_NE(check.message().find("403 SignatureDoesNotMatch"), absl::string_view::npos);
  ExpectNoCredential(check);
  const absl::Status put = store->PutBytes("k", "v", false);
  EXPECT_EQ(put.code(), absl::StatusCode::kPermissionDenied) << put;
  ExpectNoCredential(put);
  EXPECT_EQ(server.requests().size(), 2u);  // not retried
}

TEST(S3StoreTest, MissingBucketIsNotFound) {
  FakeS3Server server([](const HttpRequest&) { return HttpResponse::Xml(404, "NoSuchBucket"); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->CheckAccess();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("NoSuchBucket"), absl::string_view::npos) << s;
  EXPECT_EQ(store->Delete("k").code(), absl::StatusCode::kNotFound);
}

TEST(S3StoreTest, DamagedBodyIsDataLoss) {
  FakeS3Server server(
      [](const HttpRequest&) { return HttpResponse::Xml(400, "XAmzContentSHA256Mismatch"); });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutBytes("k", "v", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(server.requests().size(), 3u);  // retried: the next copy may arrive intact
}

TEST(S3StoreTest, SlowAnswerIsDeadlineExceeded) {
  FakeS3Server server([](const HttpRequest&) {
    HttpResponse r = Ok();
    r.delay = absl::Milliseconds(2500);
    return r;
  });
  S3Options o = OptionsFor(server);
  o.request_timeout = absl::Seconds(1);
  o.max_attempts = 1;
  auto store = StoreFor(o);
  ASSERT_NE(store, nullptr);
  const absl::Time start = absl::Now();
  const absl::Status s = store->PutBytes("k", "v", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(S3StoreTest, ClosedPortIsUnavailableAfterBoundedRetries) {
  int port = 0;
  {
    FakeS3Server gone([](const HttpRequest&) { return Ok(); });
    port = gone.port();
  }
  S3Options o;
  o.endpoint = absl::StrCat("http://127.0.0.1:", port);
  o.bucket = kBucket;
  o.access_key_id = kAccessKey;
  o.secret_access_key = kSecret;
  o.max_attempts = 4;
  o.backoff_base = absl::Milliseconds(20);
  auto store = StoreFor(o);
  ASSERT_NE(store, nullptr);
  const absl::Time start = absl::Now();
  const absl::Status s = store->GetBytes("k", 10).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("after 4 attempts"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ExpectNoCredential(s);
}

// ---------------------------------------------------------------------------
// GET.

TEST(S3StoreTest, GetToFileStreamsIntoTheFile) {
  const std::string data = RandomBytes(1, 3 * kMiB + 7);
  FakeS3Server server([&](const HttpRequest& r) {
    if (r.path == "/bkt/pre/missing") return HttpResponse::Xml(404, "NoSuchKey");
    return Ok(data);
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  TempDir dir;
  UniqueFd fd(::open(dir.Join("out").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  auto n = store->GetToFile("obj", fd.get(), data.size());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, data.size());
  EXPECT_TRUE(::ckpt::testing::ReadFile(dir.Join("out")) == data);
  EXPECT_EQ(store->GetToFile("missing", fd.get(), 100).status().code(),
            absl::StatusCode::kNotFound);
  auto bytes = store->GetBytes("obj", data.size());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(*bytes == data);
  ExpectValidSignature(server.requests()[0]);
}

TEST(S3StoreTest, MaxBytesStopsTheTransferBeforeWritingPastIt) {
  const std::string data = RandomBytes(2, 100000);
  bool with_length = true;
  FakeS3Server server([&](const HttpRequest&) {
    HttpResponse r = Ok(data);
    r.omit_length = !with_length;
    return r;
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  TempDir dir;
  for (bool length_known : {true, false}) {
    with_length = length_known;
    UniqueFd fd(::open(dir.Join("out").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    auto n = store->GetToFile("obj", fd.get(), 1000);
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << n.status();
    EXPECT_LE(FileSize(fd.get()), 1000u);
    if (length_known) {
      EXPECT_EQ(FileSize(fd.get()), 0u);
    }
    EXPECT_EQ(store->GetBytes("obj", 99999).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(server.requests().size(), 4u);  // not retried
}

TEST(S3StoreTest, ShortBodyIsRetriedThenDataLoss) {
  FakeS3Server server([](const HttpRequest&) {
    HttpResponse r = Ok(std::string(50, 'x'));
    r.content_length = 100;  // promises more than it sends, then closes
    return r;
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->GetBytes("obj", 1000).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(server.requests().size(), 3u);
}

// ---------------------------------------------------------------------------
// List and Delete.

TEST(S3StoreTest, ListFollowsContinuationTokensDecodesAndStripsThePrefix) {
  FakeS3Server server([](const HttpRequest& r) {
    const auto q = QueryMap(r.query);
    std::string body = "<?xml version=\"1.0\"?><ListBucketResult><Name>bkt</Name>";
    if (q.count("continuation-token") == 0) {
      absl::StrAppend(&body,
                      "<Contents><Key>pre/d/b&amp;c</Key><Size>3</Size></Contents>"
                      "<Contents><Key>pre/d/a&#x20;b&#233;</Key><Size>12</Size></Contents>"
                      "<IsTruncated>true</IsTruncated>"
                      "<NextContinuationToken>tok/+=&amp;</NextContinuationToken>");
    } else if (q.at("continuation-token") == "tok/+=&") {
      absl::StrAppend(&body,
                      "<Contents><Key>pre/d/c&lt;&quot;&apos;&gt;</Key><Size>0</Size></Contents>"
                      "<IsTruncated>false</IsTruncated>");
    } else {
      return HttpResponse::Xml(400, "InvalidArgument");
    }
    return Ok(absl::StrCat(body, "</ListBucketResult>"));
  });
  S3Options o = OptionsFor(server);
  o.list_page_keys = 2;
  auto store = StoreFor(o);
  ASSERT_NE(store, nullptr);
  auto listed = store->List("d/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 3u);
  EXPECT_EQ((*listed)[0].key, "d/a b\xc3\xa9");
  EXPECT_EQ((*listed)[0].size, 12u);
  EXPECT_EQ((*listed)[1].key, "d/b&c");
  EXPECT_EQ((*listed)[2].key, "d/c<\"'>");
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  const auto q = QueryMap(reqs[0].query);
  EXPECT_EQ(q.at("list-type"), "2");
  EXPECT_EQ(q.at("prefix"), "pre/d/");
  EXPECT_EQ(q.at("max-keys"), "2");
  for (const auto& r : reqs) ExpectValidSignature(r);
}

TEST(S3StoreTest, DeleteOfAMissingObjectIsOk) {
  FakeS3Server server([](const HttpRequest& r) {
    if (r.path == "/bkt/pre/gone") return HttpResponse::Xml(404, "NoSuchKey");
    HttpResponse ok;
    ok.status = 204;
    return ok;
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->Delete("here").ok());
  EXPECT_TRUE(store->Delete("gone").ok());
  ASSERT_EQ(server.requests().size(), 2u);
  EXPECT_EQ(server.requests()[0].method, "DELETE");
}

// ---------------------------------------------------------------------------
// Multipart uploads.

// A multipart server: records parts, fails the first try of `flaky_part`,
// answers CompleteMultipartUpload with `complete`.
class MultipartScript {
 public:
  int flaky_part = 0;
  int denied_part = 0;
  HttpResponse complete =
      Ok("<CompleteMultipartUploadResult><ETag>\"x-3\"</ETag>"
         "</CompleteMultipartUploadResult>");

  HttpResponse operator()(const HttpRequest& r) {
    const auto q = QueryMap(r.query);
    if (r.method == "POST" && q.count("uploads")) {
      return Ok(
          "<InitiateMultipartUploadResult><UploadId>up/1+&amp;</UploadId>"
          "</InitiateMultipartUploadResult>");
    }
    if (q.count("uploadId") && q.at("uploadId") != "up/1+&") {
      return HttpResponse::Xml(404, "NoSuchUpload");
    }
    if (r.method == "PUT" && q.count("partNumber")) {
      int part = 0;
      (void)absl::SimpleAtoi(q.at("partNumber"), &part);
      if (r.Header("x-amz-content-sha256") != r.body_sha256) {
        return HttpResponse::Xml(400, "XAmzContentSHA256Mismatch");
      }
      if (part == denied_part) return HttpResponse::Xml(403, "AccessDenied");
      absl::MutexLock lock(&mu_);
      if (part == flaky_part && flaky_failures_++ == 0)
        return HttpResponse::Xml(500, "InternalError");
      part_sizes_[part] = r.body_size;
      HttpResponse ok;
      ok.headers = {{"ETag", absl::StrFormat("\"etag-%d\"", part)}};
      return ok;
    }
    if (r.method == "POST") {
      absl::MutexLock lock(&mu_);
      complete_body_ = r.body;
      return complete;
    }
    if (r.method == "DELETE") {
      absl::MutexLock lock(&mu_);
      ++aborts_;
      HttpResponse ok;
      ok.status = 204;
      return ok;
    }
    return HttpResponse::Xml(400, "Unexpected");
  }

  std::map<int, size_t> part_sizes() {
    absl::MutexLock lock(&mu_);
    return part_sizes_;
  }
  std::string complete_body() {
    absl::MutexLock lock(&mu_);
    return complete_body_;
  }
  int aborts() {
    absl::MutexLock lock(&mu_);
    return aborts_;
  }

 private:
  absl::Mutex mu_;
  int flaky_failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, size_t> part_sizes_ ABSL_GUARDED_BY(mu_);
  std::string complete_body_ ABSL_GUARDED_BY(mu_);
  int aborts_ ABSL_GUARDED_BY(mu_) = 0;
};

class MultipartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = RandomBytes(3, 12 * kMiB + 5);  // parts of 5, 5 and 2 MiB + 5
    ::ckpt::testing::WriteFile(dir_.Join("in"), data_);
    fd_ = UniqueFd(::open(dir_.Join("in").c_str(), O_RDONLY | O_CLOEXEC));
  }
  std::unique_ptr<FakeS3Server> Serve() {
    return std::make_unique<FakeS3Server>([this](const HttpRequest& r) { return script_(r); });
  }
  TempDir dir_;
  std::string data_;
  UniqueFd fd_;
  MultipartScript script_;
};

TEST_F(MultipartTest, PartsAreRetriedIndividuallyAndCompletedInOrder) {
  script_.flaky_part = 2;
  auto server = Serve();
  auto store = StoreFor(OptionsFor(*server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutFile("big", fd_.get(), data_.size());
  ASSERT_TRUE(s.ok()) << s;
  const std::map<int, size_t> want = {{1, 5 * kMiB}, {2, 5 * kMiB}, {3, 2 * kMiB + 5}};
  EXPECT_EQ(script_.part_sizes(), want);
  EXPECT_EQ(script_.complete_body(),
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "<Part><PartNumber>1</PartNumber><ETag>\"etag-1\"</ETag></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>\"etag-2\"</ETag></Part>"
            "<Part><PartNumber>3</PartNumber><ETag>\"etag-3\"</ETag></Part>"
            "</CompleteMultipartUpload>");
  EXPECT_EQ(script_.aborts(), 0);
  const auto reqs = server->requests();
  EXPECT_EQ(reqs.size(), 1u + 4u + 1u);  // create, 3 parts + 1 retry, complete
  for (const auto& r : reqs) ExpectValidSignature(r);
}

TEST_F(MultipartTest, ErrorInsideA200CompleteFailsAndAborts) {
  script_.complete = HttpResponse::Xml(200, "InvalidPart");
  auto server = Serve();
  auto store = StoreFor(OptionsFor(*server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutFile("big", fd_.get(), data_.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("InvalidPart"), absl::string_view::npos) << s;
  EXPECT_EQ(script_.aborts(), 1);
}

TEST_F(MultipartTest, ARefusedPartAbortsTheUpload) {
  script_.denied_part = 3;
  auto server = Serve();
  auto store = StoreFor(OptionsFor(*server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutFile("big", fd_.get(), data_.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("part 3"), absl::string_view::npos) << s;
  EXPECT_EQ(script_.aborts(), 1);
  EXPECT_TRUE(script_.complete_body().empty());
}

TEST_F(MultipartTest, AShortFileAbortsTheUpload) {
  auto server = Serve();
  auto store = StoreFor(OptionsFor(*server));
  ASSERT_NE(store, nullptr);
  const absl::Status s = store->PutFile("big", fd_.get(), data_.size() + 6 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(script_.aborts(), 1);
}

TEST(S3StoreTest, ConcurrentCallsShareTheStore) {
  std::atomic<int> calls{0};
  FakeS3Server server([&](const HttpRequest& r) {
    ++calls;
    if (r.method == "GET") return Ok(r.path);
    return Ok();
  });
  auto store = StoreFor(OptionsFor(server));
  ASSERT_NE(store, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        const std::string key = absl::StrFormat("t%d/%d", t, i);
        if (!store->PutBytes(key, key, false).ok()) ++failures;
        auto got = store->GetBytes(key, 100);
        if (!got.ok() || *got != absl::StrCat("/bkt/pre/", key)) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(calls.load(), 8 * 20 * 2);
}

}  // namespace
}  // namespace ckpt::remote
