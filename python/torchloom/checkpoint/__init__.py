"""Checkpoints from Python: loom::Checkpointer underneath, every kind of state saved under the names
C++ gives it (docs/python.md), so each language loads what the other saved.

The C++ checkpointer writes sharded, atomic, verified safetensors checkpoints in the background
(docs/checkpoint-format.md): every byte checksummed (the manifest too), every value checked before
anything live changes, resharded to another TP x DP layout at load. From Python it saves:

- models (``model()``): parameters and buffers by ``state_dict`` name, as ``model/<name>``
  (``_model_state.py``); the slices of torchloom's tensor-parallel layers as slices of their
  global tensors, so a checkpoint taken at TP 2 loads at TP 1 (or 4);
- any ``torch.optim`` optimizer (``optimizer()``): the "optimizer" section (``param_groups`` by
  parameter name, step counts) and its state tensors as ``optim/<param>/<key>``, sliced like their
  parameter (``_optimizer_state.py``; loads into an optimizer whose lazy state does not exist yet);
  ``torchloom.ZeroRedundancyOptimizer``'s sharded state in the same format (each rank writes about
  1/N), so it loads at another DP size, with or without ZeRO, and from or into C++;
- any object with ``state_dict``/``load_state_dict`` (``object()``, e.g. an LR scheduler);
- ``torchloom.GradScaler``, RNG trackers, progress and user key-values;
- state of your own (``state()``): a ``StateProvider`` subclass, the seam the C++ checkpointer
  builds its own kinds of state on, so a Python provider's state loads into the C++ one of the
  same names and back (``tests/python/test_checkpoint_state.py``).

    ckpt = torchloom.Checkpointer(torchloom.world_comm(), "ckpt", keep_last=3)
    ckpt.model(model).optimizer(opt).object("lr_scheduler", sched).scaler(scaler)
    info = ckpt.load_latest()                     # None: start fresh
    ...
    handle = ckpt.save(torchloom.TrainingProgress(step=step))   # returns after the host copy
    handle.wait()                                               # or let the next save wait

A load that fails raises ``torchloom.CheckpointError`` and changes nothing.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
from typing import Any, Dict, List, Optional, Union

import torch

from .. import _C
from .._C import CheckpointInfo, LoadContext, SaveState, StateProvider, TrainingProgress, need_for, need_like
from ._encoding import SavedTensors, decode, encode, placeholders, same_kind
from ._model_state import ModelState
from ._optimizer_state import OptimizerState

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class SaveHandle:
    """An asynchronous save in progress: wait() returns what it published or raises its
    torchloom.CheckpointError (on every rank)."""

    def __init__(self, checkpointer: "Checkpointer"):
        self._checkpointer = checkpointer

    def done(self) -> bool:
        return not self._checkpointer.pending()

    def wait(self) -> CheckpointInfo:
        return self._checkpointer.wait()


class Checkpointer:
    """loom::Checkpointer. Construction is collective over `world` (a CPU communicator over every rank)."""

    def __init__(self, world: _C.Communicator, directory: str, keep_last: int = 3, async_: bool = True,
                 timeout: Union[float, datetime.timedelta, None] = None) -> None:
        self._impl = _C.Checkpointer(world, directory, keep_last=keep_last, async_=async_, timeout=timeout)
        # The model and the optimizer are providers of this checkpointer's, in this order (the
        # optimizer's load follows the model's: ZeRO's master weights start from loaded parameters).
        self._model = ModelState()
        self._optimizer = OptimizerState(self._model)
        self._impl.state("python.model", self._model)
        self._impl.state("python.optimizer", self._optimizer)
        self._objects: Dict[str, Any] = {}
        self._dynamic: List[str] = []  # tensor names registered for the current save or load
        self._scratch: Dict[str, torch.Tensor] = {}  # load: tensors the C++ side fills before apply
        self._pending_text: Dict[str, str] = {}  # save: each object's JSON, made before the save
        self._providers: List[Any] = []  # state providers added with state()

    # ---- What is saved ---------------------------------------------------------------------------

    def tensor(self, name: str, tensor: torch.Tensor) -> "Checkpointer":
        """A tensor saved once (replicated) as extra/<name> and restored in place."""
        self._impl.tensor(name, tensor)
        return self

    def model(self, module: torch.nn.Module, prefix: str = "") -> "Checkpointer":
        """Every parameter and buffer of module as model/<prefix><state_dict name> (C++'s names with
        the default prefix); the slices of torchloom tensor-parallel layers as slices of their global
        tensors. Register each model once, the optimizer's after."""
        layout = self._model.add(module, prefix)
        if layout is not None:
            self._impl.tensor_parallel(*layout)
        return self

    def optimizer(self, optimizer: Any) -> "Checkpointer":
        """Any torch.optim optimizer over parameters of registered models (state tensors sliced like
        their parameter, param_groups and steps by parameter name), or a torchloom.ZeroRedundancyOptimizer
        (its shards' state in the same format, and its fp32 master weights). Register the model(s) first."""
        self._optimizer.optimizer = optimizer
        return self

    def object(self, name: str, obj: Any) -> "Checkpointer":
        """Any object with state_dict() and load_state_dict() (an LR scheduler, a sampler). Before
        anything changes, its saved state is checked with obj.check_state_dict(state) when it has
        one, otherwise by loading it into a deep copy (torch LR schedulers: their keys and the kind of
        each value checked against the live ones, then loaded into a copy that shares only the
        optimizer)."""
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise TypeError(f"checkpoint object {name!r}: expected state_dict() and load_state_dict()")
        self._objects[name] = obj
        self._impl.object(name, lambda: self._saved_text(name), lambda text: self._check_object(name, text),
                          lambda text: self._load_object(name, text))
        return self

    def state(self, name: str, provider: "StateProvider") -> "Checkpointer":
        """A kind of state of your own: a StateProvider subclass (collect, plan, verify, apply),
        called by the C++ checkpointer exactly as its own providers are, so what it saves has the
        same names and manifest section whichever language saved it (docs/checkpoint.md)."""
        self._impl.state(name, provider)
        self._providers.append(provider)
        return self

    def scaler(self, scaler: "torchloom.GradScaler") -> "Checkpointer":  # noqa: F821
        self._impl.scaler(scaler._impl)
        return self

    def rng(self, tracker: "_C.RngTracker") -> "Checkpointer":
        self._impl.rng(tracker)
        return self

    # ---- Save ------------------------------------------------------------------------------------

    def save(self, progress: TrainingProgress, user: Optional[Dict[str, str]] = None) -> SaveHandle:
        """Saves as step_<progress.step>/; with async_, returns after the host copy (the handle's
        wait(), or the next save, waits for the writing)."""
        self._impl.wait()  # the previous save's tensors must not be replaced while it writes
        self._forget_dynamic()
        # An error here is raised from inside the C++ save (by the objects' save callbacks), so that
        # it reaches every rank through the save's agreement instead of leaving the others waiting.
        self._save_error: Optional[BaseException] = None
        try:
            for name, obj in self._objects.items():
                tensors: Dict[str, torch.Tensor] = {}
                encoded = encode(obj.state_dict(), f"objects/{name}", tensors)
                for key, t in tensors.items():
                    self._register(key, t)
                self._pending_text[name] = json.dumps(encoded)
        except (TypeError, ValueError) as e:
            self._save_error = e
        self._impl.save(progress, user or {})
        return SaveHandle(self)

    def wait(self) -> CheckpointInfo:
        """Waits for the pending save; raises its torchloom.CheckpointError on every rank."""
        return self._impl.wait()

    def pending(self) -> bool:
        return self._impl.pending()

    # ---- Load ------------------------------------------------------------------------------------

    def load_latest(self) -> Optional[CheckpointInfo]:
        """Loads the newest complete checkpoint (the same on every rank); None when there is none."""
        path = self._impl.latest()
        return self.load(path) if path is not None else None

    def load(self, path: str) -> CheckpointInfo:
        """Loads the checkpoint in path (a step_<N> directory); CheckpointError and nothing changed
        when anything in it is wrong or does not fit the registered state."""
        self._impl.wait()
        self._forget_dynamic()
        manifest = self._read_manifest(path) or {}
        # The providers' sections: under "state" from format version 3, members of their own before.
        objects = (manifest.get("state") if "state" in manifest else manifest).get("objects") or {}
        for name in self._objects:
            self._prepare(manifest, objects.get(name))
        return self._impl.load(path)

    @staticmethod
    def find_latest(directory: str) -> Optional[str]:
        return _C.Checkpointer.find_latest(directory)

    # ---- Internals: objects, whose state_dict may hold tensors (saved as extra/objects/<name>/...) ----

    def _saved_text(self, name: str) -> str:
        if getattr(self, "_save_error", None) is not None:
            raise self._save_error
        return self._pending_text[name]

    def _register(self, key: str, t: torch.Tensor) -> None:
        self._impl.tensor(key, t)
        self._dynamic.append(key)

    def _forget_dynamic(self) -> None:
        for key in self._dynamic:
            self._impl.remove_tensor(key)
        self._dynamic = []
        self._scratch = {}

    def _read_manifest(self, path: str) -> Optional[Dict[str, Any]]:
        """The manifest as JSON, to learn what to prepare; None when unreadable (the C++ load then
        refuses the checkpoint with the precise reason, verifying the manifest's checksum)."""
        try:
            with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _prepare(self, manifest: Dict[str, Any], encoded: Any) -> None:
        """Registers a scratch tensor for each tensor an object's saved state refers to; the C++ load
        fills them, and only then are they handed to the live object."""
        if encoded is None:
            return
        records = manifest.get("tensors", {})
        for key in placeholders(encoded):
            record = records.get("extra/" + key)
            if record is None or record.get("dtype") not in _DTYPES:
                continue  # the C++ load reports the missing tensor
            t = torch.empty(list(record["shape"]), dtype=_DTYPES[record["dtype"]])
            self._scratch[key] = t
            self._register(key, t)

    def _check_object(self, name: str, text: str) -> None:
        encoded = json.loads(text)
        zeros = {k: torch.zeros_like(t) for k, t in self._scratch.items()}
        state = decode(encoded, SavedTensors(zeros, name))
        obj = self._objects[name]
        if hasattr(obj, "check_state_dict"):
            obj.check_state_dict(state)
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            live = obj.state_dict()
            unknown = set(state) - set(live)
            if unknown:
                raise ValueError(f"unexpected keys {sorted(unknown)} for {type(obj).__name__}")
            for key, value in state.items():
                if not same_kind(value, live[key]):
                    raise ValueError(f"{type(obj).__name__} state {key!r} is {value!r}; the live one is a "
                                     f"{type(live[key]).__name__}")
            # Loaded into a copy that shares only the optimizer (schedulers never change it when
            # loading; copying it would copy every parameter).
            copy.deepcopy(obj, {id(obj.optimizer): obj.optimizer}).load_state_dict(state)
        else:
            copy.deepcopy(obj).load_state_dict(state)

    def _load_object(self, name: str, text: str) -> None:
        self._objects[name].load_state_dict(decode(json.loads(text), self._scratch))


__all__ = ["Checkpointer", "CheckpointInfo", "LoadContext", "SaveHandle", "SaveState", "StateProvider", "TrainingProgress",
           "need_for", "need_like"]
