"""Function bodies in C++ source, for the size check.

Walks the tokens of cpp_lex at declaration scope (the file, namespaces,
`extern "C"` blocks, class bodies) and classifies each `{` there by the
declaration in front of it (its head: the tokens since the last `;`, `{`,
`}` or access specifier):

- `namespace ...` or `extern "..."`: a scope whose contents are walked;
- `class`/`struct`/`union` without a parameter list: a class body, walked,
  its name prefixed to the functions inside;
- `enum ...`, and any head with a top-level `=` or without a parameter list
  (`int x{0}`, `kTable = {...}`): an initializer, skipped;
- otherwise a function: its body is skipped to the matching `}`, so that
  lambdas, local classes and nested blocks count toward it.

A function's size is the number of lines from the line its declaration
starts on (after any `template <...>` prefix) to its closing brace.
"""
import collections

from cpp_lex import lex

Function = collections.namedtuple("Function", "name line end_line")

CLASS_KEYS = {"class", "struct", "union"}
ACCESS = {"public", "private", "protected"}
# Identifiers that take a parenthesised argument but do not name a function.
NOT_NAMES = {
    "alignas", "alignof", "decltype", "sizeof", "noexcept", "throw", "static_assert",
    "typeid", "if", "for", "while", "switch", "return", "void", "bool", "char", "int",
    "long", "short", "unsigned", "signed", "float", "double", "auto", "operator",
}
TRAILING_QUALIFIERS = {"const", "override", "final", "noexcept", "mutable", "volatile"}


def _match(tokens, i, open_text, close_text):
    """Index of the token closing the group opened at tokens[i]."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].text == open_text:
            depth += 1
        elif tokens[j].text == close_text:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens) - 1


def _open_of(tokens, j):
    """Index of the `(` that the `)` at tokens[j] closes."""
    depth = 0
    for k in range(j, -1, -1):
        depth += {")": 1, "(": -1}.get(tokens[k].text, 0)
        if depth == 0:
            return k
    return 0


def _strip_prefix(head):
    """The head without leading `template <...>`, `[[...]]` and `typedef`."""
    i = 0
    while i < len(head):
        t = head[i].text
        if t == "template" and i + 1 < len(head) and head[i + 1].text == "<":
            depth, i = 0, i + 1
            while i < len(head):
                depth += {"<": 1, ">": -1}.get(head[i].text, 0)
                i += 1
                if depth == 0:
                    break
        elif t == "[" and i + 1 < len(head) and head[i + 1].text == "[":
            i = _match(head, i, "[", "]") + 1
        elif t in ("typedef", "inline", "constexpr", "static", "extern", "friend"):
            i += 1
        else:
            break
    return head[i:]


def _is_macro(text):
    return len(text) > 1 and text.upper() == text and any(c.isalpha() for c in text)


def _param_groups(head):
    """Indices of top-level `(` whose preceding token can name a function.

    `operator` names are handled: in `operator()(int)` the second group is
    the parameter list. Groups inside `<...>` (std::function<void()>) are not
    counted.
    """
    groups, paren, angle, i = [], 0, 0, 0
    while i < len(head):
        t = head[i]
        if t.text == "operator":
            j = i + 1
            if j < len(head) and head[j].text == "(":
                j += 2  # operator()
            while j < len(head) and head[j].text != "(":
                j += 1
            if paren == 0 and angle == 0 and j < len(head):
                groups.append(j)
            i = j
            continue
        if t.text == "(":
            if paren == 0 and angle == 0 and i > 0:
                prev = head[i - 1]
                if (prev.kind == "id" and prev.text not in NOT_NAMES
                        and not prev.text.startswith("__")) or prev.text == ">":
                    groups.append(i)
                elif prev.text == ")" and groups and _is_macro(head[groups[-1] - 1].text):
                    groups.append(i)  # void CKPT_WRAP(sym)(int x): a name made by a macro
            paren += 1
        elif t.text == ")":
            paren = max(0, paren - 1)
        elif t.text == "<" and paren == 0 and i > 0 and head[i - 1].kind == "id":
            angle += 1
        elif t.text == ">" and paren == 0 and angle > 0:
            angle -= 1
        i += 1
    return groups


def _top_level_equals(head):
    """A `=` outside parentheses that is not part of an operator's name."""
    paren = 0
    for i, t in enumerate(head):
        if t.text in "([":
            paren += 1
        elif t.text in ")]":
            paren = max(0, paren - 1)
        elif (t.text == "=" and paren == 0
              and not any(u.text == "operator" for u in head[max(0, i - 3):i])):
            return True
    return False


def _name_before(head, p):
    """The (qualified) name ending just before head[p], the parameter list's `(`."""
    parts, j = [], p - 1
    if any(t.text == "operator" for t in head[max(0, p - 4):p]):
        k = max(i for i in range(max(0, p - 4), p) if head[i].text == "operator")
        symbol = "".join(t.text for t in head[k + 1:p])
        word = head[k + 1].kind == "id" if k + 1 < p else False
        parts, j = ["operator" + (" " if word else "") + symbol], k - 1
    elif head[j].text == ")":  # a name made by a macro: CKPT_WRAP(sym)(
        k = _open_of(head, j)
        parts, j = ["".join(t.text for t in head[k - 1:p])], k - 2
    else:
        if head[j].text == ">":  # a template specialisation: Foo<int>(
            depth = 0
            while j >= 0:
                depth += {">": 1, "<": -1}.get(head[j].text, 0)
                j -= 1
                if depth == 0:
                    break
        if j >= 0:
            parts, j = [head[j].text], j - 1
    if j >= 0 and head[j].text == "~":
        parts.insert(0, "~")
        j -= 1
    while j >= 1 and head[j].text == "::" and head[j - 1].kind == "id":
        parts.insert(0, head[j - 1].text + "::")
        j -= 2
    return "".join(parts)


def _in_ctor_initializer(head, group):
    """True when a top-level `:` follows the parameter list (a constructor)."""
    close = _match(head, group, "(", ")")
    return any(t.text == ":" for t in head[close + 1:])


def classify(head):
    """('scope'|'class'|'function'|'init', name, start token index) for a head."""
    body = _strip_prefix(head)
    offset = len(head) - len(body)
    if not body:
        return "init", "", 0
    if any(t.text == "namespace" for t in body):
        return "scope", "", offset
    if head and head[0].text == "extern" and len(head) == 2 and head[1].kind == "str":
        return "scope", "", 0
    if body[0].text == "enum" or _top_level_equals(body):
        return "init", "", offset
    groups = _param_groups(body)
    named = [g for g in groups if not _is_macro(body[g - 1].text)]
    if body[0].text in CLASS_KEYS and not named:
        before_base = []
        for t in body[1:]:
            if t.text in (":", "<"):
                break
            before_base.append(t)
        ids = [t.text for t in before_base if t.kind == "id" and t.text != "final"
               and not _is_macro(t.text)]
        return "class", ids[-1] if ids else "(anonymous)", offset
    if named:
        return "function", _name_before(body, named[0]), offset
    if groups and groups[0] == 1:  # TEST(Suite, Name) {: a macro that defines a function
        close = _match(body, groups[0], "(", ")")
        args = "".join(t.text for t in body[groups[0]:close + 1])
        return "function", body[0].text + args, offset
    return "init", "", offset


def _member_init_brace(head, prev):
    """A `{` after `name` or `>` in a constructor's initializer list is a member's."""
    if prev is None or not (prev.kind == "id" or prev.text == ">"):
        return False
    if prev.text in TRAILING_QUALIFIERS:
        return False
    body = _strip_prefix(head)
    named = [g for g in _param_groups(body) if not _is_macro(body[g - 1].text)]
    return bool(named) and _in_ctor_initializer(body, named[0])


def find_functions(text):
    """The functions defined in C++ source text, as Function(name, line, end_line)."""
    tokens, _ = lex(text)
    functions = []
    scopes = []  # class names ('' for a namespace) of the enclosing declaration scopes
    head, paren, i = [], 0, 0
    while i < len(tokens):
        t = tokens[i]
        if t.text in ("(", "["):
            paren += 1
        elif t.text in (")", "]"):
            paren = max(0, paren - 1)
        if t.text == "{":
            prev = head[-1] if head else None
            if paren > 0 or _member_init_brace(head, prev):
                close = _match(tokens, i, "{", "}")
                head.extend(tokens[i:close + 1])
                i = close + 1
                continue
            kind, name, start = classify(head)
            if kind in ("scope", "class"):
                scopes.append(name if kind == "class" else "")
                head = []
                i += 1
                continue
            close = _match(tokens, i, "{", "}")
            if kind == "function":
                prefix = "".join(s + "::" for s in scopes if s)
                first = head[start].line if start < len(head) else t.line
                functions.append(Function(prefix + name, first, tokens[close].line))
                head = []
            else:
                head.extend(tokens[i:close + 1])
            i = close + 1
            continue
        if t.text == "}":
            if scopes:
                scopes.pop()
            head, paren = [], 0
        elif t.text == ";" and paren == 0:
            head = []
        elif t.text == ":" and len(head) == 1 and head[0].text in ACCESS:
            head = []
        else:
            head.append(t)
        i += 1
    return functions
