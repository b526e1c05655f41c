#!/usr/bin/env python3
"""train_gpt refuses options that do not fit the job, on every rank, by name, and the job ends.

Each case runs PROGRAM (train_gpt) under mpirun at 2 ranks with options that cannot work
together, and checks: the exit status is 1 (not a crash, not success), the job ends well within its
limit (a rank that refused must not leave another waiting), every rank's message names its rank,
the option and what was expected against what was found, and nothing crashed on the way out.

Usage: check_gpt_refusals.py --mpirun MPIRUN --program PROGRAM
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound, time_scale_note  # noqa: E402  (tests/time_scale.py)

SMALL = "--steps 4 --hidden 32 --heads 4 --layers 4 --eval-every 0 --progress lines".split()
CRASHES = ["Segmentation fault", "signal 11", "double free", "corruption", "terminate called", "Aborted"]

# (options, what every rank's message must say after "[rank R] train_gpt: ")
CASES = [
    ("--tp 1 --batch 15 --accumulate 1", "--batch 15 must be divisible by the data-parallel degree 2 x --accumulate 1"),
    ("--tp 2 --batch 16 --seq 15 --sequence-parallel",
     "--seq 15 must be divisible by the tensor-parallel degree 2 with --sequence-parallel"),
    ("--tp 1 --pp 2 --batch 16 --accumulate 4 --zero 1 --schedule interleaved",
     "--zero 1 with --virtual-stages 2: ZeRO's optimizer reduces every chunk of a rank at once"),
    ("--tp 1 --pp 2 --batch 16 --accumulate 4 --zero 2 --clip-grad-norm 1",
     "--clip-grad-norm with --zero and --pp 2: ZeRO's clip_grad_norm sums over its DP group"),
    ("--tp 1 --pp 2 --batch 16 --accumulate 4 --zero 3",
     "--zero 3 with --pp 2: fully sharded units inside pipeline stages are not built yet"),
    ("--tp 1 --batch 16 --zero 3 --hsdp 3", "--hsdp 3 must divide the data-parallel degree 2"),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpirun", required=True)
    p.add_argument("--program", required=True)
    args = p.parse_args()
    limit = time_bound(30.0)
    failures = []
    for options, expected in CASES:
        command = [args.mpirun] + os.environ.get("LOOM_MPIRUN_FLAGS", "--oversubscribe").split() + \
                  ["--allow-run-as-root", "-np", "2", args.program] + SMALL + options.split()
        start = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            failures.append(f"{options}: still running after {limit:.0f} s {time_scale_note()}")
            continue
        took = time.monotonic() - start
        output = done.stdout + done.stderr
        problems = []
        if done.returncode != 1:
            problems.append(f"exit status {done.returncode}, expected 1")
        for rank in (0, 1):
            if f"[rank {rank}] train_gpt: {expected}" not in output:
                problems.append(f"no '[rank {rank}] train_gpt: {expected}'")
        problems += [f"crash: {c!r}" for c in CRASHES if c in output]
        print(f"--- {options}: exit {done.returncode} after {took:.1f} s{': ' if problems else ''}{'; '.join(problems)}")
        if problems:
            print(output)
            failures.append(f"{options}: " + "; ".join(problems))
    for f in failures:
        print("FAIL", f)
    print("FAILED" if failures else "OK: every refusal named its rank, option and values, and the job ended")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
