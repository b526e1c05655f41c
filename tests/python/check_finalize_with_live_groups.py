"""Communicators a program keeps past torchloom.finalize() (a group in a variable, a process group not
destroyed): their progress threads stop before MPI_Finalize, since none may call MPI during or
after it (one polling a receive while MPI_Finalize ran crashed a rank); what they had not finished
fails (without ending the job: LOOM_ON_ERROR=abort does not abort a program that is finishing), and
what is asked of them later is refused with torchloom.CommError, not a crash or a hang.

CTest runs it under mpirun -np 2; it prints OK and exits 0, or names what went wrong."""
import sys
import time

import torch

import torchloom


def expect_comm_error(call, says):
    try:
        call()
    except torchloom.CommError as e:
        if says not in str(e):
            sys.exit(f"expected a CommError saying {says!r}, found: {e}")
        return
    sys.exit(f"expected a CommError saying {says!r}, found none")


def main():
    torch.set_num_threads(1)
    runtime = torchloom.init()
    world = runtime.world_comm
    kept = world.split(0, world.rank, "kept")
    kept.all_reduce(torch.ones(4)).wait()
    # A receive nobody sends to: the progress thread polls MPI for its message until finalize().
    pending = kept.recv(torch.zeros(4), src=1 - kept.rank, tag=7, timeout=600, async_op=True)
    world.barrier().wait()
    torchloom.finalize()
    expect_comm_error(pending.wait, "loom::finalize() ran first")
    expect_comm_error(lambda: kept.all_reduce(torch.ones(4)), "loom::finalize() ran first")  # broken by it
    expect_comm_error(lambda: world.all_reduce(torch.ones(4)), "found it finalized")  # healthy, kept
    # Past the abort's grace (LOOM_ABORT_GRACE, 2 s): the job must not end for that receive.
    time.sleep(3)
    print(f"rank {kept.rank}: OK")


if __name__ == "__main__":
    main()
