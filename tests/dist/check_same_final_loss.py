#!/usr/bin/env python3
"""The same training run by other means ends with the same loss, to the last digit.

Runs PROGRAM under mpirun with the shared arguments plus the reference's, then plus each
variant's, and compares the "final loss" lines (printed with 17 significant digits). Example
(CTest gpt_zero_same_loss_np4): train_gpt TP 2 x DP 2 with plain data parallelism against ZeRO
stage 1, stage 2, and stage 2 with the parameter all-gather overlapping the next forward.

A run's arguments may start with "-np N" (another world size than --np: a pipeline of N stages
against one process), and a variant may be two runs, "SAVE => RESUME": SAVE writes checkpoints
into a fresh directory (given to it as --checkpoint-dir, with its own --save-every), everything
after its first checkpoint is removed, and RESUME continues from that one with --resume (a
checkpoint written at one layout, resumed at another). The final loss is RESUME's.

Usage: check_same_final_loss.py --mpirun MPIRUN --np N --program PROGRAM --reference "ARGS"
       --variant "ARGS" [--variant "ARGS" ...] -- SHARED ARGS
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile


def final_loss(output):
    found = re.findall(r"^final loss ([0-9.eE+-]+)$", output, re.M)
    return found[-1] if found else None


def run_once(args, extra, more=()):
    words = shlex.split(extra)
    np = args.np
    if words[:1] == ["-np"]:
        np, words = int(words[1]), words[2:]
    command = [args.mpirun] + os.environ.get("LOOM_MPIRUN_FLAGS", "--oversubscribe").split() + \
              ["--allow-run-as-root", "-np", str(np), args.program] + args.shared + words + list(more)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOOM_TIMEOUT", "60")
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    loss = final_loss(result.stdout)
    print(f"{extra or '(shared arguments only)'}: exit {result.returncode}, final loss {loss}")
    if result.returncode != 0 or loss is None:
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
        return None
    return loss


def keep_first_checkpoint(directory):
    steps = sorted(d for d in os.listdir(directory) if d.startswith("step_"))
    if not steps:
        raise SystemExit(f"no checkpoint in {directory}")
    for later in steps[1:]:
        shutil.rmtree(os.path.join(directory, later))
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(steps[0] + "\n")
    return steps[0]


def run(args, extra):
    if "=>" not in extra:
        return run_once(args, extra)
    save, resume = (part.strip() for part in extra.split("=>"))
    with tempfile.TemporaryDirectory(prefix="same_loss_") as directory:
        if run_once(args, save, ["--checkpoint-dir", directory]) is None:
            return None
        print(f"  resuming from {keep_first_checkpoint(directory)}")
        return run_once(args, resume, ["--checkpoint-dir", directory, "--resume"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--np", type=int, required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--reference", default="")
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("shared", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    args.shared = [a for a in args.shared if a != "--"]
    want = run(args, args.reference)
    if want is None:
        return 1
    failed = 0
    for variant in args.variant:
        got = run(args, variant)
        if got != want:
            print(f"FAILED: {variant}: final loss {got}, the reference's {want}")
            failed += 1
    print("same final loss" if not failed else f"{failed} variant(s) differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
