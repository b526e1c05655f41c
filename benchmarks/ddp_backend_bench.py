#!/usr/bin/env python3
"""PyTorch's own DistributedDataParallel (or, with --wrapper fsdp, its FSDP2 `fully_shard`) over
backend="loom" against over backend="gloo": the step time of the same model, in the same processes
and the same run.

The default process group is "loom" (torchloom's world communicator: MPI under mpirun, Gloo under
torchrun); the reference is a new_group(backend="gloo") over the same ranks. Two DDP replicas of
one model (same initial weights, same batches) train in rounds of --steps steps, loom and gloo
alternating which goes first; a round starts after a barrier and its time is the slowest rank's
(barrier and max on a third gloo group, so neither timed group does other work). A step is
forward, backward (DDP's bucketed all-reduce overlapping it) and SGD (or --optimizer adam; the model's
shape, loss and optimizer can be zero_bench's, so that its fully sharded step compares with FSDP2's:
--input 1024 --layers 3 --classes 10 --loss cross-entropy --optimizer adam --batch 64). With --wrapper fsdp each Linear
is a fully_shard unit and the model the root (FSDP2's all-gathers and reduce-scatters instead; Gloo
has no AVG reduce-scatter, so both sides sum and divide, as FSDP2's set_force_sum_reduction_for_comms
makes them; target for FSDP2: loom <= 0.8 of gloo).

ratio = loom step time / gloo step time (median of rounds): <= 1.0 means loom is at least as fast
(issue 25's target). The two replicas' parameters are compared at the end (they must agree).

    mpirun -np 2 env PYTHONPATH=build/python python3 benchmarks/ddp_backend_bench.py --json ddp_backend_np2.json
    PYTHONPATH=build/python python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/ddp_backend_bench.py
"""

import argparse
import json
import socket
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=4, help="hidden layers")
    p.add_argument("--input", type=int, default=256, help="input features")
    p.add_argument("--classes", type=int, default=16, help="outputs (targets of the MSE, or classes)")
    p.add_argument("--loss", choices=["mse", "cross-entropy"], default="mse")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per backend")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (both)")
    p.add_argument("--wrapper", choices=["ddp", "fsdp"], default="ddp", help="PyTorch's DDP or FSDP2 (fully_shard)")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torchloom

    torch.set_num_threads(1)  # as the other benchmarks: one intra-op thread per rank
    torchloom.init()
    comm = torchloom.world_comm()
    if torchloom.world().launcher == "torchrun":
        dist.init_process_group("loom")
    else:
        port = torch.zeros(1, dtype=torch.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, 0).wait()  # rank 0 (a global rank and a group rank alike here)
        dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{int(port)}", rank=comm.rank,
                                world_size=comm.size)
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    sync = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        layers = [nn.Linear(args.input, args.width), nn.ReLU()]
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        layers.append(nn.Linear(args.width, args.classes))
        return nn.Sequential(*layers)

    def wrapped(group):
        if args.wrapper == "ddp":
            return nn.parallel.DistributedDataParallel(model(), process_group=group, bucket_cap_mb=args.bucket_mb)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh.from_group(group, "cpu")
        net = model()
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        net.set_force_sum_reduction_for_comms(True)
        return net

    sides = {"loom": wrapped(dist.group.WORLD), "gloo": wrapped(gloo)}
    optimizer = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    optimizers = {name: optimizer(m.parameters(), lr=1e-3) for name, m in sides.items()}
    params = sum(p.numel() for p in model().parameters())
    steps_done = {name: 0 for name in sides}

    def step(name):
        g = torch.Generator().manual_seed(1000 * steps_done[name] + rank)
        x = torch.randn(args.batch, args.input, generator=g)
        if args.loss == "mse":
            loss = nn.functional.mse_loss(sides[name](x), torch.randn(args.batch, args.classes, generator=g))
        else:
            loss = nn.functional.cross_entropy(sides[name](x), torch.randint(args.classes, (args.batch,), generator=g))
        optimizers[name].zero_grad()
        loss.backward()
        optimizers[name].step()
        steps_done[name] += 1

    def timed_round(name):
        dist.barrier(group=sync)
        start = time.perf_counter()
        for _ in range(args.steps):
            step(name)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=sync)
        return elapsed.item() / args.steps

    for name in sides:
        for _ in range(args.warmup):
            step(name)
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        order = ["loom", "gloo"] if r % 2 == 0 else ["gloo", "loom"]
        for name in order:
            times[name].append(timed_round(name))

    # Same batches, same steps: the replicas must agree (the all-reduce order may differ by rounding).
    def local(t):  # FSDP2's parameters are DTensors: this rank's shard
        return t.to_local() if hasattr(t, "to_local") else t
    agree = all(torch.allclose(local(a), local(b), rtol=1e-5, atol=1e-6)
                for a, b in zip(sides["loom"].parameters(), sides["gloo"].parameters()))
    result = {
        "benchmark": "ddp_backend" if args.wrapper == "ddp" else "fsdp_backend",
        "wrapper": args.wrapper,
        "launcher": torchloom.world().launcher,
        "loom_host_backend": comm.backend,
        "ranks": size,
        "parameters": params,
        "model": {"input": args.input, "width": args.width, "layers": args.layers, "classes": args.classes,
                  "loss": args.loss, "optimizer": args.optimizer},
        "gradient_bytes": params * 4,
        "batch_per_rank": args.batch,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "loom_step_s": statistics.median(times["loom"]),
        "gloo_step_s": statistics.median(times["gloo"]),
        "loom_rounds_s": times["loom"],
        "gloo_rounds_s": times["gloo"],
        "replicas_agree": agree,
    }
    result["ratio_loom_over_gloo"] = result["loom_step_s"] / result["gloo_step_s"]
    if rank == 0:
        print(f"{'DDP' if args.wrapper == 'ddp' else 'FSDP2'} step, {size} ranks, {params / 1e6:.2f} M parameters, batch {args.batch}/rank: "
              f"loom {result['loom_step_s'] * 1e3:.2f} ms, gloo {result['gloo_step_s'] * 1e3:.2f} ms, "
              f"ratio loom/gloo {result['ratio_loom_over_gloo']:.3f} "
              f"(target <= {1.0 if args.wrapper == 'ddp' else 0.8}); replicas agree: {agree}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()
    torchloom.finalize()
    if not agree:
        sys.exit("the loom and gloo replicas disagree")


if __name__ == "__main__":
    main()
