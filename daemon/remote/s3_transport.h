// The HTTP transport of S3Store: libcurl's easy handles kept in a pool, one
// request's description (Request) and its state on the wire (Transfer), the
// preparation of an attempt (URL, SigV4 headers, curl options), the mapping
// of a finished attempt to a Status, and the retry loop with its backoff.
// s3_store.h's banner states the retry and error policy this implements.
//
// Internal to daemon/remote (PRIVATE_HDRS). Called by S3Store's operations
// (s3_store.cc), which run one request at a time through Execute(), and by
// the multipart upload (s3_multipart.cc), which runs several parts at once
// on a curl multi handle through Prepare(), Classify() and Backoff().
//
// Thread-safety: a Transport is thread-safe: its fields are immutable after
// construction and its HandlePool locks itself. A Transfer (and the easy
// handle it borrows) belongs to one thread at a time.
#pragma once

#include <curl/curl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/remote/s3_store.h"
#include "daemon/remote/sigv4.h"

namespace ckpt::remote::s3_internal {

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

// Initializes libcurl for the process, once; later calls return the first
// one's outcome. INTERNAL when curl_global_init failed.
absl::Status InitCurlOnce();

// Idle easy handles, each with its connection cache, so that consecutive
// requests reuse kept-alive connections. Thread-safe.
class HandlePool {
 public:
  // An idle handle or a new one; null only when libcurl is out of memory.
  EasyPtr Take();
  // Keeps `easy` (reset; its connections stay open) unless kMaxIdle are idle.
  // REQUIRES: `easy` is in no multi handle.
  void Give(EasyPtr easy);

 private:
  static constexpr size_t kMaxIdle = 16;
  absl::Mutex mu_;
  std::vector<EasyPtr> idle_ ABSL_GUARDED_BY(mu_);
};

// A handle taken from the pool for one scope. REQUIRES: the pool outlives it.
class EasyLease {
 public:
  explicit EasyLease(HandlePool* pool) : pool_(pool), easy_(pool->Take()) {}
  ~EasyLease() { pool_->Give(std::move(easy_)); }
  EasyLease(const EasyLease&) = delete;
  EasyLease& operator=(const EasyLease&) = delete;
  // Null when the pool could not make a handle.
  CURL* get() const { return easy_.get(); }

 private:
  HandlePool* pool_;
  EasyPtr easy_;
};

// One S3 request, as the operations describe it.
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

// The state of one request on the wire, reused by its attempts; the curl
// callbacks of s3_transport.cc write into it.
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

  // Clears the outcome and the upload position before an attempt.
  void ResetOutcome();
};

class Transport {
 public:
  // REQUIRES: options.Validate() is OK, and InitCurlOnce() succeeded.
  // `options` is borrowed and must outlive the transport (S3Store owns both).
  explicit Transport(const S3Options& options);
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  const S3Options& options() const { return options_; }
  HandlePool* pool() { return &pool_; }

  // Runs `request` on a pooled handle with the retries of s3_store.h's
  // banner: OK, or the status of the last attempt ("(after N attempts)" when
  // there were several); RESOURCE_EXHAUSTED when no handle could be made.
  // `transfer`'s sink and limit are the caller's; its outcome is the last
  // attempt's (body, s3_code, detail).
  absl::Status Execute(const Request& request, Transfer* transfer);

  // Resets `transfer->easy` and configures it for one attempt of `request`,
  // signed with the current time. RESOURCE_EXHAUSTED when curl is out of
  // memory; the signer's errors. REQUIRES: transfer->easy is set; `request`
  // outlives the attempt.
  absl::Status Prepare(const Request& request, Transfer* transfer);

  // The status of one finished attempt, whose curl result was `curl_code`,
  // as s3_store.h's banner maps it; *retryable says whether another attempt
  // may succeed. Sets transfer->detail (and s3_code for an error answer).
  absl::Status Classify(const Request& request, Transfer* transfer, CURLcode curl_code,
                        bool* retryable) const;

  // The wait before retry number `retry` (1-based): random between half and
  // all of backoff_base x 2^(retry-1), at most 30 s.
  absl::Duration Backoff(unsigned retry) const;

 private:
  // Prepare's steps.
  // Signs `request` for the URL path `path` and sets transfer->header_list.
  absl::Status SetSignedHeaders(const Request& request, const std::string& path,
                                Transfer* transfer) const;
  // The options every attempt has: URL, headers, limits, callbacks.
  void SetCommonOptions(Transfer* transfer) const;
  // The method, and the body of a PUT or POST.
  static void SetMethod(const Request& request, Transfer* transfer);

  // Classify's steps, each for one kind of outcome; `op` names the request.
  absl::Status ClassifyCurlFailure(const std::string& op, Transfer* transfer, CURLcode rc,
                                   bool* retryable) const;
  absl::Status ClassifyOkAnswer(const Request& request, const std::string& op, long status,
                                Transfer* transfer, bool* retryable) const;
  absl::Status ClassifyErrorAnswer(const std::string& op, long status, Transfer* transfer,
                                   bool* retryable) const;
  // `text` (from the server) with every credential replaced.
  std::string Redact(std::string text) const;

  // Immutable after construction.
  const S3Options& options_;
  std::string scheme_;     // "http" or "https"
  std::string authority_;  // host[:port] of the endpoint
  std::string host_;       // the Host header: authority_, or bucket.authority_
  std::string path_base_;  // "/bucket" with path_style, else ""

  HandlePool pool_;  // thread-safe itself
};

}  // namespace ckpt::remote::s3_internal
