#!/usr/bin/env python3
"""GPU check (benchmarks/gpu_check.sh, 2 ranks on one GPU, TP 2): from Python, random draws on the
GPU inside torchloom.tensor_parallel.fork() differ per TP rank and those outside agree, after
ParallelState.seed; dropout masks likewise. Without the CUDA tracker being seeded and forked, the
masks inside would be the same on both ranks (the CPU tracker's fork leaves the GPU's generator
alone). Prints PASS or raises."""
import torch
import torchloom


def main():
    torch.set_num_threads(1)
    torchloom.init()
    comm = torchloom.world_comm()
    assert torch.cuda.is_available(), "no GPU"
    assert comm.size == 2, "run at 2 ranks"
    ps = torchloom.ParallelState(comm, tensor_parallel=2)
    ps.seed(1234)
    x = torch.ones(4096, device="cuda")
    with torchloom.tensor_parallel.fork():
        inside = torch.rand(8, device="cuda")
        mask_inside = torch.nn.functional.dropout(x, 0.5) != 0
    outside = torch.rand(8, device="cuda")
    mask_outside = torch.nn.functional.dropout(x, 0.5) != 0
    mine = torch.cat([inside, outside, mask_inside.float(), mask_outside.float()]).cpu()
    both = torch.empty(2 * mine.numel())
    comm.all_gather(both, mine)
    a, b = both.view(2, -1)
    n, m = 8, 4096
    assert not torch.equal(a[:n], b[:n]), "draws inside fork() are the same on both TP ranks"
    assert torch.equal(a[n:2 * n], b[n:2 * n]), "draws outside fork() differ between TP ranks"
    assert not torch.equal(a[2 * n:2 * n + m], b[2 * n:2 * n + m]), "dropout masks inside fork() are the same"
    assert torch.equal(a[2 * n + m:], b[2 * n + m:]), "dropout masks outside fork() differ"
    if comm.rank == 0:
        print("PASS python CUDA RNG: inside fork() per TP rank, outside shared (draws and dropout masks)")
    torchloom.finalize()


if __name__ == "__main__":
    main()
