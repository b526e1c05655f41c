"""backend="loom": a collective that one rank does not join in time ends in torchloom's TimeoutError
on the other, naming the rank that did not arrive, through torch.distributed's own API (CTest runs it
under mpirun -np 2 with LOOM_ON_ERROR=raise and LOOM_TIMEOUT=2; a file of its own because the group
is broken afterwards)."""
import re
import time

import torch
import torch.distributed as dist

import torchloom


def test_rank_that_does_not_arrive_is_named(loom, tcp_store):
    comm = loom.world_comm()
    assert comm.size == 2
    # Where the ranks meet again at the end, once rank 1 has joined the timed-out call late (so that
    # rank 0's operation stuck in MPI completes and both can finalize).
    spare = comm.split(0, comm.rank, "spare")
    dist.init_process_group("loom", store=tcp_store(), rank=comm.rank, world_size=2)
    dist.all_reduce(torch.ones(4))
    if comm.rank == 1:
        time.sleep(6)
        dist.all_reduce(torch.ones(8))
        spare.barrier(timeout=60).wait()
        dist.destroy_process_group()
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
    except torchloom.TimeoutError as e:
        message = str(e)
    else:
        raise AssertionError("expected torchloom.TimeoutError")
    assert time.monotonic() - start < 30
    assert re.match(r"\[rank 0\] all_reduce seq=\d+ group=world \(rank 0 of 2\) shape=\[8\]", message), message
    assert "timed out after" in message and "rank not arrived: 1" in message, message
    spare.barrier(timeout=60).wait()
    # The broken group goes before the session's finalize(), as torch.distributed asks (one kept
    # past it no longer crashes a rank: check_finalize_with_live_groups.py).
    dist.destroy_process_group()
