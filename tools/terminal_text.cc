#include "tools/terminal_text.h"

#include <cstdint>

#include "absl/strings/str_format.h"

namespace ckpt {
namespace {

// Length of the valid UTF-8 sequence at text[i] (RFC 3629: no overlongs,
// no surrogates, nothing above U+10FFFF) and its code point; 0 when the
// bytes there are not one.
size_t Utf8Sequence(absl::string_view text, size_t i, uint32_t* code_point) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char b0 = byte(0);
  size_t n;
  uint32_t cp;
  unsigned char lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
    cp = b0 & 0x1f;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    cp = b0 & 0x0f;
    if (b0 == 0xe0) lo = 0xa0;  // overlong
    if (b0 == 0xed) hi = 0x9f;  // surrogates
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    cp = b0 & 0x07;
    if (b0 == 0xf0) lo = 0x90;  // overlong
    if (b0 == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const unsigned char b = byte(k);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xbf)) return 0;
    cp = (cp << 6) | (b & 0x3f);
  }
  *code_point = cp;
  return n;
}

// Format characters that change how the text around them reads without
// showing themselves: the bidirectional controls (an override can make a
// name display as another, "Trojan Source"), the zero-width ones, the BOM,
// and the line and paragraph separators (a forged table row).
bool IsInvisibleFormat(uint32_t cp) {
  return cp == 0x061c ||                    // ARABIC LETTER MARK
         (cp >= 0x200b && cp <= 0x200f) ||  // zero-width space/joiners, LRM, RLM
         (cp >= 0x2028 && cp <= 0x202e) ||  // LS, PS, LRE, RLE, PDF, LRO, RLO
         (cp >= 0x2060 && cp <= 0x2069) ||  // word joiner.., LRI, RLI, FSI, PDI
         cp == 0xfeff;                      // BOM, zero-width no-break space
}

}  // namespace

std::string TerminalSafe(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      if (c == '\\') out += '\\';
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    if (c < 0x80) {  // C0 and DEL
      switch (c) {
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          absl::StrAppendFormat(&out, "\\x%02x", c);
      }
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = Utf8Sequence(text, i, &cp);
    if (n == 0) {
      absl::StrAppendFormat(&out, "\\x%02x", c);
      ++i;
    } else if (cp <= 0x9f || IsInvisibleFormat(cp)) {  // C1, bidi and invisible format
      absl::StrAppendFormat(&out, "\\u%04x", cp);
      i += n;
    } else {
      out.append(text.data() + i, n);
      i += n;
    }
  }
  return out;
}

}  // namespace ckpt
