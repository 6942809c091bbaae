// Text from ckptd or the command line made safe to print on a terminal.
//
// Layer, tensor and job names, error messages and paths reach ckptctl from
// the daemon (older stored data included) or from its own arguments, and
// may carry bytes a terminal acts on: an escape sequence can recolour,
// retitle or rewrite the screen, a newline can forge a table row. Every
// human-readable line ckptctl prints passes such text through
// TerminalSafe(); --json output is escaped by the JSON encoder instead.
//
// Thread-safety: a pure function.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace ckpt {

// `text` with every byte a terminal could act on written as an escape:
// - C0 controls and DEL: \n, \r, \t, else \xHH (e.g. ESC -> \x1b);
// - C1 controls (U+0080..U+009F, valid UTF-8): \u0080 .. \u009f;
// - the bidirectional controls (U+202A..U+202E, U+2066..U+2069, LRM, RLM,
//   ALM), the zero-width characters, the BOM and U+2028/U+2029, which
//   reorder or hide text without showing: \u202e and so on;
// - each byte of an invalid UTF-8 sequence (stray continuation, truncated
//   or overlong sequence, surrogate, above U+10FFFF): \xHH;
// - the backslash itself: \\, so an escape in the output is never
//   ambiguous with the same characters in the name.
// Printable ASCII and every other valid UTF-8 character pass unchanged.
std::string TerminalSafe(absl::string_view text);

}  // namespace ckpt
