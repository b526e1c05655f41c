"""A Python model's parameters and buffers in a checkpoint, under C++'s names: model/<name>, the
slices of torchloom's tensor-parallel layers as slices of their global tensors. The Python
counterpart of src/train/checkpoint_model_state.cpp, on the same seam (a StateProvider), so a model
saved from Python loads into the C++ one of the same structure and back.

Checkpoints saved by earlier Python versions named the model extra/<prefix><name> (prefix "model."
by default): they still load, read under those names when the checkpoint has no model/ tensors.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .._C import StateProvider, need_for, need_like

Slice = Optional[Tuple[List[int], int, int]]  # (global shape, dim, offset) of a tensor-parallel slice

SAVED = "model/"


class Param:
    """A registered parameter or buffer: its name (without model/), and its slice of a global tensor
    (None: whole)."""

    def __init__(self, name: str, tensor: torch.Tensor, slice_: Slice, buffer: bool, legacy: str):
        self.name, self.tensor, self.slice, self.buffer = name, tensor, slice_, buffer
        self.legacy = legacy  # the name earlier Python versions saved it under

    @property
    def saved(self) -> str:
        return SAVED + self.name


class ModelState(StateProvider):
    def __init__(self) -> None:
        super().__init__()
        self.params: Dict[int, Param] = {}  # id(tensor) -> registered parameter or buffer
        self._sources: Dict[str, str] = {}  # load: live saved name -> the name read (from plan)

    def add(self, module: torch.nn.Module, prefix: str) -> Optional[Tuple[int, int]]:
        """Registers every parameter and buffer of `module`; the tensor-parallel layout (size, rank)
        its torchloom layers report, if any."""
        from ..tensor_parallel import _ParallelLayer
        sliced: Dict[int, Tuple[List[int], int, int]] = {}
        layout = None
        for _, sub in module.named_modules():
            if isinstance(sub, _ParallelLayer):
                info = sub.shard_info()
                for pname, p in sub.named_parameters(recurse=False):
                    i = info.get(pname)
                    if i is not None and i["dim"] >= 0:
                        sliced[id(p)] = (list(i["global_shape"]), int(i["dim"]), int(i["offset"]))
                        layout = (int(i["tp_size"]), int(i["tp_rank"]))
        parameters = {id(p) for p in module.parameters()}
        for name, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue
            self.params[id(t)] = Param(prefix + name, t, sliced.get(id(t)), buffer=id(t) not in parameters,
                                       legacy="extra/" + (prefix or "model.") + name)
        return layout

    def find(self, tensor: torch.Tensor) -> Optional[Param]:
        return self.params.get(id(tensor))

    def by_name(self) -> Dict[str, Param]:
        return {p.name: p for p in self.params.values()}

    # ---- StateProvider ---------------------------------------------------------------------------

    def collect(self, rank, out) -> None:
        for p in self.params.values():
            t = p.tensor.detach()
            if p.slice is None:
                out.add_tensor(p.saved, t, lowest_rank_writes=p.buffer)
            else:
                out.add_tensor(p.saved, t, p.slice[0], p.slice[1], p.slice[2])

    def plan(self, context, needs, problems) -> None:
        self._sources = {}
        if not self.params:
            return
        saved = set(context.saved_names(SAVED))
        legacy = not saved and any(context.record(p.legacy) is not None for p in self.params.values())
        missing, mismatched = [], []
        for p in sorted(self.params.values(), key=lambda p: p.name):
            source = p.legacy if legacy else p.saved
            record = context.record(source)
            if record is None:
                missing.append(p.saved)
                continue
            live = context.live.find(p.saved)
            mismatch = need_like(source, record, live, needs) if legacy else need_for(live, record, needs)
            if mismatch:
                mismatched.append(mismatch)
            self._sources[p.saved] = source
        unexpected = sorted(saved - {p.saved for p in self.params.values()})
        if missing or unexpected:
            diff = "".join(f"\n    - {n}" for n in unexpected) + "".join(f"\n    + {n}" for n in missing)
            problems.append("tensor names differ between the checkpoint's manifest and the live state (- only in the "
                            "checkpoint, + only live):" + diff)
        if mismatched:
            problems.append("shapes or dtypes differ:" + "".join(f"\n  {m}" for m in mismatched))

    def apply(self, context, data) -> None:
        with torch.no_grad():
            for p in self.params.values():
                p.tensor.detach().copy_(data[self._sources[p.saved]])
