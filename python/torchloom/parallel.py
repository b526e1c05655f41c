"""torchloom.DistributedDataParallel: any Python nn.Module over the C++ gradient reducer.

It takes torch.nn.parallel.DistributedDataParallel's arguments and follows
loom::DistributedDataParallel step for step (the C++ wrapper in loom/parallel/data_parallel.h):
at construction every rank is checked to hold the same frozen parameters, which are broadcast
from rank 0; the trainable ones go to loom::GradientReducer (which broadcasts and checks them,
buckets them, makes each .grad a view into its bucket and all-reduces buckets from autograd hooks
while backward runs); buffers are broadcast from rank 0. Before each forward the module is checked
unchanged and, when the previous forward was followed by a synchronised backward, buffers are
broadcast again (as PyTorch's DDP).

    ddp = torchloom.DistributedDataParallel(model)          # process_group: torchloom.world_comm()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in shard:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()                       # all-reduce overlaps backward
        opt.step()                                          # averaged gradients
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from . import _C


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _parameters_now(module: torch.nn.Module) -> "_C._ModuleParameters":
    names: List[str] = []
    tensors: List[torch.Tensor] = []
    trainable: List[bool] = []
    for name, p in module.named_parameters():
        names.append(name)
        tensors.append(p)
        trainable.append(p.requires_grad)
    return _C._ModuleParameters(tensors, names, trainable)


def _where(what: str = "DistributedDataParallel") -> str:
    """What an error names first, as the C++ library's do: "[rank R] DistributedDataParallel"."""
    try:
        from . import world
        return f"[rank {world().rank}] {what}"
    except Exception:  # before torchloom.init(): no rank yet
        return what


def _communicator_of(process_group: Any, module: torch.nn.Module, where: str) -> "_C.Communicator":
    """process_group as torch's DDP takes it, as the torchloom communicator to reduce over: a
    torchloom.Communicator, a torch.distributed ProcessGroup of backend "loom" (its communicator
    for the module's device), or None (the world)."""
    if process_group is None:
        from . import world_comm
        return world_comm()
    if isinstance(process_group, _C.Communicator):
        return process_group
    import torch.distributed as dist
    if isinstance(process_group, dist.ProcessGroup):
        on_cuda = any(p.is_cuda for p in module.parameters())
        device = torch.device("cuda" if on_cuda else "cpu")
        try:
            backend = process_group._get_backend(device)
        except RuntimeError as e:
            raise _C.InvalidArgumentError(f"{where}: process_group has no backend for {device.type} tensors: {e}")
        if not isinstance(backend, _C._DistBackend):
            raise _C.InvalidArgumentError(
                f"{where}: expected a torchloom.Communicator or a process group of backend 'loom', found one of "
                f"backend '{dist.get_backend(process_group)}' (torch.distributed.init_process_group(\"loom\") "
                f"after import torchloom, or pass torchloom.world_comm())")
        comm = backend.device_comm if on_cuda else backend.host_comm
        if comm is None:
            raise _C.InvalidArgumentError(f"{where}: the loom process group has no communicator for {device.type} "
                                          f"tensors")
        return comm
    raise _C.InvalidArgumentError(f"{where}: process_group must be a torchloom.Communicator, a torch.distributed "
                                  f"ProcessGroup of backend 'loom' or None, found {type(process_group).__name__}")


class GradBucket:
    """The bucket a communication hook receives: torch.distributed.GradBucket's methods (index(),
    buffer(), gradients(), parameters(), is_last(), set_buffer()), plus torchloom's group (the
    torchloom.Communicator reducing it) and divisor (what the reduced sum is divided by)."""

    __slots__ = ("_bucket", "_parameters")

    def __init__(self, bucket: "_C._GradBucket", parameters: List[torch.Tensor]) -> None:
        self._bucket = bucket
        self._parameters = parameters

    def index(self) -> int:
        """0 for the bucket reduced first in an iteration."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The bucket's flat gradients; a hook reduces it (or returns a future of the reduced tensor)."""
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)

    def parameters(self) -> List[torch.Tensor]:
        """The bucket's parameters, in the buffer's order."""
        return [self._parameters[i] for i in self._bucket.parameters]

    def gradients(self) -> List[torch.Tensor]:
        """Each parameter's gradient as a view into buffer()."""
        views, offset, flat = [], 0, self._bucket.buffer
        for p in self.parameters():
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._bucket.last

    @property
    def group(self) -> "_C.Communicator":
        return self._bucket.group

    @property
    def divisor(self) -> float:
        return self._bucket.divisor


def _finish_future(future: torch._C.Future, buffer: torch.Tensor, index: int, timeout: float) -> Callable[[], None]:
    """After a torch-style hook: wait for its future (at most the group's timeout: a future nobody
    completes must not hang the job) and leave its value in the bucket's buffer."""
    def finish() -> None:
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise _C.TimeoutError(
                f"{_where('DistributedDataParallel comm hook')}: bucket {index}: the hook's future was not completed "
                f"within {timeout:g} s (the group's timeout); expected it to complete, e.g. as a collective's "
                f"get_future() does")
        value = future.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        if not isinstance(value, torch.Tensor):
            raise _C.InvalidArgumentError(f"{_where('DistributedDataParallel comm hook')}: the future's value must be a tensor "
                                          f"(or a list of one), found {type(value).__name__}")
        if value.data_ptr() != buffer.data_ptr() or value.shape != buffer.shape:
            buffer.copy_(value.view_as(buffer))
    return finish


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism for a Python nn.Module with torchloom's C++ reducer.

    Arguments as torch.nn.parallel.DistributedDataParallel's, in its order, with its defaults
    (gradient_as_bucket_view=False). process_group: a torchloom.Communicator, a torch.distributed
    ProcessGroup of backend "loom", or None for the world (``group=`` is the same, the older name).
    device_ids/output_device: None, or the module's one device. What torchloom does not do is
    refused by name: several devices per process, dim other than 0, mixed_precision, device_mesh,
    delay_all_reduce_named_params, param_to_hook_all_reduce, join() for uneven inputs. Raises
    torchloom.MismatchError when ranks hold different models (naming the parameter),
    torchloom.InvalidArgumentError for a module changed after wrapping."""

    def __init__(self, module: torch.nn.Module, device_ids: Optional[List[Any]] = None,
                 output_device: Optional[Any] = None, dim: int = 0, broadcast_buffers: bool = True,
                 init_sync: bool = True, process_group: Any = None, bucket_cap_mb: Optional[float] = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None, *,
                 group: Optional[_C.Communicator] = None) -> None:
        super().__init__()
        where = _where()
        unsupported = {"mixed_precision": mixed_precision, "device_mesh": device_mesh,
                       "delay_all_reduce_named_params": delay_all_reduce_named_params,
                       "param_to_hook_all_reduce": param_to_hook_all_reduce}
        for name, value in unsupported.items():
            if value is not None:
                raise _C.InvalidArgumentError(f"{where}: {name} is not supported by torchloom (found {value!r}); "
                                              f"leave it None")
        if dim != 0:
            raise _C.InvalidArgumentError(f"{where}: dim must be 0 (one device per process), found {dim}")
        if group is not None and process_group is not None:
            raise _C.InvalidArgumentError(f"{where}: give process_group or group (its older name), not both")
        self.device = self._one_device(module, device_ids, output_device, where)
        group = _communicator_of(process_group if process_group is not None else group, module, where)
        self.module = module
        self.process_group = group
        self.broadcast_buffers = broadcast_buffers
        self._at_construction = _parameters_now(module)
        _C._prepare_frozen_parameters(group, self._at_construction)
        self._trainable = self._at_construction.trainable_tensors()
        self.reducer = _C.GradientReducer(
            # As torch's: a smaller first bucket (1 MB) only under the default cap; a cap given applies to all.
            self._trainable, group, bucket_cap_mb=float(25 if bucket_cap_mb is None else bucket_cap_mb),
            first_bucket_cap_mb=1.0 if bucket_cap_mb is None else float(bucket_cap_mb),
            find_unused_parameters=find_unused_parameters, static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view, broadcast_parameters=init_sync,
            names=self._at_construction.trainable_names())
        if broadcast_buffers and init_sync:
            _C._broadcast_tensors(group, list(module.buffers()), "buffer broadcast")
        # As PyTorch's DDP, which starts with require_forward_param_sync set.
        self._buffers_need_sync = True

    @staticmethod
    def _one_device(module: torch.nn.Module, device_ids: Optional[List[Any]], output_device: Any,
                    where: str) -> Optional[torch.device]:
        """torch's rules for a module on one device: device_ids is None (CPU, or a module already
        placed) or names that device; output_device, if given, is the same device."""
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise _C.InvalidArgumentError(f"{where}: the module's parameters are on several devices "
                                          f"({sorted(str(d) for d in devices)}); torchloom takes one device per process")
        module_device = next(iter(devices)) if devices else torch.device("cpu")
        if device_ids is None:
            if output_device is not None and torch.device(output_device) != module_device:
                raise _C.InvalidArgumentError(f"{where}: output_device {output_device} is not the module's device "
                                              f"{module_device}")
            return None
        if len(device_ids) != 1:
            raise _C.InvalidArgumentError(f"{where}: device_ids must name one device (one per process), found "
                                          f"{list(device_ids)}")
        if module_device.type == "cpu":
            raise _C.InvalidArgumentError(f"{where}: device_ids must be None for a module on the CPU, found "
                                          f"{list(device_ids)}")
        wanted = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else torch.device("cuda",
                                                                                                   device_ids[0])
        if wanted != module_device:
            raise _C.InvalidArgumentError(f"{where}: device_ids {list(device_ids)} is not the module's device "
                                          f"{module_device}; move the module first (module.to(device))")
        if output_device is not None:
            out = torch.device("cuda", output_device) if isinstance(output_device, int) else torch.device(output_device)
            if out != module_device:
                raise _C.InvalidArgumentError(f"{where}: output_device {output_device} is not device_ids[0] "
                                              f"{device_ids[0]}")
        return module_device

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        _C._check_parameters_unchanged(self.process_group, self._at_construction, _parameters_now(self.module))
        if self.broadcast_buffers and self._buffers_need_sync:
            _C._broadcast_tensors(self.process_group, list(self.module.buffers()), "buffer broadcast")
        # The next forward broadcasts when this one will be followed by a synchronised backward.
        self._buffers_need_sync = torch.is_grad_enabled() and self.reducer.sync_enabled()
        if self.device is not None:  # device_ids given: inputs go to that device, as torch's DDP moves them
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
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
        """hook: torch's signature, hook(state, bucket: GradBucket) -> torch.futures.Future whose
        value is the bucket's averaged gradients (torch's own hooks, e.g.
        torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook, run unchanged over
        a process group of backend "loom"); or one returning a torchloom.Work (or (Work, finish)),
        after which bucket.buffer() holds them; or a built-in of torchloom.comm_hooks (run in C++,
        state unused). One hook, registered before the first backward."""
        if isinstance(hook, _C.BuiltinCommHook):
            self.reducer.register_builtin_comm_hook(hook)
            return
        if not callable(hook):
            raise _C.InvalidArgumentError(
                f"{_where('DistributedDataParallel.register_comm_hook')}: expected a callable hook(state, bucket) or a "
                f"torchloom.comm_hooks hook, found {type(hook).__name__}")
        parameters = self._trainable

        # (It runs inside the reducer: a hook must not call the reducer's own methods.)
        def adapted(state: object, bucket: "_C._GradBucket") -> Any:
            result = hook(state, GradBucket(bucket, parameters))
            if isinstance(result, torch._C.Future):  # torch.futures.Future and the one c10d returns
                return (None, _finish_future(result, bucket.buffer, bucket.index, bucket.group.default_timeout))
            return result

        self.reducer.register_python_comm_hook(state, adapted)

    def join(self, *args: Any, **kwargs: Any) -> None:
        """Refused: torchloom has no shadow collectives for ranks that ran out of inputs."""
        raise _C.InvalidArgumentError(
            f"{_where('DistributedDataParallel.join')}: uneven inputs are not supported by torchloom; give every rank the same "
            "number of batches (torch.utils.data.DistributedSampler(..., drop_last=True) does)")

    def join_hook(self, **kwargs: Any) -> None:
        """Refused, as join() (torch.distributed.algorithms.Join asks for it)."""
        self.join()

    def bucket_layout(self) -> List[List[int]]:
        """Indices (into the trainable parameters) of each bucket, in issue order."""
        return self.reducer.bucket_layout()

    def stats(self) -> Dict[str, Any]:
        """The reducer's counters (iterations, buckets, buckets issued during backward, ...)."""
        return self.reducer.stats()
