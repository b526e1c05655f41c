#!/usr/bin/env python3
"""Starts a program at N ranks with the env:// variables only (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and without TORCHELASTIC_USE_AGENT_STORE: no torchrun agent serves a
store, so rank 0 must serve it itself. Exits with the first non-zero rank status, or 0."""

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    # The port is released before rank 0 binds it; another process could take it in between,
    # which shows up as a bind error in rank 0, not as a wrong result.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=100.0)
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.np < 1 or not args.program:
        parser.error("need --np >= 1 and a program")

    port = free_port()
    procs = []
    for rank in range(args.np):
        env = dict(os.environ)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        # What Kubeflow's PyTorchJob sets in a pod, and nothing more (no LOCAL_RANK): torchloom
        # takes the ranks' places on their hosts from the host names.
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            env.pop(name, None)
        env.update(RANK=str(rank), WORLD_SIZE=str(args.np), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(args.program, env=env))

    deadline = time.monotonic() + args.timeout
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            status = failed[0] if failed else 124
            if not failed:
                print(f"launch_env: ranks still running after {args.timeout} s", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
        if status == 0 and p.returncode != 0:
            status = p.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
