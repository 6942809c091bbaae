// ckptctl's printing (ckptctl_output.h).
#include "tools/ckptctl_output.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {

std::string HumanBytes(uint64_t b) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (b < 1024) return absl::StrCat(b, " B");
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

std::string StepOrDash(uint64_t step) { return step == 0 ? "-" : absl::StrCat(step); }

const char* KindName(v1::LayerKind k) {
  switch (k) {
    case v1::LAYER_EMBEDDING:
      return "embedding";
    case v1::LAYER_BLOCK:
      return "block";
    case v1::LAYER_NORM:
      return "norm";
    case v1::LAYER_HEAD:
      return "head";
    default:
      return "other";
  }
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

std::string LayerList(const google::protobuf::RepeatedField<uint32_t>& layers, size_t max_chars) {
  std::vector<std::string> parts;
  for (int i = 0; i < layers.size();) {
    int j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(layers[i]) : absl::StrCat(layers[i], "-", layers[j]));
    i = j + 1;
  }
  if (parts.empty()) return "-";
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    std::string next = out.empty() ? parts[k] : absl::StrCat(out, ",", parts[k]);
    if (next.size() > max_chars && k > 0) {
      return absl::StrCat(out, ",... (", layers.size(), " layers)");
    }
    out = std::move(next);
  }
  return out;
}

Table::Table(std::vector<std::string> headers, std::vector<bool> right)
    : headers_(std::move(headers)), right_(std::move(right)) {}

void Table::Add(std::vector<std::string> row) {
  for (std::string& cell : row) cell = TerminalSafe(cell);
  rows_.push_back(std::move(row));
}

void Table::Print() const {
  std::vector<size_t> w(headers_.size());
  for (size_t c = 0; c < w.size(); ++c) {
    w[c] = headers_[c].size();
    for (const auto& r : rows_) w[c] = std::max(w[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    std::string s;
    for (size_t c = 0; c < w.size(); ++c) {
      if (c > 0) s += "  ";
      std::string pad(w[c] - r[c].size(), ' ');
      bool last = c + 1 == w.size();
      s += right_[c] ? pad + r[c] : (last ? r[c] : r[c] + pad);
    }
    std::printf("%s\n", s.c_str());
  };
  line(headers_);
  for (const auto& r : rows_) line(r);
}

void PrintKv(const std::vector<std::pair<std::string, std::string>>& kv) {
  size_t w = 0;
  for (const auto& [k, v] : kv) w = std::max(w, k.size());
  for (const auto& [k, v] : kv) {
    std::printf("%s:%s %s\n", k.c_str(), std::string(w - k.size(), ' ').c_str(),
                TerminalSafe(v).c_str());
  }
}

std::string JsonText(const Json& j) {
  std::string text = j.dump(2, ' ', /*ensure_ascii=*/true, Json::error_handler_t::replace);
  return absl::StrReplaceAll(text, {{"\x7f", "\\u007f"}});
}

void PrintJson(const Json& j) { std::printf("%s\n", JsonText(j).c_str()); }

std::string BytesWithRaw(uint64_t b) {
  return b < 1024 ? HumanBytes(b) : absl::StrCat(HumanBytes(b), " (", b, ")");
}

}  // namespace ckpt::ctl
