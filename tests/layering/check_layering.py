"""Every #include in ckptd's sources follows the dependency graph.

The graph is the block between the layering markers in docs/architecture.md:
one line per component, `component -> allowed dependencies...`. A component
is a top-level folder (base, proto, kernels, client, python, tools) or a
daemon subsystem (daemon/engine, ...; `daemon` alone is main.cc). Includes
within a component, of system and third-party headers, and of the generated
protocol headers (`ckpt/v1/...`, component proto) are resolved; every other
edge must be listed. tests/ may include anything and is not scanned.

Usage: check_layering.py REPO_ROOT          check the tree
       check_layering.py --self-test        the check fails on a planted edge
"""
import os
import re
import shutil
import sys
import tempfile

SOURCE_DIRS = ["base", "client", "daemon", "kernels", "proto", "python", "tools"]
EXTENSIONS = (".h", ".cc", ".cu")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
BEGIN, END = "<!-- layering:begin -->", "<!-- layering:end -->"


def component(path):
    parts = path.split("/")
    if parts[0] == "daemon":
        return "daemon/" + parts[1] if len(parts) > 2 else "daemon"
    return parts[0]


def read_graph(root):
    text = open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        sys.exit("docs/architecture.md has no layering block")
    graph = {}
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines():
        line = line.strip()
        if "->" not in line or line.startswith("#"):
            continue
        name, deps = line.split("->", 1)
        graph[name.strip()] = set(deps.split())
    for name, deps in graph.items():
        for d in deps:
            if d not in graph:
                sys.exit(f"layering block: {name} -> {d}, but {d} has no line of its own")
    return graph


def target_of(include, own):
    """The component an include names, or None for headers outside ours."""
    if include.startswith("ckpt/v1/"):
        return "proto"
    if include.startswith("ckpt/"):
        return "client"  # the client's public headers
    first = include.split("/", 1)[0]
    if "/" not in include:
        return own  # a header beside the file
    if first in SOURCE_DIRS:
        return component(include)
    return None


def violations(root, graph):
    found = []
    for top in SOURCE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(EXTENSIONS):
                    continue
                path = os.path.relpath(os.path.join(dirpath, f), root)
                own = component(path)
                if own not in graph:
                    found.append(f"{path}: component {own} is not in the graph")
                    continue
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as src:
                    for n, line in enumerate(src, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        to = target_of(m.group(1), own)
                        if to is None or to == own or to in graph[own]:
                            continue
                        found.append(f"{path}:{n}: {own} -> {to} (#include \"{m.group(1)}\") "
                                     "is not in the graph")
    return found


def self_test(root):
    """Plants an upward include in a copy of the graph and expects it caught."""
    tmp = tempfile.mkdtemp(prefix="ckpt-layering-")
    try:
        os.makedirs(os.path.join(tmp, "docs"))
        shutil.copy(os.path.join(root, "docs", "architecture.md"), os.path.join(tmp, "docs"))
        os.makedirs(os.path.join(tmp, "base"))
        os.makedirs(os.path.join(tmp, "client", "src"))
        with open(os.path.join(tmp, "base", "ok.h"), "w") as f:
            f.write('#include <vector>\n#include "absl/status/status.h"\n#include "ok2.h"\n')
        with open(os.path.join(tmp, "client", "src", "bad.cc"), "w") as f:
            f.write('#include "base/ok.h"\n#include "daemon/engine/engine.h"\n')
        graph = read_graph(tmp)
        found = violations(tmp, graph)
        expected = "client/src/bad.cc:2: client -> daemon/engine"
        if len(found) != 1 or not found[0].startswith(expected):
            print("self-test: expected exactly one violation starting with", repr(expected))
            print("got:", found)
            return 1
        print("self-test: the planted include was caught:", found[0])
        return 0
    finally:
        shutil.rmtree(tmp)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--self-test":
        return self_test(sys.argv[2])
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    graph = read_graph(root)
    found = violations(root, graph)
    for v in found:
        print(v)
    if found:
        print(f"{len(found)} include(s) against the dependency graph in docs/architecture.md")
        return 1
    print(f"every include follows the dependency graph ({len(graph)} components)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
