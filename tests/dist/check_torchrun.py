#!/usr/bin/env python3
"""torchrun without MPI: train_gpt started by torchrun (env:// rendezvous, Gloo through LibTorch's
TCPStore) against the same run started by mpirun (the reference).

  same-loss     TP 2 x DP 2 at 4 ranks: the final loss under torchrun equals mpirun's to the last
                digit (the same model, data and reduction order; only the transport differs)

Usage: check_torchrun.py --train-gpt PATH CASE
"""
import argparse
import os
import re
import subprocess
import sys

def environment():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOOM_TIMEOUT", "60")
    return env


def torchrun(nproc, command):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--no-python"] + command


def final_loss(output):
    found = re.findall(r"^final loss ([0-9.eE+-]+)$", output, re.M)
    return found[-1] if found else None


def same_loss(args):
    command = [args.train_gpt, "--tp", "2", "--steps", "30"]
    mpirun = ["mpirun"] + os.environ.get("LOOM_MPIRUN_FLAGS", "--oversubscribe").split() + \
             ["--allow-run-as-root", "-np", "4"] + command
    reference = subprocess.run(mpirun, capture_output=True, text=True, timeout=240, env=environment())
    ours = subprocess.run(torchrun(4, command), capture_output=True, text=True, timeout=240, env=environment())
    want, got = final_loss(reference.stdout), final_loss(ours.stdout)
    print(f"mpirun:   exit {reference.returncode}, final loss {want}")
    print(f"torchrun: exit {ours.returncode}, final loss {got}")
    if reference.returncode != 0 or want is None:
        print(reference.stdout[-3000:], reference.stderr[-3000:])
        return 1
    if ours.returncode != 0 or got != want:
        print(ours.stdout[-3000:], ours.stderr[-3000:])
        print(f"FAILED: expected final loss {want} under torchrun, found {got}")
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-gpt", required=True)
    parser.add_argument("case", choices=["same-loss"])
    args = parser.parse_args()
    return {"same-loss": same_loss}[args.case](args)


if __name__ == "__main__":
    sys.exit(main())
