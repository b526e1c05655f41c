#!/usr/bin/env python3
"""Peak host memory of building a GPT at TP 2 is at most 0.6x that at TP 1 (per rank).

Runs tp_build_memory under mpirun at 1 and 2 ranks (TP = world size) and compares the largest
per-rank rise of the resident high-water mark. With the sharded initialisation (the default) each
rank allocates only its shards: about half. With --master every rank draws each full weight first,
and the ratio exceeds the bound (run with --master to see this test fail).

  check_tp_memory.py --mpirun mpirun --program build/tests/tp_build_memory [--master]
"""
import argparse
import re
import subprocess
import sys


def peak(mpirun, np, program, master):
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(np), program] + (["--master"] if master else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    if out.returncode != 0:
        sys.exit(f"FAILED: exit {out.returncode}")
    values = [float(v) for v in re.findall(r"build peak MB (\S+)", out.stdout)]
    if len(values) != np:
        sys.exit(f"FAILED: expected {np} readings, found {values}")
    return max(values)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpirun", required=True)
    p.add_argument("--program", required=True)
    p.add_argument("--master", action="store_true")
    a = p.parse_args()
    tp1 = peak(a.mpirun, 1, a.program, a.master)
    tp2 = peak(a.mpirun, 2, a.program, a.master)
    ratio = tp2 / tp1
    print(f"build peak per rank: TP 1 {tp1:.1f} MB, TP 2 {tp2:.1f} MB, ratio {ratio:.3f} (bound 0.6)")
    if ratio > 0.6:
        sys.exit("FAILED: building at TP 2 took more than 0.6x the host memory of TP 1")
    print("OK")


if __name__ == "__main__":
    main()
