#!/usr/bin/env python3
"""torchloom's pipeline executor against torch.distributed.pipelining (Gloo): the step time of the
same model split the same way, in the same processes and the same run.

A stack of MLP blocks (hidden -> 4 hidden -> hidden, residual) is cut into one stage per rank
(torchloom.stage_layers, for both); each step runs every micro-batch forward and backward under
1F1B (or --schedule gpipe): torchloom.PipelineExecutor over the world communicator (MPI under
mpirun), and torch.distributed.pipelining's Schedule1F1B over a Gloo process group. With
--schedule zero-bubble torchloom runs ZB-H1, its blocks' linears through torchloom.pipeline_linear
(weight gradients deferred to the plan's W steps), against torch's Schedule1F1B as before. The two take
turns step by step, each on its own copy of the model; a step starts after a barrier and its time
is the slowest rank's. Gradients of both are compared after the first step (they must agree).

ratio = torchloom step time / torch.distributed.pipelining step time (median): < 1 is faster.

    mpirun -np 2 env PYTHONPATH=build/python python3 benchmarks/pipeline_torch_bench.py --json pipeline_torch_np2.json
"""

import argparse
import copy
import json
import statistics
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, default=256, help="rows of one micro-batch")
    p.add_argument("--layers-per-rank", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "zero-bubble"], default="1f1b")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    import torchloom

    torch.set_num_threads(1)  # as the other benchmarks: one intra-op thread per rank
    torchloom.init()
    comm = torchloom.world_comm()
    rank, ranks = comm.rank, comm.size
    port = torch.zeros(1, dtype=torch.int64)
    server = None
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, ranks, True, wait_for_workers=False)
        port[0] = server.port
    comm.broadcast(port, 0).wait()
    store = server or dist.TCPStore("127.0.0.1", int(port), ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
            self.linear = nn.functional.linear  # torchloom.pipeline_linear: deferrable weight gradients

        def forward(self, x):
            h = nn.functional.gelu(self.linear(x, self.fc1.weight, self.fc1.bias))
            return x + self.linear(h, self.fc2.weight, self.fc2.bias)

    torch.manual_seed(3)
    layers = args.layers_per_rank * ranks
    first, end = torchloom.stage_layers(layers, ranks, rank)
    whole = [Block(args.hidden) for _ in range(layers)]
    ours_stage = nn.Sequential(*whole[first:end])
    theirs_stage = copy.deepcopy(ours_stage)
    if args.schedule == "zero-bubble":
        for block in ours_stage:
            block.linear = torchloom.pipeline_linear
    m = args.micro_batches
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(args.rows, args.hidden, generator=g) for _ in range(m)]
    targets = [torch.randn(args.rows, args.hidden, generator=g) for _ in range(m)]
    last = rank == ranks - 1

    ours = torchloom.PipelineExecutor(comm, [ours_stage], schedule=args.schedule, micro_batches=m)
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    theirs = kind(PipelineStage(theirs_stage, rank, ranks, torch.device("cpu")), n_microbatches=m,
                  loss_fn=nn.functional.mse_loss)
    whole_input, whole_target = torch.cat(inputs), torch.cat(targets)

    def run_ours():
        ours_stage.zero_grad()
        ours.step(inputs if rank == 0 else [],
                  (lambda out, k: nn.functional.mse_loss(out, targets[k]) / m) if last else None)

    def run_theirs():
        theirs_stage.zero_grad()
        if rank == 0:
            theirs.step(whole_input)
        elif last:
            theirs.step(target=whole_target)
        else:
            theirs.step()

    def timed(run):
        dist.barrier()
        start = time.perf_counter()
        run()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    times = {"torchloom": [], "torch.distributed.pipelining": []}
    bubbles = []
    for step in range(args.warmup + args.steps):
        order = [("torchloom", run_ours), ("torch.distributed.pipelining", run_theirs)]
        if step % 2:
            order.reverse()  # neither always goes first
        for name, run in order:
            t = timed(run)
            if step >= args.warmup:
                times[name].append(t)
        if step >= args.warmup:
            b = torch.tensor([ours.last_step.bubble], dtype=torch.float64)
            dist.all_reduce(b)
            bubbles.append(float(b) / ranks)
        if step == 0:  # same stages, same data: the same gradients
            for a, b in zip(ours_stage.parameters(), theirs_stage.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["torchloom"] / med["torch.distributed.pipelining"]
    if rank == 0:
        print(f"pipeline {args.schedule} over {ranks} ranks, {m} micro-batches of [{args.rows}, {args.hidden}], "
              f"{layers} MLP blocks; median of {args.steps} steps (range)")
        for k, v in times.items():
            print(f"  {k:30s} {med[k] * 1e3:8.2f} ms  ({min(v) * 1e3:.2f} .. {max(v) * 1e3:.2f})")
        print(f"  ratio torchloom / torch.distributed.pipelining: {ratio:.3f}   "
              f"(torchloom's measured bubble {statistics.median(bubbles):.3f}, promised {ours.bubble_promised:.3f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": ranks, "schedule": args.schedule, "micro_batches": m, "hidden": args.hidden,
                           "rows": args.rows, "layers": layers, "steps": args.steps,
                           "median_seconds": med, "range_seconds": {k: [min(v), max(v)] for k, v in times.items()},
                           "ratio": ratio, "bubble_measured": statistics.median(bubbles),
                           "bubble_promised": ours.bubble_promised}, f, indent=2)
    dist.destroy_process_group()
    torchloom.finalize()


if __name__ == "__main__":
    main()
