"""The fenced code blocks of README.md and docs/*.md, for the documentation checks
(check_doc_snippets.py compiles the C++ ones, run_python_blocks.py runs the Python ones).

A block the checks must leave alone says why on the line before its fence:
    <!-- snippet: skip REASON -->
"""
import glob
import os
import re

SKIP = re.compile(r"<!--\s*snippet:\s*skip\b(.*?)-->")


def pages(source_dir):
    return [os.path.join(source_dir, "README.md")] + sorted(glob.glob(os.path.join(source_dir, "docs", "*.md")))


def blocks(path, language):
    """(line of the opening fence, code, skip reason or None) for each ```language block of path."""
    fence = re.compile(r"^```" + re.escape(language) + r"\n(.*?)^```", re.S | re.M)
    text = open(path, encoding="utf-8").read()
    for m in fence.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        yield line, m.group(1), (skip.group(1).strip() if skip else None)
