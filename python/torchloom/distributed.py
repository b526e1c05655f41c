"""torchloom as a torch.distributed backend: ``backend="loom"``.

Importing torchloom registers the backend, so an unmodified PyTorch program gets torchloom's
communicators (MPI or Gloo for CPU tensors, NCCL for CUDA tensors) under PyTorch's own DDP, FSDP2
and torch.distributed.checkpoint, with torchloom's size and order checks, timeouts naming the
missing ranks, and flight recorder::

    import torch.distributed as dist
    import torchloom  # noqa: F401  (registers "loom")

    dist.init_process_group("loom")       # under mpirun / loomrun / torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)

What it does with torch's arguments:

- The world is torchloom's: the creator starts torchloom (``torchloom.init()``) if the program did
  not, and refuses (``torchloom.ConfigError``) a rank or world size other than the launcher's.
  torch.distributed still needs its own store (``MASTER_ADDR``/``MASTER_PORT`` or ``init_method``),
  which torchloom does not use under mpirun.
- Timeouts: torch's default (30 minutes) means torchloom's (``LOOM_TIMEOUT``); any other
  ``timeout=`` given to ``init_process_group``/``new_group`` applies to every operation of that
  group, and a per-call timeout to that call.
- ``new_group``/``split_group``: a subgroup is split from the default group's communicators
  (``Communicator.split``, a collective over every rank, which torch's ``new_group`` is too). For
  torch to let the ranks outside a new group take part, the creator binds the default group to a
  device (``bound_device_id``: this rank's CUDA device when torchloom has a device communicator,
  else ``cpu:0``) unless ``init_process_group(device_id=...)`` did. ``new_group(...,
  use_local_synchronization=True)`` cannot be served (the ranks outside never call in) and ends in
  torchloom's timeout naming them.
- Operations: every collective DDP, FSDP2 and DCP use, ``barrier``, ``send``/``recv``,
  ``all_to_all_single`` (even and uneven splits), ``gather``/``scatter`` (built on all-gather and
  point-to-point). ``recv`` from any source, sparse all-reduce, ``monitored_barrier``, BXOR and
  PREMUL_SUM raise an error naming the operation.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as _dist

from . import _C

BACKEND_NAME = "loom"


def _loom_timeout(timeout: datetime.timedelta | None) -> datetime.timedelta | None:
    """torch's default timeout means "torchloom's own" (None); any other value is the user's."""
    if timeout is None:
        return None
    from torch.distributed.constants import default_pg_timeout
    if abs(timeout.total_seconds() - default_pg_timeout.total_seconds()) < 1e-3:
        return None
    return timeout


def _bind_default_device(process_group, runtime) -> None:
    """Binds the default group to a device (see the module's text: it lets new_group split)."""
    if process_group is None or process_group.bound_device_id is not None:
        return
    if runtime.device_comm is not None and runtime.cuda_device is not None:
        process_group.bound_device_id = torch.device("cuda", runtime.cuda_device)
    else:
        process_group.bound_device_id = torch.device("cpu", 0)


def _create_backend(opts, backend_options=None):
    """torch.distributed's creator for backend "loom" (extended API: a _DistributedBackendOptions)."""
    import torchloom
    timeout = _loom_timeout(opts.timeout)
    members = list(opts.global_ranks_in_group)
    split_from = opts.split_from
    if split_from is not None:
        # new_group after the default group was bound to a device: the ranks outside the new group
        # call split_from.perform_nocolor_split at the same point.
        if not isinstance(split_from, _C._DistBackend):
            raise torchloom.InvalidArgumentError(
                f"torch.distributed backend loom: new_group {members} would split a {type(split_from).__name__}, "
                "not a loom backend")
        return split_from._split_members(members, timeout, opts.group_id)
    if not torchloom.is_initialized():
        torchloom.init()
    runtime = torchloom.runtime()
    world = runtime.world
    if not members:  # the default group
        backend = _C._make_dist_backend(opts.group_rank, opts.group_size, timeout, opts.group_id)
        _bind_default_device(opts.process_group, runtime)
        return backend
    if sorted(members) == list(range(world.size)):
        # Every rank is a member, so every rank is here: split the world in the order given.
        world_backend = _C._make_dist_backend(world.rank, world.size, timeout, opts.group_id + "-world")
        return world_backend._split_members(members, timeout, opts.group_id)
    raise torchloom.InvalidArgumentError(
        f"[rank {world.rank}] torch.distributed backend loom: new_group over ranks {members} needs the default "
        "process group to be 'loom' (a subgroup is split from it, which the ranks outside the group take part "
        "in) and new_group(use_local_synchronization=False)")


def is_registered() -> bool:
    """True when torch.distributed knows the "loom" backend."""
    return _dist.is_available() and BACKEND_NAME in _dist.Backend.backend_list


def _register() -> None:
    if not _dist.is_available() or is_registered():
        return
    _dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


_register()

__all__ = ["BACKEND_NAME", "is_registered"]
