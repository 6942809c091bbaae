// TerminalSafe: what ckptctl does to names and messages before printing them.
#include "tools/terminal_text.h"

#include <string>

#include "gtest/gtest.h"

namespace ckpt {
namespace {

TEST(TerminalSafeTest, PrintableAsciiAndUtf8PassUnchanged) {
  EXPECT_EQ(TerminalSafe(""), "");
  EXPECT_EQ(TerminalSafe("layers.0.attn.q_proj.weight"), "layers.0.attn.q_proj.weight");
  EXPECT_EQ(TerminalSafe("~ !\"#$%&'()*+,-./09:;<=>?@AZ[]^_`az{|}"),
            "~ !\"#$%&'()*+,-./09:;<=>?@AZ[]^_`az{|}");
  // U+00A0 (just past C1), U+00E9, U+20AC, U+10348, U+10FFFF.
  const std::string utf8 = "\xc2\xa0 \xc3\xa9 \xe2\x82\xac \xf0\x90\x8d\x88 \xf4\x8f\xbf\xbf";
  EXPECT_EQ(TerminalSafe(utf8), utf8);
}

TEST(TerminalSafeTest, C0ControlsAndDelAreEscaped) {
  EXPECT_EQ(TerminalSafe("a\x1b[31mred\x1b[0m"), "a\\x1b[31mred\\x1b[0m");
  EXPECT_EQ(TerminalSafe("row\nforged row"), "row\\nforged row");
  EXPECT_EQ(TerminalSafe("\r\t"), "\\r\\t");
  EXPECT_EQ(TerminalSafe(std::string("\0\x01\x07\x08\x1f\x7f", 6)),
            "\\x00\\x01\\x07\\x08\\x1f\\x7f");
}

TEST(TerminalSafeTest, C1ControlsAreEscapedAsCodePoints) {
  EXPECT_EQ(TerminalSafe("\xc2\x80"), "\\u0080");
  EXPECT_EQ(TerminalSafe("x\xc2\x9b"
                         "31my"),
            "x\\u009b31my");  // CSI
  EXPECT_EQ(TerminalSafe("\xc2\x9d"
                         "0;title\xc2\x9c"),
            "\\u009d0;title\\u009c");  // OSC .. ST
  EXPECT_EQ(TerminalSafe("\xc2\x9f"), "\\u009f");
}

// Regression: U+202E (RIGHT-TO-LEFT OVERRIDE) and U+202C printed raw, so a
// job named "safe\u202egnp.exe" showed in ckptctl's tables as another name.
TEST(TerminalSafeTest, BidiAndInvisibleFormatCharactersAreEscaped) {
  EXPECT_EQ(TerminalSafe("job\xe2\x80\xae"
                         "321\xe2\x80\xac"),
            "job\\u202e321\\u202c");
  EXPECT_EQ(TerminalSafe("\xe2\x81\xa6x\xe2\x81\xa9"), "\\u2066x\\u2069");  // LRI .. PDI
  EXPECT_EQ(TerminalSafe("a\xe2\x80\x8b"
                         "b"),
            "a\\u200bb");                              // zero-width space
  EXPECT_EQ(TerminalSafe("\xef\xbb\xbf"), "\\ufeff");  // BOM
  EXPECT_EQ(TerminalSafe("row\xe2\x80\xa8next"), "row\\u2028next");
  EXPECT_EQ(TerminalSafe("\xd8\x9c"), "\\u061c");
  // Neighbours that are ordinary text still pass.
  EXPECT_EQ(TerminalSafe("\xe2\x80\x94\xe2\x80\xb0"),
            "\xe2\x80\x94\xe2\x80\xb0");  // em dash, per mille
}

TEST(TerminalSafeTest, InvalidUtf8IsEscapedBytewise) {
  EXPECT_EQ(TerminalSafe("\x9b"
                         "31m"),
            "\\x9b31m");                                                // a bare C1 byte
  EXPECT_EQ(TerminalSafe("a\x80"), "a\\x80");                           // stray continuation
  EXPECT_EQ(TerminalSafe("\xc3"), "\\xc3");                             // truncated at the end
  EXPECT_EQ(TerminalSafe("\xe2\x82z"), "\\xe2\\x82z");                  // truncated inside
  EXPECT_EQ(TerminalSafe("\xc0\xaf"), "\\xc0\\xaf");                    // overlong '/'
  EXPECT_EQ(TerminalSafe("\xc1\x9b"), "\\xc1\\x9b");                    // overlong ESC-ish
  EXPECT_EQ(TerminalSafe("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");           // overlong, 3 bytes
  EXPECT_EQ(TerminalSafe("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // a surrogate
  EXPECT_EQ(TerminalSafe("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // > U+10FFFF
  EXPECT_EQ(TerminalSafe("\xff\xfe"), "\\xff\\xfe");
}

TEST(TerminalSafeTest, BackslashIsEscapedSoOutputIsUnambiguous) {
  EXPECT_EQ(TerminalSafe("a\\x1b"), "a\\\\x1b");
  EXPECT_NE(TerminalSafe("\\x1b"), TerminalSafe("\x1b"));
}

TEST(TerminalSafeTest, OutputIsAlwaysPrintable) {
  // Every single byte and every two-byte combination: the output holds no C0
  // byte, no DEL, and decodes to no C1 control.
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const std::string in = {static_cast<char>(a), static_cast<char>(b)};
      const std::string out = TerminalSafe(in);
      for (size_t i = 0; i < out.size(); ++i) {
        const unsigned char c = static_cast<unsigned char>(out[i]);
        ASSERT_TRUE(c >= 0x20 && c != 0x7f) << a << "," << b;
        if (c == 0xc2 && i + 1 < out.size()) {
          ASSERT_GT(static_cast<unsigned char>(out[i + 1]), 0x9f) << a << "," << b;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ckpt
