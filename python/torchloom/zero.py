"""ZeRO from Python: optimizer state (stage 1) and gradients (stage 2) sharded over a data-parallel
group, on torchloom's gradient reducer (loom::ZeroOptimizer), stepped by a torch.optim optimizer.

Unlike torch.distributed.optim.ZeroRedundancyOptimizer, which shards whole parameters and sits on
top of DDP, this one replaces both DDP and the optimizer: its reducer reduce-scatters the gradient
buckets during backward (no DDP wrapper: use the plain model), each rank's optimizer steps a flat
1/N of every bucket, and the parameters are all-gathered after the step. Bytes per parameter with
fp32 Adam: DDP 16; stage 1 8 + 8/N; stage 2 4 + 12/N.

    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=2)
    for x, y in batches:
        zero.zero_grad()
        loss_fn(model(x), y).backward()     # reduce-scatter overlaps backward
        zero.clip_grad_norm_(1.0)           # optional: the global norm over every shard
        zero.step()

Element-wise optimizers only (each element's update depends on that element alone): SGD, Adam,
AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta. One parameter group.

bf16/fp16 parameters get fp32 master weights (master_weights=True): the optimizer steps an fp32
copy of this rank's shard, cast back into the parameters before the all-gather; bytes per parameter
with Adam: stage 1 4 + 12/N, stage 2 2 + 14/N. With torchloom.GradScaler, scaler.step(zero) agrees
on found-inf over the group.

overlap_param_gather=True with module=model: step() returns with the parameter all-gathers running
(the first layers' first) and a forward pre-hook on each submodule waits for that submodule's
parameters, so the next forward overlaps the gathers. Read parameters outside the model's forward
only after zero.wait_parameters().
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Type

import torch

from . import _C

# Each element's update depends on that element (its gradient and state) alone, so a flat shard
# cutting through parameters is stepped exactly as the whole.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def _where() -> str:
    from . import world
    return f"[rank {world().rank}] ZeroRedundancyOptimizer"


class ZeroRedundancyOptimizer:
    """params: the model's parameters (frozen ones are left out); optimizer_class and **defaults
    build the optimizer over this rank's shard tensors; process_group: a torchloom Communicator
    (default: the world's); stage 1 or 2; bucket_cap_mb as DDP's; find_unused_parameters as DDP's;
    reduce_dtype: reduce-scatter in this dtype (e.g. torch.bfloat16); master_weights: fp32 copies of
    the shards of bf16/fp16 parameters; overlap_param_gather with module: the next forward waits
    for each submodule's parameters in a forward pre-hook."""

    def __init__(self, params: Iterable[Any], optimizer_class: Type[torch.optim.Optimizer],
                 process_group: Optional[_C.Communicator] = None, stage: int = 1, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, reduce_dtype: Optional[torch.dtype] = None,
                 master_weights: bool = True, overlap_param_gather: bool = False,
                 module: Optional[torch.nn.Module] = None, **defaults: Any) -> None:
        listed = list(params)
        if any(isinstance(p, dict) for p in listed):
            raise _C.InvalidArgumentError(f"{_where()}: expected one parameter group (a list of tensors), found "
                                          f"parameter-group dicts")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, _ELEMENTWISE)):
            name = getattr(optimizer_class, "__name__", repr(optimizer_class))
            raise _C.InvalidArgumentError(
                f"{_where()}: expected an element-wise optimizer class ("
                f"{', '.join(c.__name__ for c in _ELEMENTWISE)}: each element's update depends on that element "
                f"alone, so a shard is stepped by itself), found {name}")
        if process_group is None:
            from . import world_comm
            process_group = world_comm()
        if not isinstance(process_group, _C.Communicator):
            raise _C.InvalidArgumentError(f"{_where()}: expected process_group to be a torchloom Communicator or "
                                          f"None, found {type(process_group).__name__}")
        if overlap_param_gather and module is None:
            raise _C.InvalidArgumentError(
                f"{_where()}: overlap_param_gather needs module= (the model whose submodules' forward pre-hooks wait "
                f"for their parameters), found None")
        trainable = [p for p in listed if p.requires_grad]
        names: List[str] = []
        if module is not None:  # for messages: the module's names of the parameters
            by_id = {id(p): name for name, p in module.named_parameters()}
            names = [by_id.get(id(p), f"parameter {i}") for i, p in enumerate(trainable)]
        # The first bucket is 1 MB (it starts reducing soonest), or bucket_cap_mb when that is smaller.
        self._zero = _C._Zero(trainable, process_group, stage=stage, bucket_cap_mb=bucket_cap_mb,
                              first_bucket_cap_mb=min(1.0, bucket_cap_mb), find_unused_parameters=find_unused_parameters,
                              reduce_dtype=reduce_dtype, master_weights=master_weights,
                              overlap_param_gather=overlap_param_gather, names=names)
        self._shards = self._zero.shard_parameters()
        self.optim: torch.optim.Optimizer = optimizer_class(self._shards, **defaults)
        self._hooks: List[Any] = []
        if overlap_param_gather:
            self._hook_module(module)

    def _hook_module(self, module: torch.nn.Module) -> None:
        ours = {id(p) for p in self._zero.parameters}
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in ours]
            if own:
                self._hooks.append(sub.register_forward_pre_hook(
                    lambda _module, _args, own=own: self._zero.wait_parameters(own)))

    def wait_parameters(self) -> None:
        """Waits for every parameter all-gather still running (overlap_param_gather): before reading
        parameters outside the model's forward (saving them, evaluating another way)."""
        self._zero.wait_all_parameters()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The shard optimizer's groups (lr and the rest apply to every shard); an LR scheduler takes
        `zero.optim`."""
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def stage(self) -> int:
        return self._zero.stage

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every parameter's gradient (the next backward starts from zero)."""
        self._zero.zero_grad()

    def step(self, closure: None = None) -> None:
        """Steps this rank's shards with the optimizer, then all-gathers the parameters."""
        if closure is not None:
            raise _C.InvalidArgumentError(f"{_where()}: step(closure) is not supported (a closure would rerun "
                                          f"forward and backward, and with them the reduce-scatter)")
        self._zero.begin_step()
        self.optim.step()
        self._zero.gather_parameters()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clips by the global L2 norm over every shard (as torch.nn.utils.clip_grad_norm_ over the
        whole model); returns the norm before clipping."""
        return self._zero.clip_grad_norm(float(max_norm))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally; the next one outside reduces the sum."""
        previous = self._zero.sync_enabled()
        self._zero.set_sync(False)
        try:
            yield
        finally:
            self._zero.set_sync(previous)

    def shard_gradients(self) -> List[torch.Tensor]:
        return self._zero.shard_gradients()

    def memory(self) -> Dict[str, int]:
        """Bytes held by this rank: parameters, gradients, fp32 master weights and the optimizer's state
        (each storage once)."""
        m = dict(self._zero.memory())
        seen = set()
        total = 0
        for per_param in self.optim.state.values():
            for value in per_param.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    key = value.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += value.untyped_storage().nbytes()
        m["optimizer_state"] = total
        return m

    def stats(self) -> Dict[str, int]:
        return dict(self._zero.stats())
