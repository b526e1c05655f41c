#!/usr/bin/env python3
"""torchloom's FullyShardedDataParallel (C++) against PyTorch's FSDP2 over Gloo, on the same model.

The same MLP (zero_bench's: 1024 inputs, 4 hidden Linear+ReLU layers of 1024, 10 classes, 4.21 M
parameters), the same units (each Linear a unit, the model the root), Adam, cross-entropy, batch 64
per rank, fp32, 1 thread per rank. The two cannot share a process (one is a C++ program, the other
Python), so this runs them alternately, --runs times each, in one invocation:
  ours    zero_bench's fsdp variant (its median step over 40 interleaved iterations);
  theirs  ddp_backend_bench.py --wrapper fsdp, which times FSDP2 over backend "gloo" (and over
          "loom") in the same processes (median of its rounds).
Prints each pair's ratio ours / FSDP2-over-Gloo (target <= 0.5) and the median and range over the
pairs; writes them as JSON.

    python3 benchmarks/fsdp_vs_fsdp2.py --mpirun mpirun --build build --np 2 --json fsdp_vs_fsdp2_np2.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(command, env=None):
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--mpirun-flags", default=os.environ.get("LOOM_MPIRUN_FLAGS", "--oversubscribe --bind-to none"))
    p.add_argument("--build", default="build", help="the build directory (zero_bench, the Python module)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="pairs of runs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    here = os.path.dirname(os.path.abspath(__file__))
    mpirun = [args.mpirun] + args.mpirun_flags.split() + ["-np", str(args.np)]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(args.build), "python"))
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            ours_json, theirs_json = os.path.join(tmp, f"zero_{i}.json"), os.path.join(tmp, f"fsdp2_{i}.json")
            run(mpirun + [os.path.join(args.build, "benchmarks", "zero_bench"), "--json", ours_json])
            run(mpirun + [sys.executable, os.path.join(here, "ddp_backend_bench.py"), "--wrapper", "fsdp", "--input", "1024",
                          "--width", "1024", "--layers", "3", "--classes", "10", "--loss", "cross-entropy",
                          "--optimizer", "adam", "--batch", "64", "--json", theirs_json], env=env)
            with open(ours_json) as f:
                ours = json.load(f)
            with open(theirs_json) as f:
                theirs = json.load(f)
            if ours["parameters"] != theirs["parameters"]:
                sys.exit(f"not the same model: {ours['parameters']} against {theirs['parameters']} parameters")
            pair = {"ours_s": ours["median_s"]["fsdp"], "fsdp2_gloo_s": theirs["gloo_step_s"],
                    "fsdp2_loom_s": theirs["loom_step_s"]}
            pair["ratio"] = pair["ours_s"] / pair["fsdp2_gloo_s"]
            pairs.append(pair)
            print(f"run {i + 1}: ours {pair['ours_s'] * 1e3:.1f} ms, FSDP2 over gloo {pair['fsdp2_gloo_s'] * 1e3:.1f} ms "
                  f"(over loom {pair['fsdp2_loom_s'] * 1e3:.1f} ms): ours / FSDP2-gloo {pair['ratio']:.3f}", flush=True)
    ratios = [p["ratio"] for p in pairs]
    median = statistics.median(ratios)
    print(f"{args.np} ranks, {ours['parameters'] / 1e6:.2f} M parameters: ours / FSDP2 over gloo, median {median:.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs; target <= 0.5: "
          f"{'met' if median <= 0.5 else 'missed'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fsdp_vs_fsdp2", "ranks": args.np, "parameters": ours["parameters"],
                       "pairs": pairs, "median_ratio": median, "min_ratio": min(ratios), "max_ratio": max(ratios)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
