// ckpt_sigv4_sign: signs one request with daemon/remote/sigv4.h, for
// test_sigv4_botocore.py.
//
// Reads one JSON object on stdin:
//   {"method": "PUT", "path": "/bucket/key a", "query": {"k": "v"} or [["k","v"],...],
//    "headers": {"host": "127.0.0.1:7480", ...}, "payload_sha256": "...",
//    "region": "us-east-1", "access_key_id": "...", "secret_access_key": "...",
//    "session_token": "", "amz_date": "20260101T000000Z"}
// and prints {"authorization": ..., "headers": {name: value}, "canonical_request":
// ..., "string_to_sign": ...}. Exit status 1 and a message on stderr on error.
#include <iostream>
#include <iterator>
#include <string>

#include "daemon/remote/sigv4.h"
#include "nlohmann/json.hpp"

namespace {

// The string member `name` of `j` ("" when absent); false when it is not a string.
bool Field(const nlohmann::json& j, const char* name, std::string* out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_string()) return false;
  *out = it->get<std::string>();
  return true;
}

// The member `name` of `j` as pairs: an object of strings, or an array of
// [string, string]; false for anything else.
bool Pairs(const nlohmann::json& j, const char* name, ckpt::remote::HeaderList* out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  if (it->is_object()) {
    for (const auto& [k, v] : it->items()) {
      if (!v.is_string()) return false;
      out->emplace_back(k, v.get<std::string>());
    }
    return true;
  }
  if (!it->is_array()) return false;
  for (const auto& pair : *it) {
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
      return false;
    }
    out->emplace_back(pair[0].get<std::string>(), pair[1].get<std::string>());
  }
  return true;
}

}  // namespace

int main() {
  const std::string input((std::istreambuf_iterator<char>(std::cin)),
                          std::istreambuf_iterator<char>());
  const nlohmann::json in = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (in.is_discarded() || !in.is_object()) {
    std::cerr << "ckpt_sigv4_sign: stdin is not a JSON object\n";
    return 1;
  }
  ckpt::remote::SigV4Request request;
  ckpt::remote::SigV4Credentials credentials;
  std::string region, amz_date;
  const bool ok = Field(in, "method", &request.method) && Field(in, "path", &request.path) &&
                  Pairs(in, "query", &request.query) && Pairs(in, "headers", &request.headers) &&
                  Field(in, "payload_sha256", &request.payload_sha256) &&
                  Field(in, "access_key_id", &credentials.access_key_id) &&
                  Field(in, "secret_access_key", &credentials.secret_access_key) &&
                  Field(in, "session_token", &credentials.session_token) &&
                  Field(in, "region", &region) && Field(in, "amz_date", &amz_date);
  if (!ok) {
    std::cerr << "ckpt_sigv4_sign: a field has the wrong JSON type\n";
    return 1;
  }
  auto signed_request = ckpt::remote::SignV4(request, credentials, region, "s3", amz_date);
  if (!signed_request.ok()) {
    std::cerr << "ckpt_sigv4_sign: " << signed_request.status() << "\n";
    return 1;
  }
  nlohmann::json out;
  out["authorization"] = signed_request->authorization;
  out["canonical_request"] = signed_request->canonical_request;
  out["string_to_sign"] = signed_request->string_to_sign;
  out["headers"] = nlohmann::json::object();
  for (const auto& [name, value] : signed_request->headers) out["headers"][name] = value;
  std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return 0;
}
