"""Comments cite only what the repository holds.

Reads the comments of the tree's code (C++ and protobuf `//` and `/* */`;
Python `#` comments and docstrings; shell and CMake `#` comments), outside
build trees, and reports each citation of a document the repository does
not hold, which sends its reader to something they cannot open:

- a section sign (U+00A7) after a name that is not a file of the
  repository (at the top, in docs/ or beside the file, with or without
  .md), or after no name at all; public standards cited as `RFC <number>`
  are allowed;
- an upper-case name followed by "section N" or "row N" (the way the
  documents of a project are cited), when no such file exists;
- an upper-case Markdown name (the way project documents are named, as in
  README.md) that is not a file of the repository;
- a repository path (one starting with a top-level directory: docs/,
  daemon/, tests/ and so on) that does not exist. A path without its
  extension may name a program or target built from a source of that name.

tests/lint/citation_pending.txt lists the citations not fixed yet, as
`PATH  CITED  COUNT` lines (COUNT citations of CITED in PATH); they are
reported but do not fail the check. The list may only shrink: one more
citation than an entry's COUNT fails the check, and so does an entry whose
citations are fewer than its COUNT (lower it, or remove the entry).

Usage: check_citations.py ROOT [--pending FILE]   check the tree
       check_citations.py ROOT --suggest            the pending list for today's tree
       check_citations.py --self-test               the check catches a bad citation
"""
import ast
import collections
import io
import os
import re
import sys
import tokenize

from cpp_lex import lex
from lint_common import list_entries, parse_args, print_table, read_text, SelfTest, source_files

C_STYLE = (".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".proto")
HASH_STYLE = (".sh", ".cmake", "CMakeLists.txt")
TOP_DIRS = {"base", "client", "cmake", "daemon", "deploy", "docs", "kernels", "proto", "python",
            "tests", "tools"}
SECTION = "\u00a7"
# A name, then one or more sections: "<name> <sign>1.2, <sign>3 and <sign>4".
SECTION_CITATION = re.compile(r"(?:(?P<doc>RFC\s*\d+|[A-Za-z][\w./-]*)\s*)?" + SECTION +
                              r"[\w.]*(?:\s*(?:,|and|or|&)\s*" + SECTION + r"[\w.]*)*")
NAMED_PART = re.compile(r"\b(?P<doc>[A-Z][A-Z0-9_]{2,}(?:\.md)?)(?:'s)?\s+(?:sections?|rows?)\s+\d")
UPPER_MD = re.compile(r"(?<![\w./-])(?P<doc>[A-Z][A-Z0-9_-]*\.md)\b")
PROGRAM_EXTENSIONS = (".cc", ".h", ".py", ".sh", ".cu", ".pyi")


def c_comment_lines(text):
    lines = []
    for comment in lex(text)[1]:
        for offset, line in enumerate(comment.text.split("\n")):
            lines.append((comment.line + offset, re.sub(r"^\s*\*+(?!/)", "", line)))
    return lines


def python_comment_lines(text):
    lines = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                lines.append((token.start[0], token.string[1:]))
        tree = ast.parse(text)
    except (SyntaxError, tokenize.TokenError) as e:
        return [(1, f"(not parsed: {e})")]
    source = text.split("\n")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for number in range(first.lineno, first.end_lineno + 1):
                    lines.append((number, source[number - 1]))
    return sorted(lines)


def hash_comment_lines(text):
    """`#` comments of shell and CMake: a # outside quotes, at the start or after a blank."""
    lines = []
    for number, line in enumerate(text.split("\n"), 1):
        quote = None
        for i, c in enumerate(line):
            if quote:
                quote = None if c == quote and line[i - 1] != "\\" else quote
            elif c in "'\"":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;") and not line.startswith("#!"):
                lines.append((number, line[i + 1:]))
                break
    return lines


def comment_blocks(path, text):
    """Runs of comment lines on consecutive lines, as [(line, text)], for the citations."""
    if path.endswith(C_STYLE):
        lines = c_comment_lines(text)
    elif path.endswith(".py"):
        lines = python_comment_lines(text)
    else:
        lines = hash_comment_lines(text)
    blocks = []
    for number, line in lines:
        if blocks and number - blocks[-1][-1][0] <= 1:
            blocks[-1].append((number, line))
        else:
            blocks.append([(number, line)])
    return blocks


def _joined(block):
    """The block's text on one line, and the line each character came from."""
    text, origin = "", []
    for number, line in block:
        piece = line.strip() + " "
        text += piece
        origin.extend([number] * len(piece))
    return text, origin


def _document_exists(root, path, doc):
    here = os.path.dirname(path)
    for where in ("", "docs", here):
        for suffix in ("", ".md"):
            if os.path.isfile(os.path.join(root, where, doc + suffix)):
                return True
    return False


def _path_exists(root, cited):
    full = os.path.join(root, cited)
    return os.path.exists(full) or any(os.path.isfile(full + e) for e in PROGRAM_EXTENSIONS)


def _documents_cited(joined):
    """(offset, name) of each document the text cites by name or section."""
    for pattern in (SECTION_CITATION, NAMED_PART, UPPER_MD):
        for m in pattern.finditer(joined):
            doc = (m.group("doc") or "").rstrip(".")
            if not doc.startswith("RFC"):
                yield m.start(), doc


def citations(root, path, text, top_dirs):
    """(line, cited, what) for each bad citation in the comments of one file."""
    repo_path = re.compile(r"(?<![\w./-])(?:\.\./)*((?:%s)/[\w./+-]*)" % "|".join(sorted(top_dirs)))
    found = {}
    for block in comment_blocks(path, text):
        joined, origin = _joined(block)
        for offset, doc in _documents_cited(joined):
            if not doc or not _document_exists(root, path, doc):
                key = (origin[offset], doc or SECTION)
                found.setdefault(key, "a document not in the repository")
        for m in repo_path.finditer(joined):
            cited = m.group(1).rstrip(".")
            if not _path_exists(root, cited):
                found.setdefault((origin[m.start(1)], cited), "no such path in the repository")
    return sorted((line, cited, what) for (line, cited), what in found.items())


def scan(root):
    top_dirs = TOP_DIRS | {d for d in os.listdir(root)
                           if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")}
    hits = []
    for path in source_files(root, C_STYLE + (".py",) + HASH_STYLE):
        for line, cited, what in citations(root, path, read_text(root, path), top_dirs):
            hits.append((path, line, cited, what))
    return hits


def read_pending(path):
    """{(path, cited): (count, line)} of the pending list."""
    pending = {}
    for number, line in list_entries(path):
        parts = line.split()
        count = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 0
        pending[(parts[0], parts[1] if len(parts) > 1 else "")] = (count, number)
    return pending


def check(root, pending_path, out):
    """Prints the bad citations; returns how many fail the check."""
    hits = scan(root)
    pending = read_pending(pending_path)
    rel_list = os.path.relpath(pending_path, root)
    counts = collections.Counter((path, cited) for path, _, cited, _ in hits)
    rows, failing = [], 0
    for path, line, cited, what in hits:
        allowed = pending.get((path, cited), (0, 0))[0]
        if counts[(path, cited)] > allowed:
            failing += 1
            if allowed:
                what += f" (its pending entry allows {allowed}: a new one)"
        else:
            what += " (pending)"
        rows.append((f"{path}:{line}", cited, what))
    for (path, cited), (allowed, number) in sorted(pending.items()):
        left = counts[(path, cited)]
        if allowed == 0 or left < allowed:
            failing += 1
            problem = ("malformed entry: write PATH CITED COUNT" if allowed == 0 else
                       f"pending entry allows {allowed}, {left} left: "
                       + ("remove it" if left == 0 else f"lower it to {left}"))
            rows.append((f"{rel_list}:{number}", f"{path} {cited}", problem))
    out.write(f"check_citations: {len(hits)} bad citation(s), {len(pending)} pending entries, "
              f"{failing} failing\n")
    if rows:
        print_table(["where", "cited", "problem"], rows, out)
    return failing


def self_test():
    base = {"docs/real.md": "# Real\n", "README.md": "# ckptd\n",
            "daemon/ok.h": "// See docs/real.md, real.md and daemon/ok.h; RFC 3986 " + SECTION +
                           "2.3.\n// tools/prog names the program of tools/prog.cc.\n",
            "tools/prog.cc": "int main() { return 0; }\n"}
    test = SelfTest("check_citations", check, base)
    expect = test.expect

    outside = "// The invariant (PLAN " + SECTION + "4, " + SECTION + "5) holds.\n"
    wrapped = "// Rows of the fault matrix (PLAN\n// " + SECTION + "6.2 rows 3 and 4).\n"
    expect("clean tree", {}, "", 0)
    expect("section of an outside document", {"daemon/a.cc": outside}, "", 1,
           ["daemon/a.cc:1", "PLAN"])
    expect("citation across comment lines", {"daemon/w.cc": wrapped}, "", 1, ["daemon/w.cc:1"])
    expect("a path that does not exist", {"daemon/p.h": "/* see docs/gone.md#x */\n"}, "", 1,
           ["docs/gone.md", "no such path"])
    expect("python comment and docstring",
           {"python/m.py": '"""Module (PLAN ' + SECTION + '2)."""\n'
                           'x = "docs/gone.md"  # tests/nope.py\n'},
           "", 2, ["python/m.py:1", "tests/nope.py"])
    expect("a string is not a comment",
           {"daemon/s.cc": 'const char* k = "docs/gone.md PLAN ' + SECTION + '1";\n'}, "", 0)
    expect("rows and sections of an outside document",
           {"tests/t.py": "# PLAN section 4 and PLAN.md rows 7, 8\n",
            "tests/u.sh": "#!/bin/sh\necho ${#x}  # (PLAN row 3)\n"}, "", 3,
           ["tests/t.py:1", "PLAN.md", "tests/u.sh:2"])
    expect("cmake comment", {"tests/CMakeLists.txt": "add_test(x)  # see tests/none.sh\n"}, "", 1,
           ["tests/none.sh"])
    expect("pending citation", {"daemon/a.cc": outside}, "daemon/a.cc PLAN 1\n", 0, ["(pending)"])
    expect("a new citation beside a pending one", {"daemon/a.cc": outside + outside},
           "daemon/a.cc PLAN 1\n", 2, ["a new one"])
    expect("pending entry above its count", {"daemon/a.cc": outside},
           "daemon/a.cc PLAN 2\n", 1, ["lower it to 1"])
    expect("stale pending entry", {}, "daemon/a.cc PLAN 1\n", 1, ["remove it"])
    return test.result()


def main():
    args = parse_args(__doc__, "pending")
    if args.self_test:
        return self_test()
    if args.suggest:
        counts = collections.Counter((h[0], h[2]) for h in scan(args.root))
        for (path, cited), count in sorted(counts.items()):
            print(f"{path}  {cited}  {count}")
        return 0
    pending = args.list_file or os.path.join(args.root, "tests", "lint", "citation_pending.txt")
    return 1 if check(args.root, pending, sys.stdout) else 0


if __name__ == "__main__":
    sys.exit(main())
