"""Checkpoints from Python: loom::Checkpointer underneath (model, optimizer and ZeRO state under
names of their own for now, docs/python.md).

The C++ checkpointer writes sharded, atomic, verified safetensors checkpoints in the background
(docs/checkpoint-format.md): every byte checksummed (the manifest too), every value checked before
anything live changes, resharded to another TP x DP layout at load. From Python it saves:

- models (``model()``): parameters and buffers by ``state_dict`` name; the slices of torchloom's
  tensor-parallel layers as slices of their global tensors, so a checkpoint taken at TP 2 loads at
  TP 1 (or 4);
- any ``torch.optim`` optimizer (``optimizer()``): its state tensors sliced like their parameter,
  its ``param_groups`` hyper-parameters, keyed by parameter name (loads into an optimizer whose
  lazy state does not exist yet); ``torchloom.ZeroRedundancyOptimizer``'s sharded state in the same
  format (each rank writes about 1/N), so it loads at another DP size, with or without ZeRO;
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
import inspect
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .. import _C
from .._C import CheckpointInfo, LoadContext, SaveState, StateProvider, TrainingProgress, need_for
from . import _zero_state as zero_state

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

# The optimizer's state in the manifest's "objects" (a name no object() call can clash with: "/").
_OPTIMIZER = "torch.optim/optimizer"

# ---- State dicts as JSON with tensors set apart -------------------------------------------------------


def _encode(value: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
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
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {"__dict__": [[_encode(k, f"{path}/key{i}", tensors), _encode(v, f"{path}/{i}", tensors)]
                             for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"checkpoint: cannot save {path} of type {type(value).__name__} "
                    "(tensors, numbers, strings, None, lists, tuples and dicts can be saved)")


def _decode(value: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if set(value) == {"__dict__"}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__dict__"]}
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def _placeholders(value: Any) -> List[str]:
    """The tensor keys an encoded value refers to."""
    if isinstance(value, list):
        return [k for v in value for k in _placeholders(v)]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return [value["__tensor__"]]
        return [k for v in value.values() for k in _placeholders(v)]
    return []


class _Param:
    """A registered parameter: its name, and its slice of a global tensor (None: whole)."""

    def __init__(self, name: str, tensor: torch.Tensor, slice_: Optional[Tuple[List[int], int, int]]):
        self.name, self.tensor, self.slice = name, tensor, slice_


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
        self._params: Dict[int, _Param] = {}  # id(tensor) -> registered parameter
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._objects: Dict[str, Any] = {}
        self._dynamic: List[str] = []  # tensor names registered for the current save or load
        self._scratch: Dict[str, torch.Tensor] = {}  # load: tensors the C++ side fills before apply
        self._pending_text: Dict[str, str] = {}  # save: each object's JSON, made before the save
        self._providers: List[Any] = []  # state providers added with state()

    # ---- What is saved ---------------------------------------------------------------------------

    def tensor(self, name: str, tensor: torch.Tensor) -> "Checkpointer":
        """A tensor saved once (replicated) and restored in place."""
        self._impl.tensor(name, tensor)
        return self

    def model(self, module: torch.nn.Module, prefix: str = "model.") -> "Checkpointer":
        """Every parameter and buffer of module (state_dict names, under prefix); the slices of
        torchloom tensor-parallel layers as slices of their global tensors."""
        from ..tensor_parallel import _ParallelLayer
        sliced: Dict[int, Tuple[List[int], int, int]] = {}
        for _, sub in module.named_modules():
            if isinstance(sub, _ParallelLayer):
                info = sub.shard_info()
                for pname, p in sub.named_parameters(recurse=False):
                    i = info.get(pname)
                    if i is not None and i["dim"] >= 0:
                        sliced[id(p)] = (list(i["global_shape"]), int(i["dim"]), int(i["offset"]))
                        self._impl.tensor_parallel(int(i["tp_size"]), int(i["tp_rank"]))
        for name, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue
            s = sliced.get(id(t))
            if s is None:
                self._impl.tensor(prefix + name, t.detach())
            else:
                self._impl.tensor_slice(prefix + name, t.detach(), s[0], s[1], s[2], tensor_parallel=True)
            self._params[id(t)] = _Param(prefix + name, t, s)
        return self

    def optimizer(self, optimizer: Any) -> "Checkpointer":
        """Any torch.optim optimizer over parameters of registered models: state tensors (sliced like
        their parameter) and param_groups, by parameter name; or a torchloom.ZeroRedundancyOptimizer
        (its shards' state in the same format, and its fp32 master weights). Register the model(s)
        first."""
        self._optimizer = optimizer
        self._impl.object(_OPTIMIZER, lambda: self._saved_text(_OPTIMIZER),
                          lambda text: self._check_object(_OPTIMIZER, text),
                          lambda text: self._load_object(_OPTIMIZER, text))
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
            if self._optimizer is not None:
                self._pending_text[_OPTIMIZER] = self._encode_optimizer()
            for name, obj in self._objects.items():
                tensors: Dict[str, torch.Tensor] = {}
                encoded = _encode(obj.state_dict(), f"objects/{name}", tensors)
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
        manifest = self._read_manifest(path)
        # The providers' sections: under "state" from format version 3, members of their own before.
        manifest = manifest or {}
        objects = (manifest.get("state") if "state" in manifest else manifest).get("objects") or {}
        if self._optimizer is not None:
            zero = self._zero()
            # ZeRO reads only the state of the parameters overlapping this rank's shards.
            self._prepare(manifest, objects.get(_OPTIMIZER),
                          zero_state.needed(zero, self._zero_names(zero)[0]) if zero is not None else None)
        for name in self._objects:
            self._prepare(manifest, objects.get(name))
        return self._impl.load(path)

    @staticmethod
    def find_latest(directory: str) -> Optional[str]:
        return _C.Checkpointer.find_latest(directory)

    # ---- Internals -------------------------------------------------------------------------------

    def _saved_text(self, name: str) -> str:
        if getattr(self, "_save_error", None) is not None:
            raise self._save_error
        return self._pending_text[name]

    def _register(self, key: str, t: torch.Tensor, slice_: Optional[Tuple[List[int], int, int]] = None) -> None:
        if slice_ is None:
            self._impl.tensor(key, t)
        else:
            # Every slice here follows a tensor-parallel layer's parameter (its optimizer state).
            self._impl.tensor_slice(key, t, slice_[0], slice_[1], slice_[2], tensor_parallel=True)
        self._dynamic.append(key)

    def _forget_dynamic(self) -> None:
        for key in self._dynamic:
            self._impl.remove_tensor(key)
        self._dynamic = []
        self._scratch = {}

    def _param_name(self, p: torch.Tensor) -> _Param:
        found = self._params.get(id(p))
        if found is None:
            raise ValueError(f"checkpoint: an optimizer parameter of shape {list(p.shape)} is not a parameter of a "
                             "registered model (call model() first)")
        return found

    def _zero(self) -> Optional[Any]:
        """The registered optimizer when it is a torchloom.ZeroRedundancyOptimizer."""
        from ..zero import ZeroRedundancyOptimizer
        return self._optimizer if isinstance(self._optimizer, ZeroRedundancyOptimizer) else None

    def _zero_names(self, zero: Any) -> Tuple[List[str], List[Any]]:
        params = [self._param_name(p) for p in zero._zero.parameters]
        return [p.name for p in params], [p.slice for p in params]

    def _encode_zero(self, zero: Any) -> str:
        """Collective over the ZeRO group: each bucket's state is all-gathered (_zero_state.py)."""
        names, slices = self._zero_names(zero)
        encoded = zero_state.encode(zero, names, slices, self._register, lambda value, path: _encode(value, path, {}))
        in_groups: Dict[str, torch.Tensor] = {}
        hyper = {k: _encode(v, f"optimizer/param_groups/{k}", in_groups)
                 for k, v in zero.optim.param_groups[0].items() if k != "params"}
        if in_groups:
            raise TypeError(f"checkpoint: tensor-valued optimizer options {sorted(in_groups)} are not supported")
        encoded["param_groups"] = [{"params": names, "options": hyper}]
        return json.dumps(encoded)

    def _zero_state_dict(self, zero: Any, encoded: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                         check: bool) -> Dict[str, Any]:
        """The shard optimizer's state_dict from a saved optimizer (ZeRO at any DP size, or plain)."""
        names, _ = self._zero_names(zero)
        if encoded.get("type") != type(zero.optim).__name__:
            raise ValueError(f"the checkpoint's optimizer is {encoded.get('type')}; the live one is "
                             f"{type(zero.optim).__name__}")
        groups = encoded.get("param_groups") or []
        if len(groups) != 1:
            raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups; ZeRO has one")
        if groups[0]["params"] != names:
            only_saved = sorted(set(groups[0]["params"]) - set(names))
            only_live = sorted(set(names) - set(groups[0]["params"]))
            raise ValueError(f"optimizer parameter group 0: parameters differ (only in the checkpoint: {only_saved}, "
                             f"only live: {only_live})")
        options = _decode(groups[0]["options"], tensors)
        missing = set(k for k in zero.optim.param_groups[0] if k != "params") - set(options)
        if missing:
            raise ValueError(f"optimizer parameter group 0: options {sorted(missing)} missing in the checkpoint")
        if check:
            _check_options_on_scratch(zero.optim, options, 0)
        return zero_state.shard_state_dict(
            zero, encoded, names, options,
            lambda value, owner: _decode(value, _SavedTensors(tensors, owner) if check else tensors))

    def _encode_optimizer(self) -> str:
        opt = self._optimizer
        zero = self._zero()
        if zero is not None:
            return self._encode_zero(zero)
        groups = []
        state: Dict[str, Any] = {}
        for group in opt.param_groups:
            names = []
            for p in group["params"]:
                param = self._param_name(p)
                names.append(param.name)
                per_param = opt.state.get(p)
                if not per_param:
                    continue
                encoded: Dict[str, Any] = {}
                for key, value in per_param.items():
                    saved = f"optim/{param.name}/{key}"
                    if isinstance(value, torch.Tensor):
                        if param.slice is not None and value.shape == p.shape:
                            self._register(saved, value.detach(), param.slice)
                        elif param.slice is not None and value.dim() > 0:
                            raise ValueError(f"checkpoint: optimizer state {key!r} of the sliced parameter "
                                             f"{param.name} has shape {list(value.shape)}, neither the parameter's "
                                             "nor a scalar: it cannot follow the parameter's slice")
                        else:
                            self._register(saved, value.detach())
                        encoded[key] = {"__tensor__": saved}
                    else:
                        encoded[key] = _encode(value, saved, {})
                state[param.name] = encoded
            in_groups: Dict[str, torch.Tensor] = {}
            hyper = {k: _encode(v, f"optimizer/param_groups/{k}", in_groups) for k, v in group.items() if k != "params"}
            if in_groups:
                raise TypeError(f"checkpoint: tensor-valued optimizer options {sorted(in_groups)} are not supported")
            groups.append({"params": names, "options": hyper})
        return json.dumps({"type": type(opt).__name__, "param_groups": groups, "state": state})

    def _read_manifest(self, path: str) -> Optional[Dict[str, Any]]:
        """The manifest as JSON, to learn what to prepare; None when unreadable (the C++ load then
        refuses the checkpoint with the precise reason, verifying the manifest's checksum)."""
        try:
            with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _prepare(self, manifest: Optional[Dict[str, Any]], encoded: Any,
                 wanted: Optional[set] = None) -> None:
        """Registers a scratch tensor (this rank's piece of it) for each tensor the saved state refers
        to (of the parameters in `wanted`, when given); the C++ load fills them, and only then are
        they handed to the live objects."""
        if manifest is None or encoded is None:
            return
        records = manifest.get("tensors", {})
        keys = _placeholders(encoded)
        if isinstance(encoded, dict) and isinstance(encoded.get("master"), dict):
            keys += [k for k in encoded["master"].values() if isinstance(k, str)]
        for key in keys:
            owner = key[len("optim/"):key.rfind("/")] if key.startswith("optim/") else (
                key[len("master/"):] if key.startswith("master/") else None)
            if wanted is not None and owner not in wanted:
                continue
            record = records.get("extra/" + key)
            if record is None or record.get("dtype") not in _DTYPES:
                continue  # the C++ load reports the missing tensor
            shape, slice_ = list(record["shape"]), None
            if owner is not None:
                # Optimizer state (and master weights) shaped like its parameter follows the
                # parameter's slice here, whatever the layout it was saved at.
                param = self._params_by_name().get(owner)
                if param is not None and param.slice is not None and shape == param.slice[0]:
                    slice_, shape = param.slice, list(param.tensor.shape)
            t = torch.empty(shape, dtype=_DTYPES[record["dtype"]])
            self._scratch[key] = t
            self._register(key, t, slice_)

    def _params_by_name(self) -> Dict[str, _Param]:
        return {p.name: p for p in self._params.values()}

    def _check_object(self, name: str, text: str) -> None:
        encoded = json.loads(text)
        zeros = {k: torch.zeros_like(t) for k, t in self._scratch.items()}
        if name == _OPTIMIZER:
            zero = self._zero()
            if zero is not None:
                self._zero_state_dict(zero, encoded, zeros, check=True)
                zero_state.check_masters(zero, encoded, self._zero_names(zero)[0], zeros)
            else:
                self._optimizer_state_dict(encoded, zeros, check=True)
            return
        state = _decode(encoded, _SavedTensors(zeros, name))
        obj = self._objects[name]
        if hasattr(obj, "check_state_dict"):
            obj.check_state_dict(state)
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            live = obj.state_dict()
            unknown = set(state) - set(live)
            if unknown:
                raise ValueError(f"unexpected keys {sorted(unknown)} for {type(obj).__name__}")
            for key, value in state.items():
                if not _same_kind(value, live[key]):
                    raise ValueError(f"{type(obj).__name__} state {key!r} is {value!r}; the live one is a "
                                     f"{type(live[key]).__name__}")
            # Loaded into a copy that shares only the optimizer (schedulers never change it when
            # loading; copying it would copy every parameter).
            copy.deepcopy(obj, {id(obj.optimizer): obj.optimizer}).load_state_dict(state)
        else:
            copy.deepcopy(obj).load_state_dict(state)

    def _load_object(self, name: str, text: str) -> None:
        encoded = json.loads(text)
        if name == _OPTIMIZER:
            zero = self._zero()
            if zero is not None:
                zero.optim.load_state_dict(self._zero_state_dict(zero, encoded, self._scratch, check=False))
                zero_state.load_masters(zero, encoded, self._zero_names(zero)[0], self._scratch)
            else:
                self._optimizer.load_state_dict(self._optimizer_state_dict(encoded, self._scratch, check=False))
            return
        self._objects[name].load_state_dict(_decode(encoded, self._scratch))

    def _optimizer_state_dict(self, encoded: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                              check: bool) -> Dict[str, Any]:
        """torch.optim's state_dict for the live optimizer from the saved one, by parameter name."""
        opt = self._optimizer
        if encoded.get("type") != type(opt).__name__:
            raise ValueError(f"the checkpoint's optimizer is {encoded.get('type')}; the live one is "
                             f"{type(opt).__name__}")
        saved_groups = encoded["param_groups"]
        if len(saved_groups) != len(opt.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups; the live one has "
                             f"{len(opt.param_groups)}")
        index: Dict[str, int] = {}
        groups = []
        next_index = 0
        for g, (saved, live) in enumerate(zip(saved_groups, opt.param_groups)):
            live_names = [self._param_name(p).name for p in live["params"]]
            if saved["params"] != live_names:
                only_saved = sorted(set(saved["params"]) - set(live_names))
                only_live = sorted(set(live_names) - set(saved["params"]))
                raise ValueError(f"optimizer parameter group {g}: parameters differ (only in the checkpoint: "
                                 f"{only_saved}, only live: {only_live})")
            options = _decode(saved["options"], tensors)
            missing = set(k for k in live if k != "params") - set(options)
            if missing:
                raise ValueError(f"optimizer parameter group {g}: options {sorted(missing)} missing in the checkpoint")
            if check:
                _check_options_on_scratch(opt, options, g)
            ids = []
            for n in live_names:
                index[n] = next_index
                ids.append(next_index)
                next_index += 1
            groups.append(dict(options, params=ids))
        state = {}
        for pname, per_param in encoded["state"].items():
            if pname not in index:
                raise ValueError(f"optimizer state of {pname}, which is not a live parameter")
            state[index[pname]] = _decode(per_param, _SavedTensors(tensors, pname) if check else tensors)
        return {"state": state, "param_groups": groups}


class _SavedTensors(dict):
    """Tensor lookup for checks before the data is read. A saved state that names a tensor with no
    scratch copy (the manifest has no such record, or one of a dtype torch cannot hold) is refused
    here: the load would otherwise fail on it after the model had changed."""

    def __init__(self, tensors: Dict[str, torch.Tensor], owner: str):
        super().__init__(tensors)
        self.owner = owner

    def __missing__(self, key: str) -> torch.Tensor:
        raise ValueError(f"the saved state of {self.owner} refers to tensor {key!r}, which the checkpoint does not "
                         "hold (its manifest has no such record, or one of an unsupported dtype)")


def _same_kind(saved: Any, live: Any) -> bool:
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


def _check_options_on_scratch(optimizer: torch.optim.Optimizer, options: Dict[str, Any], group: int) -> None:
    """Range-checks saved hyper-parameters as the optimizer's constructor does, on a scratch optimizer
    of its class over one scratch parameter on the live parameters' device (torch.optim's
    load_state_dict checks none of them: a negative lr or a string for betas would load)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in options.items() if k in accepted and k not in ("self", "params")}
    device = optimizer.param_groups[0]["params"][0].device
    try:
        cls([torch.zeros(1, device=device, requires_grad=True)], **kwargs)
    except Exception as e:  # whatever the constructor raises for a bad value
        raise ValueError(f"optimizer parameter group {group}: the saved options are not valid for {cls.__name__}: "
                         f"{e}") from None
    # A step hands each number to its parameters' kernels in their dtype: a value the dtype cannot
    # hold (weight_decay 1e308 with float32 parameters) makes Adam's step raise and AdamW's turn
    # every weight to -inf. Refused now, as the C++ loader refuses it.
    dtypes = {p.dtype for p in optimizer.param_groups[group]["params"] if p.is_floating_point()}
    for key, value in kwargs.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            for dtype in dtypes:
                if abs(v) > torch.finfo(dtype).max:
                    raise ValueError(f"optimizer parameter group {group}: option {key!r} is {v}, which the parameters' "
                                     f"dtype {dtype} cannot hold (its steps would fail)")


__all__ = ["Checkpointer", "CheckpointInfo", "LoadContext", "SaveHandle", "SaveState", "StateProvider", "TrainingProgress",
           "need_for"]
