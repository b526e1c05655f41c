"""A torch.optim optimizer (or torchloom.ZeroRedundancyOptimizer) in a checkpoint, in C++'s format
(src/train/checkpoint_optimizer_state.cpp), on the same seam (a StateProvider):

- the "optimizer" section: {"type", "param_groups": [{"params": [parameter names], "options"}],
  "steps": {parameter: step}}, and, for values of per-parameter state that are neither tensors nor
  a step (optimizers C++ does not have), "state": {parameter: {key: value}};
- each state tensor as optim/<parameter>/<key>, sliced like its parameter, so it reshards with it;
  a ZeRO optimizer's fp32 master weights as master/<parameter> (src/train/checkpoint_zero_state.cpp).

So an optimizer saved from Python loads into C++'s of the same kind and back (the options C++ lacks,
such as foreach or fused, keep their live values; "maximize" is refused by C++ rather than dropped),
and a ZeRO checkpoint loads at another data-parallel size, with or without ZeRO. Nothing live changes
before apply: plan checks the section and options, verify builds the state to load from the data
read, apply only hands it over.

Checkpoints saved by earlier Python versions kept this state as the object "torch.optim/optimizer"
(tensors under extra/): they still load.
"""
from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._C import StateProvider, need_like
from . import _zero_state as zero_state
from ._encoding import decode, encode
from ._model_state import ModelState, Param

SECTION = "optimizer"
LEGACY_OBJECT = "torch.optim/optimizer"  # earlier Python versions: an object, its tensors under extra/


class _Saved:
    """A saved optimizer, whichever format it came in: its section, and where each tensor is."""

    def __init__(self, section: Dict[str, Any], tensors: Dict[str, Dict[str, str]], masters: Dict[str, str]):
        self.section = section
        self.tensors = tensors  # parameter -> state key -> saved tensor name
        self.masters = masters  # parameter -> saved master weights' name


def _option_json(value: Any, path: str) -> Any:
    """An option as C++ reads it: tuples (Adam's betas) as plain lists."""
    if isinstance(value, tuple):
        return [_option_json(v, f"{path}/{i}") for i, v in enumerate(value)]
    tensors: Dict[str, torch.Tensor] = {}
    encoded = encode(value, path, tensors)
    if tensors:
        raise TypeError(f"checkpoint: tensor-valued optimizer option {path} is not supported")
    return encoded


def _options(group: Dict[str, Any], g: int) -> Dict[str, Any]:
    return {k: _option_json(v, f"optimizer/param_groups/{g}/{k}") for k, v in group.items() if k != "params"}


def _step(value: Any) -> Optional[int]:
    """A step count as the integer C++ keeps (torch keeps a float tensor); None when it is none."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() and value >= 0 else None


class OptimizerState(StateProvider):
    def __init__(self, model: ModelState) -> None:
        super().__init__()
        self.model = model
        self.optimizer: Optional[Any] = None
        self._saved: Optional[_Saved] = None  # load: from plan
        self._loaded: Optional[Callable[[], None]] = None  # load: from verify, run by apply

    def zero(self) -> Optional[Any]:
        """The optimizer when it is a torchloom.ZeroRedundancyOptimizer."""
        from ..zero import ZeroRedundancyOptimizer
        return self.optimizer if isinstance(self.optimizer, ZeroRedundancyOptimizer) else None

    def _param(self, p: torch.Tensor) -> Param:
        found = self.model.find(p)
        if found is None:
            raise ValueError(f"checkpoint: an optimizer parameter of shape {list(p.shape)} is not a parameter of a "
                             "registered model (call model() first)")
        return found

    def _zero_params(self, zero: Any) -> List[Param]:
        return [self._param(p) for p in zero._zero.parameters]

    # ---- Save ------------------------------------------------------------------------------------

    def collect(self, rank, out) -> None:
        if self.optimizer is None or out.for_load:
            return

        def add(saved: str, t: torch.Tensor, slice_) -> None:
            if slice_ is None:
                out.add_tensor(saved, t)
            else:
                out.add_tensor(saved, t, slice_[0], slice_[1], slice_[2])

        zero = self.zero()
        if zero is not None:
            params = self._zero_params(zero)
            section = zero_state.encode(zero, [p.name for p in params], [p.slice for p in params], add, _step,
                                        lambda value, path: encode(value, path, {}))
            section["param_groups"] = [{"params": [p.name for p in params], "options": _options(zero.optim.param_groups[0], 0)}]
        else:
            section = self._encode(add)
        out.set_section(SECTION, json.dumps(section))

    def _encode(self, add: Callable[[str, torch.Tensor, Any], None]) -> Dict[str, Any]:
        opt = self.optimizer
        groups, steps, values = [], {}, {}
        for g, group in enumerate(opt.param_groups):
            names = []
            for p in group["params"]:
                param = self._param(p)
                names.append(param.name)
                for key, value in (opt.state.get(p) or {}).items():
                    saved = f"optim/{param.name}/{key}"
                    if key == "step" and _step(value) is not None:
                        steps[param.name] = _step(value)
                    elif isinstance(value, torch.Tensor):
                        if param.slice is not None and value.shape == p.shape:
                            add(saved, value.detach(), param.slice)
                        elif param.slice is not None and value.dim() > 0:
                            raise ValueError(f"checkpoint: optimizer state {key!r} of the sliced parameter "
                                             f"{param.name} has shape {list(value.shape)}, neither the parameter's "
                                             "nor a scalar: it cannot follow the parameter's slice")
                        else:
                            add(saved, value.detach(), None)
                    elif value is not None:
                        values.setdefault(param.name, {})[key] = encode(value, saved, {})
            groups.append({"params": names, "options": _options(group, g)})
        section: Dict[str, Any] = {"type": type(opt).__name__, "param_groups": groups, "steps": steps}
        if values:
            section["state"] = values
        return section

    # ---- Load ------------------------------------------------------------------------------------

    def _read(self, context) -> Optional[_Saved]:
        """The saved optimizer in either format; None when the checkpoint has none."""
        text = context.section(SECTION)
        if text:
            section = json.loads(text)
            tensors: Dict[str, Dict[str, str]] = {}
            for name in context.saved_names("optim/"):
                param, key = name[len("optim/"):].rsplit("/", 1)
                tensors.setdefault(param, {})[key] = name
            masters = {name[len("master/"):]: name for name in context.saved_names("master/")}
            return _Saved(section, tensors, masters)
        objects = context.section("objects")
        legacy = json.loads(objects).get(LEGACY_OBJECT) if objects else None
        if not isinstance(legacy, dict):
            return None
        # {"state": {param: {key: {"__tensor__": "optim/<param>/<key>"} or a value}}, "master": {...}},
        # parameters named as the model was then (extra/<prefix><name>, prefix "model." by default).
        renamed = {p.legacy[len("extra/"):]: p.name for p in self.model.params.values()}
        state = legacy.get("state") or {}
        tensors, values = {}, {}
        for param, per_param in state.items():
            for key, value in per_param.items():
                if isinstance(value, dict) and set(value) == {"__tensor__"}:
                    tensors.setdefault(renamed.get(param, param), {})[key] = "extra/" + value["__tensor__"]
                else:
                    values.setdefault(renamed.get(param, param), {})[key] = value
        masters = {renamed.get(param, param): "extra/" + key for param, key in (legacy.get("master") or {}).items()
                   if isinstance(key, str)}
        groups = [dict(g, params=[renamed.get(n, n) for n in g.get("params") or []]) if isinstance(g, dict) else g
                  for g in legacy.get("param_groups") or []]
        section = {"type": legacy.get("type"), "param_groups": groups, "steps": {}, "state": values}
        return _Saved(section, tensors, masters)

    def plan(self, context, needs, problems) -> None:
        self._saved, self._loaded = None, None
        if self.optimizer is None:
            return
        try:
            saved = self._read(context)
        except (ValueError, AttributeError) as e:
            problems.append(f"the checkpoint's optimizer state is malformed: {e}")
            return
        if saved is None:
            problems.append("the checkpoint holds no optimizer state")
            return
        zero = self.zero()
        live = zero.optim if zero is not None else self.optimizer
        section = saved.section
        if section.get("type") != type(live).__name__:
            problems.append(f"the checkpoint's optimizer is {section.get('type')}; the live one is {type(live).__name__}")
            return
        groups = section.get("param_groups")
        steps, values = section.get("steps"), section.get("state") or {}
        if not isinstance(groups, list) or not isinstance(steps, dict) or not isinstance(values, dict):
            problems.append("the checkpoint's optimizer section has no param_groups or steps")
            return
        try:
            if zero is not None:
                live_groups = [[p.name for p in self._zero_params(zero)]]
            else:
                live_groups = [[self._param(p).name for p in group["params"]] for group in live.param_groups]
            self._check_groups(groups, live_groups, live)
        except ValueError as e:
            problems.append(str(e))
            return
        for name, step in steps.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                problems.append(f"optimizer step count of {name} is {json.dumps(step)}")
        for g, names in enumerate(live_groups):
            _check_state_keys(section["type"], groups[g]["options"], names, saved.tensors, problems)
        wanted = zero_state.needed(zero, live_groups[0]) if zero is not None else None
        params = self.model.by_name()
        for param, keys in sorted(saved.tensors.items()):
            if wanted is not None and param not in wanted:
                continue  # ZeRO reads only the state of the parameters overlapping this rank's shards
            p = params.get(param)
            if p is None:
                problems.append(f"optimizer state of {param}, which is not a live parameter")
                continue
            like = context.live.find(p.saved)
            for key, source in sorted(keys.items()):
                record = context.record(source)
                if record is None:
                    problems.append(f"the checkpoint's optimizer state names {source}, which it does not hold")
                elif list(record.shape) == list(like.global_shape):
                    need_like(source, record, like, needs)
                elif p.slice is not None and len(record.shape) > 0:
                    problems.append(f"optimizer state {source} {list(record.shape)} does not match {p.saved} "
                                    f"{list(like.global_shape)}")
                else:
                    need_like(source, record, None, needs)
        if zero is not None:
            for param, source in sorted(saved.masters.items()):
                p, record = params.get(param), context.record(source)
                if p is not None and record is not None and param in wanted and zero_state.has_masters(zero, p.tensor):
                    mismatch = need_like(source, record, context.live.find(p.saved), needs)
                    if mismatch:
                        problems.append("master weights " + mismatch)
        self._saved = saved

    def _check_groups(self, groups: List[Any], live_groups: List[List[str]], live: Any) -> None:
        """The saved parameter groups against the live ones: the same parameters by name, options the
        optimizer's constructor accepts (ValueError naming the group)."""
        if len(groups) != len(live_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups; the live one has "
                             f"{len(live_groups)}")
        for g, (group, names) in enumerate(zip(groups, live_groups)):
            if not isinstance(group, dict) or not isinstance(group.get("params"), list) or \
                    not isinstance(group.get("options"), dict):
                raise ValueError(f"optimizer parameter group {g}: malformed in the checkpoint")
            if group["params"] != names:
                only_saved = sorted(set(map(str, group["params"])) - set(names))
                only_live = sorted(set(names) - set(map(str, group["params"])))
                raise ValueError(f"optimizer parameter group {g}: parameters differ (only in the checkpoint: "
                                 f"{only_saved}, only live: {only_live})")
            _check_options_on_scratch(live, self._group_options(group["options"], live.param_groups[g]), g)

    @staticmethod
    def _group_options(saved: Dict[str, Any], live: Dict[str, Any]) -> Dict[str, Any]:
        """The options to load into a live group: the saved ones (lists where the live value is a
        tuple), the live values of those the checkpoint lacks (a C++ optimizer has no foreach, fused...)."""
        options = {}
        for key, value in live.items():
            if key == "params":
                continue
            if key not in saved:
                options[key] = value
                continue
            v = decode(saved[key], {})
            options[key] = tuple(v) if isinstance(value, tuple) and isinstance(v, list) else v
        return options

    def verify(self, context, data, problems) -> None:
        if self._saved is None:
            return
        try:
            self._loaded = self._prepare(data)
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            problems.append(str(e))

    def _per_param(self, data: Dict[str, torch.Tensor], names: List[str]) -> Dict[str, Dict[str, Any]]:
        """Each parameter's saved state as torch.optim keeps it: tensors read, the step as a float
        tensor, other values decoded."""
        saved = self._saved
        steps, values = saved.section.get("steps") or {}, saved.section.get("state") or {}
        state: Dict[str, Dict[str, Any]] = {}
        for name in names:
            per_param: Dict[str, Any] = {}
            for key, value in (values.get(name) or {}).items():
                per_param[key] = decode(value, {})
            for key, source in (saved.tensors.get(name) or {}).items():
                if source in data:
                    per_param[key] = data[source]
            if name in steps:
                per_param["step"] = torch.tensor(float(steps[name]), dtype=torch.float32)
            if per_param:
                state[name] = per_param
        return state

    def _prepare(self, data: Dict[str, torch.Tensor]) -> Callable[[], None]:
        """The load, built from the data read and checked; returns what apply runs."""
        zero = self.zero()
        groups = self._saved.section["param_groups"]
        if zero is not None:
            names = [p.name for p in self._zero_params(zero)]
            options = self._group_options(groups[0]["options"], zero.optim.param_groups[0])
            shard_state = zero_state.shard_state_dict(zero, self._per_param(data, names), names, options)
            masters = {name: data[source] for name, source in self._saved.masters.items() if source in data}
            zero_state.check_masters(zero, names, masters)

            def load_zero() -> None:
                zero.optim.load_state_dict(shard_state)
                zero_state.load_masters(zero, names, masters)
            return load_zero
        opt = self.optimizer
        index: Dict[str, int] = {}
        param_groups = []
        for g, live in enumerate(opt.param_groups):
            ids = []
            for p in live["params"]:
                index[self._param(p).name] = len(index)
                ids.append(index[self._param(p).name])
            param_groups.append(dict(self._group_options(groups[g]["options"], live), params=ids))
        state = {index[name]: per_param for name, per_param in self._per_param(data, list(index)).items()}
        state_dict = {"state": state, "param_groups": param_groups}
        return lambda: opt.load_state_dict(state_dict)

    def apply(self, context, data) -> None:
        if self._loaded is not None:
            self._loaded()
        self._saved, self._loaded = None, None


def _state_keys(kind: str, options: Dict[str, Any]) -> Optional[Tuple[set, set]]:
    """The state tensors (besides the step) a parameter with state must have, and may have, for an
    optimizer of these options (as src/train/checkpoint_optimizer_state.cpp); None for kinds C++ has
    not."""
    if kind == "SGD":
        return set(), {"momentum_buffer"}
    if kind in ("Adam", "AdamW"):
        required = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if options.get("amsgrad") else set())
    elif kind == "RMSprop":
        required = {"square_avg"} | ({"momentum_buffer"} if (options.get("momentum") or 0) > 0 else set()) | \
            ({"grad_avg"} if options.get("centered") else set())
    elif kind == "Adagrad":
        required = {"sum"}
    else:
        return None
    return required, required


def _check_state_keys(kind: str, options: Dict[str, Any], names: List[str], tensors: Dict[str, Dict[str, str]],
                      problems: List[str]) -> None:
    """Each parameter's saved state is complete for the saved options (a checkpoint that lost one
    tensor would load an optimizer that fails at its next step), and nothing else."""
    keys = _state_keys(kind, options)
    if keys is None:
        return
    required, allowed = keys
    for name in names:
        saved = set(tensors.get(name) or {}) - {"step"}
        if not saved:
            continue  # no state yet (never stepped)
        for key in sorted(required - saved):
            problems.append(f"optimizer state of {name} lacks {key}, which {kind} with these options keeps for every "
                            "parameter with state")
        for key in sorted(saved - allowed):
            problems.append(f"optimizer state of {name} has {key}, which {kind} with these options does not keep")


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
