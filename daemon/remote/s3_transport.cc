#include "daemon/remote/s3_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/remote/s3_options.h"
#include "daemon/remote/s3_xml.h"

namespace ckpt::remote::s3_internal {

namespace {

constexpr absl::Duration kMaxBackoff = absl::Seconds(30);
// The low-speed limit: a transfer slower than this for kLowSpeedTime fails.
constexpr long kLowSpeedBytesPerSecond = 1024;
constexpr absl::Duration kLowSpeedTime = absl::Seconds(30);

absl::once_flag curl_once;
CURLcode curl_init_code = CURLE_OK;

bool Is2xx(long status) { return status >= 200 && status < 300; }

// ---- curl callbacks; `userdata` is the Transfer ----

size_t OnRead(char* buffer, size_t size, size_t nitems, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
  const size_t n = std::min(size * nitems, t->upload.size() - t->upload_pos);
  std::memcpy(buffer, t->upload.data() + t->upload_pos, n);
  t->upload_pos += n;
  return n;
}

int OnSeek(void* userdata, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(userdata);
  if (origin != SEEK_SET || offset < 0 || static_cast<uint64_t>(offset) > t->upload.size()) {
    return CURL_SEEKFUNC_CANTSEEK;
  }
  t->upload_pos = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

// Writes a piece of a 2xx body to the transfer's file; false (write_errno
// set) when that fails.
bool WriteToFd(Transfer* t, const char* data, size_t len) {
  size_t done = 0;
  while (done < len) {
    const ssize_t n =
        ::pwrite(t->fd, data + done, len - done, static_cast<off_t>(t->received + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      t->write_errno = n < 0 ? errno : EIO;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

size_t OnWrite(char* data, size_t size, size_t nmemb, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
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
    const size_t room = Transfer::kMaxErrorBody - t->error_body.size();
    t->error_body.append(data, std::min(len, room));
    return len;
  }
  if (len > t->max_bytes - t->received) {
    t->too_big = true;
    return 0;
  }
  if (t->sink == Sink::kMemory) {
    t->body.append(data, len);
  } else if (!WriteToFd(t, data, len)) {
    return 0;
  }
  t->received += len;
  return len;
}

size_t OnHeader(char* data, size_t size, size_t nitems, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
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

}  // namespace

absl::Status InitCurlOnce() {
  absl::call_once(curl_once, [] { curl_init_code = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (curl_init_code != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("curl_global_init failed: ", curl_easy_strerror(curl_init_code)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// HandlePool, Transfer

EasyPtr HandlePool::Take() {
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

void HandlePool::Give(EasyPtr easy) {
  if (easy == nullptr) return;
  curl_easy_reset(easy.get());
  absl::MutexLock lock(&mu_);
  if (idle_.size() < kMaxIdle) idle_.push_back(std::move(easy));
}

void Transfer::ResetOutcome() {
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

// ---------------------------------------------------------------------------
// Transport

Transport::Transport(const S3Options& options) : options_(options) {
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

std::string Transport::Redact(std::string text) const {
  for (const std::string* secret :
       {&options_.secret_access_key, &options_.session_token, &options_.access_key_id}) {
    if (secret->size() >= 4) absl::StrReplaceAll({{*secret, "<redacted>"}}, &text);
  }
  return text;
}

absl::Duration Transport::Backoff(unsigned retry) const {
  absl::Duration d = options_.backoff_base;
  for (unsigned i = 1; i < retry && d < kMaxBackoff; ++i) d *= 2;
  d = std::min(d, kMaxBackoff);
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::uniform_real_distribution<double> half(0.5, 1.0);
  return d * half(rng);
}

// ---- Prepare ----

absl::Status Transport::Prepare(const Request& request, Transfer* t) {
  curl_easy_reset(t->easy);
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

  CKPT_RETURN_IF_ERROR(SetSignedHeaders(request, path, t));
  SetCommonOptions(t);
  t->upload = request.body;
  SetMethod(request, t);
  return absl::OkStatus();
}

absl::Status Transport::SetSignedHeaders(const Request& request, const std::string& path,
                                         Transfer* t) const {
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
  return absl::OkStatus();
}

void Transport::SetCommonOptions(Transfer* t) const {
  CURL* easy = t->easy;
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
}

void Transport::SetMethod(const Request& request, Transfer* t) {
  CURL* easy = t->easy;
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
}

// ---- Classify ----

absl::Status Transport::Classify(const Request& request, Transfer* t, CURLcode rc,
                                 bool* retryable) const {
  *retryable = false;
  const std::string op = absl::StrCat("S3 ", request.method, " ",
                                      request.key.empty() ? "(bucket)" : Sanitize(request.key),
                                      " at ", options_.endpoint, " bucket ", options_.bucket);
  if (t->too_big) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the object is larger than the limit of ", t->max_bytes, " bytes"));
  }
  if (t->write_errno != 0) {
    return ErrnoStatus(t->write_errno, absl::StrCat(op, ": writing the object to the file"));
  }
  if (rc != CURLE_OK) return ClassifyCurlFailure(op, t, rc, retryable);
  long status = t->status;
  if (!t->status_known) curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
  if (Is2xx(status)) return ClassifyOkAnswer(request, op, status, t, retryable);
  return ClassifyErrorAnswer(op, status, t, retryable);
}

absl::Status Transport::ClassifyCurlFailure(const std::string& op, Transfer* t, CURLcode rc,
                                            bool* retryable) const {
  // curl's error buffer names the host and the failing step; never headers.
  t->detail = t->error_buffer[0] != '\0'
                  ? absl::StrCat(curl_easy_strerror(rc), " (", Sanitize(t->error_buffer), ")")
                  : std::string(curl_easy_strerror(rc));
  absl::StatusCode code = CodeForCurl(rc, retryable);
  curl_off_t connect_us = 0;
  if (rc == CURLE_OPERATION_TIMEDOUT &&
      curl_easy_getinfo(t->easy, CURLINFO_CONNECT_TIME_T, &connect_us) == CURLE_OK &&
      connect_us == 0) {
    code = absl::StatusCode::kUnavailable;  // never connected: unreachable, not slow
  }
  return absl::Status(code, absl::StrCat(op, ": ", t->detail));
}

absl::Status Transport::ClassifyOkAnswer(const Request& request, const std::string& op, long status,
                                         Transfer* t, bool* retryable) const {
  if (request.error_in_ok_body && absl::StrContains(t->body, "<Error>")) {
    const std::string code = ElementText(t->body, "Code").value_or("(no code)");
    const std::string message = ElementText(t->body, "Message").value_or("");
    t->detail = absl::StrCat(status, " with an error: ", Sanitize(code), ": ",
                             Sanitize(Redact(std::string(message))));
    // Mapped by the code alone, as for a 400 answer: InternalError and
    // SlowDown are retried, a refused part list is not.
    return absl::Status(CodeForHttp(400, code, retryable), absl::StrCat(op, ": ", t->detail));
  }
  if (request.method == "GET") {
    curl_off_t length = -1;
    curl_easy_getinfo(t->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
    if (length >= 0 && t->received != static_cast<uint64_t>(length)) {
      t->detail = absl::StrCat("received ", t->received, " bytes of ", length);
      *retryable = true;
      return absl::DataLossError(absl::StrCat(op, ": ", t->detail));
    }
  }
  return absl::OkStatus();
}

absl::Status Transport::ClassifyErrorAnswer(const std::string& op, long status, Transfer* t,
                                            bool* retryable) const {
  const std::string code = Sanitize(ElementText(t->error_body, "Code").value_or(""));
  const std::string message = ElementText(t->error_body, "Message").value_or("");
  t->s3_code = code;
  t->detail = absl::StrCat(status);
  if (!code.empty()) absl::StrAppend(&t->detail, " ", code);
  if (!message.empty()) absl::StrAppend(&t->detail, ": ", Sanitize(Redact(std::string(message))));
  return absl::Status(CodeForHttp(status, code, retryable), absl::StrCat(op, ": ", t->detail));
}

// ---- Execute ----

absl::Status Transport::Execute(const Request& request, Transfer* t) {
  EasyLease easy(&pool_);
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

}  // namespace ckpt::remote::s3_internal
