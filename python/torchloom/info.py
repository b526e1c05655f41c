"""python -m torchloom.info: versions (torchloom, torch, MPI, NCCL compiled or not) and the world.

Without a launcher the world is the environment's (a process of its own); under mpirun add
--init to start torchloom and print the world MPI confirms:  mpirun -np 2 python -m torchloom.info --init
"""
from __future__ import annotations

import argparse
import sys

import torch

import torchloom
from torchloom import _C


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchloom.info", description=__doc__.splitlines()[0])
    parser.add_argument("--init", action="store_true", help="start torchloom (MPI) and print the world it confirms")
    args = parser.parse_args(argv)
    nccl = f"compiled (headers {_C.nccl_version()})" if _C.nccl_compiled() else "not compiled"
    print(f"torchloom {torchloom.__version__} ({torchloom.__file__})")
    print(f"torch {torch.__version__} (built against LibTorch {_C.torch_version_compiled})")
    print(f"MPI {_C.mpi_library_version().splitlines()[0] if _C.mpi_library_version() else 'unknown'}")
    print(f"NCCL {nccl}")
    print(f"CUDA available: {torch.cuda.is_available()}")
    if args.init:
        torchloom.init()
    w = torchloom.world()
    print(f"world: rank {w.rank} of {w.size}, local rank {w.local_rank} of {w.local_size}, "
          f"node {w.node_index} of {w.num_nodes} ({w.hostname}), launcher {w.launcher}"
          + ("" if args.init else " (from the environment; --init to confirm with MPI)"))
    if args.init:
        torchloom.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
