#!/usr/bin/env python3
"""Data-parallel training from Python with torchloom: DDP over the C++ reducer, AMP (bfloat16
autocast on CPU, float16 on CUDA) with torchloom.GradScaler, gradient accumulation under no_sync().
A small MLP learns a synthetic task (y = a fixed random teacher network); progress as the C++
example prints it; exits 1 unless the loss halves.

    mpirun -np 2 python3 python/examples/train.py --steps 200 --accumulate 2
"""
import argparse
import sys
import time

import torch
import torch.nn as nn

import torchloom


def fmt(seconds):
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-per-rank", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (no_sync on all but the last)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--amp", choices=["bf16", "off"], default="bf16")
    p.add_argument("--scaler", action="store_true", help="use torchloom.GradScaler (needed for float16 on CUDA)")
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args()
    if args.batch_per_rank % args.accumulate:
        print(f"train.py: --batch-per-rank {args.batch_per_rank} must be a multiple of --accumulate "
              f"{args.accumulate}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        rt = torchloom.init()
        world = rt.world
        device = torch.device("cpu")
        torch.manual_seed(0)
        teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        for q in teacher.parameters():
            q.requires_grad_(False)
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden), nn.GELU(),
                              nn.Linear(args.hidden, 8)).to(device)
        ddp = torchloom.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        scaler = torchloom.GradScaler("cpu", enabled=args.scaler)
        micro = args.batch_per_rank // args.accumulate
        if world.rank == 0:
            print(f"train.py: {world.size} ranks, {args.steps} steps, global batch {args.batch_per_rank * world.size} "
                  f"({args.batch_per_rank} per rank, {args.accumulate} micro-batches), amp {args.amp}, lr {args.lr}",
                  flush=True)
        gen = torch.Generator().manual_seed(1000 + world.rank)
        start = time.perf_counter()
        first = last = None
        for step in range(1, args.steps + 1):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m in range(args.accumulate):
                x = torch.randn(micro, 32, generator=gen)
                y = teacher(x)
                sync = m == args.accumulate - 1
                with (ddp.no_sync() if not sync else torch.enable_grad()):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
                        out = ddp(x)
                    loss = nn.functional.mse_loss(out.float(), y) / args.accumulate
                    scaler.scale(loss).backward()
                total += loss.item()
            scaler.step(opt)
            scaler.update()
            avg = torch.tensor([total])
            torchloom.world_comm().all_reduce(avg, torchloom.ReduceOp.AVG).wait()
            last = avg.item()
            first = last if first is None else first
            if world.rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
                elapsed = time.perf_counter() - start
                rate = step * args.batch_per_rank * world.size / elapsed
                eta = elapsed / step * (args.steps - step)
                print(f"step {step:5d}/{args.steps}  loss {last:.4f}  {rate:9.0f} samples/s  elapsed {fmt(elapsed)}  "
                      f"eta {fmt(eta)}", flush=True)
        learned = last < first / 2
        if world.rank == 0:
            print(f"first loss {first:.4f}, final loss {last:.4f} ({100 * last / first:.1f}% of first), "
                  f"{fmt(time.perf_counter() - start)} for {args.steps} steps")
            print("OK: the loss fell below half its start" if learned else "FAILED: the loss did not halve")
        torchloom.finalize()
        return 0 if learned else 1
    except torchloom.Error as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
