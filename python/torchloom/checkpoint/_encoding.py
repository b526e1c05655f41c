"""State dicts as JSON with their tensors set apart: how the Python checkpointer writes the state of
objects (LR schedulers, samplers) and the values of optimizer state that are not tensors."""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch


def encode(value: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """JSON for `value`, each tensor replaced by {"__tensor__": key} and put in `tensors` under key."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach()
        return {"__tensor__": path}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{path}/key{i}", tensors), encode(v, f"{path}/{i}", tensors)]
                             for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"checkpoint: cannot save {path} of type {type(value).__name__} "
                    "(tensors, numbers, strings, None, lists, tuples and dicts can be saved)")


def decode(value: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        if set(value) == {"__tuple__"}:
            return tuple(decode(v, tensors) for v in value["__tuple__"])
        if set(value) == {"__dict__"}:
            return {decode(k, tensors): decode(v, tensors) for k, v in value["__dict__"]}
        return {k: decode(v, tensors) for k, v in value.items()}
    return value


def placeholders(value: Any) -> List[str]:
    """The tensor keys an encoded value refers to."""
    if isinstance(value, list):
        return [k for v in value for k in placeholders(v)]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return [value["__tensor__"]]
        return [k for v in value.values() for k in placeholders(v)]
    return []


class SavedTensors(dict):
    """Tensor lookup for checks before the data is read. A saved state that names a tensor with no
    scratch copy (the manifest has no such record, or one of a dtype torch cannot hold) is refused
    here: the load would otherwise fail on it after the model had changed."""

    def __init__(self, tensors: Dict[str, torch.Tensor], owner: str):
        super().__init__(tensors)
        self.owner = owner

    def __missing__(self, key: str) -> torch.Tensor:
        raise ValueError(f"the saved state of {self.owner} refers to tensor {key!r}, which the checkpoint does not "
                         "hold (its manifest has no such record, or one of an unsupported dtype)")


def same_kind(saved: Any, live: Any) -> bool:
    """Whether a saved value can stand where the live one does: numbers for numbers (not booleans),
    the same container or scalar type otherwise; anything where the live value is None."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if live is None:
        return True
    if number(live):
        return number(saved)
    if isinstance(live, (list, tuple)):
        return isinstance(saved, (list, tuple))
    return isinstance(saved, type(live))
