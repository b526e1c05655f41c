#!/usr/bin/env python3
"""Runs the Python code blocks of README.md and docs/*.md, as a reader would, on every rank.

Started under mpirun (CTest: doc_blocks_python_np2, 2 ranks). Each Markdown file's blocks run in
order in one namespace of their own (a page reads top to bottom), which starts from PRELUDE: the
names the prose introduces before the blocks (a model, a loader, a loss). torch.distributed's env://
variables are set first (rank 0's free port sent over torchloom), so a block may call
init_process_group("loom") as written; a process group a page leaves is destroyed after it.

A block the check must leave alone says why on the line before its fence:
    <!-- snippet: skip REASON -->
A failing block prints its file and line with the traceback and ends the job (exit 1).
"""
import os
import socket
import sys
import traceback

from markdown_blocks import blocks as page_blocks, pages

PRELUDE = '''
import contextlib
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchloom
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
loss_fn = nn.functional.mse_loss
loader = [[(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)] for _ in range(2)]  # micro-batches per step
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
scaler = torchloom.GradScaler(enabled=False)
step = 1
t = torch.ones(1024)
vocab, hidden = 64, 16
ids = torch.randint(0, vocab, (4, 2))
target = torch.randint(0, vocab, (4, 2))
h = torch.randn(4, 2, hidden)
'''


def blocks(source_dir):
    for path in pages(source_dir):
        found = list(page_blocks(path, "python"))
        if found:
            yield os.path.relpath(path, source_dir), found


def set_env_rendezvous(comm):
    """MASTER_ADDR/PORT, RANK, WORLD_SIZE as torchrun would set them: rank 0's free port, broadcast."""
    import torch
    port = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.broadcast(port, src=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port)), RANK=str(comm.rank),
                      WORLD_SIZE=str(comm.size))


def main():
    source_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    import torch
    import torch.distributed as dist
    import torchloom
    torch.set_num_threads(1)
    torchloom.init()
    comm = torchloom.world_comm()
    if comm.rank == 0:  # a checkpoint block writes ./ckpt: start without an earlier run's
        import shutil
        shutil.rmtree("ckpt", ignore_errors=True)
    comm.barrier()
    ran = skipped = 0
    for path, found in blocks(source_dir):
        namespace = {"__name__": f"doc:{path}"}
        exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
        set_env_rendezvous(comm)
        for line, code, reason in found:
            if reason is not None:
                skipped += 1
                if comm.rank == 0:
                    print(f"doc blocks: skipped {path}:{line}: {reason}", flush=True)
                continue
            try:
                # Compiled under the Markdown file's name, the code shifted to its line: a traceback
                # names the page and the line there.
                exec(compile("\n" * line + code, path, "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                print(f"==== rank {comm.rank}: the Python block at {path}:{line} failed ====", file=sys.stderr,
                      flush=True)
                os._exit(1)
            ran += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        comm.barrier()
    if comm.rank == 0:
        print(f"doc blocks: {ran} Python blocks of README.md and docs/ ran on {comm.size} ranks ({skipped} skipped)")
    torchloom.finalize()
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
