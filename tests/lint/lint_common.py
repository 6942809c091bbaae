"""What the lint checks share: the files of the tree, list files, tables,
the command line and the self-tests' harness."""
import argparse
import io
import os
import shutil
import tempfile

# Directories never scanned: build trees (at the top, as .gitignore has them,
# and anywhere else a CMakeCache.txt marks one), hidden directories (.git,
# .venv, .gpu-bundle) and what tools leave behind.
TOP_SKIP_PREFIXES = ("build", "cmake-build")
TOP_SKIP_DIRS = {"data"}  # the default data directory of a local ckptd
SKIP_DIRS = {"__pycache__", "node_modules"}

CPP_EXTENSIONS = (".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp")


def _skipped(root, rel_dir, name):
    if name.startswith(".") or name in SKIP_DIRS:
        return True
    if not rel_dir and (name in TOP_SKIP_DIRS or name.startswith(TOP_SKIP_PREFIXES)):
        return True
    return os.path.exists(os.path.join(root, rel_dir, name, "CMakeCache.txt"))


def source_files(root, extensions, top_dirs=None):
    """Sorted repository-relative paths (with /) of files ending in extensions.

    top_dirs limits the walk to those top-level directories; build trees,
    hidden directories and __pycache__ are never entered.
    """
    found = []
    starts = [d for d in (top_dirs or [""]) if os.path.isdir(os.path.join(root, d))]
    for start in starts:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, start)):
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
            dirnames[:] = sorted(d for d in dirnames if not _skipped(root, rel_dir, d))
            for name in filenames:
                if name.endswith(extensions):
                    found.append(f"{rel_dir}/{name}" if rel_dir else name)
    return sorted(found)


def read_text(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def line_count(text):
    """Lines as `wc -l` counts them, plus a last line without a newline."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def list_entries(path):
    """(line number, text) of each entry of a list file: # comments and blank lines skipped."""
    entries = []
    if not os.path.exists(path):
        return entries
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append((number, line))
    return entries


def print_table(headers, rows, out):
    """Rows of strings as aligned columns under a header line."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]
    fmt = "  ".join("{:<%d}" % w for w in widths[:-1]) + "  {}"
    out.write(fmt.format(*headers).rstrip() + "\n")
    out.write(fmt.format(*["-" * w for w in widths]).rstrip() + "\n")
    for row in rows:
        out.write(fmt.format(*[str(c) for c in row]).rstrip() + "\n")


def write_tree(root, files):
    """Writes {relative path: text} under root (the self-tests' trees)."""
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path) or root, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def parse_args(doc, list_option):
    """ROOT, --LIST_OPTION FILE, --suggest and --self-test, as every check takes them."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("root", nargs="?")
    parser.add_argument("--" + list_option, dest="list_file")
    parser.add_argument("--suggest", action="store_true")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if not args.self_test and not args.root:
        parser.error("ROOT is required")
    if args.root:
        args.root = os.path.abspath(args.root)
    return args


class SelfTest:
    """Runs a check over small trees written for each case and collects what it
    got wrong. `check(root, list_path, out)` returns its count of problems."""

    def __init__(self, name, check, base, list_name="list.txt"):
        self.name, self.check, self.base, self.list_name = name, check, base, list_name
        self.cases, self.failures = [], []

    def expect(self, case, files, list_text, want, want_text=()):
        """`want`: the exact count of problems (an int), or whether any (a bool)."""
        self.cases.append(case)
        root = tempfile.mkdtemp(prefix="ckpt-lint-")
        try:
            write_tree(root, dict(self.base, **files))
            write_tree(root, {self.list_name: list_text})
            out = io.StringIO()
            got = self.check(root, os.path.join(root, self.list_name), out)
            text = out.getvalue()
            missing = [w for w in want_text if w not in text]
            wrong = (got > 0) != want if isinstance(want, bool) else got != want
            if wrong or missing:
                self.failures.append(f"{case}: {got} problem(s), wanted {want}; missing "
                                     f"{missing}\n{text}")
        finally:
            shutil.rmtree(root)

    def result(self):
        """Prints the outcome; 0 when every case passed."""
        if self.failures:
            print(f"{self.name} self-test FAILED:\n" + "\n".join(self.failures))
            return 1
        print(f"{self.name} self-test: {len(self.cases)} cases passed")
        return 0
