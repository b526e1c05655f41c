"""PyTorch's own DistributedDataParallel over backend="loom", started as a user starts any job:
`dist.init_process_group("loom")` with no arguments, under mpirun, loomrun or torchrun.

Under mpirun and loomrun no env:// variable is set (RANK, MASTER_ADDR, ...): torchloom answers
torch's env:// rendezvous from MPI. Each rank's gradients after backward must equal the average of
every rank's gradients, computed here on one process from the same weights and inputs (plain
autograd, no communication).
"""
import os
import sys

import torch
import torch.distributed as dist

import torchloom  # noqa: F401  (registers "loom")


def inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 16, generator=g)


def main():
    launcher = sys.argv[1] if len(sys.argv) > 1 else "?"
    if launcher in ("mpirun", "loomrun"):
        unset = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v in os.environ]
        assert not unset, f"under {launcher} the test expects no env:// variable, found {unset}"
    dist.init_process_group("loom")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "loom", dist.get_backend()

    torch.manual_seed(7)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model.load_state_dict(reference.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(inputs(rank)).pow(2).mean().backward()

    # The average of every rank's gradients, on this process alone.
    expected = [torch.zeros_like(p) for p in reference.parameters()]
    for r in range(size):
        reference.zero_grad()
        reference(inputs(r)).pow(2).mean().backward()
        for e, p in zip(expected, reference.parameters()):
            e += p.grad / size
    for (name, p), e in zip(model.named_parameters(), expected):
        assert torch.allclose(p.grad, e, rtol=1e-5, atol=1e-7), \
            f"rank {rank}: {name}'s gradient differs from the average by {(p.grad - e).abs().max().item()}"
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}/{size} under {launcher}: DDP over backend loom, gradients equal to the average", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
