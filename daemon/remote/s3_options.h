// What S3Store checks of its configuration before it sends anything: the
// endpoint's form, S3's limits on a multipart upload that S3Options::Validate
// enforces and the multipart upload (s3_multipart.h) obeys. s3_options.cc
// also defines S3Options::Validate and ReadS3Credentials (the credentials
// file), declared in s3_store.h.
//
// Internal to daemon/remote (PRIVATE_HDRS); called by S3Options::Validate,
// the transport's constructor (s3_transport.h) and s3_multipart.cc.
//
// Thread-safety: constants and a stateless function, thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt::remote::s3_internal {

// S3's bounds on one part of a multipart upload, and on the parts of one.
inline constexpr uint64_t kMinPartBytes = uint64_t{5} << 20;
inline constexpr uint64_t kMaxPartBytes = uint64_t{5} << 30;
inline constexpr uint64_t kMaxParts = 10000;
// ckptd's bound on S3Options::parallel_parts.
inline constexpr unsigned kMaxParallelParts = 64;

// An endpoint taken apart.
struct Endpoint {
  std::string scheme;     // "http" or "https"
  std::string authority;  // host[:port]
};

// `endpoint` as scheme://host[:port], optionally with one trailing '/'.
// INVALID_ARGUMENT (naming the endpoint, sanitized) for another scheme, or
// for a path, a query, a fragment, a user, a blank or a control character.
absl::StatusOr<Endpoint> ParseEndpoint(absl::string_view endpoint);

}  // namespace ckpt::remote::s3_internal
