#!/usr/bin/env python3
"""A CPU job on a machine with fewer GPUs than ranks is never refused.

The suite's fake NVML library stands in for the driver (as libnvidia-ml.so.1 on LD_LIBRARY_PATH),
describing FAKE_NVML_COUNT GPUs, fewer than the ranks on the node: loom::init() must not refuse the
job (no placement plan fits one GPU per rank), the ranks train on the CPU, and the log says what
was chosen and why. Also with LOOM_NCCL=off, which never wanted a GPU."""
import argparse
import os
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--mpirun", required=True)
parser.add_argument("--program", required=True, help="examples/train_ddp")
parser.add_argument("--fake-nvml-dir", required=True, help="a directory holding the fake libnvidia-ml.so.1")
args = parser.parse_args()

failures = []
for np, gpus, extra in [(2, 1, {}), (2, 1, {"LOOM_NCCL": "off"}), (4, 2, {})]:
    env = dict(os.environ, LD_LIBRARY_PATH=args.fake_nvml_dir + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
               FAKE_NVML_COUNT=str(gpus), LOOM_LOG_LEVEL="info", OMP_NUM_THREADS="1", **extra)
    command = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(np), args.program, "--steps", "100"]
    label = f"{np} ranks, {gpus} GPU(s){', ' + str(extra) if extra else ''}"
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        failures.append(f"{label}: the job hung")
        continue
    output = proc.stdout + proc.stderr
    print(f"--- {label}: exit {proc.returncode} ---")
    print("\n".join(line for line in output.splitlines() if "placement" in line or "device communicator" in line))
    if proc.returncode != 0:
        failures.append(f"{label}: exit status {proc.returncode}:\n{output[-3000:]}")
        continue
    # The fake driver was read (else this proves nothing): the plan was tried and dropped, saying why.
    wanted = ["no placement plan: the GPUs found do not fit the job: node 0 ('"]
    if extra.get("LOOM_NCCL") == "off":
        wanted.append("no device communicator: LOOM_NCCL=off")
    else:
        wanted.append("no device communicator (LOOM_NCCL=auto), every rank runs on the CPU: rank 0: ")
    for text in wanted:
        for rank in range(np):
            if not any(f"[rank {rank}/{np}]" in line and text in line for line in output.splitlines()):
                failures.append(f"{label}: rank {rank} did not log '{text}'")

for f in failures:
    print("FAIL", f)
print("PASS" if not failures else "FAILED")
sys.exit(1 if failures else 0)
