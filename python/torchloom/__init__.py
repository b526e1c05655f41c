"""torchloom from Python: the C++ runtime (libtorchloom) with PyTorch's conventions.

A thin adapter: every operation is the C++ library's (communicators, the gradient reducer, the
GradScaler, tensor-parallel layers, checkpoints); this package only shapes them like PyTorch.

    import torch, torchloom
    rt = torchloom.init()                       # MPI; launch with mpirun / loomrun
    comm = torchloom.world_comm()
    t = torch.ones(4)
    comm.all_reduce(t, torchloom.ReduceOp.AVG).wait()
    ddp = torchloom.DistributedDataParallel(model)
    ...
    torchloom.finalize()

Errors are torchloom.Error and its subclasses (InvalidArgumentError, UnsupportedError, ConfigError, CommError,
TimeoutError, MismatchError, CheckpointError), carrying the C++ messages.
"""
from __future__ import annotations

import datetime as _datetime
from typing import Optional, Union

import torch as _torch  # loads LibTorch and torch's Python bindings before the extension

from . import _C
from ._C import (CheckpointError, CommError, Communicator, ConfigError, Error, InvalidArgumentError,
                 MismatchError, ParallelGroups, ParallelLayout, ParallelState, PipelineExecutor, PipelineStepTimes,
                 ReduceOp, Runtime, TimeoutError, UnsupportedError, Work, World, pipeline_linear, stage_layers,
                 make_parallel_groups, planned_dp_rings)

__version__: str = _C.__version__

_runtime: Optional[Runtime] = None


def init(timeout: Union[float, _datetime.timedelta, None] = None, on_error: Optional[str] = None) -> Runtime:
    """Starts torchloom (loom::init()): reads the launch environment, starts MPI, agrees on the LOOM_*
    configuration across ranks, plans placement and builds the world communicators. Idempotent.

    timeout: default operation timeout of the world communicators (seconds or timedelta; default LOOM_TIMEOUT).
    on_error: "raise" or "abort" (default LOOM_ON_ERROR). Raises torchloom.ConfigError for a bad launch."""
    global _runtime
    _runtime = _C.init(timeout=timeout, on_error=on_error)
    return _runtime


def is_initialized() -> bool:
    """True between init() and finalize()."""
    return _runtime is not None


def runtime() -> Runtime:
    """The runtime init() started; torchloom.Error when init() was not called."""
    if _runtime is None:
        raise InvalidArgumentError("torchloom.runtime(): call torchloom.init() first")
    return _runtime


def world() -> World:
    """Rank, size, local rank and node of this process: the runtime's after init(), else what the
    launcher's environment says (a process without a launcher is a world of one)."""
    return _runtime.world if _runtime is not None else _C.world_from_environment()


def world_comm() -> Communicator:
    """The communicator over every process of the job (CPU tensors, MPI)."""
    return runtime().world_comm


def device_comm() -> Optional[Communicator]:
    """The communicator over every process for CUDA tensors (NCCL), or None."""
    return runtime().device_comm


def finalize() -> None:
    """Destroys the communicators and finalizes MPI (loom::finalize()). Idempotent."""
    global _runtime
    _C.finalize()
    _runtime = None


def placement_plan() -> Optional[dict]:
    """The placement plan init() made (devices, CPUs, TP groups, DP rings) as a dict; None without one."""
    import json
    text = _C.placement_plan_json()
    return None if text is None else json.loads(text)


def explain_placement(message_bytes: float = 64 << 20) -> Optional[str]:
    """The placement plan explained (per group: devices, links, modelled all-reduce time); None without one."""
    return _C.explain_placement(message_bytes)


def _excepthook_telling_the_other_ranks(exc_type, exc, traceback):
    """An exception nobody caught ends this rank (exit status 1): the other ranks are told so now,
    with its text, before the interpreter's teardown (they fail their operations with this rank at
    once instead of waiting for it); then Python's own report as usual."""
    try:
        if _runtime is not None:
            _C._announce_exit(1, f"{exc_type.__name__}: {exc}")
    finally:
        _previous_excepthook(exc_type, exc, traceback)


import sys as _sys  # noqa: E402

_previous_excepthook = _sys.excepthook
_sys.excepthook = _excepthook_telling_the_other_ranks

from .parallel import DistributedDataParallel  # noqa: E402
from .zero import ZeroRedundancyOptimizer  # noqa: E402
from .amp import GradScaler  # noqa: E402
from . import comm_hooks, tensor_parallel, checkpoint  # noqa: E402
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,  # noqa: E402
                              vocab_parallel_cross_entropy)
from .checkpoint import Checkpointer, TrainingProgress  # noqa: E402
from . import distributed  # noqa: E402  (registers torch.distributed's backend "loom")

__all__ = [
    "init", "is_initialized", "runtime", "world", "world_comm", "device_comm", "finalize", "placement_plan",
    "explain_placement", "planned_dp_rings", "Error", "InvalidArgumentError", "UnsupportedError", "ConfigError", "CommError", "TimeoutError",
    "MismatchError", "CheckpointError", "Communicator", "Work", "World", "Runtime", "ReduceOp", "ParallelGroups", "ParallelLayout", "PipelineExecutor", "PipelineStepTimes", "pipeline_linear", "stage_layers",
    "ParallelState", "make_parallel_groups", "DistributedDataParallel", "GradScaler", "comm_hooks",
    "tensor_parallel", "checkpoint", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "Checkpointer", "TrainingProgress",
]
