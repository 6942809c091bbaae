"""Sizes stay readable: no source file above 600 lines, no function above 100.

Scans the C++ (.cc .h .cu) and Python (.py) files under base/ client/
daemon/ kernels/ python/ tools/ (tests/ is not scanned). A file's size is
its line count; a function's is the number of lines from its declaration's
first line to its closing brace (C++, see cpp_functions.py) or from `def`
to its last line (Python, by ast). Methods are functions of their own;
lambdas, local classes and nested functions count toward the function they
are in.

The allow-list (tests/lint/size_allowlist.txt) names what may be larger,
one entry a line:

    PATH[:FUNCTION]  LIMIT  REASON

An entry fails the check when its file or function grows past LIMIT, and
when it is no longer needed (the file or function is gone, or back within
the normal limit), so the list stays short and true.

Usage: check_sizes.py ROOT [--allowlist FILE]   check the tree
       check_sizes.py ROOT --suggest            entries for today's violations
       check_sizes.py --self-test               the check catches a violation
"""
import ast
import os
import re
import sys

from cpp_functions import find_functions
from lint_common import line_count, list_entries, parse_args, print_table, read_text, SelfTest, source_files

SOURCE_DIRS = ["base", "client", "daemon", "kernels", "python", "tools"]
EXTENSIONS = (".cc", ".h", ".cu", ".py")
FILE_LIMIT = 600
FUNCTION_LIMIT = 100
ENTRY = re.compile(r"^(?P<key>\S.*?)\s+(?P<limit>\d+)\s+(?P<reason>\S.*)$")


class Item:
    """A file or a function and its size."""

    def __init__(self, key, path, line, size, limit):
        self.key, self.path, self.line, self.size, self.limit = key, path, line, size, limit


def python_functions(text):
    """(qualified name, first line, last line) of module-level functions and methods."""
    found = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + node.name, node.lineno, node.end_lineno))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(ast.parse(text).body, "")
    return found


def measure(root):
    """Every file and function of the scanned tree, keyed PATH and PATH:FUNCTION."""
    items = {}
    for path in source_files(root, EXTENSIONS, SOURCE_DIRS):
        text = read_text(root, path)
        items[path] = Item(path, path, 1, line_count(text), FILE_LIMIT)
        if path.endswith(".py"):
            functions = python_functions(text)
        else:
            functions = [(f.name, f.line, f.end_line) for f in find_functions(text)]
        for name, first, last in functions:
            key = f"{path}:{name}"
            size = last - first + 1
            # Overloads share a key: the largest one is the one that counts.
            if key not in items or items[key].size < size:
                items[key] = Item(key, path, first, size, FUNCTION_LIMIT)
    return items


ADVICE = {
    "file too long": "split it (rarely: an allow-list entry with its reason)",
    "function too long": "split it (rarely: an allow-list entry with its reason)",
    "grew past its entry": "split it back under the entry's limit; do not raise the limit",
    "entry no longer needed": "it is within the normal limit now: remove the entry",
    "entry for nothing": "no such file or function (renamed, split, deleted): remove the entry",
    "entry at or below the limit": "an entry must allow more than the normal limit: remove it",
    "malformed entry": "write PATH[:FUNCTION] LIMIT REASON",
    "duplicate entry": "one entry per file or function",
}


def read_allowlist(path, root):
    """{key: (limit, where)} and the problems of malformed entries."""
    entries, problems = {}, []
    for number, line in list_entries(path):
        m = ENTRY.match(line)
        where = f"{os.path.relpath(path, root)}:{number}"
        if not m:
            problems.append((where, line, "", "", "malformed entry"))
            continue
        key, limit = m.group("key"), int(m.group("limit"))
        if key in entries:
            problems.append((where, key, "", limit, "duplicate entry"))
            continue
        entries[key] = (limit, where)
    return entries, problems


def _judge(item, entry):
    """The problem of one measured item and its entry (or None), or None if it is fine."""
    if entry is None:
        if item.size <= item.limit:
            return None
        return "file too long" if item.key == item.path else "function too long"
    limit = entry[0]
    if limit <= item.limit:
        return "entry at or below the limit"
    if item.size > limit:
        return "grew past its entry"
    if item.size <= item.limit:
        return "entry no longer needed"
    return None


def check(root, allowlist, out):
    """Prints the violations as a table; returns how many there are."""
    items = measure(root)
    entries, problems = read_allowlist(allowlist, root)
    notes = []
    for key, item in sorted(items.items(), key=lambda kv: (kv[1].path, kv[1].line)):
        entry = entries.get(key)
        problem = _judge(item, entry)
        name = key[len(item.path) + 1:] or "(the file)"
        if problem:
            where = entry[1] if problem.startswith("entry") else f"{item.path}:{item.line}"
            limit = entry[0] if entry else item.limit
            problems.append((where, name, item.size, limit, problem))
        elif entry and item.size < entry[0]:
            notes.append(f"{key}: {item.size} lines; its entry allows {entry[0]}: lower the entry")
    for key, (limit, where) in sorted(entries.items()):
        if key not in items:
            problems.append((where, key, "", limit, "entry for nothing"))
    files = sum(1 for k, i in items.items() if k == i.path)
    out.write(f"check_sizes: {files} files, {len(items) - files} functions, {len(entries)} "
              f"allow-list entries; limits {FILE_LIMIT} lines a file, "
              f"{FUNCTION_LIMIT} a function\n")
    for note in notes:
        out.write(f"note: {note}\n")
    if problems:
        out.write(f"{len(problems)} size violation(s):\n")
        print_table(["where", "function", "lines", "limit", "problem"], problems, out)
        for problem in sorted({p[-1] for p in problems}):
            out.write(f"  {problem}: {ADVICE[problem]}\n")
    return len(problems)


def suggest(root, out):
    """Allow-list lines for every file and function over its limit."""
    for key, item in sorted(measure(root).items()):
        if item.size > item.limit:
            out.write(f"{key}  {item.size}  to be split\n")


def self_test():
    long_body = "".join(f"  x += {i};\n" for i in range(FUNCTION_LIMIT))
    tree = {
        "daemon/a/ok.cc": "namespace ckpt {\nint Small() { return 1; }\n}  // namespace ckpt\n",
        # tests/ is not scanned, however long its files are.
        "tests/long_test.cc": "int x;\n" * (FILE_LIMIT + 10),
    }
    long_fn = ("namespace ckpt {\nclass Engine {\n public:\n  int Grow(int x) {\n"
               "    auto f = [&] { return \"}\"; };  // } in a string and a comment\n"
               + long_body + "    return x;\n  }\n};\n}  // namespace ckpt\n")
    long_py = "class Trainer:\n    def step(self):\n" + "        x = 1\n" * FUNCTION_LIMIT
    test = SelfTest("check_sizes", check, tree)
    expect = test.expect

    expect("clean tree", {}, "", False)
    expect("function too long", {"daemon/a/long.cc": long_fn}, "", True,
           ["Engine::Grow", "daemon/a/long.cc:4 ", "function too long"])
    expect("python method too long", {"python/p/t.py": long_py}, "", True,
           ["python/p/t.py:2", "Trainer.step", "function too long"])
    expect("file too long", {"tools/big.py": "x = 1\n" * (FILE_LIMIT + 1)}, "", True,
           ["tools/big.py", "file too long"])
    grow = FUNCTION_LIMIT + 4  # the Grow function's size: its body plus five lines
    entry = f"daemon/a/long.cc:Engine::Grow  {grow}  a numbered sequence\n"
    expect("allow-listed", {"daemon/a/long.cc": long_fn}, entry, False)
    expect("grew past its entry", {"daemon/a/long.cc": long_fn},
           f"daemon/a/long.cc:Engine::Grow  {grow - 1}  a numbered sequence\n", True,
           ["grew past its entry"])
    expect("entry no longer needed", {}, "daemon/a/ok.cc:Small  150  was long\n", True,
           ["entry no longer needed"])
    expect("entry for nothing", {}, "daemon/a/gone.cc  700  was long\n", True,
           ["entry for nothing"])
    expect("entry without a reason", {"daemon/a/long.cc": long_fn},
           f"daemon/a/long.cc:Engine::Grow  {grow}\n", True, ["malformed entry"])
    return test.result()


def main():
    args = parse_args(__doc__, "allowlist")
    if args.self_test:
        return self_test()
    if args.suggest:
        suggest(args.root, sys.stdout)
        return 0
    allowlist = args.list_file or os.path.join(args.root, "tests", "lint", "size_allowlist.txt")
    return 1 if check(args.root, allowlist, sys.stdout) else 0


if __name__ == "__main__":
    sys.exit(main())
