"""backend="loom": a collective called with different sizes on two ranks ends, on both, in torchloom's
MismatchError naming both ranks and both sizes (over Gloo alone the larger rank's data would be
written past the smaller rank's buffer, or the call would hang). CTest runs it under mpirun -np 2
with LOOM_ON_ERROR=raise (the communicator is broken afterwards, hence a file of its own)."""

import pytest
import torch
import torch.distributed as dist

import torchloom


def test_all_reduce_of_different_sizes_names_both_ranks(loom, tcp_store):
    comm = loom.world_comm()
    assert comm.size == 2
    dist.init_process_group("loom", store=tcp_store(), rank=comm.rank, world_size=2)
    dist.all_reduce(torch.ones(4))  # a matching call first: the group works
    mine, theirs = (1024, 2048) if comm.rank == 0 else (2048, 1024)
    with pytest.raises(torchloom.MismatchError) as raised:
        dist.all_reduce(torch.ones(mine))
    message = str(raised.value)
    assert f"[rank {comm.rank}]" in message
    assert f"rank {1 - comm.rank}" in message
    assert str(mine) in message and str(theirs) in message
