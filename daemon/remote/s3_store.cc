#include "daemon/remote/s3_store.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/remote/sigv4.h"

namespace ckpt::remote {

// ---------------------------------------------------------------------------
// libcurl resources and the per-request state.
namespace s3_internal {

struct EasyDeleter {
  void operator()(CURL* easy) const { curl_easy_cleanup(easy); }
};
using EasyPtr = std::unique_ptr<CURL, EasyDeleter>;

struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using SlistPtr = std::unique_ptr<curl_slist, SlistDeleter>;

struct MultiDeleter {
  void operator()(CURLM* multi) const { curl_multi_cleanup(multi); }
};
using MultiPtr = std::unique_ptr<CURLM, MultiDeleter>;

// Idle easy handles, each with its connection cache, so that consecutive
// requests reuse kept-alive connections.
class HandlePool {
 public:
  // An idle handle or a new one; null only when libcurl is out of memory.
  EasyPtr Take() {
    {
      absl::MutexLock lock(&mu_);
      if (!idle_.empty()) {
        EasyPtr easy = std::move(idle_.back());
        idle_.pop_back();
        return easy;
      }
    }
    return EasyPtr(curl_easy_init());
  }
  // Keeps `easy` (reset; its connections stay open) unless kMaxIdle are idle.
  // REQUIRES: `easy` is in no multi handle.
  void Give(EasyPtr easy) {
    if (easy == nullptr) return;
    curl_easy_reset(easy.get());
    absl::MutexLock lock(&mu_);
    if (idle_.size() < kMaxIdle) idle_.push_back(std::move(easy));
  }

 private:
  static constexpr size_t kMaxIdle = 16;
  absl::Mutex mu_;
  std::vector<EasyPtr> idle_ ABSL_GUARDED_BY(mu_);
};

// A handle taken from the pool for one scope.
class EasyLease {
 public:
  explicit EasyLease(HandlePool* pool) : pool_(pool), easy_(pool->Take()) {}
  ~EasyLease() { pool_->Give(std::move(easy_)); }
  EasyLease(const EasyLease&) = delete;
  EasyLease& operator=(const EasyLease&) = delete;
  CURL* get() const { return easy_.get(); }

 private:
  HandlePool* pool_;
  EasyPtr easy_;
};

struct Request {
  std::string method;      // GET HEAD PUT POST DELETE
  std::string key;         // the full object key (prefix included); empty: the bucket
  QueryList query;         // unencoded
  HeaderList headers;      // sent and signed besides the signer's own
  absl::string_view body;  // PUT and POST; must outlive the request
  std::string payload_sha256 = std::string(kEmptySha256);
  // A 2xx answer whose body is an <Error> document is a failure
  // (CompleteMultipartUpload).
  bool error_in_ok_body = false;
};

// Where a 2xx body goes.
enum class Sink { kMemory, kFd };

struct Transfer {
  CURL* easy = nullptr;  // borrowed; set by whoever runs the transfer
  Sink sink = Sink::kMemory;
  int fd = -1;                             // Sink::kFd
  uint64_t max_bytes = uint64_t{1} << 20;  // of a 2xx body

  // Set by Prepare(); valid while the attempt runs.
  std::string url;
  SlistPtr header_list;
  absl::string_view upload;
  size_t upload_pos = 0;
  char error_buffer[CURL_ERROR_SIZE] = {};

  // The outcome of the last attempt.
  long status = 0;
  bool status_known = false;
  std::string body;        // a 2xx body with Sink::kMemory
  std::string error_body;  // a non-2xx body, at most kMaxErrorBody bytes
  uint64_t received = 0;   // bytes of the 2xx body
  bool too_big = false;
  int write_errno = 0;
  std::string etag;
  std::string s3_code;  // of a non-2xx answer, when its body has one
  // "403 SignatureDoesNotMatch: ..." or curl's words: the detail of the last
  // failure, without the operation.
  std::string detail;

  static constexpr size_t kMaxErrorBody = 64 << 10;

  void ResetOutcome() {
    upload_pos = 0;
    error_buffer[0] = '\0';
    status = 0;
    status_known = false;
    body.clear();
    error_body.clear();
    received = 0;
    too_big = false;
    write_errno = 0;
    etag.clear();
    s3_code.clear();
    detail.clear();
  }
};

}  // namespace s3_internal

using s3_internal::EasyLease;
using s3_internal::EasyPtr;
using s3_internal::MultiPtr;
using s3_internal::Sink;
using s3_internal::SlistPtr;

namespace {

constexpr uint64_t kMinPartBytes = uint64_t{5} << 20;
constexpr uint64_t kMaxPartBytes = uint64_t{5} << 30;
constexpr uint64_t kMaxParts = 10000;
constexpr size_t kMaxKeyBytes = 1024;
constexpr absl::Duration kMaxBackoff = absl::Seconds(30);
constexpr unsigned kMaxParallelParts = 64;
// The low-speed limit: a transfer slower than this for kLowSpeedTime fails.
constexpr long kLowSpeedBytesPerSecond = 1024;
constexpr absl::Duration kLowSpeedTime = absl::Seconds(30);
constexpr uint64_t kMaxListPageBytes = uint64_t{32} << 20;
// Pages one List reads at most (10 million keys at 1000 a page).
constexpr size_t kMaxListPages = 10000;

// ---- libcurl once per process ----

absl::once_flag curl_once;
CURLcode curl_init_code = CURLE_OK;

absl::Status InitCurlOnce() {
  absl::call_once(curl_once, [] { curl_init_code = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (curl_init_code != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("curl_global_init failed: ", curl_easy_strerror(curl_init_code)));
  }
  return absl::OkStatus();
}

// ---- small text helpers ----

bool HasControlChar(absl::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u < 0x20 || u == 0x7f;
  });
}

// Appends `cp` as UTF-8.
void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// Replaces the five predefined XML entities and numeric character
// references; anything else after '&' is kept as it is.
std::string XmlDecode(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '&') {
      out.push_back(s[i++]);
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == absl::string_view::npos || semi - i > 12) {
      out.push_back(s[i++]);
      continue;
    }
    const absl::string_view name = s.substr(i + 1, semi - i - 1);
    bool ok = true;
    if (name == "amp") {
      out.push_back('&');
    } else if (name == "lt") {
      out.push_back('<');
    } else if (name == "gt") {
      out.push_back('>');
    } else if (name == "quot") {
      out.push_back('"');
    } else if (name == "apos") {
      out.push_back('\'');
    } else if (name.size() >= 2 && name[0] == '#') {
      uint32_t cp = 0;
      const bool hex = name[1] == 'x' || name[1] == 'X';
      const absl::string_view digits = name.substr(hex ? 2 : 1);
      ok = !digits.empty() &&
           (hex ? absl::SimpleHexAtoi(digits, &cp) : absl::SimpleAtoi(digits, &cp)) &&
           cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
      if (ok) AppendUtf8(cp, &out);
    } else {
      ok = false;
    }
    if (!ok) {
      out.push_back(s[i++]);
      continue;
    }
    i = semi + 1;
  }
  return out;
}

std::string XmlEscape(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

// The raw text of the first <tag>...</tag> at or after *pos, which is moved
// past it; nullopt when there is none.
std::optional<absl::string_view> FindElement(absl::string_view xml, absl::string_view tag,
                                             size_t* pos) {
  const std::string open = absl::StrCat("<", tag, ">");
  const std::string close = absl::StrCat("</", tag, ">");
  const size_t start = xml.find(open, *pos);
  if (start == absl::string_view::npos) return std::nullopt;
  const size_t text = start + open.size();
  const size_t end = xml.find(close, text);
  if (end == absl::string_view::npos) return std::nullopt;
  *pos = end + close.size();
  return xml.substr(text, end - text);
}

std::optional<std::string> ElementText(absl::string_view xml, absl::string_view tag) {
  size_t pos = 0;
  auto raw = FindElement(xml, tag, &pos);
  if (!raw.has_value()) return std::nullopt;
  return XmlDecode(*raw);
}

// A message from the server, made safe for a status: control characters
// replaced, at most 200 bytes.
std::string Sanitize(absl::string_view text) {
  std::string out(text.substr(0, 200));
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = ' ';
  }
  return out;
}

// ---- curl callbacks ----

size_t OnRead(char* buffer, size_t size, size_t nitems, void* userdata) {
  auto* t = static_cast<s3_internal::Transfer*>(userdata);
  const size_t n = std::min(size * nitems, t->upload.size() - t->upload_pos);
  std::memcpy(buffer, t->upload.data() + t->upload_pos, n);
  t->upload_pos += n;
  return n;
}

int OnSeek(void* userdata, curl_off_t offset, int origin) {
  auto* t = static_cast<s3_internal::Transfer*>(userdata);
  if (origin != SEEK_SET || offset < 0 || static_cast<uint64_t>(offset) > t->upload.size()) {
    return CURL_SEEKFUNC_CANTSEEK;
  }
  t->upload_pos = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

bool Is2xx(long status) { return status >= 200 && status < 300; }

size_t OnWrite(char* data, size_t size, size_t nmemb, void* userdata) {
  auto* t = static_cast<s3_internal::Transfer*>(userdata);
  const size_t len = size * nmemb;
  if (!t->status_known) {
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->status);
    t->status_known = true;
    if (Is2xx(t->status)) {
      curl_off_t length = -1;
      curl_easy_getinfo(t->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
      if (length > 0 && static_cast<uint64_t>(length) > t->max_bytes) {
        t->too_big = true;
        return 0;  // aborts the transfer before anything is written
      }
      if (length > 0 && t->sink == Sink::kMemory) t->body.reserve(static_cast<size_t>(length));
    }
  }
  if (!Is2xx(t->status)) {
    const size_t room = s3_internal::Transfer::kMaxErrorBody - t->error_body.size();
    t->error_body.append(data, std::min(len, room));
    return len;
  }
  if (len > t->max_bytes - t->received) {
    t->too_big = true;
    return 0;
  }
  if (t->sink == Sink::kMemory) {
    t->body.append(data, len);
  } else {
    size_t done = 0;
    while (done < len) {
      const ssize_t n =
          ::pwrite(t->fd, data + done, len - done, static_cast<off_t>(t->received + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        t->write_errno = n < 0 ? errno : EIO;
        return 0;
      }
      done += static_cast<size_t>(n);
    }
  }
  t->received += len;
  return len;
}

size_t OnHeader(char* data, size_t size, size_t nitems, void* userdata) {
  auto* t = static_cast<s3_internal::Transfer*>(userdata);
  const size_t len = size * nitems;
  absl::string_view line(data, len);
  if (absl::StartsWith(line, "HTTP/")) {
    t->etag.clear();  // a new response (after 100 Continue, say)
  } else if (absl::StartsWithIgnoreCase(line, "etag:")) {
    t->etag = std::string(absl::StripAsciiWhitespace(line.substr(5)));
  }
  return len;
}

// ---- status mapping ----

// S3 error codes that mean "send it again".
bool IsRetryableS3Code(absl::string_view code) {
  return code == "RequestTimeout" || code == "SlowDown" || code == "InternalError" ||
         code == "ServiceUnavailable" || code == "BadDigest" ||
         code == "XAmzContentSHA256Mismatch" || code == "OperationAborted" ||
         code == "IncompleteBody";
}

bool IsCredentialCode(absl::string_view code) {
  return code == "ExpiredToken" || code == "InvalidToken" ||
         code == "AuthorizationHeaderMalformed" || code == "InvalidAccessKeyId" ||
         code == "SignatureDoesNotMatch" || code == "AccessDenied" ||
         code == "TokenRefreshRequired";
}

// The code a finished HTTP answer maps to (banner of s3_store.h).
absl::StatusCode CodeForHttp(long status, absl::string_view s3_code, bool* retryable) {
  *retryable = false;
  if (status == 429 || status >= 500 || status == 409) {
    *retryable = true;
    return absl::StatusCode::kUnavailable;
  }
  if (s3_code == "BadDigest" || s3_code == "XAmzContentSHA256Mismatch" ||
      s3_code == "InvalidDigest") {
    *retryable = s3_code != "InvalidDigest";
    return absl::StatusCode::kDataLoss;
  }
  if (IsRetryableS3Code(s3_code)) {
    *retryable = true;
    return absl::StatusCode::kUnavailable;
  }
  if (status == 403 || IsCredentialCode(s3_code)) return absl::StatusCode::kPermissionDenied;
  switch (status) {
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 404:
      return absl::StatusCode::kNotFound;
    case 412:
      return absl::StatusCode::kAlreadyExists;
    default:
      return absl::StatusCode::kInvalidArgument;
  }
}

// The code a failed libcurl transfer maps to.
absl::StatusCode CodeForCurl(CURLcode rc, bool* retryable) {
  *retryable = false;
  switch (rc) {
    case CURLE_OPERATION_TIMEDOUT:
      *retryable = true;
      return absl::StatusCode::kDeadlineExceeded;
    case CURLE_PARTIAL_FILE:
      *retryable = true;
      return absl::StatusCode::kDataLoss;
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SEND_FAIL_REWIND:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_AGAIN:
      *retryable = true;
      return absl::StatusCode::kUnavailable;
    case CURLE_URL_MALFORMAT:
    case CURLE_UNSUPPORTED_PROTOCOL:
      return absl::StatusCode::kInvalidArgument;
    case CURLE_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    default:
      // TLS verification, a bad CA file and the like: trying again does not help.
      return absl::StatusCode::kUnavailable;
  }
}

// ---- files ----

// Reads exactly `len` bytes at `offset`; INVALID_ARGUMENT when the file ends first.
absl::Status PreadFull(int fd, char* buf, size_t len, uint64_t offset) {
  size_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, buf + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, "reading the file to upload");
    if (n == 0) {
      return absl::InvalidArgumentError(absl::StrCat("the file to upload ends at byte ",
                                                     offset + done, ", before the size given"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// ---- options ----

bool ValidBucket(absl::string_view bucket, bool path_style) {
  if (path_style) {
    return !bucket.empty() && bucket.size() <= 255 &&
           std::all_of(bucket.begin(), bucket.end(), [](char c) {
             return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ||
                    c == '_';
           });
  }
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  if (!absl::ascii_isalnum(static_cast<unsigned char>(bucket.front())) ||
      !absl::ascii_isalnum(static_cast<unsigned char>(bucket.back()))) {
    return false;
  }
  return std::all_of(bucket.begin(), bucket.end(), [](char c) {
    return absl::ascii_islower(static_cast<unsigned char>(c)) ||
           absl::ascii_isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-';
  });
}

struct Endpoint {
  std::string scheme;
  std::string authority;
};

absl::StatusOr<Endpoint> ParseEndpoint(absl::string_view endpoint) {
  Endpoint out;
  absl::string_view rest = endpoint;
  if (absl::ConsumePrefix(&rest, "http://")) {
    out.scheme = "http";
  } else if (absl::ConsumePrefix(&rest, "https://")) {
    out.scheme = "https";
  } else {
    return absl::InvalidArgumentError(absl::StrCat("S3 endpoint \"", Sanitize(endpoint),
                                                   "\" does not start with http:// or https://"));
  }
  absl::ConsumeSuffix(&rest, "/");
  if (rest.empty() || rest.find_first_of("/?#@ \t") != absl::string_view::npos ||
      HasControlChar(rest)) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 endpoint \"", Sanitize(endpoint),
                     "\" is not of the form scheme://host[:port] (no path, no user)"));
  }
  out.authority = std::string(rest);
  return out;
}

}  // namespace

absl::Status S3Options::Validate() const {
  CKPT_RETURN_IF_ERROR(ParseEndpoint(endpoint).status());
  if (region.empty() || HasControlChar(region) || region.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("S3 region is empty or malformed");
  }
  if (!ValidBucket(bucket, path_style)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "S3 bucket \"", Sanitize(bucket), "\" is not a valid ",
        path_style ? "bucket name" : "bucket name for virtual-hosted addressing (DNS label)"));
  }
  if (absl::StartsWith(prefix, "/") || HasControlChar(prefix) || prefix.size() > 512) {
    return absl::InvalidArgumentError(
        "S3 prefix starts with '/', has a control character, or is over 512 bytes");
  }
  if (part_bytes < kMinPartBytes || part_bytes > kMaxPartBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "S3 part_bytes ", part_bytes, " is outside [5 MiB, 5 GiB], S3's bounds on a part"));
  }
  if (parallel_parts < 1 || parallel_parts > kMaxParallelParts) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 parallel_parts ", parallel_parts, " is outside [1, 64]"));
  }
  if (max_attempts < 1) return absl::InvalidArgumentError("S3 max_attempts is 0");
  if (backoff_base < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("S3 backoff_base is negative");
  }
  if (request_timeout < absl::Seconds(1) || connect_timeout < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(
        "S3 request_timeout is under 1 s or connect_timeout under 1 ms");
  }
  if (list_page_keys < 1 || list_page_keys > 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 list_page_keys ", list_page_keys, " is outside [1, 1000]"));
  }
  if (HasControlChar(access_key_id) || HasControlChar(secret_access_key) ||
      HasControlChar(session_token)) {
    return absl::UnauthenticatedError("S3 credentials contain a control character");
  }
  if (access_key_id.empty() || secret_access_key.empty()) {
    return absl::UnauthenticatedError("S3 access key id or secret key is empty");
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// The credentials file.

absl::Status ReadS3Credentials(const std::string& path, S3Options* out) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ELOOP) {
      return absl::PermissionDeniedError(
          absl::StrCat("S3 credentials file ", path, " is a symbolic link; refusing it"));
    }
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("S3 credentials file ", path, " does not exist"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open the S3 credentials file ", path, ": ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("fstat of the S3 credentials file ", path));
  }
  const unsigned mode = static_cast<unsigned>(st.st_mode) & 07777u;
  if (!S_ISREG(st.st_mode)) {
    return absl::PermissionDeniedError(
        absl::StrFormat("S3 credentials file %s is not a regular file (mode %06o); refusing it",
                        path, static_cast<unsigned>(st.st_mode)));
  }
  if ((mode & 077u) != 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("S3 credentials file %s has mode %04o: group or others have access to it; "
                        "refusing it (chmod 600 it)",
                        path, mode));
  }
  constexpr off_t kMaxFileBytes = 64 << 10;
  if (st.st_size > kMaxFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 credentials file ", path, " is over 64 KiB"));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrCat("reading S3 credentials file ", path));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);

  std::optional<std::string> access, secret, token;
  absl::Status status;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const size_t eq = line.find('=');
    absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, std::min(eq, line.size())));
    absl::string_view value =
        eq == absl::string_view::npos ? "" : absl::StripAsciiWhitespace(line.substr(eq + 1));
    std::optional<std::string>* slot = nullptr;
    if (name == "access_key_id") {
      slot = &access;
    } else if (name == "secret_access_key") {
      slot = &secret;
    } else if (name == "session_token") {
      slot = &token;
    }
    const char* problem = nullptr;
    if (eq == absl::string_view::npos) {
      problem = "is not of the form key = value";
    } else if (slot == nullptr) {
      problem = "has an unknown key (expected access_key_id, secret_access_key, session_token)";
    } else if (slot->has_value()) {
      problem = "repeats a key";
    } else if (value.empty() || HasControlChar(value)) {
      problem = "has an empty value or a control character in it";
    }
    if (problem != nullptr) {
      status = absl::InvalidArgumentError(
          absl::StrCat("S3 credentials file ", path, ": line ", line_number, " ", problem));
      break;
    }
    *slot = std::string(value);
  }
  if (status.ok() && !access.has_value()) {
    status = absl::InvalidArgumentError(
        absl::StrCat("S3 credentials file ", path, " has no access_key_id"));
  }
  if (status.ok() && !secret.has_value()) {
    status = absl::InvalidArgumentError(
        absl::StrCat("S3 credentials file ", path, " has no secret_access_key"));
  }
  if (status.ok()) {
    out->access_key_id = std::move(*access);
    out->secret_access_key = std::move(*secret);
    out->session_token = token.has_value() ? std::move(*token) : std::string();
  }
  // The secret's bytes do not linger in freed memory.
  explicit_bzero(text.data(), text.size());
  for (auto* v : {&access, &secret, &token}) {
    if (v->has_value()) explicit_bzero((*v)->data(), (*v)->size());
  }
  return status;
}

// ---------------------------------------------------------------------------
// S3Store

absl::StatusOr<std::unique_ptr<S3Store>> S3Store::Create(S3Options options) {
  CKPT_RETURN_IF_ERROR(options.Validate());
  CKPT_RETURN_IF_ERROR(InitCurlOnce());
  return std::unique_ptr<S3Store>(new S3Store(std::move(options)));
}

S3Store::S3Store(S3Options options)
    : options_(std::move(options)), pool_(std::make_unique<s3_internal::HandlePool>()) {
  // Validate() accepted the endpoint.
  Endpoint endpoint = ParseEndpoint(options_.endpoint).value();
  scheme_ = endpoint.scheme;
  authority_ = endpoint.authority;
  if (options_.path_style) {
    host_ = authority_;
    path_base_ = absl::StrCat("/", options_.bucket);
  } else {
    host_ = absl::StrCat(options_.bucket, ".", authority_);
  }
}

S3Store::~S3Store() = default;

std::string S3Store::Describe() const {
  return absl::StrCat("s3 ", options_.endpoint, " bucket ", options_.bucket, " prefix ",
                      options_.prefix);
}

std::string S3Store::Redact(std::string text) const {
  for (const std::string* secret :
       {&options_.secret_access_key, &options_.session_token, &options_.access_key_id}) {
    if (secret->size() >= 4) absl::StrReplaceAll({{*secret, "<redacted>"}}, &text);
  }
  return text;
}

absl::StatusOr<std::string> S3Store::FullKey(const std::string& key) const {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("S3 key \"", Sanitize(key), "\" ", why));
  };
  if (key.empty()) return bad("is empty");
  if (key.front() == '/') return bad("starts with '/'");
  if (HasControlChar(key)) return bad("has a control character");
  for (absl::string_view segment : absl::StrSplit(key, '/')) {
    if (segment.empty() || segment == "." || segment == "..") {
      return bad("has an empty, \".\" or \"..\" segment");
    }
  }
  std::string full = absl::StrCat(options_.prefix, key);
  if (full.size() > kMaxKeyBytes) return bad("is over 1024 bytes with the prefix");
  return full;
}

absl::Duration S3Store::Backoff(unsigned retry) const {
  absl::Duration d = options_.backoff_base;
  for (unsigned i = 1; i < retry && d < kMaxBackoff; ++i) d *= 2;
  d = std::min(d, kMaxBackoff);
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> half(0.5, 1.0);
  return d * half(rng);
}

absl::Status S3Store::Prepare(const Request& request, Transfer* t) {
  CURL* easy = t->easy;
  curl_easy_reset(easy);
  t->ResetOutcome();

  std::string path = path_base_;
  if (!request.key.empty()) {
    absl::StrAppend(&path, "/", request.key);
  } else if (path.empty()) {
    path = "/";
  }
  t->url = absl::StrCat(scheme_, "://", host_, UriEncode(path, true));
  const std::string query = CanonicalQueryString(request.query);
  if (!query.empty()) absl::StrAppend(&t->url, "?", query);

  SigV4Request sig;
  sig.method = request.method;
  sig.path = path;
  sig.query = request.query;
  sig.headers = request.headers;
  sig.headers.emplace_back("host", host_);
  sig.payload_sha256 = request.payload_sha256;
  const SigV4Credentials credentials{options_.access_key_id, options_.secret_access_key,
                                     options_.session_token};
  CKPT_ASSIGN_OR_RETURN(SigV4Signed signed_request,
                        SignV4(sig, credentials, options_.region, "s3", AmzDate(absl::Now())));

  curl_slist* list = nullptr;
  bool has_content_type = false;
  const auto append = [&list](const std::string& line) {
    curl_slist* next = curl_slist_append(list, line.c_str());
    if (next != nullptr) list = next;
    return next != nullptr;
  };
  bool ok = true;
  for (const auto& [name, value] : signed_request.headers) {
    if (name == "content-type") has_content_type = true;
    // "name;" is curl's way to send a header with an empty value.
    ok = ok && append(value.empty() ? absl::StrCat(name, ";") : absl::StrCat(name, ": ", value));
  }
  // No "Expect: 100-continue" round trip, no form content type on POST.
  ok = ok && append("Expect:");
  if (!has_content_type) ok = ok && append("Content-Type:");
  t->header_list.reset(list);
  if (!ok) return absl::ResourceExhaustedError("curl_slist_append: out of memory");

  curl_easy_setopt(easy, CURLOPT_URL, t->url.c_str());
  curl_easy_setopt(easy, CURLOPT_HTTPHEADER, t->header_list.get());
  curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(easy, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(easy, CURLOPT_PATH_AS_IS, 1L);
  curl_easy_setopt(easy, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(easy, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, t->error_buffer);
  curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS,
                   static_cast<long>(absl::ToInt64Milliseconds(options_.request_timeout)));
  curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(absl::ToInt64Milliseconds(options_.connect_timeout)));
  curl_easy_setopt(easy, CURLOPT_LOW_SPEED_LIMIT, kLowSpeedBytesPerSecond);
  curl_easy_setopt(
      easy, CURLOPT_LOW_SPEED_TIME,
      static_cast<long>(absl::ToInt64Seconds(std::min(kLowSpeedTime, options_.request_timeout))));
  if (!options_.ca_file.empty()) curl_easy_setopt(easy, CURLOPT_CAINFO, options_.ca_file.c_str());
  curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &OnWrite);
  curl_easy_setopt(easy, CURLOPT_WRITEDATA, t);
  curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(easy, CURLOPT_HEADERDATA, t);
  curl_easy_setopt(easy, CURLOPT_PRIVATE, t);

  t->upload = request.body;
  // A body (PUT, POST) is read through OnRead and rewound through OnSeek.
  auto send_body = [easy, t] {
    curl_easy_setopt(easy, CURLOPT_READFUNCTION, &OnRead);
    curl_easy_setopt(easy, CURLOPT_READDATA, t);
    curl_easy_setopt(easy, CURLOPT_SEEKFUNCTION, &OnSeek);
    curl_easy_setopt(easy, CURLOPT_SEEKDATA, t);
  };
  if (request.method == "GET") {
    curl_easy_setopt(easy, CURLOPT_HTTPGET, 1L);
  } else if (request.method == "HEAD") {
    curl_easy_setopt(easy, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    curl_easy_setopt(easy, CURLOPT_UPLOAD, 1L);
    send_body();
    curl_easy_setopt(easy, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method == "POST") {
    curl_easy_setopt(easy, CURLOPT_POST, 1L);
    send_body();
    curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(request.body.size()));
  } else {
    curl_easy_setopt(easy, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  return absl::OkStatus();
}

absl::Status S3Store::Classify(const Request& request, Transfer* transfer, int curl_code,
                               bool* retryable) const {
  Transfer& t = *transfer;
  *retryable = false;
  const auto rc = static_cast<CURLcode>(curl_code);
  const std::string op = absl::StrCat("S3 ", request.method, " ",
                                      request.key.empty() ? "(bucket)" : Sanitize(request.key),
                                      " at ", options_.endpoint, " bucket ", options_.bucket);
  std::string& detail = t.detail;
  if (t.too_big) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the object is larger than the limit of ", t.max_bytes, " bytes"));
  }
  if (t.write_errno != 0) {
    return ErrnoStatus(t.write_errno, absl::StrCat(op, ": writing the object to the file"));
  }
  if (rc != CURLE_OK) {
    // curl's error buffer names the host and the failing step; never headers.
    detail = t.error_buffer[0] != '\0'
                 ? absl::StrCat(curl_easy_strerror(rc), " (", Sanitize(t.error_buffer), ")")
                 : std::string(curl_easy_strerror(rc));
    absl::StatusCode code = CodeForCurl(rc, retryable);
    curl_off_t connect_us = 0;
    if (rc == CURLE_OPERATION_TIMEDOUT &&
        curl_easy_getinfo(t.easy, CURLINFO_CONNECT_TIME_T, &connect_us) == CURLE_OK &&
        connect_us == 0) {
      code = absl::StatusCode::kUnavailable;  // never connected: unreachable, not slow
    }
    return absl::Status(code, absl::StrCat(op, ": ", detail));
  }
  long status = t.status;
  if (!t.status_known) curl_easy_getinfo(t.easy, CURLINFO_RESPONSE_CODE, &status);
  if (Is2xx(status)) {
    if (request.error_in_ok_body && absl::StrContains(t.body, "<Error>")) {
      const std::string code = ElementText(t.body, "Code").value_or("(no code)");
      const std::string message = ElementText(t.body, "Message").value_or("");
      detail =
          absl::StrCat(status, " with an error: ", Sanitize(code), ": ", Sanitize(Redact(std::string(message))));
      // Mapped by the code alone, as for a 400 answer: InternalError and
      // SlowDown are retried, a refused part list is not.
      return absl::Status(CodeForHttp(400, code, retryable), absl::StrCat(op, ": ", detail));
    }
    if (request.method == "GET") {
      curl_off_t length = -1;
      curl_easy_getinfo(t.easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
      if (length >= 0 && t.received != static_cast<uint64_t>(length)) {
        detail = absl::StrCat("received ", t.received, " bytes of ", length);
        *retryable = true;
        return absl::DataLossError(absl::StrCat(op, ": ", detail));
      }
    }
    return absl::OkStatus();
  }
  const std::string code = Sanitize(ElementText(t.error_body, "Code").value_or(""));
  const std::string message = ElementText(t.error_body, "Message").value_or("");
  t.s3_code = code;
  detail = absl::StrCat(status);
  if (!code.empty()) absl::StrAppend(&detail, " ", code);
  if (!message.empty()) absl::StrAppend(&detail, ": ", Sanitize(Redact(std::string(message))));
  return absl::Status(CodeForHttp(status, code, retryable), absl::StrCat(op, ": ", detail));
}

absl::Status S3Store::Execute(const Request& request, Transfer* t) {
  EasyLease easy(pool_.get());
  if (easy.get() == nullptr) return absl::ResourceExhaustedError("curl_easy_init failed");
  t->easy = easy.get();
  absl::Status status;
  for (unsigned attempt = 1;; ++attempt) {
    status = Prepare(request, t);
    if (!status.ok()) break;
    const CURLcode rc = curl_easy_perform(t->easy);
    bool retryable = false;
    status = Classify(request, t, rc, &retryable);
    if (status.ok() || !retryable || attempt >= options_.max_attempts) {
      if (!status.ok() && attempt > 1) {
        status = absl::Status(status.code(),
                              absl::StrCat(status.message(), " (after ", attempt, " attempts)"));
      }
      break;
    }
    const absl::Duration wait = Backoff(attempt);
    CKPT_LOG(WARNING) << status.message() << "; attempt " << attempt << " of "
                      << options_.max_attempts << ", retrying in " << wait;
    absl::SleepFor(wait);
  }
  t->easy = nullptr;
  return status;
}

absl::Status S3Store::CheckAccess() {
  Request request;
  request.method = "GET";
  request.query = {{"list-type", "2"}, {"max-keys", "1"}, {"prefix", options_.prefix}};
  Transfer t;
  t.max_bytes = kMaxListPageBytes;
  absl::Status status = Execute(request, &t);
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return status;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return absl::Status(status.code(), absl::StrCat("the S3 store at ", options_.endpoint,
                                                      " refused ckptd's credentials for bucket ",
                                                      options_.bucket, " (", t.detail, ")"));
    case absl::StatusCode::kNotFound:
      return absl::NotFoundError(absl::StrCat("the S3 store at ", options_.endpoint,
                                              " has no bucket ", options_.bucket, " (", t.detail,
                                              ")"));
    default:
      return status;
  }
}

absl::Status S3Store::PutBytes(const std::string& key, std::string_view bytes, bool if_absent) {
  const absl::string_view data(bytes.data(), bytes.size());
  Request request;
  request.method = "PUT";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  request.body = data;
  request.payload_sha256 = Sha256Hex(data);
  if (if_absent) request.headers.emplace_back("if-none-match", "*");
  Transfer t;
  return Execute(request, &t);
}

absl::Status S3Store::PutFile(const std::string& key, int fd, uint64_t size) {
  CKPT_ASSIGN_OR_RETURN(std::string full_key, FullKey(key));
  if (size > options_.part_bytes) return PutMultipart(full_key, fd, size);
  std::unique_ptr<char[]> buf(new char[std::max<uint64_t>(size, 1)]);
  CKPT_RETURN_IF_ERROR(PreadFull(fd, buf.get(), size, 0));
  Request request;
  request.method = "PUT";
  request.key = std::move(full_key);
  request.body = absl::string_view(buf.get(), size);
  request.payload_sha256 = Sha256Hex(request.body);
  Transfer t;
  return Execute(request, &t);
}

absl::Status S3Store::PutMultipart(const std::string& full_key, int fd, uint64_t size) {
  // More than kMaxParts parts of part_bytes: larger parts, in whole MiB.
  uint64_t part_size = options_.part_bytes;
  if ((size + part_size - 1) / part_size > kMaxParts) {
    constexpr uint64_t kMiB = uint64_t{1} << 20;
    part_size = ((size + kMaxParts - 1) / kMaxParts + kMiB - 1) / kMiB * kMiB;
    if (part_size > kMaxPartBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("S3 object ", Sanitize(full_key), " of ", size,
                       " bytes is over S3's limit (10000 parts of 5 GiB)"));
    }
  }

  Request create;
  create.method = "POST";
  create.key = full_key;
  create.query = {{"uploads", ""}};
  Transfer created;
  CKPT_RETURN_IF_ERROR(Execute(create, &created));
  const std::optional<std::string> upload_id = ElementText(created.body, "UploadId");
  if (!upload_id.has_value() || upload_id->empty()) {
    return absl::UnavailableError(absl::StrCat("S3 POST ", Sanitize(full_key), " at ",
                                               options_.endpoint,
                                               ": no UploadId in the answer to "
                                               "CreateMultipartUpload"));
  }

  std::vector<std::string> etags;
  absl::Status status = UploadParts(full_key, *upload_id, fd, size, part_size, &etags);
  if (status.ok()) status = CompleteMultipart(full_key, *upload_id, etags);
  if (!status.ok()) AbortMultipart(full_key, *upload_id);
  return status;
}

namespace {

// One part transfer of a multipart upload.
struct PartSlot {
  enum class State { kIdle, kRunning, kWaiting };
  EasyLease easy;
  std::unique_ptr<char[]> buffer;
  State state = State::kIdle;
  uint64_t part = 0;  // 0-based index
  unsigned attempt = 0;
  absl::Time not_before;
  s3_internal::Request request;
  s3_internal::Transfer transfer;

  explicit PartSlot(s3_internal::HandlePool* pool) : easy(pool) {}
};

// Removes every running transfer from the multi handle on the way out, so
// that the handles go back to the pool detached.
class MultiSession {
 public:
  explicit MultiSession(std::vector<std::unique_ptr<PartSlot>>* slots)
      : multi_(curl_multi_init()), slots_(slots) {}
  ~MultiSession() {
    for (auto& slot : *slots_) {
      if (slot->state == PartSlot::State::kRunning) {
        curl_multi_remove_handle(multi_.get(), slot->easy.get());
        slot->state = PartSlot::State::kIdle;
      }
    }
  }
  MultiSession(const MultiSession&) = delete;
  MultiSession& operator=(const MultiSession&) = delete;
  CURLM* get() const { return multi_.get(); }

 private:
  MultiPtr multi_;
  std::vector<std::unique_ptr<PartSlot>>* slots_;
};

}  // namespace

absl::Status S3Store::UploadParts(const std::string& full_key, const std::string& upload_id, int fd,
                                  uint64_t size, uint64_t part_size,
                                  std::vector<std::string>* etags) {
  const uint64_t parts = (size + part_size - 1) / part_size;
  etags->assign(parts, std::string());
  const size_t slot_count = static_cast<size_t>(std::min<uint64_t>(options_.parallel_parts, parts));
  std::vector<std::unique_ptr<PartSlot>> slots;
  for (size_t i = 0; i < slot_count; ++i) {
    slots.push_back(std::make_unique<PartSlot>(pool_.get()));
    if (slots.back()->easy.get() == nullptr) {
      return absl::ResourceExhaustedError("curl_easy_init failed");
    }
  }
  MultiSession multi(&slots);
  if (multi.get() == nullptr) return absl::ResourceExhaustedError("curl_multi_init failed");

  // (Re)starts the transfer of `slot`'s part.
  const auto start = [&](PartSlot* slot) -> absl::Status {
    ++slot->attempt;
    slot->transfer.easy = slot->easy.get();
    CKPT_RETURN_IF_ERROR(Prepare(slot->request, &slot->transfer));
    const CURLMcode mc = curl_multi_add_handle(multi.get(), slot->easy.get());
    if (mc != CURLM_OK) {
      return absl::InternalError(absl::StrCat("curl_multi_add_handle: ", curl_multi_strerror(mc)));
    }
    slot->state = PartSlot::State::kRunning;
    return absl::OkStatus();
  };

  uint64_t next_part = 0;
  uint64_t parts_done = 0;
  while (parts_done < parts) {
    const absl::Time now = absl::Now();
    absl::Time earliest_retry = absl::InfiniteFuture();
    for (auto& slot_ptr : slots) {
      PartSlot* slot = slot_ptr.get();
      if (slot->state == PartSlot::State::kIdle && next_part < parts) {
        const uint64_t offset = next_part * part_size;
        const size_t len = static_cast<size_t>(std::min(part_size, size - offset));
        if (slot->buffer == nullptr) slot->buffer.reset(new char[part_size]);
        CKPT_RETURN_IF_ERROR(PreadFull(fd, slot->buffer.get(), len, offset));
        slot->part = next_part++;
        slot->attempt = 0;
        slot->request = Request();
        slot->request.method = "PUT";
        slot->request.key = full_key;
        slot->request.query = {{"partNumber", absl::StrCat(slot->part + 1)},
                               {"uploadId", upload_id}};
        slot->request.body = absl::string_view(slot->buffer.get(), len);
        slot->request.payload_sha256 = Sha256Hex(slot->request.body);
        CKPT_RETURN_IF_ERROR(start(slot));
      } else if (slot->state == PartSlot::State::kWaiting) {
        if (now >= slot->not_before) {
          CKPT_RETURN_IF_ERROR(start(slot));
        } else {
          earliest_retry = std::min(earliest_retry, slot->not_before);
        }
      }
    }

    int running = 0;
    CURLMcode mc = curl_multi_perform(multi.get(), &running);
    if (mc != CURLM_OK) {
      return absl::InternalError(absl::StrCat("curl_multi_perform: ", curl_multi_strerror(mc)));
    }
    int queued = 0;
    while (CURLMsg* msg = curl_multi_info_read(multi.get(), &queued)) {
      if (msg->msg != CURLMSG_DONE) continue;
      PartSlot* slot = nullptr;
      for (auto& s : slots) {
        if (s->easy.get() == msg->easy_handle) slot = s.get();
      }
      if (slot == nullptr) continue;
      const CURLcode rc = msg->data.result;
      curl_multi_remove_handle(multi.get(), slot->easy.get());
      slot->state = PartSlot::State::kIdle;
      bool retryable = false;
      absl::Status status = Classify(slot->request, &slot->transfer, rc, &retryable);
      if (status.ok() && slot->transfer.etag.empty()) {
        status = absl::UnavailableError(absl::StrCat("S3 PUT ", Sanitize(full_key), " part ",
                                                     slot->part + 1, " at ", options_.endpoint,
                                                     ": no ETag in the answer"));
        retryable = true;
      }
      if (status.ok()) {
        (*etags)[slot->part] = slot->transfer.etag;
        ++parts_done;
        continue;
      }
      if (!retryable || slot->attempt >= options_.max_attempts) {
        std::string where = absl::StrCat(" (part ", slot->part + 1);
        if (slot->attempt > 1) absl::StrAppend(&where, ", after ", slot->attempt, " attempts");
        return absl::Status(status.code(), absl::StrCat(status.message(), where, ")"));
      }
      const absl::Duration wait = Backoff(slot->attempt);
      CKPT_LOG(WARNING) << status.message() << "; part " << slot->part + 1 << " attempt "
                        << slot->attempt << " of " << options_.max_attempts << ", retrying in "
                        << wait;
      slot->state = PartSlot::State::kWaiting;
      slot->not_before = absl::Now() + wait;
      earliest_retry = std::min(earliest_retry, slot->not_before);
    }
    if (parts_done == parts) break;

    // Sleep until a socket is ready, a retry is due, or at most 1 s.
    absl::Duration timeout = absl::Seconds(1);
    if (earliest_retry != absl::InfiniteFuture()) {
      timeout = std::clamp(earliest_retry - absl::Now(), absl::ZeroDuration(), timeout);
    }
    const bool slot_free = std::any_of(slots.begin(), slots.end(), [&](const auto& s) {
      return s->state == PartSlot::State::kIdle && next_part < parts;
    });
    if (slot_free) timeout = absl::ZeroDuration();
    mc = curl_multi_poll(multi.get(), nullptr, 0,
                         static_cast<int>(absl::ToInt64Milliseconds(timeout)), nullptr);
    if (mc != CURLM_OK) {
      return absl::InternalError(absl::StrCat("curl_multi_poll: ", curl_multi_strerror(mc)));
    }
  }
  return absl::OkStatus();
}

absl::Status S3Store::CompleteMultipart(const std::string& full_key, const std::string& upload_id,
                                        const std::vector<std::string>& etags) {
  std::string xml = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (size_t i = 0; i < etags.size(); ++i) {
    absl::StrAppend(&xml, "<Part><PartNumber>", i + 1, "</PartNumber><ETag>", XmlEscape(etags[i]),
                    "</ETag></Part>");
  }
  absl::StrAppend(&xml, "</CompleteMultipartUpload>");
  Request request;
  request.method = "POST";
  request.key = full_key;
  request.query = {{"uploadId", upload_id}};
  request.headers = {{"content-type", "application/xml"}};
  request.body = xml;
  request.payload_sha256 = Sha256Hex(xml);
  request.error_in_ok_body = true;
  Transfer t;
  absl::Status status = Execute(request, &t);
  if (status.code() == absl::StatusCode::kNotFound) {
    // NoSuchUpload: the upload is gone (an earlier attempt may even have
    // completed it); the caller uploads again.
    return absl::UnavailableError(
        absl::StrCat(status.message(), " (CompleteMultipartUpload; upload the object again)"));
  }
  return status;
}

void S3Store::AbortMultipart(const std::string& full_key, const std::string& upload_id) {
  Request request;
  request.method = "DELETE";
  request.key = full_key;
  request.query = {{"uploadId", upload_id}};
  Transfer t;
  const absl::Status status = Execute(request, &t);
  if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
    // The parts stay until a lifecycle rule or ListMultipartUploads removes them.
    CKPT_LOG(WARNING) << "AbortMultipartUpload failed: " << status.message();
  }
  IgnoreError(status, "the upload already failed; the parts left are garbage, not state");
}

absl::StatusOr<uint64_t> S3Store::GetToFile(const std::string& key, int fd, uint64_t max_bytes) {
  Request request;
  request.method = "GET";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  Transfer t;
  t.sink = Sink::kFd;
  t.fd = fd;
  t.max_bytes = max_bytes;
  CKPT_RETURN_IF_ERROR(Execute(request, &t));
  return t.received;
}

absl::StatusOr<std::string> S3Store::GetBytes(const std::string& key, uint64_t max_bytes) {
  Request request;
  request.method = "GET";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  Transfer t;
  t.sink = Sink::kMemory;
  t.max_bytes = max_bytes;
  CKPT_RETURN_IF_ERROR(Execute(request, &t));
  return std::move(t.body);
}

absl::StatusOr<std::vector<ObjectInfo>> S3Store::List(const std::string& prefix) {
  if (absl::StartsWith(prefix, "/") || HasControlChar(prefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "S3 list prefix \"", Sanitize(prefix), "\" starts with '/' or has a control character"));
  }
  const std::string full_prefix = absl::StrCat(options_.prefix, prefix);
  std::vector<ObjectInfo> out;
  std::string token;
  for (size_t page = 0;; ++page) {
    // A server that never stops paging must not grow ckptd without bound.
    if (page >= kMaxListPages) {
      return absl::UnavailableError(absl::StrCat("S3 list at ", options_.endpoint, " bucket ",
                                                 options_.bucket, ": more than ", kMaxListPages,
                                                 " pages under one prefix"));
    }
    Request request;
    request.method = "GET";
    request.query = {{"list-type", "2"},
                     {"max-keys", absl::StrCat(options_.list_page_keys)},
                     {"prefix", full_prefix}};
    if (!token.empty()) request.query.emplace_back("continuation-token", token);
    Transfer t;
    t.max_bytes = kMaxListPageBytes;
    CKPT_RETURN_IF_ERROR(Execute(request, &t));

    size_t pos = 0;
    while (auto contents = FindElement(t.body, "Contents", &pos)) {
      std::optional<std::string> key = ElementText(*contents, "Key");
      std::optional<std::string> size_text = ElementText(*contents, "Size");
      uint64_t size = 0;
      if (!key.has_value() || !size_text.has_value() || !absl::SimpleAtoi(*size_text, &size)) {
        return absl::UnavailableError(absl::StrCat("S3 list at ", options_.endpoint, " bucket ",
                                                   options_.bucket,
                                                   ": a <Contents> entry without Key or Size"));
      }
      if (!absl::StartsWith(*key, full_prefix)) continue;
      out.push_back(ObjectInfo{key->substr(options_.prefix.size()), size});
    }
    const bool truncated = ElementText(t.body, "IsTruncated").value_or("false") == "true";
    if (!truncated) break;
    std::string next = ElementText(t.body, "NextContinuationToken").value_or("");
    if (next.empty() || next == token) {
      return absl::UnavailableError(
          absl::StrCat("S3 list at ", options_.endpoint, " bucket ", options_.bucket,
                       ": a truncated page without a new NextContinuationToken"));
    }
    token = std::move(next);
  }
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return out;
}

absl::Status S3Store::Delete(const std::string& key) {
  Request request;
  request.method = "DELETE";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  Transfer t;
  absl::Status status = Execute(request, &t);
  // A missing object is deleted already; a missing bucket is an error.
  if (status.code() == absl::StatusCode::kNotFound && t.s3_code != "NoSuchBucket") {
    return absl::OkStatus();
  }
  return status;
}

}  // namespace ckpt::remote
