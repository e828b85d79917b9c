#!/usr/bin/env python3
"""Lists C++ functions whose body is longer than a limit, so that none grows past it unnoticed.

    scripts/function-lengths.py [--max N] PATH...      # N defaults to 150

Each PATH is a C++ file or a folder (searched recursively for .cc, .cpp, .h, .hpp). Prints one
line `file:line name length` per function whose body spans more than N lines (from the line of
its opening brace to the line of its closing brace, both counted) and exits 1 when there is any;
exits 0 when there is none, 2 on a usage error.

The scan matches braces; it is not a parser. Comments, string literals (raw strings included)
and character literals are blanked first, and preprocessor lines dropped. Then a `{` at
namespace or class scope opens a function body when the text before it (since the last `;`,
`{` or `}`) ends in a parameter list `name(...)`, optionally followed by qualifiers (const,
noexcept, override, a trailing return type, ...) or a constructor's initializer list.
Everything inside a body, lambdas and local classes included, counts towards its function.
"""
import argparse
import os
import re
import sys

SUFFIXES = (".cc", ".cpp", ".cxx", ".h", ".hpp")
SCOPE_KEYWORD = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")
# Words that take a parenthesised operand but do not name a function.
NOT_A_NAME = {"if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "alignas",
              "decltype", "noexcept", "static_assert", "throw", "requires", "__attribute__"}
NAME_BEFORE_PAREN = re.compile(
    r"((?:[A-Za-z_]\w*\s*(?:<[^;{}]*?>)?\s*::\s*)*~?\s*"
    r"(?:operator\s*(?:\(\s*\)|\[\s*\]|[^\s\w(]+|\w[\w:<> ]*?)|[A-Za-z_]\w*))\s*$")
# What may follow a function's parameter list before its body.
QUALIFIERS = re.compile(
    r"(?:\s+|const\b|volatile\b|override\b|final\b|mutable\b|constexpr\b|&&|&|"
    r"noexcept\b(?:\s*\((?:[^()]|\([^()]*\))*\))?|throw\s*\(\s*\)|->.*)*", re.S)


def blank_literals(text):
    """Returns text with comments, string and character literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)

    def blank(s):
        return re.sub(r"[^\n]", " ", s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text[i:j]))
            i = j
        elif c == '"' and is_raw_string_start(text, i):
            m = re.compile(r'"([^()\\\s]{0,16})\(').match(text, i)
            close = ")" + m.group(1) + '"'
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append('"' + blank(text[i + 1:j - 1]) + '"')
            i = j
        elif c == '"' or (c == "'" and not is_digit_separator(text, i)):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + blank(text[i + 1:j - 1]) + (c if j - 1 > i else ""))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def is_raw_string_start(text, i):
    # R"delim( ... )delim", with an optional encoding prefix: u8R, uR, UR, LR.
    m = re.search(r"(?<![\w])(?:u8|u|U|L)?R$", text[max(0, i - 4):i])
    return m is not None and re.match(r'"[^()\\\s]{0,16}\(', text[i:i + 19]) is not None


def is_digit_separator(text, i):
    # 1'000'000: a quote inside a number literal.
    m = re.search(r"(?<![\w.])\d[\w']*$", text[max(0, i - 40):i])
    return m is not None and i + 1 < len(text) and text[i + 1].isalnum()


def strip_preprocessor(code):
    return re.sub(r"(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
                  lambda m: "\n" * m.group(0).count("\n"), code)


def matching_paren(head, k):
    depth = 0
    for j in range(k, len(head)):
        if head[j] == "(":
            depth += 1
        elif head[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    return -1


def classify(head):
    """What a `{` preceded by head opens: ("function", name), ("init", None) for a brace inside
    a constructor's initializer list, ("scope", None) or ("other", None)."""
    depth = 0
    for k, ch in enumerate(head):
        if ch == ")":
            depth -= 1
        if ch != "(":
            continue
        depth += 1
        if depth != 1:
            continue
        m = NAME_BEFORE_PAREN.search(head[:k])
        if not m or m.group(1).split("::")[-1].strip() in NOT_A_NAME:
            continue
        close = matching_paren(head, k)
        if close < 0:
            break
        rest = head[close + 1:]
        if QUALIFIERS.fullmatch(rest):
            return "function", re.sub(r"\s+", "", m.group(1))
        init = re.fullmatch(r"\s*(?:const\b|noexcept\b|\s)*:(?!:)(.*)", rest, re.S)
        if init:
            tail = init.group(1).rstrip()
            if re.search(r"[\w>]$", tail):
                return "init", None  # `: member_{`: the brace initialises a member
            if tail.endswith((")", "}")):
                return "function", re.sub(r"\s+", "", m.group(1))
    if SCOPE_KEYWORD.search(head):
        return "scope", None
    return "other", None


def scan(text):
    """Yields (line, name, length) for each function body at namespace or class scope."""
    code = strip_preprocessor(blank_literals(text))
    stack = []  # per open brace: (kind, line, name, head_start to restore for "init")
    head_start = 0
    line = 1
    for k, ch in enumerate(code):
        if ch == "\n":
            line += 1
        elif ch == "{":
            if any(kind in ("function", "other") for kind, _, _, _ in stack):
                kind, name = "other", None
            else:
                kind, name = classify(code[head_start:k])
            stack.append((kind, line, name, head_start))
            head_start = k + 1
        elif ch == "}":
            if stack:
                kind, start, name, saved = stack.pop()
                if kind == "function":
                    yield start, name, line - start + 1
                if kind == "init":
                    head_start = saved  # the head goes on: `: a_{x}, b_(y) {`
                    continue
            head_start = k + 1
        elif ch == ";":
            head_start = k + 1


def files_under(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    if n.endswith(SUFFIXES):
                        yield os.path.join(root, n)
        elif os.path.isfile(p):
            yield p
        else:
            raise FileNotFoundError(p)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=150, help="longest body allowed, in lines")
    parser.add_argument("paths", nargs="+", help="C++ files or folders")
    args = parser.parse_args(argv)
    try:
        files = list(files_under(args.paths))
    except FileNotFoundError as e:
        print(f"function-lengths: no such file or folder: {e}", file=sys.stderr)
        return 2
    found = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for start, name, length in scan(text):
            if length > args.max:
                print(f"{path}:{start} {name} {length}")
                found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
