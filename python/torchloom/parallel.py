"""torchloom.DistributedDataParallel: any Python nn.Module over the C++ gradient reducer.

It takes torch.nn.parallel.DistributedDataParallel's arguments and follows
loom::DistributedDataParallel step for step (the C++ wrapper in loom/parallel/data_parallel.h):
at construction every rank is checked to hold the same frozen parameters, which are broadcast
from rank 0; the trainable ones go to loom::GradientReducer (which broadcasts and checks them,
buckets them, makes each .grad a view into its bucket and all-reduces buckets from autograd hooks
while backward runs); buffers are broadcast from rank 0. Before each forward the module is checked
unchanged and, when the previous forward was followed by a synchronised backward, buffers are
broadcast again (as PyTorch's DDP).

    ddp = torchloom.DistributedDataParallel(model)          # group: torchloom.world_comm()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in shard:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()                       # all-reduce overlaps backward
        opt.step()                                          # averaged gradients
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from . import _C


def _parameters_now(module: torch.nn.Module) -> "_C._ModuleParameters":
    names: List[str] = []
    tensors: List[torch.Tensor] = []
    trainable: List[bool] = []
    for name, p in module.named_parameters():
        names.append(name)
        tensors.append(p)
        trainable.append(p.requires_grad)
    return _C._ModuleParameters(tensors, names, trainable)


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism for a Python nn.Module with torchloom's C++ reducer.

    Arguments as torch.nn.parallel.DistributedDataParallel: group (a torchloom.Communicator; default
    the world communicator), bucket_cap_mb, find_unused_parameters, static_graph,
    gradient_as_bucket_view, broadcast_buffers. Raises torchloom.MismatchError when ranks hold
    different models (naming the parameter), torchloom.InvalidArgumentError for a module changed
    after wrapping."""

    def __init__(self, module: torch.nn.Module, group: Optional[_C.Communicator] = None, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, static_graph: bool = False,
                 gradient_as_bucket_view: bool = True, broadcast_buffers: bool = True) -> None:
        super().__init__()
        if group is None:
            from . import world_comm
            group = world_comm()
        self.module = module
        self.process_group = group
        self.broadcast_buffers = broadcast_buffers
        self._at_construction = _parameters_now(module)
        _C._prepare_frozen_parameters(group, self._at_construction)
        self.reducer = _C.GradientReducer(
            self._at_construction.trainable_tensors(), group, bucket_cap_mb=float(bucket_cap_mb),
            find_unused_parameters=find_unused_parameters, static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view, names=self._at_construction.trainable_names())
        if broadcast_buffers:
            _C._broadcast_tensors(group, list(module.buffers()), "buffer broadcast")
        # As PyTorch's DDP, which starts with require_forward_param_sync set.
        self._buffers_need_sync = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        _C._check_parameters_unchanged(self.process_group, self._at_construction, _parameters_now(self.module))
        if self.broadcast_buffers and self._buffers_need_sync:
            _C._broadcast_tensors(self.process_group, list(self.module.buffers()), "buffer broadcast")
        # The next forward broadcasts when this one will be followed by a synchronised backward.
        self._buffers_need_sync = torch.is_grad_enabled() and self.reducer.sync_enabled()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally; the first backward after it reduces
        the accumulated sum."""
        previous = self.reducer.sync_enabled()
        self.reducer.set_sync(False)
        try:
            yield
        finally:
            self.reducer.set_sync(previous)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """hook: a built-in hook of torchloom.comm_hooks (allreduce_hook, fp16_compress_hook,
        bf16_compress_hook; state unused), or a Python callable hook(state, bucket) returning a
        torchloom.Work or (Work, finish) (see torchloom.comm_hooks)."""
        if isinstance(hook, _C.BuiltinCommHook):
            self.reducer.register_builtin_comm_hook(hook)
        elif callable(hook):
            self.reducer.register_python_comm_hook(state, hook)
        else:
            raise _C.InvalidArgumentError(
                f"DistributedDataParallel.register_comm_hook: expected a torchloom.comm_hooks hook or a callable, "
                f"found {type(hook).__name__}")

    def bucket_layout(self) -> List[List[int]]:
        """Indices (into the trainable parameters) of each bucket, in issue order."""
        return self.reducer.bucket_layout()

    def stats(self) -> Dict[str, Any]:
        """The reducer's counters (iterations, buckets, buckets issued during backward, ...)."""
        return self.reducer.stats()
