#!/usr/bin/env python3
"""Lists functions longer than a limit in C++ and CUDA sources, and fails when any is.

    .ci/function_lengths.py [--limit 100] [folders...]   (default: the library folders)

A function's length is the number of lines from the line of its opening brace
to the line of its closing brace. Functions are found by their braces: after
comments and literals are blanked, a '{' at namespace or class scope whose head
(the text since the previous ';', '{' or '}') ends in a parameter list is a
function body. Lambdas and local classes count towards the function that holds
them.
"""
import argparse
import pathlib
import re
import sys

LIBRARIES = ["runtime", "data", "parallel", "moe", "checkpoint", "optim", "models", "launch"]
SUFFIXES = {".cc", ".h", ".cu", ".cuh"}


def blank(text):
    """Comments, string and character literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 60'000
            out.append(c); i += 1
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1])); i = j + 1
        else:
            out.append(c); i += 1
    return "".join(out)


def functions(path):
    text = blank(path.read_text(errors="replace"))
    stack, head_start, found = [], 0, []
    for i, c in enumerate(text):
        if c in ";":
            head_start = i + 1
        elif c == "{":
            head = text[head_start:i]
            head = re.sub(r"^\s*#.*$", "", head, flags=re.M).strip()
            outer = stack[-1][0] if stack else "namespace"
            if outer in ("namespace", "class") and re.search(r"\bnamespace\b", head) and "(" not in head:
                kind = "namespace"
            elif outer in ("namespace", "class") and re.match(r"(template\s*<.*>\s*)?(class|struct|union|enum)\b", head, re.S) \
                    and not re.search(r"\)\s*$", head):
                kind = "class"
            elif outer in ("namespace", "class") and re.search(r"\)[\w\s:&<>,()\-]*$", head) and not head.startswith("="):
                kind = "function"
            else:
                kind = "block"
            name = re.sub(r"\s+", " ", head)[-120:]
            stack.append((kind, text.count("\n", 0, i) + 1, name))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, line, name = stack.pop()
                if kind == "function":
                    found.append((text.count("\n", 0, i) + 1 - line + 1, line, name))
            head_start = i + 1
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--top", type=int, default=0, help="also list the N longest functions")
    parser.add_argument("folders", nargs="*", default=LIBRARIES)
    args = parser.parse_args()
    root = pathlib.Path(__file__).resolve().parent.parent
    everything = []
    for folder in args.folders:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SUFFIXES and "tools" not in path.parts[-2:-1] or path.suffix in SUFFIXES:
                for length, line, name in functions(path):
                    everything.append((length, f"{path.relative_to(root)}:{line}", name))
    everything.sort(reverse=True)
    for length, where, name in everything[: args.top]:
        print(f"{length:5d}  {where}  {name[-70:]}")
    over = [f for f in everything if f[0] > args.limit]
    for length, where, name in over:
        print(f"{where}: a function of {length} lines (limit {args.limit}): {name[-70:]}", file=sys.stderr)
    print(f"{len(everything)} functions in {', '.join(args.folders)}; the longest {everything[0][0] if everything else 0} "
          f"lines; {len(over)} over {args.limit}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
