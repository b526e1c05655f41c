"""backend="loom": a collective called with different sizes on two ranks ends, on both, in torchloom's
MismatchError naming both ranks and both sizes (over Gloo alone the larger rank's data would be
written past the smaller rank's buffer, or the call would hang). CTest runs it under mpirun -np 2
with LOOM_ON_ERROR=raise (the communicator is broken afterwards, hence a file of its own)."""
import socket

import pytest
import torch
import torch.distributed as dist

import torchloom


def test_all_reduce_of_different_sizes_names_both_ranks(loom):
    comm = loom.world_comm()
    assert comm.size == 2
    port = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.broadcast(port, 0).wait()  # rank 0 (a global rank and a group rank alike here)
    dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{int(port)}", rank=comm.rank, world_size=2)
    dist.all_reduce(torch.ones(4))  # a matching call first: the group works
    mine, theirs = (1024, 2048) if comm.rank == 0 else (2048, 1024)
    with pytest.raises(torchloom.MismatchError) as raised:
        dist.all_reduce(torch.ones(mine))
    message = str(raised.value)
    assert f"[rank {comm.rank}]" in message
    assert f"rank {1 - comm.rank}" in message
    assert str(mine) in message and str(theirs) in message
