#!/usr/bin/env python3
"""Writes docs/api-reference.md from the sources: every public C++ header under include/loom (its
opening comment, then each type and function declared in it with the comment above it; public
members of classes too) and the Python package (each public class and function of python/torchloom
with its signature and the first paragraph of its docstring, and the extension's stub _C.pyi).

    python3 scripts/api_reference.py            # rewrite docs/api-reference.md
    python3 scripts/api_reference.py --check    # exit 1 when docs/api-reference.md is not current

The reference is generated, never edited by hand: a CTest (api_reference_current) fails when a
header or the package changed and the page was not regenerated. Text only: no compiler or import
is involved (C++ declarations are found line by line, Python ones with the ast module).
"""
import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "api-reference.md")

# A declaration worth listing starts like one of these (after template<...> lines, at any indent).
TYPE = re.compile(r"^(?:template\s*<.*>\s*)?(class|struct|enum class|enum|using)\s+(\w+)")
SKIP_NAMES = {"Impl", "detail"}


def comment_text(lines):
    return " ".join(l.strip()[2:].strip() for l in lines).strip()


def header_overview(lines):
    """The comment block at the top of the header (before #pragma once), as paragraphs."""
    out, para = [], []
    for line in lines:
        s = line.strip()
        if not s.startswith("//"):
            break
        body = s[2:]
        if body.startswith(" "):
            body = body[1:]
        out.append(body)
    return out


def cpp_declarations(lines):
    """(kind, name or signature, comment, depth) of what namespace loom declares outside namespace
    detail: every type, and every function or member that has a comment right above it; members only
    from public sections. Found line by line (brace counting), which the project's style allows."""
    result = []
    comment = []
    scopes = []  # open braces: "detail", "class-public", "class-private" or "other"
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        i += 1
        if s.startswith("//"):
            comment.append(s)
            continue
        in_detail = "detail" in scopes
        classes = [x for x in scopes if x.startswith("class")]
        public = not classes or classes[-1] == "class-public"
        if s in ("public:", "protected:", "private:"):
            if classes:
                for k in range(len(scopes) - 1, -1, -1):
                    if scopes[k].startswith("class"):
                        scopes[k] = "class-public" if s == "public:" else "class-private"
                        break
            comment = []
            continue
        m = TYPE.match(s)
        if re.match(r"^namespace\s+(\w+::)*detail\s*\{", s):
            scopes.append("detail")
        elif m and not s.endswith(";") or (m and m.group(1) == "using"):
            kind, name = m.group(1), m.group(2)
            if not in_detail and public and name not in SKIP_NAMES:
                result.append((kind, name, comment_text(comment), len(classes)))
            if "{" in s and not s.rstrip().endswith("}") and not s.endswith("};"):
                scopes.append(("class-private" if kind == "class" else "class-public") if kind in ("class", "struct")
                              else "other")
                s = s[s.index("{") + 1:]
            else:
                s = ""
        elif comment and not in_detail and public and "(" in s and not s.startswith(("#", "return", "}", ":")):
            text = s
            end = declaration_end(text)
            while end is None and i < len(lines):
                text += " " + lines[i].strip()
                i += 1
                end = declaration_end(text)
            end = len(text) if end is None else end
            sig = re.sub(r"\s+", " ", text[:end]).strip()
            sig = re.sub(r"\s*(=\s*(default|delete|0))?\s*$", "", sig)
            if sig:
                result.append(("function", sig, comment_text(comment), len(classes)))
            s = text[end:]
        for ch in s:
            if ch == "{":
                scopes.append("other")
            elif ch == "}" and scopes:
                scopes.pop()
        comment = []
    return result


def declaration_end(text):
    """Where a function declaration's signature ends: after its parameter list (balanced, so default
    arguments such as `= {}` stay in) and qualifiers, at the ';' or the body's '{'; None when the
    text does not reach that far yet."""
    start = text.find("(")
    if start < 0:
        return None
    depth = 0
    for k in range(start, len(text)):
        if text[k] in "([{<" and text[k] != "<":
            depth += 1
        elif text[k] in ")]}":
            depth -= 1
            if depth == 0 and text[k] == ")":
                rest = text[k + 1:]
                m = re.search(r"[;{]|:\s*\w+\(", rest)  # the end, the body or a constructor's initialiser list
                return None if m is None else k + 1 + m.start()
    return None


def cpp_section():
    out = ["## C++ (include/loom)", ""]
    headers = []
    for base, _, files in os.walk(os.path.join(ROOT, "include", "loom")):
        for f in files:
            if f.endswith(".h"):
                headers.append(os.path.join(base, f))
    for path in sorted(headers):
        rel = os.path.relpath(path, os.path.join(ROOT, "include"))
        with open(path) as fh:
            lines = fh.readlines()
        out += [f"### `{rel}`", ""]
        overview = header_overview(lines)
        if overview:
            text = "\n".join(overview).strip("\n")
            out += ["```text", text, "```", ""]
        for kind, name, comment, depth in cpp_declarations(lines):
            bullet = "  " * min(depth, 2) + "- "
            label = f"`{name}`" if kind == "function" else f"{kind} `{name}`"
            out.append(f"{bullet}{label}" + (f": {comment}" if comment else ""))
        out.append("")
    return out


def first_paragraph(doc):
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def signature(node):
    try:
        args = ast.unparse(node.args)
    except Exception:
        args = "..."
    returns = f" -> {ast.unparse(node.returns)}" if getattr(node, "returns", None) is not None else ""
    return f"{node.name}({args}){returns}"


def python_module(path, title):
    with open(path) as fh:
        tree = ast.parse(fh.read())
    out = [f"### `{title}`", ""]
    doc = first_paragraph(ast.get_docstring(tree))
    if doc:
        out += [doc, ""]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            d = first_paragraph(ast.get_docstring(node))
            out.append(f"- `{signature(node)}`" + (f": {d}" if d else ""))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            d = first_paragraph(ast.get_docstring(node))
            out.append(f"- class `{node.name}`" + (f": {d}" if d else ""))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        (not item.name.startswith("_") or item.name == "__init__"):
                    di = first_paragraph(ast.get_docstring(item))
                    out.append(f"  - `{signature(item)}`" + (f": {di}" if di else ""))
    out.append("")
    return out


def python_section():
    out = ["## Python (python/torchloom)", ""]
    pkg = os.path.join(ROOT, "python", "torchloom")
    modules = []
    for base, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py") or f == "_C.pyi":
                modules.append(os.path.join(base, f))
    for path in sorted(modules):
        rel = os.path.relpath(path, os.path.join(ROOT, "python"))
        if os.path.basename(path) == "__main__.py":
            continue
        if os.path.basename(path).startswith("_") and not path.endswith(("__init__.py", "_C.pyi")):
            continue  # private modules: implementation, not API
        title = rel.replace(os.sep, ".").removesuffix(".py").removesuffix(".pyi").replace(".__init__", "")
        out += python_module(path, title if not path.endswith(".pyi") else rel)
    return out


def render():
    head = ["# API reference", "",
            "Generated by `python3 scripts/api_reference.py` from the public headers and the Python package; "
            "**do not edit by hand** (the test `api_reference_current` fails when it is not current). Each entry "
            "is the declaration and the comment or docstring above or inside it; the guides in `docs/` explain "
            "how the pieces fit.", ""]
    return "\n".join(head + cpp_section() + python_section()).rstrip("\n") + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/api-reference.md is not current")
    args = p.parse_args()
    text = render()
    if args.check:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if current != text:
            print("docs/api-reference.md is not current: run python3 scripts/api_reference.py", file=sys.stderr)
            return 1
        print(f"docs/api-reference.md is current ({len(text.splitlines())} lines)")
        return 0
    with open(OUT, "w") as fh:
        fh.write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
