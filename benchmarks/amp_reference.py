#!/usr/bin/env python3
"""How fast is PyTorch's own torch.amp.GradScaler("cpu").unscale_ on amp_bench's workloads?

The reference for benchmarks/amp_bench.cpp, which reads this script's JSON (--python-json) and sets
loom::GradScaler::unscale_ against it. Same workloads, same timing:
  small   1000 float32 tensors, sizes drawn with splitmix64 (seeded) from the same list as amp_bench
  large   4 float32 tensors of 16M elements
each gradient its own allocation, the .grad of a parameter of a torch.optim.SGD; 1 intra-op thread.
Before every timed pass the gradients are refilled from a pristine scaled copy (untimed), so values
stay finite and normal and every pass starts from the same cache state; after each unscale_,
update(scale) (untimed) makes the scaler ready again with the same scale. Two variants, in rounds as
amp_bench runs them (each variant --block passes in a row, the first --warmup untimed, the order
rotated every round), medians of the timed passes:
  unscale           scaler.unscale_(optimizer)
  copy_per_tensor   dst[i].copy_(grad[i]): this process's memory speed, which amp_bench uses to
                    cancel drift between the two processes
    python3 benchmarks/amp_reference.py --json amp_python.json
"""

import argparse
import json
import statistics
import sys
import time

# Must match kSmallSizes in amp_bench.cpp.
SMALL_SIZES = (64, 96, 256, 768, 1024, 3000, 4096, 12288, 16384, 65536)
MASK = (1 << 64) - 1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=1, help="untimed passes at the start of every block")
    p.add_argument("--block", type=int, default=4, help="timed passes of one variant in a row")
    p.add_argument("--iters", type=int, default=20, help="timed passes per variant and workload")
    p.add_argument("--small-tensors", type=int, default=1000)
    p.add_argument("--large-tensors", type=int, default=4)
    p.add_argument("--large-elements", type=int, default=16 << 20)
    p.add_argument("--scale", type=float, default=65536.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def small_sizes(count, seed):
    """splitmix64, as in amp_bench.cpp, so both programs build the same tensors."""
    state, sizes = seed & MASK, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        z ^= z >> 31
        sizes.append(SMALL_SIZES[z % len(SMALL_SIZES)])
    return sizes


def run_workload(args, torch, name, sizes):
    elements = sum(sizes)
    gen = torch.Generator().manual_seed(args.seed + 1)
    source_flat = torch.randn(elements, generator=gen).mul_(args.scale)
    sources = torch.split(source_flat, sizes)
    # zeros, not empty: first-touch page faults would otherwise be timed in the first passes.
    params = [torch.zeros(s, requires_grad=True) for s in sizes]
    grads = [torch.zeros(s) for s in sizes]
    copy_dst = [torch.zeros(s) for s in sizes]
    for p, g in zip(params, grads):
        p.grad = g
    optimizer = torch.optim.SGD(params, lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.scale)
    scaler.scale(torch.ones(1))  # what scale(loss) does before backward: creates the scale tensor

    def refill():
        for g, s in zip(grads, sources):
            g.copy_(s)

    def unscale():
        refill()
        t0 = time.perf_counter()
        scaler.unscale_(optimizer)
        seconds = time.perf_counter() - t0
        scaler.update(args.scale)  # next pass: READY again, same scale
        return seconds

    def copy():
        refill()
        t0 = time.perf_counter()
        for d, g in zip(copy_dst, grads):
            d.copy_(g)
        return time.perf_counter() - t0

    variants = {"unscale": unscale, "copy_per_tensor": copy}
    names = list(variants)
    samples = {n: [] for n in names}
    # As amp_bench: a pass follows a pass of its own kind, so each is timed from its own steady cache
    # state (what follows another variant is slower or faster by up to 1.7x on the small workload).
    rounds = (args.iters + args.block - 1) // args.block
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            for p in range(-args.warmup, min(args.block, args.iters - r * args.block)):
                seconds = variants[n]()
                if p >= 0:
                    samples[n].append(seconds * 1e6)

    # 1/scale is a power of two: the unscaled gradients must be exact.
    refill()
    scaler.unscale_(optimizer)
    correct = all(torch.equal(g, s * (1.0 / args.scale)) for g, s in zip(grads, sources))
    scaler.update(args.scale)
    return {
        "name": name,
        "tensors": len(sizes),
        "elements": elements,
        "bytes": elements * 4,
        "sizes": sizes,
        "median_us": {n: statistics.median(v) for n, v in samples.items()},
        "samples_us": samples,
        "correct": correct,
    }


def main():
    args = parse_args()
    import torch

    torch.set_num_threads(1)  # as amp_bench: one intra-op thread
    workloads = [
        run_workload(args, torch, "small", small_sizes(args.small_tensors, args.seed)),
        run_workload(args, torch, "large", [args.large_elements] * args.large_tensors),
    ]
    print(f"amp_reference: torch {torch.__version__} torch.amp.GradScaler('cpu').unscale_, float32, "
          f"{torch.get_num_threads()} thread, scale {args.scale:g}; median of {args.iters} timed passes, in "
          f"rounds of {args.block} after {args.warmup} untimed")
    for w in workloads:
        gbps = {n: 2 * w["bytes"] / us / 1e3 for n, us in w["median_us"].items()}
        print(f"  {w['name']:<6} {w['tensors']:5d} tensors, {w['bytes'] / 1e6:7.1f} MB: "
              f"unscale_ {w['median_us']['unscale']:10.1f} us ({gbps['unscale']:6.2f} GB/s), "
              f"copy/tensor {w['median_us']['copy_per_tensor']:10.1f} us ({gbps['copy_per_tensor']:6.2f} GB/s), "
              f"exact: {'yes' if w['correct'] else 'NO'}")
    if args.json:
        doc = {
            "benchmark": "amp_unscale",
            "implementation": "pytorch",
            "torch_version": torch.__version__,
            "device": "cpu",
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "scale": args.scale,
            "seed": args.seed,
            "warmup": args.warmup,
            "block": args.block,
            "iters": args.iters,
            "gbps_counts": "2 x gradient bytes (read + write)",
            "workloads": workloads,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0 if all(w["correct"] for w in workloads) else 1


if __name__ == "__main__":
    sys.exit(main())
