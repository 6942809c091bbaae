"""Every C++ source of the tree is formatted by clang-format with .clang-format.

Runs `clang-format --dry-run --Werror --style=file` over each .cc .h .cu
.cuh .cpp .hpp file outside build trees and hidden directories. The
reference binary is clang-format-14 (Debian 12's; deploy/install_deps.sh
installs it); $CKPT_CLANG_FORMAT names another. Without one the check fails.

tests/lint/format_pending.txt lists the files not formatted yet, one path a
line; they are skipped, and the list may only shrink: the check fails when a
listed file is already formatted or no longer exists (remove its line).

Usage: check_format.py ROOT [--pending FILE]   check the tree
       check_format.py ROOT --suggest          the pending list for today's tree
       check_format.py --self-test             the check catches an unformatted file
"""
import concurrent.futures
import os
import shutil
import subprocess
import sys

from lint_common import CPP_EXTENSIONS, list_entries, parse_args, print_table, SelfTest, source_files

CANDIDATES = ("clang-format-14", "clang-format")


def find_clang_format():
    """(path, version line) of the clang-format to use, or (None, why not)."""
    named = os.environ.get("CKPT_CLANG_FORMAT")
    for name in ([named] if named else CANDIDATES):
        path = shutil.which(name)
        if path:
            version = subprocess.run([path, "--version"], capture_output=True, text=True)
            return path, version.stdout.strip()
    wanted = named or " or ".join(CANDIDATES)
    return None, (f"{wanted} not found: install clang-format-14 (deploy/install_deps.sh "
                  "installs it) or name a binary in CKPT_CLANG_FORMAT")


def unformatted(binary, root, paths):
    """{path: number of places clang-format would change} for the files it would change."""

    def run(path):
        result = subprocess.run([binary, "--dry-run", "--Werror", "--style=file", path],
                                cwd=root, capture_output=True, text=True)
        if result.returncode == 0:
            return path, 0
        places = result.stderr.count("[-Wclang-format-violations]")
        return path, max(places, 1)

    jobs = min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(run, paths))
    return {path: places for path, places in results if places}


def check(binary, root, pending_path, out):
    """Prints the files that fail; returns how many problems there are."""
    if not os.path.exists(os.path.join(root, ".clang-format")):
        out.write(f"check_format: {root} has no .clang-format\n")
        return 1
    paths = source_files(root, CPP_EXTENSIONS)
    pending = {line: number for number, line in list_entries(pending_path)}
    bad = unformatted(binary, root, paths)
    rel_list = os.path.relpath(pending_path, root)
    problems = []
    for path in paths:
        if path in bad and path not in pending:
            problems.append((path, bad[path], "not formatted: run clang-format -i on it"))
        elif path in pending and path not in bad:
            problems.append((path, 0, f"formatted now: remove it from {rel_list}"))
    for path, number in sorted(pending.items()):
        if path not in paths:
            problems.append((path, "", f"no such file: remove line {number} of {rel_list}"))
    out.write(f"check_format: {len(paths)} files, {len(bad)} not formatted, {len(pending)} "
              f"listed as pending ({os.path.basename(binary)})\n")
    if problems:
        out.write(f"{len(problems)} format problem(s):\n")
        print_table(["file", "places", "problem"], problems, out)
    return len(problems)


def self_test(binary):
    style = "BasedOnStyle: Google\nColumnLimit: 100\n"
    tidy = "int Add(int a, int b) { return a + b; }\n"
    messy = "int   Add( int a,int b ){\nreturn a+b;}\n"
    base = {".clang-format": style, "daemon/ok.cc": tidy, "tests/ok_test.cc": tidy}
    test = SelfTest("check_format", lambda root, pending, out: check(binary, root, pending, out),
                    base)
    expect = test.expect

    expect("formatted tree", {}, "", False)
    expect("unformatted file", {"tests/bad.h": messy}, "", True, ["tests/bad.h", "not formatted"])
    expect("unformatted file listed as pending", {"daemon/bad.cc": messy}, "daemon/bad.cc\n",
           False)
    expect("pending file already formatted", {}, "daemon/ok.cc\n", True, ["formatted now"])
    expect("pending file gone", {}, "daemon/gone.cc\n", True, ["no such file"])
    expect("build trees are not checked", {"build-x/gen.cc": messy, "sub/b/CMakeCache.txt": "",
                                           "sub/b/gen.cc": messy}, "", False)
    return test.result()


def main():
    args = parse_args(__doc__, "pending")
    binary, version = find_clang_format()
    if not binary:
        print(f"check_format: {version}")
        return 1
    print(f"check_format: {binary}: {version}", file=sys.stderr if args.suggest else sys.stdout)
    if args.self_test:
        return self_test(binary)
    if args.suggest:
        bad = unformatted(binary, args.root, source_files(args.root, CPP_EXTENSIONS))
        sys.stdout.write("".join(f"{path}\n" for path in sorted(bad)))
        return 0
    pending = args.list_file or os.path.join(args.root, "tests", "lint", "format_pending.txt")
    return 1 if check(binary, args.root, pending, sys.stdout) else 0


if __name__ == "__main__":
    sys.exit(main())
