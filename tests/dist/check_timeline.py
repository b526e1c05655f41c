#!/usr/bin/env python3
"""Runs the data-parallel tests with LOOM_TIMELINE set and checks the timeline files: one per
rank, valid Chrome trace JSON, with every bucket's ready instant and all_reduce span, and at
least one all_reduce that started before the last bucket became ready (overlap with backward).
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "timeline")
        env = dict(os.environ, LOOM_TIMELINE=prefix, OMP_NUM_THREADS="1")
        command = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(args.np), args.program,
                   "--gtest_filter=DataParallel.ConvNetSgdWithManySmallBuckets"]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr)
            print("FAIL: the traced run failed")
            return 1
        if not re.search(r"PASSED .*\] .*1 test\.", proc.stdout):
            print(proc.stdout)
            print("FAIL: the traced test did not run (was it renamed?)")
            return 1
        files = sorted(glob.glob(prefix + ".rank*.json"))
        failures = []
        if len(files) != args.np:
            failures.append(f"expected {args.np} timeline files, found {files}")
        for path in files:
            events = json.load(open(path))["traceEvents"]
            ready = [e for e in events if e.get("ph") == "i" and e["name"].endswith(" ready")]
            reduce = [e for e in events if e.get("ph") == "X" and e["name"].endswith(" all_reduce")]
            if not ready or not reduce:
                failures.append(f"{path}: no bucket events ({len(ready)} ready, {len(reduce)} all_reduce)")
                continue
            if any(e["dur"] < 0 for e in reduce):
                failures.append(f"{path}: negative duration")
            # Within one iteration buckets become ready over time; some all_reduce must start
            # before the latest ready instant of the same iteration (iterations are 5 identical
            # passes, so compare per pass by ordering).
            per_iteration = len(reduce) // 5 if len(reduce) >= 5 else len(reduce)
            overlapped = 0
            for k in range(0, len(reduce), per_iteration):
                spans = reduce[k:k + per_iteration]
                marks = ready[k:k + per_iteration]
                if spans and marks and min(s["ts"] for s in spans) < max(m["ts"] for m in marks):
                    overlapped += 1
            print(f"{path}: {len(ready)} ready marks, {len(reduce)} all_reduce spans, "
                  f"{overlapped} iterations with a reduction started before the last bucket was ready")
            if overlapped == 0:
                failures.append(f"{path}: no reduction overlapped backward")
        for f in failures:
            print("FAIL", f)
        print("PASS" if not failures else "FAILED")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
