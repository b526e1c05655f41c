"""Under LOOM_ON_ERROR=raise a collective that a rank never joins times out and arrives in Python
as torchloom.TimeoutError with the C++ message (run under mpirun -np 2 by CTest, LOOM_TIMEOUT=2)."""
import time

import torch

import torchloom


def test_timeout_arrives_as_torchloom_timeout_error(loom):
    comm = loom.world_comm()
    # A second communicator, to meet again once rank 1 has joined the timed-out all_reduce late (so
    # that rank 0's operation stuck in MPI has completed and both ranks finalize cleanly).
    spare = comm.split(0, comm.rank, "spare")
    if comm.rank == 1:
        # Joins late, after rank 0's all_reduce timed out (LOOM_TIMEOUT=2 s): the operation stuck in
        # MPI on rank 0 then completes, and both ranks can finalize.
        time.sleep(5)
        comm.all_reduce(torch.ones(8)).wait()
        spare.barrier(timeout=60).wait()
        return
    t = torch.ones(8)
    start = time.monotonic()
    try:
        comm.all_reduce(t).wait()
    except torchloom.TimeoutError as e:
        msg = str(e)
        assert isinstance(e, torchloom.CommError) and isinstance(e, TimeoutError)
        assert msg.startswith("[rank 0] all_reduce seq="), msg
        assert "timed out after" in msg and "shape=[8]" in msg, msg
    else:
        raise AssertionError("expected torchloom.TimeoutError")
    assert time.monotonic() - start < 30
    # The communicator is marked broken as part of the same failure (just after the waiter wakes).
    deadline = time.monotonic() + 10
    while not comm.is_broken() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert comm.is_broken()
    try:
        comm.all_reduce(t)
    except torchloom.CommError:
        pass
    else:
        raise AssertionError("a broken communicator must refuse new operations")
    spare.barrier(timeout=60).wait()
