#!/usr/bin/env python3
"""all_reduce bus bandwidth through PyTorch's torch.distributed with the Gloo backend.

The third line of the all-reduce plot next to allreduce_bench's loom and raw MPI: the same
message sizes (float32 sum, in place, sizes from --min-bytes times 4 up to --max-bytes), the same
conventions (nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n; warm-up iterations
first, a barrier before each timed call, each sample the slowest rank's time, the median
reported; the iteration count sized from one probe to take about --seconds-per-size). Gloo runs
in separate processes from allreduce_bench, so set the two against each other only within one run
of benchmarks/run_all.sh, and expect drift between the programs.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/allreduce_gloo.py --min-bytes 4 --json allreduce_gloo_np2.json
"""

import argparse
import json
import os
import statistics
import sys
import time


def human(n):
    if n >= 1 << 20:
        return f"{n >> 20} MB"
    if n >= 1024:
        return f"{n >> 10} KB"
    return f"{n} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=40, help="timed iterations per size at most (at least 5)")
    p.add_argument("--seconds-per-size", type=float, default=1.5, help="time budget per size")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit("allreduce_gloo.py must run under torchrun (python3 -m torch.distributed.run)")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the other benchmarks: one intra-op thread per rank
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    bus_factor = 2.0 * (n - 1) / n if n > 1 else 1.0

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    if rank == 0:
        print(f"all_reduce float32 sum, torch.distributed gloo (torch {torch.__version__}), {n} ranks, in place; "
              f"median of timed iterations (slowest rank)")
        print(f"{'size':>9} {'iters':>5} {'gloo us':>10} {'gloo busbw':>13}")
    results, all_correct = [], True
    size = args.min_bytes
    while size <= args.max_bytes:
        count = max(1, size // 4)
        buf = torch.empty(count, dtype=torch.float32)
        buf.fill_(1)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        probe = slowest(time.perf_counter() - t0)
        iters = int(min(max(args.seconds_per_size / max(probe, 1e-6), 5), args.max_iters))
        it_t = torch.tensor([iters])
        dist.broadcast(it_t, 0)
        iters = int(it_t.item())
        times, correct = [], True
        expected = n * (n + 1) / 2.0
        for it in range(-args.warmup, iters):
            buf.fill_(rank + 1)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            seconds = slowest(time.perf_counter() - t0)
            correct = correct and buf[0].item() == expected and buf[-1].item() == expected
            if it >= 0:
                times.append(seconds)
        all_correct = all_correct and correct
        s = statistics.median(times)
        busbw = count * 4.0 / s * bus_factor / 1e9
        if rank == 0:
            print(f"{human(size):>9} {iters:5d} {s * 1e6:10.1f} {busbw:8.3f} GB/s{'' if correct else '  WRONG RESULT'}",
                  flush=True)
        results.append({"bytes": count * 4.0, "iterations": iters, "gloo_us": s * 1e6, "gloo_busbw_gbps": busbw,
                        "correct": correct})
        size *= 4
    if rank == 0 and args.json:
        doc = {"benchmark": "allreduce_gloo", "implementation": "pytorch", "backend": "gloo",
               "torch_version": torch.__version__, "ranks": n, "dtype": "float32",
               "config": {"min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "warmup": args.warmup,
                          "max_iters": args.max_iters, "seconds_per_size": args.seconds_per_size},
               "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    dist.destroy_process_group()
    return 0 if all_correct else 1


if __name__ == "__main__":
    sys.exit(main())
