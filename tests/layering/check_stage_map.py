#!/usr/bin/env python3
"""The engine's stage map is true: every method of Engine lives in the file
its group in daemon/engine/engine.h names.

engine.h groups Engine's declarations under markers of the form
`// ---- what (engine_file.cc) ----`. This check reads the class, takes each
declared method's group, finds every `Engine::Name(...) {` definition in
daemon/engine/*.cc, and fails when a method is defined in another file than
its group names, defined nowhere (and not inline), or defined without being
declared under a marker. It also fails when another header of
daemon/engine/ includes engine.h: the facade sits on top of its components,
never below them.

    check_stage_map.py REPO            check the repository
    check_stage_map.py --self-test REPO  show that a moved definition is caught
"""
import os
import re
import shutil
import sys
import tempfile

MARKER = re.compile(r"//\s*----.*?\((engine\w*\.cc)\)")
IDENT_CALL = re.compile(r"(~?[A-Za-z_]\w*)\s*\(")
DEFINITION = re.compile(r"\bEngine::(~?\w+)\s*\(")


def strip_comments(text):
    """Blanks out comments and string literals, keeping line structure."""
    out = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] in "\"'":
            q = text[i]
            j = i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out.append(q + " " * (j - i - 1) + q)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def method_name(statement):
    """The method a member declaration declares, or None (data, deleted)."""
    if re.search(r"=\s*(delete|default)\b", statement):
        return None
    for m in IDENT_CALL.finditer(statement):
        name = m.group(1)
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", name):  # ABSL_..., CKPT_... macros
            continue
        if name in ("decltype", "alignas", "sizeof", "operator", "noexcept"):
            continue
        if "=" in statement[:m.start()]:
            return None  # a data member with an initializer that calls something
        return name
    return None


def declarations(header_text):
    """{method: (file, line)} of Engine's out-of-line methods, and the inline ones."""
    start = header_text.find("\nclass Engine {")
    if start < 0:
        raise SystemExit("engine.h: no `class Engine {`")
    raw_lines = header_text[start:].split("\n")
    code_lines = strip_comments(header_text[start:]).split("\n")
    declared, inline = {}, set()
    group = None
    depth = 0
    statement, statement_line = "", 0
    skipping = 0  # depth of an inline body or nested type being skipped
    for lineno, (raw, code) in enumerate(zip(raw_lines, code_lines), start=1):
        marker = MARKER.search(raw)
        if marker and depth == 1 and not skipping:
            group = marker.group(1)
        for ch in code:
            if ch == "{":
                if depth == 0:
                    depth = 1  # the class body opens
                    continue
                if depth == 1 and not skipping:
                    name = method_name(statement)
                    body = name is not None and re.search(r"\)\s*(const\s*)?(override\s*)?$",
                                                         statement.strip())
                    if body:
                        inline.add(name)
                        statement = ""
                        skipping = 1
                        depth += 1
                        continue
                    if "(" not in statement and re.search(r"\b(struct|class|union|enum)\b",
                                                          statement):
                        skipping = 1  # a nested type
                        depth += 1
                        continue
                    statement += ch  # a brace initializer
                    depth += 1
                    continue
                depth += 1
                if skipping:
                    skipping += 1
                else:
                    statement += ch
                continue
            if ch == "}":
                depth -= 1
                if depth == 0:
                    return declared, inline
                if skipping:
                    skipping -= 1
                    if skipping == 0:
                        statement = ""
                else:
                    statement += ch
                continue
            if skipping:
                continue
            if depth == 1 and ch == ";":
                name = method_name(statement)
                if name is not None and not statement.strip().startswith(("using", "friend")):
                    declared.setdefault(name, (group, statement_line or lineno))
                statement, statement_line = "", 0
                continue
            if depth >= 1:
                if not statement.strip() and not ch.isspace():
                    statement_line = lineno
                statement += ch
        statement += " "
    raise SystemExit("engine.h: class Engine does not close")


def balanced_end(text, open_paren):
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def definitions(engine_dir):
    """[(method, file, line)] of every `Engine::X(...) {` in daemon/engine/*.cc."""
    found = []
    for name in sorted(os.listdir(engine_dir)):
        if not name.endswith(".cc"):
            continue
        code = strip_comments(open(os.path.join(engine_dir, name)).read())
        for m in DEFINITION.finditer(code):
            close = balanced_end(code, m.end() - 1)
            if close < 0:
                continue
            after = code[close + 1:close + 400]
            # A body (or a constructor's initializer list) follows a definition.
            if re.match(r"\s*(const\s*)?(\{|:[^:])", after):
                line = code.count("\n", 0, m.start()) + 1
                found.append((m.group(1), name, line))
    return found


def check(repo):
    engine_dir = os.path.join(repo, "daemon", "engine")
    declared, inline = declarations(open(os.path.join(engine_dir, "engine.h")).read())
    problems = []
    defined = {}
    for method, path, line in definitions(engine_dir):
        defined.setdefault(method, []).append((path, line))
        if method not in declared:
            problems.append(f"{path}:{line}: Engine::{method} is defined here but not declared "
                            "under a `// ---- ... (file.cc)` group of engine.h")
            continue
        group, decl_line = declared[method]
        if group is None:
            problems.append(f"engine.h: Engine::{method} is declared before any group marker")
        elif group != path:
            problems.append(f"{path}:{line}: Engine::{method} belongs in {group} "
                            f"(its group in engine.h)")
    for method, (group, line) in sorted(declared.items()):
        if method not in defined and method not in inline:
            problems.append(f"engine.h: Engine::{method} (group {group}) is defined nowhere")
    for name in sorted(os.listdir(engine_dir)):
        if name.endswith(".h") and name != "engine.h":
            text = open(os.path.join(engine_dir, name)).read()
            if '#include "daemon/engine/engine.h"' in text:
                problems.append(f"{name}: includes engine.h (a component header includes upwards)")
    return problems, len(declared), sum(len(v) for v in defined.values())


def self_test(repo):
    """A definition moved to another stage file must be caught."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "daemon", "engine")
        shutil.copytree(os.path.join(repo, "daemon", "engine"), copy)
        problems, _, _ = check(tmp)
        if problems:
            print("the real tree fails already:\n" + "\n".join(problems))
            return 1
        admin = os.path.join(copy, "engine_admin.cc")
        with open(admin, "a") as f:
            f.write("\nnamespace ckpt {\nabsl::Status Engine::Unregister(const RankRef& rank, "
                    "bool drain, const Caller& caller,\n    absl::Time deadline) {\n"
                    "  return absl::OkStatus();\n}\n}  // namespace ckpt\n")
        problems, _, _ = check(tmp)
        if not any("Engine::Unregister belongs in engine_registry.cc" in p for p in problems):
            print("a definition of Unregister in engine_admin.cc was not caught:", problems)
            return 1
        with open(os.path.join(copy, "engine_events.cc"), "a") as f:
            f.write("\nnamespace ckpt {\nvoid Engine::Undeclared() {\n}\n}  // namespace ckpt\n")
        problems, _, _ = check(tmp)
        if not any("Engine::Undeclared is defined here but not declared" in p for p in problems):
            print("an undeclared definition was not caught:", problems)
            return 1
        with open(os.path.join(copy, "quota.h"), "a") as f:
            f.write('\n#include "daemon/engine/engine.h"\n')
        problems, _, _ = check(tmp)
        if not any("quota.h: includes engine.h" in p for p in problems):
            print("an upward include was not caught:", problems)
            return 1
    print("stage map self-test: a moved and an undeclared definition and an upward include are caught")
    return 0


def main(argv):
    if len(argv) >= 2 and argv[1] == "--self-test":
        return self_test(argv[2])
    problems, methods, defs = check(argv[1])
    if problems:
        print("the engine's stage map (daemon/engine/engine.h) is not true:")
        for p in problems:
            print("  " + p)
        return 1
    print(f"stage map: {methods} methods of Engine, {defs} definitions, each in its group's file")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
