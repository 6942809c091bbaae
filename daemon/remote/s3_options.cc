// S3Options::Validate and ReadS3Credentials (s3_store.h), and the endpoint
// parser (s3_options.h).
#include "daemon/remote/s3_options.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/remote/s3_store.h"
#include "daemon/remote/s3_xml.h"

namespace ckpt::remote {

namespace s3_internal {

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

}  // namespace s3_internal

using s3_internal::HasControlChar;
using s3_internal::Sanitize;

namespace {

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

// Opens the credentials file at `path` and reads it into *text, refusing a
// symbolic link, a file that is not regular, one that group or others can
// access, and one over 64 KiB (ReadS3Credentials' errors). *text is the
// caller's, which clears it whatever this returns.
absl::Status ReadCredentialsFile(const std::string& path, std::string* text) {
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
  text->assign(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text->size()) {
    const ssize_t n = ::read(fd.get(), text->data() + got, text->size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrCat("reading S3 credentials file ", path));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text->resize(got);
  return absl::OkStatus();
}

// The credentials in `text`, the file at `path`, moved into `out` when all
// is well (ReadS3Credentials' INVALID_ARGUMENT errors); `out` is unchanged
// otherwise. Clears its own copies of the values.
absl::Status ParseCredentials(const std::string& path, absl::string_view text, S3Options* out) {
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
  for (auto* v : {&access, &secret, &token}) {
    if (v->has_value()) explicit_bzero((*v)->data(), (*v)->size());
  }
  return status;
}

}  // namespace

absl::Status S3Options::Validate() const {
  using s3_internal::kMaxParallelParts;
  using s3_internal::kMaxPartBytes;
  using s3_internal::kMinPartBytes;
  CKPT_RETURN_IF_ERROR(s3_internal::ParseEndpoint(endpoint).status());
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

absl::Status ReadS3Credentials(const std::string& path, S3Options* out) {
  std::string text;
  absl::Status status = ReadCredentialsFile(path, &text);
  if (status.ok()) status = ParseCredentials(path, text, out);
  // The secret's bytes do not linger in freed memory.
  explicit_bzero(text.data(), text.size());
  return status;
}

}  // namespace ckpt::remote
