#!/usr/bin/env python3
"""The C++ code blocks of README.md and docs/*.md, as one translation unit to compile.

Every ```cpp block becomes a function of the unit (its #include lines go to the top), after
tests/docs/doc_snippet_prelude.h, which declares the names the prose introduces before the blocks
(rt, comm, ddp, opt, a batch, ...). A block holding a whole program (int main) stays as it is, in
a namespace of its own. CTest's doc_blocks_compile builds the unit against the library (target
doc_snippets): every call, template and designated initializer is checked against the real API;
nothing runs. A #line directive per block makes a compiler message name the Markdown file and line.

A block the check must leave alone says why on the line before its fence:
    <!-- snippet: skip REASON -->

    check_doc_snippets.py --source-dir DIR --emit doc_snippets.cpp
"""
import argparse
import os
import re
import sys

from markdown_blocks import blocks as page_blocks, pages


def blocks(source_dir):
    for path in pages(source_dir):
        for line, code, skip in page_blocks(path, "cpp"):
            yield os.path.relpath(path, source_dir), line, code, skip


def translation_unit(found):
    includes, bodies = [], []
    for k, (path, line, code, _) in enumerate(found):
        lines = code.split("\n")
        includes += [l for l in lines if l.startswith("#include")]
        rest = [l for l in lines if not l.startswith("#include")]
        # A #line directive per block: the compiler's messages name the Markdown file and line.
        head = f'#line {line + 1} "{path}"'
        if re.search(r"\bint\s+main\s*\(", code):
            bodies.append(f"namespace doc_block_{k} {{\n{head}\n" + "\n".join(rest) + "\n}\n")
        else:
            bodies.append(f"void doc_block_{k}() {{\n{head}\n" + "\n".join(rest) + "\n}\n")
    unique = list(dict.fromkeys(includes))
    return '#include "doc_snippet_prelude.h"\n' + "\n".join(unique) + "\n\n" + "\n".join(bodies)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source-dir", required=True)
    p.add_argument("--emit", required=True, help="the translation unit to write")
    args = p.parse_args()
    found = list(blocks(args.source_dir))
    checked = [b for b in found if b[3] is None]
    for path, line, _, reason in found:
        if reason is not None:
            print(f"doc blocks: skipped {path}:{line}: {reason}")
    if not checked:
        sys.exit("no C++ blocks found: wrong --source-dir?")
    text = translation_unit(checked)
    # Rewritten only when it changes: the build recompiles it only then.
    if not os.path.exists(args.emit) or open(args.emit).read() != text:
        with open(args.emit, "w") as f:
            f.write(text)
    print(f"doc blocks: {len(checked)} C++ blocks of README.md and docs/ in {args.emit} "
          f"({len(found) - len(checked)} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
