#include "daemon/remote/s3_xml.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace ckpt::remote::s3_internal {

namespace {

// Appends `cp` as UTF-8.
void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

}  // namespace

std::string XmlDecode(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '&') {
      out.push_back(s[i++]);
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == absl::string_view::npos || semi - i > 12) {
      out.push_back(s[i++]);
      continue;
    }
    const absl::string_view name = s.substr(i + 1, semi - i - 1);
    bool ok = true;
    if (name == "amp") {
      out.push_back('&');
    } else if (name == "lt") {
      out.push_back('<');
    } else if (name == "gt") {
      out.push_back('>');
    } else if (name == "quot") {
      out.push_back('"');
    } else if (name == "apos") {
      out.push_back('\'');
    } else if (name.size() >= 2 && name[0] == '#') {
      uint32_t cp = 0;
      const bool hex = name[1] == 'x' || name[1] == 'X';
      const absl::string_view digits = name.substr(hex ? 2 : 1);
      ok = !digits.empty() &&
           (hex ? absl::SimpleHexAtoi(digits, &cp) : absl::SimpleAtoi(digits, &cp)) &&
           cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
      if (ok) AppendUtf8(cp, &out);
    } else {
      ok = false;
    }
    if (!ok) {
      out.push_back(s[i++]);
      continue;
    }
    i = semi + 1;
  }
  return out;
}

std::string XmlEscape(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

std::optional<absl::string_view> FindElement(absl::string_view xml, absl::string_view tag,
                                             size_t* pos) {
  const std::string open = absl::StrCat("<", tag, ">");
  const std::string close = absl::StrCat("</", tag, ">");
  const size_t start = xml.find(open, *pos);
  if (start == absl::string_view::npos) return std::nullopt;
  const size_t text = start + open.size();
  const size_t end = xml.find(close, text);
  if (end == absl::string_view::npos) return std::nullopt;
  *pos = end + close.size();
  return xml.substr(text, end - text);
}

std::optional<std::string> ElementText(absl::string_view xml, absl::string_view tag) {
  size_t pos = 0;
  auto raw = FindElement(xml, tag, &pos);
  if (!raw.has_value()) return std::nullopt;
  return XmlDecode(*raw);
}

bool HasControlChar(absl::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u < 0x20 || u == 0x7f;
  });
}

std::string Sanitize(absl::string_view text) {
  std::string out(text.substr(0, 200));
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = ' ';
  }
  return out;
}

}  // namespace ckpt::remote::s3_internal
