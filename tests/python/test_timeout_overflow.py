"""Timeouts from Python that do not fit the clock (run under mpirun -np 2 by CTest): a wait of
1e10 s or float('inf') waits for the operation (it used to time out at once: the deadline
overflowed, and inf was converted to an integer, undefined behaviour); NaN and negatives are refused."""
import math
import time

import pytest
import torch

import torchloom


def test_a_wait_beyond_the_clock_waits(loom):
    comm = loom.world_comm()
    assert comm.size == 2
    for timeout in (1e10, 9.3e15, math.inf):
        t = torch.zeros(4)
        if comm.rank == 0:
            start = time.monotonic()
            comm.recv(t, 1).wait(timeout=timeout)
            assert time.monotonic() - start >= 0.2, timeout
            assert t[0].item() == 7.0
        else:
            time.sleep(0.3)
            comm.send(torch.full((4,), 7.0), 0).wait()
        comm.barrier().wait()


def test_a_per_operation_timeout_beyond_the_clock_is_accepted(loom):
    comm = loom.world_comm()
    t = torch.ones(4)
    comm.all_reduce(t, timeout=math.inf).wait(timeout=1e300)
    assert t[0].item() == comm.size


def test_nan_and_negative_timeouts_are_refused(loom):
    comm = loom.world_comm()
    work = comm.barrier()
    for bad in (math.nan, -1.0, -math.inf):
        with pytest.raises(torchloom.InvalidArgumentError):
            work.wait(timeout=bad)
    work.wait()
