"""torchloom.ZeroRedundancyOptimizer's sharded state in a checkpoint, in the format of any other
optimizer (_optimizer_state.py: optim/<param>/<key>, sliced like the parameter; steps and
param_groups by name), so a ZeRO checkpoint loads at another data-parallel size, with or without
ZeRO, and a plain one loads into ZeRO. The Python counterpart of src/train/checkpoint_zero_state.cpp.

Save (collective over the ZeRO group): each bucket's state is all-gathered one key at a time and
each rank adds the parameters whose first element lies in its shard (about 1/N of the state);
every rank describes every parameter's state in the same JSON. fp32 master weights of bf16/fp16
parameters are saved as master/<param>, so a resumed run steps from the same values.
Load: only the parameters overlapping this rank's shards are read; their overlapping elements are
copied into the shard state; the masters take the loaded parameters' values, then the saved masters'.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

Slice = Optional[Tuple[List[int], int, int]]


class ZeroLayout:
    """Where each of a ZeRO optimizer's parameters lies in the buckets, and this rank's shard of each."""

    def __init__(self, zero: Any) -> None:
        z = zero._zero
        self.zero = zero
        self.params: List[torch.Tensor] = list(z.parameters)
        self.placements: List[Tuple[int, int, int]] = [tuple(p) for p in z.placements()]
        self.shards: List[torch.Tensor] = list(zero.optim.param_groups[0]["params"])
        self.shard_numel = [z.shard_numel(b) for b in range(len(self.shards))]
        self.masters = [z.has_master_weights(b) for b in range(len(self.shards))]
        self.group = z.group
        self.rank, self.size = self.group.rank, self.group.size
        self.members: List[List[int]] = [[] for _ in self.shards]
        for i, (b, _, _) in enumerate(self.placements):
            self.members[b].append(i)

    def owner(self, i: int) -> int:
        """The rank holding parameter i's first element: it writes the parameter's state."""
        b, offset, _ = self.placements[i]
        return offset // self.shard_numel[b]

    def overlap(self, i: int) -> Tuple[int, int]:
        """Parameter i's elements [begin, end) (bucket layout) in this rank's shard; empty when end <= begin."""
        b, offset, numel = self.placements[i]
        s = self.shard_numel[b]
        return max(offset, self.rank * s), min(offset + numel, (self.rank + 1) * s)

    def gather(self, b: int, shard_tensor: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.shard_numel[b] * self.size, dtype=shard_tensor.dtype, device=shard_tensor.device)
        self.group.all_gather(full, shard_tensor.detach().contiguous())
        return full


def _agree_on_state(zero: Any, layout: ZeroLayout) -> None:
    """Every shard on every rank must hold the same state keys and step before the per-key
    all-gathers, or the ranks would gather different keys and wait on each other until the group's
    timeout: one all-gather of a hash instead, and every rank refuses (ValueError) at once."""
    import hashlib
    per_shard = []
    for shard in layout.shards:
        state = zero.optim.state.get(shard, {})
        step = state.get("step")
        step = float(step) if step is not None else None
        per_shard.append((sorted(state), step))
    mine = "every shard: " + repr(per_shard[0]) if all(d == per_shard[0] for d in per_shard) else \
        "; ".join(f"shard {b}: {d!r}" for b, d in enumerate(per_shard))
    digest = int.from_bytes(hashlib.sha256(mine.encode()).digest()[:7], "little")
    everyone = torch.zeros(layout.size, dtype=torch.int64)
    layout.group.all_gather(everyone, torch.tensor([digest], dtype=torch.int64))
    differing = [r for r in range(layout.size) if int(everyone[r]) != int(everyone[0])]
    if differing:
        raise ValueError(f"the ZeRO shards' optimizer state differs between ranks (they stepped differently): "
                         f"ranks {differing} differ from rank 0; this rank (rank {layout.rank}) has {mine}")
    if not mine.startswith("every shard"):
        raise ValueError(f"the ZeRO shards' optimizer state differs between buckets (they stepped differently): {mine}")


def encode(zero: Any, names: List[str], slices: List[Slice], add: Callable[[str, torch.Tensor, Slice], None],
           step_of: Callable[[Any], Optional[int]], encode_value: Callable[[Any, str], Any]) -> Dict[str, Any]:
    """The optimizer section (the same on every rank) without its param_groups; adds this rank's
    tensors with `add`. A step (every shard holds the same) goes into "steps", as C++ keeps it."""
    layout = ZeroLayout(zero)
    _agree_on_state(zero, layout)
    zero.wait_parameters()  # the parameters are saved beside this state: every all-gather done
    steps: Dict[str, int] = {}
    values: Dict[str, Dict[str, Any]] = {}
    for b, shard in enumerate(layout.shards):
        s = layout.shard_numel[b]
        per_shard = zero.optim.state.get(shard, {})
        for key in sorted(per_shard):
            value = per_shard[key]
            if key == "step" and step_of(value) is not None:
                for i in layout.members[b]:
                    steps[names[i]] = step_of(value)
                continue
            shaped = torch.is_tensor(value) and value.dim() == 1 and value.numel() == s
            full = layout.gather(b, value) if shaped else None
            for i in layout.members[b]:
                saved = f"optim/{names[i]}/{key}"
                if not torch.is_tensor(value):
                    if value is not None:
                        values.setdefault(names[i], {})[key] = encode_value(value, saved)
                    continue
                if layout.owner(i) != layout.rank:
                    continue
                if shaped:
                    _, offset, numel = layout.placements[i]
                    add(saved, full[offset:offset + numel].view(layout.params[i].shape).clone(), slices[i])
                else:  # a scalar tensor: every shard holds the same
                    add(saved, value.detach().clone(), None)
        if layout.masters[b]:
            full = layout.gather(b, shard)
            for i in layout.members[b]:
                if layout.owner(i) == layout.rank:
                    _, offset, numel = layout.placements[i]
                    add(f"master/{names[i]}", full[offset:offset + numel].view(layout.params[i].shape).clone(),
                        slices[i])
    section: Dict[str, Any] = {"type": type(zero.optim).__name__, "steps": steps}
    if values:
        section["state"] = values
    return section


def needed(zero: Any, names: List[str]) -> Set[str]:
    """The parameter names whose saved state this rank reads: those overlapping its shards."""
    layout = ZeroLayout(zero)
    return {names[i] for i in range(len(names)) if layout.overlap(i)[0] < layout.overlap(i)[1]}


def has_masters(zero: Any, param: torch.Tensor) -> bool:
    """Whether the parameter's bucket keeps fp32 master weights (bf16/fp16 parameters)."""
    layout = ZeroLayout(zero)
    for i, p in enumerate(layout.params):
        if p is param:
            return layout.masters[layout.placements[i][0]]
    return False


def shard_state_dict(zero: Any, saved_state: Dict[str, Dict[str, Any]], names: List[str],
                     options: Dict[str, Any]) -> Dict[str, Any]:
    """torch.optim's state_dict for the shard optimizer from each parameter's saved state (any DP
    size, ZeRO or not): each shard's state assembled from the overlapping parameters'. ValueError
    when a saved tensor does not fit its parameter."""
    layout = ZeroLayout(zero)
    state: Dict[int, Dict[str, Any]] = {}
    for b, shard in enumerate(layout.shards):
        s = layout.shard_numel[b]
        assembled: Dict[str, Any] = {}
        for i in layout.members[b]:
            begin, end = layout.overlap(i)
            per_param = saved_state.get(names[i])
            if end <= begin or not per_param:
                continue
            _, offset, numel = layout.placements[i]
            for key, value in per_param.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != numel:
                        raise ValueError(f"optimizer state {key!r} of {names[i]} has {value.numel()} elements; the "
                                         f"parameter has {numel}")
                    into = assembled.get(key)
                    if into is None:  # zeros where no parameter lies (padding)
                        into = assembled[key] = torch.zeros(s, dtype=shard.dtype, device=shard.device)
                    into[begin - layout.rank * s:end - layout.rank * s].copy_(
                        value.reshape(-1)[begin - offset:end - offset])
                else:
                    assembled.setdefault(key, value.clone() if torch.is_tensor(value) else value)
        if assembled:
            state[b] = assembled
    return {"state": state, "param_groups": [dict(options, params=list(range(len(layout.shards))))]}


def _masters_read_here(layout: ZeroLayout, names: List[str],
                       masters: Dict[str, torch.Tensor]) -> Iterator[Tuple[int, str, torch.Tensor]]:
    """(parameter index, name, saved tensor) of each saved master weight this rank reads: those of
    parameters with fp32 masters overlapping its shards."""
    for i, name in enumerate(names):
        begin, end = layout.overlap(i)
        if layout.masters[layout.placements[i][0]] and begin < end and name in masters:
            yield i, name, masters[name]


def check_masters(zero: Any, names: List[str], masters: Dict[str, torch.Tensor]) -> None:
    """Before anything changes: every saved master weight this rank will read has its parameter's
    number of elements (a forged or truncated one would fail half-way through load_masters, after
    the model and the optimizer state were replaced). ValueError naming the parameter."""
    layout = ZeroLayout(zero)
    for i, name, found in _masters_read_here(layout, names, masters):
        numel = layout.placements[i][2]
        if found.numel() != numel:
            raise ValueError(f"the master weights master/{name} have shape {list(found.shape)} ({found.numel()} "
                             f"elements); the parameter {name} has shape {list(layout.params[i].shape)} ({numel} elements)")


def load_masters(zero: Any, names: List[str], masters: Dict[str, torch.Tensor]) -> None:
    """The masters take the (already loaded) parameters' values, then the saved masters' where the
    checkpoint has them."""
    layout = ZeroLayout(zero)
    zero._zero.refresh_master_weights()
    with torch.no_grad():
        for i, _, found in _masters_read_here(layout, names, masters):
            b, offset, _ = layout.placements[i]
            begin, end = layout.overlap(i)
            s = layout.shard_numel[b]
            layout.shards[b][begin - layout.rank * s:end - layout.rank * s].copy_(
                found.reshape(-1)[begin - offset:end - offset])
