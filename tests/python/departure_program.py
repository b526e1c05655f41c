"""A rank that leaves with an ordinary Python error (run by tests/dist/check_fault.py under mpirun,
with the default LOOM_TIMEOUT of 600 s): after five all-reduces the last rank raises an exception
nobody catches, or calls sys.exit(3); the others go on to a sixth all-reduce. They must fail it at
once, naming that rank, its exit status and the exception's text, and the job must end within
seconds."""
import sys
import time

import torch

import torchloom

scenario = sys.argv[1]
torchloom.init()
comm = torchloom.world_comm()
victim = comm.size - 1
t = torch.ones(4, 6)
for _ in range(5):
    comm.all_reduce(t).wait()
if comm.rank == victim:
    print(f"RANK {comm.rank} LEAVING", flush=True)
    if scenario == "py_rank_throws":
        raise RuntimeError("the data loader found a corrupt record")
    sys.exit(3)
start = time.monotonic()
try:
    comm.all_reduce(t).wait()
    kind, message = "none", ""
except torchloom.Error as e:
    kind, message = type(e).__name__, str(e)
print(f"RESULT rank={comm.rank} kind={kind} elapsed={time.monotonic() - start:.3f} message={message}", flush=True)
time.sleep(60)  # the job must end before this does
