#!/usr/bin/env python3
"""all_reduce under torchrun: torchloom over Gloo against torch.distributed over Gloo, in the same
processes and the same run.

Under torchrun (no MPI), torchloom.init() takes the env:// path: its world communicator is loom's
Communicator (validation, sequence numbers, flight record, watchdog) in front of LibTorch's
c10d::ProcessGroupGloo. The reference is torch.distributed.all_reduce on a gloo process group: the
same engine, called from Python as torchloom is. Both reduce one float32 buffer (sum, in place),
refilled before each call; every call starts after a barrier and its time is the slowest rank's.
Barrier and that max go through a third gloo group, so neither timed group does other work. The
two are interleaved call by call, in alternating order (the second of two calls is faster by
itself), so that machine drift hits both alike; the result of every call is checked.

Each side's time per size is the mean of its central 80% of calls (the fastest and slowest 10%
left out). Not the median: on a machine with fewer cores than threads wanting one, these times
are bimodal (a call either runs through or waits a scheduler tick; at 1 MB the two modes are about
1 ms and 3 ms, near half the calls each), and a median then jumps between the modes from run to
run (0.65 to 2.0 between identical runs), while the trimmed mean moves with the whole distribution.
Medians and every call's time are in the JSON too.

ratio = reference time / torchloom time: >= 1 means torchloom is at least as fast
(issue 24's target: >= 0.95 at every size).

    PYTHONPATH=build/python python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/allreduce_torchrun.py --json allreduce_torchrun_np2.json
"""

import argparse
import json
import os
import statistics
import sys
import time

DEFAULT_SIZES = [4, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def central_mean(xs, cut=0.1):
    """Mean of the values left when the lowest and highest `cut` of them are dropped."""
    xs = sorted(xs)
    k = int(len(xs) * cut)
    kept = xs[k:len(xs) - k] or xs
    return sum(kept) / len(kept)


def human(n):
    if n >= 1 << 20:
        return f"{n >> 20} MB"
    if n >= 1024:
        return f"{n >> 10} KB"
    return f"{n} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs of calls per size")
    p.add_argument("--min-iters", type=int, default=9, help="timed calls per size and side at least")
    p.add_argument("--max-iters", type=int, default=200, help="timed calls per size and side at most")
    p.add_argument("--seconds-per-size", type=float, default=3.0, help="time budget per size, both sides together")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        sys.exit("allreduce_torchrun.py must run under torchrun (python3 -m torch.distributed.run)")

    import torch
    import torch.distributed as dist
    import torchloom

    torch.set_num_threads(1)  # as the other benchmarks: one intra-op thread per rank
    torchloom.init()
    comm = torchloom.world_comm()
    if comm.backend != "gloo":
        sys.exit(f"torchloom's world communicator is {comm.backend}, not gloo: launch with torchrun, not mpirun")
    dist.init_process_group("gloo")
    sync = dist.new_group(backend="gloo")  # barriers and the slowest-rank max only
    rank, n = dist.get_rank(), dist.get_world_size()
    assert comm.rank == rank and comm.size == n, "torchloom and torch.distributed disagree on the ranks"

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sync)
        return t.item()

    if rank == 0:
        print(f"all_reduce float32 sum, {n} ranks, in place, torchrun: torchloom (gloo) vs torch.distributed (gloo, "
              f"torch {torch.__version__}), same processes, alternating; mean of the central 80% of timed calls "
              f"(slowest rank)")
        print(f"ratio = torch.distributed time / torchloom time (>= 0.95: issue 24's target)")
        print(f"{'size':>9} {'iters':>5} {'loom us':>10} {'torch us':>10} {'ratio':>7} {'loom p25-p75 us':>18} "
              f"{'torch p25-p75 us':>18}", flush=True)
    results, all_correct = [], True
    expected = n * (n + 1) / 2.0
    for size in args.bytes:
        count = max(1, size // 4)
        buf = torch.empty(count, dtype=torch.float32)
        correct = True

        def timed(call):
            nonlocal correct
            buf.fill_(rank + 1)
            dist.barrier(group=sync)
            t0 = time.perf_counter()
            call()
            seconds = slowest(time.perf_counter() - t0)
            correct = correct and buf[0].item() == expected and buf[-1].item() == expected
            return seconds

        def loom_call():
            comm.all_reduce(buf).wait()

        def torch_call():
            dist.all_reduce(buf)

        probe = timed(torch_call)
        iters = int(min(max(args.seconds_per_size / (2 * max(probe, 1e-6)), args.min_iters), args.max_iters))
        it_t = torch.tensor([iters])
        dist.broadcast(it_t, 0, group=sync)
        iters = int(it_t.item())
        loom_times, torch_times = [], []
        for it in range(-args.warmup, iters):
            if it % 2 == 0:
                lt = timed(loom_call)
                tt = timed(torch_call)
            else:
                tt = timed(torch_call)
                lt = timed(loom_call)
            if it >= 0:
                loom_times.append(lt)
                torch_times.append(tt)
        all_correct = all_correct and correct
        lm, tm = central_mean(loom_times), central_mean(torch_times)
        lq = statistics.quantiles(loom_times, n=4)
        tq = statistics.quantiles(torch_times, n=4)
        ratio = tm / lm
        if rank == 0:
            print(f"{human(size):>9} {iters:5d} {lm * 1e6:10.1f} {tm * 1e6:10.1f} {ratio:7.3f} "
                  f"{lq[0] * 1e6:8.1f}-{lq[2] * 1e6:<9.1f} {tq[0] * 1e6:8.1f}-{tq[2] * 1e6:<9.1f}"
                  f"{'' if correct else '  WRONG RESULT'}", flush=True)
        results.append({"bytes": count * 4, "iterations": iters, "loom_us": lm * 1e6, "torch_us": tm * 1e6,
                        "ratio_torch_over_loom_time": ratio,
                        "loom_us_p25": lq[0] * 1e6, "loom_us_p75": lq[2] * 1e6,
                        "torch_us_p25": tq[0] * 1e6, "torch_us_p75": tq[2] * 1e6, "correct": correct,
                        "loom_median_us": statistics.median(loom_times) * 1e6,
                        "torch_median_us": statistics.median(torch_times) * 1e6,
                        "loom_us_samples": [round(t * 1e6, 1) for t in loom_times],
                        "torch_us_samples": [round(t * 1e6, 1) for t in torch_times]})
    if rank == 0 and args.json:
        doc = {"benchmark": "allreduce_torchrun", "launcher": "torchrun", "loom_backend": comm.backend,
               "reference": "torch.distributed gloo", "torch_version": torch.__version__, "ranks": n,
               "dtype": "float32", "ratio": "torch.distributed time / torchloom time, each the mean of its central 80% of calls",
               "config": {"warmup": args.warmup, "min_iters": args.min_iters, "max_iters": args.max_iters,
                          "seconds_per_size": args.seconds_per_size},
               "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    dist.destroy_process_group(sync)
    dist.destroy_process_group()
    torchloom.finalize()
    return 0 if all_correct else 1


if __name__ == "__main__":
    sys.exit(main())
