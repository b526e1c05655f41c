"""Checkpoints from Python: loom::Checkpointer with what maps to Python directly.

The C++ checkpointer writes sharded, atomic, verified safetensors checkpoints in the background
(docs/checkpoint-format.md). From Python it saves named tensors (register a model's parameters
and buffers, and optimizer state tensors once they exist), torchloom.GradScaler, the RNG tracker
(the CPU default generator and CUDA ones are always saved), progress and user key-values. Tensors
are saved once (replicated) and restored in place; tensor-parallel slices are not resharded from
Python (that needs the C++ module's shard description).

    ckpt = torchloom.Checkpointer(torchloom.world_comm(), "ckpt", keep_last=3)
    ckpt.model(ddp.module).scaler(scaler)
    info = ckpt.load_latest()                     # None: start fresh
    ...
    ckpt.save(torchloom.TrainingProgress(step=step))
    ckpt.wait()
"""
from __future__ import annotations

import datetime
from typing import Dict, Optional, Union

import torch

from . import _C
from ._C import CheckpointInfo, TrainingProgress


class Checkpointer:
    """loom::Checkpointer. Construction is collective over `world` (a CPU communicator over every rank)."""

    def __init__(self, world: _C.Communicator, directory: str, keep_last: int = 3, async_: bool = True,
                 timeout: Union[float, datetime.timedelta, None] = None) -> None:
        self._impl = _C.Checkpointer(world, directory, keep_last=keep_last, async_=async_, timeout=timeout)

    def tensor(self, name: str, tensor: torch.Tensor) -> "Checkpointer":
        """A tensor saved once (replicated) and restored in place."""
        self._impl.tensor(name, tensor)
        return self

    def model(self, module: torch.nn.Module, prefix: str = "model.") -> "Checkpointer":
        """Every parameter and buffer of module (state_dict names, under prefix)."""
        for name, t in module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                self._impl.tensor(prefix + name, t.detach())
        return self

    def scaler(self, scaler: "torchloom.GradScaler") -> "Checkpointer":  # noqa: F821
        self._impl.scaler(scaler._impl)
        return self

    def rng(self, tracker: "_C.RngTracker") -> "Checkpointer":
        self._impl.rng(tracker)
        return self

    def save(self, progress: TrainingProgress, user: Optional[Dict[str, str]] = None) -> None:
        """Saves as step_<progress.step>/; with async_, returns after the host copy."""
        self._impl.save(progress, user or {})

    def wait(self) -> CheckpointInfo:
        """Waits for the pending save; raises its torchloom.CheckpointError on every rank."""
        return self._impl.wait()

    def pending(self) -> bool:
        return self._impl.pending()

    def load_latest(self) -> Optional[CheckpointInfo]:
        """Loads the newest complete checkpoint; None when there is none."""
        return self._impl.load_latest()

    def load(self, path: str) -> CheckpointInfo:
        return self._impl.load(path)

    @staticmethod
    def find_latest(directory: str) -> Optional[str]:
        return _C.Checkpointer.find_latest(directory)


__all__ = ["Checkpointer", "CheckpointInfo", "TrainingProgress"]
