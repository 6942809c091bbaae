// S3Store's operations: each builds its request(s) and runs them through the
// transport (s3_transport.h); PutFile above part_bytes goes multipart
// (s3_multipart.h).
#include "daemon/remote/s3_store.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "daemon/remote/s3_multipart.h"
#include "daemon/remote/s3_transport.h"
#include "daemon/remote/s3_xml.h"
#include "daemon/remote/sigv4.h"

namespace ckpt::remote {

using s3_internal::ElementText;
using s3_internal::FindElement;
using s3_internal::HasControlChar;
using s3_internal::Request;
using s3_internal::Sanitize;
using s3_internal::Sink;
using s3_internal::Transfer;

namespace {

constexpr size_t kMaxKeyBytes = 1024;
constexpr uint64_t kMaxListPageBytes = uint64_t{32} << 20;
// Pages one List reads at most (10 million keys at 1000 a page).
constexpr size_t kMaxListPages = 10000;

}  // namespace

absl::StatusOr<std::unique_ptr<S3Store>> S3Store::Create(S3Options options) {
  CKPT_RETURN_IF_ERROR(options.Validate());
  CKPT_RETURN_IF_ERROR(s3_internal::InitCurlOnce());
  return std::unique_ptr<S3Store>(new S3Store(std::move(options)));
}

S3Store::S3Store(S3Options options)
    : options_(std::move(options)),
      transport_(std::make_unique<s3_internal::Transport>(options_)) {}

S3Store::~S3Store() = default;

std::string S3Store::Describe() const {
  return absl::StrCat("s3 ", options_.endpoint, " bucket ", options_.bucket, " prefix ",
                      options_.prefix);
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

absl::Status S3Store::CheckAccess() {
  Request request;
  request.method = "GET";
  request.query = {{"list-type", "2"}, {"max-keys", "1"}, {"prefix", options_.prefix}};
  Transfer t;
  t.max_bytes = kMaxListPageBytes;
  absl::Status status = transport_->Execute(request, &t);
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
  return transport_->Execute(request, &t);
}

absl::Status S3Store::PutFile(const std::string& key, int fd, uint64_t size) {
  CKPT_ASSIGN_OR_RETURN(std::string full_key, FullKey(key));
  if (size > options_.part_bytes) {
    return s3_internal::PutMultipart(transport_.get(), full_key, fd, size);
  }
  std::unique_ptr<char[]> buf(new char[std::max<uint64_t>(size, 1)]);
  CKPT_RETURN_IF_ERROR(s3_internal::PreadFull(fd, buf.get(), size, 0));
  Request request;
  request.method = "PUT";
  request.key = std::move(full_key);
  request.body = absl::string_view(buf.get(), size);
  request.payload_sha256 = Sha256Hex(request.body);
  Transfer t;
  return transport_->Execute(request, &t);
}

absl::StatusOr<uint64_t> S3Store::GetToFile(const std::string& key, int fd, uint64_t max_bytes) {
  Request request;
  request.method = "GET";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  Transfer t;
  t.sink = Sink::kFd;
  t.fd = fd;
  t.max_bytes = max_bytes;
  CKPT_RETURN_IF_ERROR(transport_->Execute(request, &t));
  return t.received;
}

absl::StatusOr<std::string> S3Store::GetBytes(const std::string& key, uint64_t max_bytes) {
  Request request;
  request.method = "GET";
  CKPT_ASSIGN_OR_RETURN(request.key, FullKey(key));
  Transfer t;
  t.sink = Sink::kMemory;
  t.max_bytes = max_bytes;
  CKPT_RETURN_IF_ERROR(transport_->Execute(request, &t));
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
    CKPT_RETURN_IF_ERROR(transport_->Execute(request, &t));

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
  absl::Status status = transport_->Execute(request, &t);
  // A missing object is deleted already; a missing bucket is an error.
  if (status.code() == absl::StatusCode::kNotFound && t.s3_code != "NoSuchBucket") {
    return absl::OkStatus();
  }
  return status;
}

}  // namespace ckpt::remote
