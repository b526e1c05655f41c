#!/usr/bin/env python3
"""The multi-rank C++ tests write files only through test::SharedFile (tests/dist/test_util.h).

Every rank of such a test reads the files it checks; a rank that writes one by itself, without
waiting for the others to finish reading, races them (CheckpointDist once read a manifest that
rank 0 was rewriting: "manifest.json is truncated"). SharedFile::rewrite orders the write between
two barriers, so the race cannot be written through it; this check refuses every other way of
writing a file in tests/dist, naming the file and line.
"""
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
# Ways a C++ test could write or replace a file by itself.
WRITES = re.compile(r"\bofstream\b|\bfopen\s*\(|\bfwrite\s*\(|\b(?:fs|filesystem)::(?:copy|copy_file|rename|resize_file)\b"
                    r"|\bstd::rename\s*\(|[^_\w]::write\s*\(|\bpwrite\s*\(")
ALLOWED = {"test_util.h"}  # the helper itself


def offending_lines(root=HERE):
    found = []
    for path in sorted(root.iterdir()):
        if path.suffix not in {".cpp", ".h"} or path.name in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if WRITES.search(code):
                found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def main():
    found = offending_lines()
    for line in found:
        print(f"{line}\n  writes a file outside test::SharedFile (tests/dist/test_util.h), which orders the "
              "write after every rank's reads and before any rank's next read", file=sys.stderr)
    if found:
        return 1
    print("every file written by a multi-rank test goes through test::SharedFile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
