// How ckptctl prints: human sizes and steps, enum names, text tables,
// key-value lists and JSON documents. Every text a table or list prints goes
// through TerminalSafe() (tools/terminal_text.h), so no control character
// reaches the terminal; JSON is escaped by JsonText(). Used by every
// command of ckptctl; single-threaded.
#pragma once

#include <grpcpp/support/status_code_enum.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/v1/ckpt.pb.h"
#include "nlohmann/json.hpp"

namespace ckpt::ctl {

using Json = nlohmann::ordered_json;  // keeps the proto's field order

// "512 B", "1.5 KiB", ... "2.0 EiB" (one decimal from 1 KiB on).
std::string HumanBytes(uint64_t b);

// HumanBytes, followed by the raw count in parentheses from 1 KiB on.
std::string BytesWithRaw(uint64_t b);

// "-" for an empty string or step 0 (none), else the value.
std::string OrDash(const std::string& s);
std::string StepOrDash(uint64_t step);

// "embedding", "block", "norm", "head", else "other".
const char* KindName(v1::LayerKind k);

// The gRPC code's canonical name ("NOT_FOUND"); "UNKNOWN" for codes outside it.
const char* CodeName(grpc::StatusCode code);

// Layer ids as ranges ("0-3,5,7-9"); cut at an element boundary with a count
// of the rest when longer than `max_chars`; "-" for none.
std::string LayerList(const google::protobuf::RepeatedField<uint32_t>& layers, size_t max_chars);

// A plain text table: columns separated by two spaces; numeric columns
// right-aligned.
class Table {
 public:
  // One header per column; right[c] right-aligns column c.
  Table(std::vector<std::string> headers, std::vector<bool> right);
  // A row of one cell per column. Every cell is stored terminal-safe, so
  // widths are those printed.
  void Add(std::vector<std::string> row);
  // Prints the header line and the rows on stdout.
  void Print() const;

 private:
  std::vector<std::string> headers_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// Prints "key: value" lines on stdout, the values aligned one space after
// the longest key's colon, each value terminal-safe.
void PrintKv(const std::vector<std::pair<std::string, std::string>>& kv);

// JSON text that is printable ASCII: the encoder escapes C0 controls and,
// with ensure_ascii, everything above 0x7f (C1 controls included); invalid
// UTF-8 becomes U+FFFD instead of an exception; DEL, which JSON allows raw,
// can only occur inside a string and is escaped there. Indented by two.
std::string JsonText(const Json& j);

// JsonText(j) and a newline on stdout.
void PrintJson(const Json& j);

}  // namespace ckpt::ctl
