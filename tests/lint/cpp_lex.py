"""A small C++ lexer for the lint checks: tokens and comments with line numbers.

It knows what matters for finding function bodies and comments: `//` and
`/* */` comments, string and character literals (escapes, encoding prefixes,
raw strings `R"delim(...)delim"`), numbers with digit separators (`1'000`),
and preprocessor directives (with backslash continuations), whose tokens are
dropped because a macro body's braces are not the program's. Comments inside
directives are kept. It is not a full C++ lexer: a literal or comment left
open at the end of the file simply ends there.
"""
import collections

Token = collections.namedtuple("Token", "kind text line")  # kind: id num str chr punct
Comment = collections.namedtuple("Comment", "line end_line text")  # text without // or /* */

RAW_PREFIXES = {"R", "u8R", "uR", "UR", "LR"}
TWO_CHAR_PUNCT = {"::", "->"}


class _Lexer:
    def __init__(self, text):
        self.s = text
        self.n = len(text)
        self.i = 0
        self.line = 1
        self.tokens = []
        self.comments = []
        self.in_directive = False
        self.line_has_token = False  # a token already seen on this physical line

    def advance_to(self, j):
        self.line += self.s.count("\n", self.i, j)
        self.i = j

    def emit(self, kind, start, end, line):
        self.line_has_token = True
        if not self.in_directive:
            self.tokens.append(Token(kind, self.s[start:end], line))

    def run(self):
        s = self.s
        while self.i < self.n:
            c = s[self.i]
            if c == "\n":
                if not (self.i > 0 and s[self.i - 1] == "\\"):
                    self.in_directive = False
                self.line_has_token = False
                self.advance_to(self.i + 1)
            elif c in " \t\r\f\v\\":
                self.i += 1
            elif s.startswith("//", self.i):
                self.line_comment()
            elif s.startswith("/*", self.i):
                self.block_comment()
            elif c == "#" and not self.line_has_token:
                self.in_directive = True
                self.line_has_token = True
                self.i += 1
            elif c == '"':
                self.quoted('"', "str")
            elif c == "'":
                self.quoted("'", "chr")
            elif c.isdigit() or (c == "." and self.i + 1 < self.n and s[self.i + 1].isdigit()):
                self.number()
            elif c.isalpha() or c == "_":
                self.identifier()
            else:
                two = s[self.i:self.i + 2]
                width = 2 if two in TWO_CHAR_PUNCT else 1
                self.emit("punct", self.i, self.i + width, self.line)
                self.i += width
        return self.tokens, self.comments

    def line_comment(self):
        s, j = self.s, self.i + 2
        while True:  # a backslash before the newline continues the comment
            k = s.find("\n", j)
            if k < 0:
                k = self.n
                break
            if s[k - 1] == "\\" or (s[k - 1] == "\r" and s[k - 2] == "\\"):
                j = k + 1
                continue
            break
        self.comments.append(Comment(self.line, self.line + s.count("\n", self.i, k),
                                     s[self.i + 2:k]))
        self.advance_to(k)

    def block_comment(self):
        s = self.s
        k = s.find("*/", self.i + 2)
        end = self.n if k < 0 else k + 2
        self.comments.append(Comment(self.line, self.line + s.count("\n", self.i, end),
                                     s[self.i + 2:k if k >= 0 else self.n]))
        self.advance_to(end)

    def quoted(self, quote, kind):
        """A string or character literal; it does not run past the end of its line."""
        s, j = self.s, self.i + 1
        while j < self.n and s[j] != quote and s[j] != "\n":
            j += 2 if s[j] == "\\" else 1
        end = min(j + 1, self.n) if j < self.n and s[j] == quote else j
        self.emit(kind, self.i, end, self.line)
        self.advance_to(end)

    def raw_string(self, start):
        """R"delim( ... )delim" starting at the quote; start is where the prefix began."""
        s = self.s
        open_paren = s.find("(", self.i)
        delim = s[self.i + 1:open_paren] if open_paren >= 0 else ""
        close = s.find(")" + delim + '"', open_paren + 1) if open_paren >= 0 else -1
        end = self.n if close < 0 else close + len(delim) + 2
        self.emit("str", start, end, self.line)
        self.advance_to(end)

    def number(self):
        s, j = self.s, self.i + 1
        while j < self.n:
            ch = s[j]
            if ch.isalnum() or ch in "_.":
                j += 1
            elif ch == "'" and j + 1 < self.n and s[j + 1].isalnum():
                j += 1  # a digit separator
            elif ch in "+-" and s[j - 1] in "eEpP" and not s[self.i:j].startswith(("0x", "0X")):
                j += 1
            elif ch in "+-" and s[j - 1] in "pP":
                j += 1
            else:
                break
        self.emit("num", self.i, j, self.line)
        self.i = j

    def identifier(self):
        s, j = self.s, self.i + 1
        while j < self.n and (s[j].isalnum() or s[j] == "_"):
            j += 1
        word = s[self.i:j]
        if j < self.n and s[j] == '"' and word in RAW_PREFIXES:
            start = self.i
            self.i = j
            self.raw_string(start)
            return
        if j < self.n and s[j] in "\"'" and word in ("u8", "u", "U", "L"):
            self.i = j  # an encoding prefix: the literal follows
            self.quoted(s[j], "str" if s[j] == '"' else "chr")
            return
        self.emit("id", self.i, j, self.line)
        self.i = j


def lex(text):
    """Returns (tokens, comments) of C++ source text."""
    return _Lexer(text).run()
