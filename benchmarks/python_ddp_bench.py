#!/usr/bin/env python3
"""How does torchloom's DDP from Python compare with PyTorch's own DDP, and what does a Python
collective cost over the C++ call? Run under mpirun (torchloom's ranks are MPI processes):

    mpirun -np 2 python3 benchmarks/python_ddp_bench.py --json python_ddp.json

(a) step time: the same Python training loop (zero_grad, forward, cross-entropy, backward, SGD
    step) on the same MLP as ddp_bench (1024 inputs, 4 hidden layers of 1024, float32, 1 thread
    per rank), with torchloom.DistributedDataParallel and with torch.nn.parallel.DistributedDataParallel
    (Gloo, started in the same processes), plus the plain model; variants interleaved iteration by
    iteration, a barrier before each step, slowest rank per step, medians. Target: ratio <= 0.9.
(b) per-call overhead: comm.all_reduce(t).wait() on a 1-element tensor from Python against the same
    loop run inside C++ (torchloom._C._time_all_reduce_loop), same process and communicator.
    Target: <= 5 us.
"""
import argparse
import json
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

import torchloom


def make_mlp(args):
    torch.manual_seed(args.seed)
    layers, width = [], args.input
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, args.classes))
    return torch.nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-per-rank", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--calls", type=int, default=20000, help="collective calls timed for (b)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = torchloom.init().world_comm
    rank, world = comm.rank, comm.size
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.broadcast(port, src=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=rank, world_size=world)

    models = {"plain": make_mlp(args),
              "torch_ddp": torch.nn.parallel.DistributedDataParallel(make_mlp(args), gradient_as_bucket_view=True),
              "torchloom_ddp": torchloom.DistributedDataParallel(make_mlp(args))}
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
    names = list(models)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch_per_rank, args.input, generator=gen)
    y = torch.randint(args.classes, (args.batch_per_rank,), generator=gen)
    local = {n: [] for n in names}
    for it in range(-args.warmup, args.iters):
        shift = (it + args.warmup) % len(names)
        for n in names[shift:] + names[:shift]:
            comm.barrier().wait()
            t0 = time.perf_counter()
            opts[n].zero_grad()
            torch.nn.functional.cross_entropy(models[n](x), y).backward()
            opts[n].step()
            if it >= 0:
                local[n].append(time.perf_counter() - t0)
    times = torch.tensor([local[n] for n in names], dtype=torch.float64)
    comm.all_reduce(times, torchloom.ReduceOp.MAX).wait()
    median = {n: statistics.median(times[i].tolist()) for i, n in enumerate(names)}
    max_diff = max((a - b).abs().max().item() for a, b in zip(models["torch_ddp"].module.parameters(),
                                                              models["torchloom_ddp"].module.parameters()))

    # (b) per-call overhead, 1-element float32 all_reduce + wait.
    t = torch.ones(1)
    comm.barrier().wait()
    torchloom._C._time_all_reduce_loop(comm, t, 200)
    cpp_rounds, py_rounds = [], []
    for _ in range(3):
        comm.barrier().wait()
        cpp_rounds.append(torchloom._C._time_all_reduce_loop(comm, t, args.calls))
        comm.barrier().wait()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            comm.all_reduce(t).wait()
        py_rounds.append((time.perf_counter() - t0) / args.calls)
    per_call = torch.tensor([min(cpp_rounds), min(py_rounds)], dtype=torch.float64)
    comm.all_reduce(per_call, torchloom.ReduceOp.MAX).wait()
    cpp_call, py_call = per_call.tolist()
    ratio = median["torchloom_ddp"] / median["torch_ddp"]
    overhead_us = (py_call - cpp_call) * 1e6
    if rank == 0:
        print(f"python_ddp_bench: {world} ranks, torch {torch.__version__}, torchloom {torchloom.__version__}, "
              f"median of {args.iters} interleaved steps (slowest rank)")
        for n in names:
            print(f"  {n:<16} {median[n] * 1e3:9.2f} ms")
        print(f"  (a) torchloom DDP / torch DDP (Gloo): {ratio:.3f}  (target <= 0.9)")
        print(f"  (b) all_reduce+wait per call: Python {py_call * 1e6:.2f} us, C++ {cpp_call * 1e6:.2f} us, "
              f"overhead {overhead_us:.2f} us  (target <= 5 us)")
        print(f"  parameters torchloom vs torch DDP: max difference {max_diff:.3g}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "python_ddp", "ranks": world, "torch_version": torch.__version__,
                           "config": {k: getattr(args, k) for k in ("input", "hidden", "layers", "classes",
                                                                     "batch_per_rank", "iters", "calls")},
                           "median_s": median, "samples_s": {n: times[i].tolist() for i, n in enumerate(names)},
                           "step_ratio_torchloom_over_torch": ratio, "per_call_python_s": py_call,
                           "per_call_cpp_s": cpp_call, "per_call_overhead_us": overhead_us,
                           "max_parameter_difference": max_diff}, f, indent=2)
                f.write("\n")
    dist.destroy_process_group()
    torchloom.finalize()
    return 0 if max_diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
