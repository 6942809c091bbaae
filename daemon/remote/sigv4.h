// AWS Signature Version 4 for S3 requests (the "Authorization: AWS4-HMAC-SHA256
// ..." header form), with OpenSSL's SHA-256 and HMAC-SHA256.
//
// Used by s3_transport.cc for every request S3Store sends, and by the signer
// tool of tests/daemon/remote/ that compares the result with botocore's. A
// pure function of its inputs: the caller supplies the time (AmzDate) and the
// payload hash, so the same request always signs the same way.
//
// Canonical forms (S3's, which differ from other services in two points: the
// path is not normalized, and it is encoded once):
//   path     each byte outside A-Z a-z 0-9 - . _ ~ and '/' as %XX (upper hex);
//            "." and ".." segments and repeated '/' are kept as they are
//   query    key=value pairs, both encoded like the path but with '/' encoded
//            too, sorted by encoded key then encoded value, joined with '&';
//            a parameter without a value is written "key="
//   headers  names lowercased, values trimmed with inner whitespace runs
//            collapsed to one space, repeated names joined with ',', sorted
//            by name; every header passed in is signed
//
// Thread-safety: every function here is stateless and thread-safe.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ckpt::remote {

// The hex SHA-256 of the empty string, the payload hash of a request without a body.
inline constexpr absl::string_view kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
// The payload hash that tells S3 the body is not hashed.
inline constexpr absl::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";

// Lowercase hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);
// Lowercase hex of `bytes` (any binary string).
std::string HexEncode(absl::string_view bytes);
// HMAC-SHA256 of `data` under `key`: 32 binary bytes.
std::string HmacSha256(absl::string_view key, absl::string_view data);

// `t` as SigV4's timestamp "YYYYMMDD'T'HHMMSS'Z'" in UTC.
std::string AmzDate(absl::Time t);

// Percent-encodes every byte of `s` outside the unreserved set
// A-Z a-z 0-9 - . _ ~ (upper-case hex), and '/' too unless `keep_slash`.
// keep_slash = true encodes an object path, false a query key or value.
std::string UriEncode(absl::string_view s, bool keep_slash);

using HeaderList = std::vector<std::pair<std::string, std::string>>;
using QueryList = std::vector<std::pair<std::string, std::string>>;

// The canonical query string of `query` (unencoded pairs), as described in
// the banner. It is also a valid query string to send.
std::string CanonicalQueryString(const QueryList& query);

struct SigV4Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: none (no x-amz-security-token)
};

struct SigV4Request {
  std::string method;  // "GET", "PUT", ...; upper-cased when signed
  // The request path, unencoded ("/bucket/dir/a b.bin"); empty means "/".
  std::string path;
  // Unencoded query parameters; order does not matter.
  QueryList query;
  // Headers to send and sign; names in any case. Must contain "host" (with
  // the port when the URL has a non-default one), exactly as it is sent.
  // x-amz-date, x-amz-content-sha256, x-amz-security-token and
  // authorization are set by the signer; values given for them are dropped.
  HeaderList headers;
  // Lowercase hex SHA-256 of the body, kEmptySha256, or kUnsignedPayload.
  std::string payload_sha256;
};

struct SigV4Signed {
  // The value of the Authorization header.
  std::string authorization;
  // Everything to send, names lowercased and sorted: the request's headers,
  // host, x-amz-content-sha256, x-amz-date, x-amz-security-token (with a
  // session token) and authorization.
  HeaderList headers;
  // The intermediate strings, for tests and debugging. The canonical request
  // contains the session token when there is one: never log it.
  std::string canonical_request;
  std::string string_to_sign;
};

// Signs `request` for `region` and `service` ("s3") at `amz_date` (from
// AmzDate()).
// Errors: INVALID_ARGUMENT when the method, region, service or payload hash
// is empty, there is no host header, or `amz_date` is not of the form
// YYYYMMDDTHHMMSSZ; UNAUTHENTICATED when the access key id or the secret is
// empty. Messages never contain a credential.
absl::StatusOr<SigV4Signed> SignV4(const SigV4Request& request, const SigV4Credentials& credentials,
                                   absl::string_view region, absl::string_view service,
                                   absl::string_view amz_date);

}  // namespace ckpt::remote
