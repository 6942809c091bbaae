#include "daemon/remote/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cctype>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt::remote {
namespace {

constexpr char kHexDigitsLower[] = "0123456789abcdef";
constexpr char kHexDigitsUpper[] = "0123456789ABCDEF";
constexpr absl::string_view kAlgorithm = "AWS4-HMAC-SHA256";

bool IsUnreserved(unsigned char c) {
  return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~';
}

// Trimall: leading and trailing whitespace removed, inner runs of whitespace
// replaced by one space.
std::string TrimAll(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  bool pending_space = false;
  for (char c : value) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(c);
  }
  return out;
}

bool IsAmzDate(absl::string_view d) {
  if (d.size() != 16 || d[8] != 'T' || d[15] != 'Z') return false;
  for (size_t i = 0; i < 15; ++i) {
    if (i == 8) continue;
    if (!absl::ascii_isdigit(static_cast<unsigned char>(d[i]))) return false;
  }
  return true;
}

}  // namespace

std::string HexEncode(absl::string_view bytes) {
  std::string out(bytes.size() * 2, '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out[2 * i] = kHexDigitsLower[b >> 4];
    out[2 * i + 1] = kHexDigitsLower[b & 0xf];
  }
  return out;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // EVP_Digest fails only on allocation failure inside OpenSSL; an empty
  // result then makes the signature (and the request) fail visibly.
  if (EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr) != 1) return "";
  return HexEncode(absl::string_view(reinterpret_cast<const char*>(md), len));
}

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), md, &len) == nullptr) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::string AmzDate(absl::Time t) {
  return absl::FormatTime("%Y%m%dT%H%M%SZ", t, absl::UTCTimeZone());
}

std::string UriEncode(absl::string_view s, bool keep_slash) {
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (IsUnreserved(c) || (keep_slash && c == '/')) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHexDigitsUpper[c >> 4]);
      out.push_back(kHexDigitsUpper[c & 0xf]);
    }
  }
  return out;
}

std::string CanonicalQueryString(const QueryList& query) {
  std::vector<std::pair<std::string, std::string>> encoded;
  encoded.reserve(query.size());
  for (const auto& [k, v] : query) encoded.emplace_back(UriEncode(k, false), UriEncode(v, false));
  std::sort(encoded.begin(), encoded.end());
  return absl::StrJoin(encoded, "&", [](std::string* out, const auto& kv) {
    absl::StrAppend(out, kv.first, "=", kv.second);
  });
}

absl::StatusOr<SigV4Signed> SignV4(const SigV4Request& request, const SigV4Credentials& credentials,
                                   absl::string_view region, absl::string_view service,
                                   absl::string_view amz_date) {
  if (request.method.empty()) return absl::InvalidArgumentError("SigV4: empty method");
  if (region.empty() || service.empty()) {
    return absl::InvalidArgumentError("SigV4: empty region or service");
  }
  if (request.payload_sha256.empty()) {
    return absl::InvalidArgumentError("SigV4: empty payload hash");
  }
  if (!IsAmzDate(amz_date)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SigV4: date \"", amz_date, "\" is not of the form YYYYMMDDTHHMMSSZ"));
  }
  if (credentials.access_key_id.empty() || credentials.secret_access_key.empty()) {
    return absl::UnauthenticatedError("SigV4: the access key id or the secret key is empty");
  }

  // Lowercased name -> values in the order given. The signer's own headers
  // replace whatever the caller passed under their names.
  std::map<std::string, std::vector<std::string>> headers;
  for (const auto& [name, value] : request.headers) {
    std::string lname = absl::AsciiStrToLower(TrimAll(name));
    if (lname == "x-amz-date" || lname == "x-amz-content-sha256" ||
        lname == "x-amz-security-token" || lname == "authorization") {
      continue;
    }
    headers[lname].push_back(value);
  }
  if (headers.find("host") == headers.end()) {
    return absl::InvalidArgumentError("SigV4: the request has no host header");
  }
  headers["x-amz-date"] = {std::string(amz_date)};
  headers["x-amz-content-sha256"] = {request.payload_sha256};
  if (!credentials.session_token.empty()) {
    headers["x-amz-security-token"] = {credentials.session_token};
  }

  SigV4Signed out;
  std::string canonical_headers;
  std::vector<std::string> names;
  for (const auto& [name, values] : headers) {
    std::vector<std::string> trimmed;
    trimmed.reserve(values.size());
    for (const auto& v : values) trimmed.push_back(TrimAll(v));
    std::string joined = absl::StrJoin(trimmed, ",");
    absl::StrAppend(&canonical_headers, name, ":", joined, "\n");
    names.push_back(name);
    out.headers.emplace_back(name, std::move(joined));
  }
  const std::string signed_headers = absl::StrJoin(names, ";");

  const std::string path = request.path.empty() ? "/" : request.path;
  out.canonical_request =
      absl::StrCat(absl::AsciiStrToUpper(request.method), "\n", UriEncode(path, true), "\n",
                   CanonicalQueryString(request.query), "\n", canonical_headers, "\n",
                   signed_headers, "\n", request.payload_sha256);

  const absl::string_view day = amz_date.substr(0, 8);
  const std::string scope = absl::StrCat(day, "/", region, "/", service, "/aws4_request");
  out.string_to_sign =
      absl::StrCat(kAlgorithm, "\n", amz_date, "\n", scope, "\n", Sha256Hex(out.canonical_request));

  std::string key = HmacSha256(absl::StrCat("AWS4", credentials.secret_access_key), day);
  key = HmacSha256(key, region);
  key = HmacSha256(key, service);
  key = HmacSha256(key, "aws4_request");
  const std::string signature = HexEncode(HmacSha256(key, out.string_to_sign));
  if (signature.empty()) return absl::InternalError("SigV4: HMAC-SHA256 failed in OpenSSL");

  out.authorization =
      absl::StrCat(kAlgorithm, " Credential=", credentials.access_key_id, "/", scope,
                   ", SignedHeaders=", signed_headers, ", Signature=", signature);
  out.headers.emplace_back("authorization", out.authorization);
  std::sort(out.headers.begin(), out.headers.end());
  return out;
}

}  // namespace ckpt::remote
