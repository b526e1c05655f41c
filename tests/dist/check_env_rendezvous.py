#!/usr/bin/env python3
"""Bad env:// launches, started by hand as a new user would (no torchrun): each is refused on every
rank that started, by a typed error whose message says what is wrong, in bounded time, with no
backtrace in it and no crash.

  duplicate_local_rank  two ranks of one host both with LOCAL_RANK=0: ConfigError naming both
  missing_rank          RANK=0 WORLD_SIZE=2 and no rank 1: TimeoutError after LOOM_TIMEOUT naming rank 1
  unresolvable_master   MASTER_ADDR that does not resolve: ConfigError at once, naming it
  no_agent_store        TORCHELASTIC_USE_AGENT_STORE=True with no agent serving: CommError after
                        LOOM_TIMEOUT saying who was expected to serve the store

Usage: check_env_rendezvous.py --program PATH (tests/dist/fault_program.cpp's binary)
"""
import argparse
import os
import re
import socket
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound, time_scale_note  # noqa: E402  (tests/time_scale.py)

TIMEOUT = 3.0  # LOOM_TIMEOUT of these launches
RESULT = re.compile(r"^RESULT rank=(\d+) kind=(\S+) elapsed=([\d.]+) message=(.*)$", re.M)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(program, ranks, **variables):
    """Starts one process per entry of `ranks` (a dict of that rank's own variables) at once."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOOM_", "OMPI_", "PMIX_", "TORCHELASTIC_"))}
    base.update(OMP_NUM_THREADS="1", LOOM_TIMEOUT=str(TIMEOUT), MASTER_PORT=str(free_port()), **variables)
    procs = [subprocess.Popen([program, "bad_config_value"], env=dict(base, **own), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for own in ranks]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n(still running after 60 s: killed)")
    return procs, outputs


CASES = {
    "duplicate_local_rank": dict(
        ranks=[dict(RANK="0"), dict(RANK="1")],
        variables=dict(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),
        kind="ConfigError", low=0, high=5.0,
        parts=["ranks 0 and 1 both run on host", "with LOCAL_RANK=0", "expected each rank of a host to have its own "
               "LOCAL_RANK"]),
    "missing_rank": dict(
        ranks=[dict(RANK="0")], variables=dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),
        kind="TimeoutError", low=TIMEOUT, high=TIMEOUT + 3.0,
        parts=["the env:// rendezvous at 127.0.0.1:", "timed out after", "(LOOM_TIMEOUT): rank 1 of WORLD_SIZE=2 never "
               "arrived"]),
    "unresolvable_master": dict(
        ranks=[dict(RANK="0"), dict(RANK="1")], variables=dict(WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid"),
        kind="ConfigError", low=0, high=2.0,
        parts=["MASTER_ADDR='no-such-host.invalid' does not resolve to an address"]),
    "no_agent_store": dict(
        ranks=[dict(RANK="0")],
        variables=dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", TORCHELASTIC_USE_AGENT_STORE="True"),
        kind="CommError", low=TIMEOUT, high=2 * TIMEOUT + 3.0,
        parts=["no store answered; expected torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True) to serve it there"]),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", required=True)
    parser.add_argument("cases", nargs="*", default=sorted(CASES))
    args = parser.parse_args()
    failures = []
    for name in args.cases:
        case = CASES[name]
        procs, outputs = launch(args.program, case["ranks"], **case["variables"])
        for rank, (p, out) in enumerate(zip(procs, outputs)):
            found = RESULT.findall(out)
            label = f"{name} rank {rank}"
            if len(found) != 1:
                failures.append(f"{label}: no RESULT line (exit {p.returncode}):\n{out[-2000:]}")
                continue
            _, kind, elapsed, message = found[0]
            elapsed = float(elapsed)
            print(f"{label}: {kind} after {elapsed:.2f} s: {message}")
            high = case["low"] + time_bound(case["high"] - case["low"])
            if kind != case["kind"]:
                failures.append(f"{label}: expected {case['kind']}, found {kind}")
            if not case["low"] <= elapsed <= high:
                failures.append(f"{label}: after {elapsed:.2f} s, expected {case['low']} to {high:.1f} s"
                                f"{time_scale_note()}")
            failures += [f"{label}: the message lacks '{part}'" for part in case["parts"] if part not in message]
            if "frame #" in message or "Exception raised from" in message or len(message) > 600:
                failures.append(f"{label}: the message carries a backtrace or is {len(message)} bytes long")
            if p.returncode != 0 or "Segmentation fault" in out or "terminate called" in out:
                failures.append(f"{label}: exit {p.returncode} (the program reports and exits 0)")
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
