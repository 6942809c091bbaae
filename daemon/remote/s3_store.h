// S3Store: the RemoteStore backend for S3-compatible object stores (AWS S3,
// Ceph RGW, MinIO), over libcurl with SigV4 (sigv4.h).
//
// Created once by ckptd's wiring from the [remote] config and the credentials
// file (ReadS3Credentials); called by the remote uploader's threads and by
// restore. Owns no on-disk format: keys are remote_layout.h's, stored as
// `prefix + key` in one bucket.
//
// Requests:
//   PutFile   up to part_bytes: one PUT. Larger: CreateMultipartUpload, the
//             parts through one curl multi handle with up to parallel_parts
//             in flight, CompleteMultipartUpload; AbortMultipartUpload on
//             every failure path. Each part is read with pread into its own
//             buffer, so an upload holds at most parallel_parts x part size
//             bytes; the part size grows past part_bytes only when the object
//             would otherwise need more than S3's 10000 parts.
//   PutBytes  one PUT (If-None-Match: * with if_absent)
//   Get*      one streamed GET
//   List      ListObjectsV2 pages (list-type=2), list_page_keys per page
//   Delete    one DELETE
// Every body that is sent carries its SHA-256 in x-amz-content-sha256, which
// the server checks (a mismatch is DATA_LOSS).
//
// Retries: each request (each part on its own) is tried up to max_attempts
// times after a connection failure, a timeout, 5xx, 429, 409, 400
// RequestTimeout / BadDigest / XAmzContentSHA256Mismatch, or a short GET;
// retry n waits a random time between half and all of
// backoff_base x 2^(n-1), at most 30 s. When every attempt failed the
// status is that of the last attempt: UNAVAILABLE for refused or timed-out
// connections, 5xx and throttling; DEADLINE_EXCEEDED when a connected
// request ran past request_timeout or the low-speed limit (under 1 KiB/s for
// 30 s), so that a caller can tell a slow store from a dead one; DATA_LOSS
// for a body the server received damaged or a GET that ended short of its
// Content-Length. A request therefore takes at most about
// max_attempts x (request_timeout + backoff); the message says
// "after N attempts".
//
// Other answers map to remote_store.h's codes: 403 PERMISSION_DENIED (with
// S3's error code: AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch,
// RequestTimeTooSkewed, ...; also 400 ExpiredToken / InvalidToken /
// AuthorizationHeaderMalformed), 401 UNAUTHENTICATED, 404 NOT_FOUND, 412
// ALREADY_EXISTS, other 3xx/4xx INVALID_ARGUMENT. A 200 answer to
// CompleteMultipartUpload whose body is an <Error> is a failure, mapped by
// its code (InternalError and SlowDown are retried). Messages name the endpoint,
// the bucket, the operation and the key; never a credential (nor the request
// headers, nor the parts of an error body that echo them).
//
// The implementation is internal to daemon/remote: s3_store.cc (the
// operations), s3_transport.h (curl handles, signing, retries, the mapping to
// codes above), s3_multipart.h (the multipart upload), s3_options.h
// (Validate, the endpoint, the credentials file), s3_xml.h (S3's XML).
//
// Thread-safety: thread-safe. Concurrent calls use separate curl handles,
// taken from a small pool so that connections are kept alive between calls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/remote/remote_store.h"

namespace ckpt::remote {

namespace s3_internal {
// The HTTP transport (s3_transport.h, internal to daemon/remote).
class Transport;
}  // namespace s3_internal

struct S3Options {
  // scheme://host[:port], without a path: "http://127.0.0.1:7480",
  // "https://s3.eu-west-1.amazonaws.com".
  std::string endpoint;
  // The region in the signature's scope; RGW accepts any, usually "us-east-1".
  std::string region = "us-east-1";
  std::string bucket;
  // Prepended to every key ("ckptd/node-a/"); may be empty; no leading '/'.
  std::string prefix;
  // true: endpoint/bucket/key (RGW, MinIO). false: virtual-hosted,
  // bucket.host/key (AWS), which needs a bucket name valid as a DNS label.
  bool path_style = true;
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: none
  // Objects above this size go multipart, in parts of this size; at least
  // S3's minimum of 5 MiB, at most 5 GiB.
  uint64_t part_bytes = uint64_t{16} << 20;
  // Parts in flight per multipart upload, 1..64.
  unsigned parallel_parts = 4;
  // Tries per request (and per part), at least 1.
  unsigned max_attempts = 5;
  // The first retry waits up to this long; each later one twice as long.
  absl::Duration backoff_base = absl::Milliseconds(200);
  // The limit on one request, connection included.
  absl::Duration request_timeout = absl::Seconds(120);
  absl::Duration connect_timeout = absl::Seconds(10);
  // CA bundle for https; empty: the system's.
  std::string ca_file;
  // Keys per ListObjectsV2 page, 1..1000 (S3's maximum). Smaller values only
  // make List take more requests (the tests use them to page).
  unsigned list_page_keys = 1000;

  // OK, or INVALID_ARGUMENT naming the first bad field (never a credential's
  // value); UNAUTHENTICATED when the access key id or the secret is empty.
  absl::Status Validate() const;
};

// Fills the credential fields of `out` from a file of `key = value` lines
// (keys access_key_id, secret_access_key, and optionally session_token;
// blank lines and lines starting with '#' are skipped). `out` is unchanged
// on error.
// Errors: NOT_FOUND when `path` does not exist; PERMISSION_DENIED (naming the
// path and the mode) when it is a symbolic link or not a regular file, when
// group or others have any access to it, or when it cannot be opened;
// INVALID_ARGUMENT naming the line number for a malformed line, an unknown or
// repeated key, or an empty value, and naming the key when a required one is
// missing. Messages never contain the file's text.
absl::Status ReadS3Credentials(const std::string& path, S3Options* out);

class S3Store final : public RemoteStore {
 public:
  // Validates `options` (S3Options::Validate's errors) and initializes
  // libcurl once per process. Sends nothing: CheckAccess() does.
  static absl::StatusOr<std::unique_ptr<S3Store>> Create(S3Options options);
  ~S3Store() override;
  S3Store(const S3Store&) = delete;
  S3Store& operator=(const S3Store&) = delete;

  // One ListObjectsV2 request for a single key under the prefix: what
  // HEAD bucket checks, with S3's error code in the answer. OK when the
  // bucket is readable with these credentials; PERMISSION_DENIED ("the S3
  // store at ... refused ckptd's credentials (403 SignatureDoesNotMatch)"),
  // NOT_FOUND (no such bucket), UNAVAILABLE / DEADLINE_EXCEEDED (unreachable
  // after the retries). Used at start-up and by the tests.
  absl::Status CheckAccess();

  // "s3 <endpoint> bucket <bucket> prefix <prefix>".
  std::string Describe() const override;

  // RemoteStore. Keys must be non-empty, must not start with '/', and must
  // have no empty, "." or ".." segment and no control character
  // (INVALID_ARGUMENT otherwise). Beyond remote_store.h's codes: PutFile
  // returns INVALID_ARGUMENT when `fd` holds fewer than `size` bytes, and
  // GetToFile returns the errno's code when writing `fd` fails.
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override;
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override;
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max_bytes) override;
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) override;
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix) override;
  absl::Status Delete(const std::string& key) override;

 private:
  explicit S3Store(S3Options options);

  // prefix + key, or INVALID_ARGUMENT for a key the banner refuses.
  absl::StatusOr<std::string> FullKey(const std::string& key) const;

  // Immutable after construction.
  const S3Options options_;
  // Borrows options_. Thread-safe itself: it runs the requests of every
  // operation, with the retries described in the banner.
  std::unique_ptr<s3_internal::Transport> transport_;
};

}  // namespace ckpt::remote
