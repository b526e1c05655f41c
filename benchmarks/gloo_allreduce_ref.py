#!/usr/bin/env python3
"""torch.distributed's Gloo allreduce timed the way `gloo_probe --bench N` times LibTorch's
ProcessGroupGloo from C++ (tests/gloo_probe): float32 sum at 4 B, 64 KiB, 4 MiB and 64 MiB,
3 warm-up calls, then N calls each after a barrier, the median printed by rank 0.

    torchrun --standalone --nproc_per_node 2 benchmarks/gloo_allreduce_ref.py --iterations 20
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # env:// from torchrun
    rank = dist.get_rank()
    for size in (4, 64 << 10, 4 << 20, 64 << 20):
        tensor = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(tensor)
        seconds = []
        for _ in range(args.iterations):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"python_gloo allreduce bytes={size} median_us={statistics.median(seconds) * 1e6:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
