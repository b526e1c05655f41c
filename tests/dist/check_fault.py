#!/usr/bin/env python3
"""Runs one fault scenario of loom_fault_program under mpirun and checks what happened.

A hang is a failure: every run has a hard limit well below CTest's. Each scenario states the
exit status it expects, which typed error each rank must report, the bounds on how long that
took (relative to the operation timeout), and what the message must say.
"""
import argparse
import os
import re
import subprocess
import sys
import time

TIMEOUT_S = 2.0  # LOOM_TIMEOUT for the scenarios: short, so the suite stays fast

SCENARIOS = {
    # scenario: (ranks, extra environment, expect exit 0?, {rank: (kind, min_s, max_s, [substrings])})
    "bad_input_one_rank": (2, {"LOOM_ON_ERROR": "raise"}, True, {
        1: ("InvalidArgumentError", 0.0, 0.5,
            ["[rank 1] all_reduce group=world (rank 1 of 2)", "expected a contiguous tensor, found shape [4, 6]"]),
        0: ("TimeoutError", TIMEOUT_S, 2 * TIMEOUT_S,
            ["[rank 0] all_reduce seq=0 group=world (rank 0 of 2) shape=[4, 6] dtype=Float op=sum timed out after",
             "(timeout 2.0 s)"]),
    }),
    "missing_call_abort": (2, {"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, False, {
        0: ("TimeoutError", TIMEOUT_S, 2 * TIMEOUT_S,
            ["[rank 0] all_reduce seq=0 group=world (rank 0 of 2) shape=[4, 6] dtype=Float op=sum timed out after"]),
    }),
    "mismatch_detected": (2, {"LOOM_CHECK_COLLECTIVES": "1", "LOOM_ON_ERROR": "raise"}, True, {
        0: ("MismatchError", 0.0, 1.0,
            ["collective mismatch: this rank called all_reduce(seq=0, dtype=Float, numel=24, op=sum) "
             "but rank 1 called broadcast(seq=0, dtype=Double, numel=12, root=0)"]),
        1: ("MismatchError", 0.0, 1.0,
            ["collective mismatch: this rank called broadcast(seq=0, dtype=Double, numel=12, root=0) "
             "but rank 0 called all_reduce(seq=0, dtype=Float, numel=24, op=sum)"]),
    }),
    # A device communicator demanded where there is no GPU: a clear error on every rank at init.
    "nccl_on_without_gpu": (2, {"LOOM_NCCL": "on"}, True, {
        0: ("ConfigError", 0.0, 5.0, ["[rank 0] init: LOOM_NCCL=on but"]),
        1: ("ConfigError", 0.0, 5.0, ["[rank 1] init: LOOM_NCCL=on but"]),
    }),
    # A killed rank: Open MPI's runtime ends the others; no rank may be left waiting.
    "sigkill_rank": (2, {"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, False, {}),
    # A stopped rank never answers: the others time out, report it, and end the job.
    "sigstop_rank": (2, {"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, False, {
        0: ("TimeoutError", TIMEOUT_S, 2 * TIMEOUT_S, ["timed out after", "seq=1"]),
    }),
}

def gpu_visible():
    """Whether nvidia-smi lists a GPU (the scenario needs a machine without one)."""
    import shutil
    if not shutil.which("nvidia-smi"):
        return False
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listing.returncode == 0 and "GPU" in listing.stdout


RESULT = re.compile(r"^RESULT rank=(\d+) kind=(\S+) elapsed=([\d.]+) message=(.*)$")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    args = parser.parse_args()
    ranks, extra_env, expect_success, expected = SCENARIOS[args.scenario]
    if args.scenario == "nccl_on_without_gpu" and gpu_visible():
        print("SKIP nccl_on_without_gpu: a GPU is visible here (benchmarks/gpu_check.sh covers this machine)")
        return 0

    env = dict(os.environ, LOOM_TIMEOUT=str(TIMEOUT_S), OMP_NUM_THREADS="1", **extra_env)
    command = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), args.program, args.scenario]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as e:
        print(f"FAIL {args.scenario}: the job hung (still running after 45 s)")
        print((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        return 1
    wall = time.monotonic() - start
    output = proc.stdout + proc.stderr
    print(f"--- {args.scenario}: exit {proc.returncode} after {wall:.1f} s ---\n{output}\n---")

    failures = []
    if expect_success and proc.returncode != 0:
        failures.append(f"expected exit status 0, found {proc.returncode}")
    if not expect_success and proc.returncode == 0:
        failures.append("expected the job to be ended with a non-zero status, found 0")
    if not expect_success and wall > 30:
        failures.append(f"the job took {wall:.1f} s to end; the ranks sleep 60 s, so it was not ended by the fault")

    results = {}
    for line in proc.stdout.splitlines():
        m = RESULT.match(line.strip())
        if m:
            results[int(m.group(1))] = (m.group(2), float(m.group(3)), m.group(4))
    for rank, (kind, low, high, parts) in expected.items():
        if rank not in results and kind == "TimeoutError" and extra_env.get("LOOM_ON_ERROR") == "abort":
            # With LOOM_ON_ERROR=abort a waiter may itself be running the collective (the
            # submit-then-wait fast path) and so cannot raise: the watchdog's logged error and
            # the job's end are the report, as with c10d's asynchronous error handling.
            logged = [line for line in output.splitlines()
                      if f"[rank {rank}/" in line and "[error]" in line and "timed out after" in line]
            if logged:
                m = re.search(r"timed out after ([\d.]+) s", logged[0])
                results[rank] = ("TimeoutError", float(m.group(1)), logged[0])
        if rank not in results:
            failures.append(f"rank {rank} reported nothing (expected {kind})")
            continue
        got_kind, elapsed, message = results[rank]
        if got_kind != kind:
            failures.append(f"rank {rank}: expected {kind}, found {got_kind}: {message}")
        if not (low <= elapsed <= high):
            failures.append(f"rank {rank}: error after {elapsed:.3f} s, expected between {low} and {high} s")
        for part in parts:
            if part not in message:
                failures.append(f"rank {rank}: message lacks '{part}': {message}")
    if args.scenario == "sigkill_rank" and "RANK 1 SIGNALLING ITSELF" not in output:
        failures.append("rank 1 never reached the kill")

    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else "FAILED", args.scenario)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
