#!/usr/bin/env python3
"""The structural claims of the docs, checked against the tree and the build.

- Every repository path the docs name in backquotes (`src/comm/watchdog.cpp`, `cmake/...`) exists,
  or is a program built from a source of that name (`examples/train_gpt`).
- docs/contributing.md's layout block names paths that exist, and names every module under src/
  and every top-level folder of the project.
- docs/contributing.md's layer block is exactly the one generated from the layer list the build
  uses (cmake/LoomLayers.cmake); `--print-layers` prints it.

  check_doc_claims.py --root .            # exit 1 and one line per false claim
  check_doc_claims.py --root . --print-layers
"""
import argparse
import glob
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "layering"))
from check_layer_symbols import allowed_layers  # noqa: E402  (the same parser as the symbol check)

PATH_IN_QUOTES = re.compile(r"`((?:src|include|tests|scripts|benchmarks|cmake|python|examples|docs|\.ci)/[^`\s]*)`")
TOP_LEVEL = ["include", "src", "tests", "benchmarks", "examples", "python", "docs", "scripts", "cmake"]


def layer_block(root):
    with open(os.path.join(root, "cmake", "LoomLayers.cmake")) as f:
        text = f.read()
    allowed = allowed_layers(text)
    order = list(allowed)  # the order of the loom_layer_include_dir() calls: lower layers first
    lines = []
    for layer in order:
        uses = [other for other in order if other in allowed[layer] and other != layer]
        lines.append(f"{layer:<9} <- {', '.join(uses)}" if uses else layer)
    return lines


def fenced_block_after(text, marker):
    """The lines of the first ``` block after the line holding `marker`."""
    at = text.find(marker)
    if at < 0:
        return None
    start = text.find("```", at)
    start = text.find("\n", start) + 1
    end = text.find("```", start)
    return text[start:end].rstrip("\n").split("\n")


def exists(root, path):
    path = path.split(":")[0].rstrip(".,;)")
    if any(c in path for c in "<>*{}$"):
        return True  # a pattern, not a path
    full = os.path.join(root, path)
    return os.path.exists(full) or os.path.exists(full + ".cpp") or os.path.exists(full + ".py")


def check_quoted_paths(root, problems):
    for page in ["README.md", *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        page_path = page if os.path.isabs(page) else os.path.join(root, page)
        with open(page_path) as f:
            for number, line in enumerate(f, 1):
                for match in PATH_IN_QUOTES.finditer(line):
                    if not exists(root, match.group(1)):
                        rel = os.path.relpath(page_path, root)
                        problems.append(f"{rel}:{number}: `{match.group(1)}` does not exist")


def check_layout(root, text, problems):
    block = fenced_block_after(text, "## Layout")
    if block is None:
        problems.append("docs/contributing.md: no layout block under '## Layout'")
        return
    listed = set()
    for line in block:
        word = line.split()[0] if line.strip() else ""
        if "/" not in word:
            continue
        listed.add(word.rstrip("/"))
        if not exists(root, word):
            problems.append(f"docs/contributing.md layout: {word} does not exist")
    wanted = TOP_LEVEL + sorted(f"src/{d}" for d in os.listdir(os.path.join(root, "src"))
                                if os.path.isdir(os.path.join(root, "src", d)))
    for path in wanted:
        if path not in listed and not any(p.startswith(path + "/") for p in listed):
            problems.append(f"docs/contributing.md layout: {path}/ is in the tree but not in the layout")


def check_layers(root, text, problems):
    block = fenced_block_after(text, "<!-- layers: generated")
    expected = layer_block(root)
    if block is None:
        problems.append("docs/contributing.md: no layer block after '<!-- layers: generated ... -->'")
    elif [line.rstrip() for line in block] != expected:
        problems.append("docs/contributing.md: the layer block differs from cmake/LoomLayers.cmake's list; it should read:\n" +
                        "\n".join("    " + line for line in expected))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".")
    p.add_argument("--print-layers", action="store_true")
    args = p.parse_args()
    if args.print_layers:
        print("\n".join(layer_block(args.root)))
        return 0
    with open(os.path.join(args.root, "docs", "contributing.md")) as f:
        contributing = f.read()
    problems = []
    check_quoted_paths(args.root, problems)
    check_layout(args.root, contributing, problems)
    check_layers(args.root, contributing, problems)
    for line in problems:
        print("FAIL " + line)
    if not problems:
        print("the docs' paths, layout and layers match the tree and the build")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
