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
- The launch: under torchrun the env:// variables are there. Under ``mpirun`` or ``loomrun`` (Open
  MPI, PMIx or Slurm's variables, and no ``RANK``/``MASTER_ADDR``), torch's default ``env://`` needs
  nothing either: torchloom answers it, starting itself over MPI, taking the rank and world size
  from it, and serving torch.distributed's store from rank 0 on a free port whose address it hands
  to the others over MPI. ``init_method=`` and ``store=`` work as in torch.
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
import os
import socket

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


# Variables a rank started by mpirun/loomrun (Open MPI, PMIx) or srun has, and torchrun's never has.
_MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _launched_without_env_rendezvous() -> bool:
    """An MPI (or Slurm) launch that set none of env://'s variables: torchloom serves env://."""
    return (not any(os.environ.get(v) for v in ("RANK", "MASTER_ADDR")) and
            any(os.environ.get(v) for v in _MPI_LAUNCH_VARIABLES))


def _mpi_store(timeout: datetime.timedelta):
    """torch.distributed's store for a job that MPI started: rank 0 serves a TCPStore on a free port
    of its host, the others learn host and port from it over torchloom's world communicator."""
    import torchloom
    if not torchloom.is_initialized():
        torchloom.init()
    world = torchloom.world_comm()
    server = None
    address = torch.zeros(258, dtype=torch.uint8)  # port (2 bytes) and host name (up to 256 bytes)
    if world.rank == 0:
        host = socket.gethostname()
        server = _dist.TCPStore(host, 0, world.size, True, timeout=timeout, wait_for_workers=False)
        encoded = host.encode()[:256]
        address[0], address[1] = server.port >> 8, server.port & 0xFF
        address[2:2 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    world.broadcast(address, src=0)
    if server is not None:
        return server, world.rank, world.size
    port = int(address[0]) << 8 | int(address[1])
    host = bytes(address[2:][address[2:].nonzero().flatten()].tolist()).decode()
    if host == socket.gethostname():
        host = "127.0.0.1"  # the server listens on every interface; on rank 0's host, loopback reaches it
    return _dist.TCPStore(host, port, world.size, False, timeout=timeout), world.rank, world.size


def _env_rendezvous_or_mpi(torch_env_handler):
    """env://, answered by torchloom under an MPI launch, by torch's own handler otherwise."""
    def handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs):
        if not _launched_without_env_rendezvous():
            yield from torch_env_handler(url, timeout=timeout, **kwargs)
            return
        yield _mpi_store(timeout)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")
    handler.torchloom_mpi = True
    return handler


def _serve_env_rendezvous_under_mpi() -> None:
    # torch's register_rendezvous_handler refuses a scheme twice, and env:// is the default
    # init_method: torchloom's handler takes env:// over, deferring to torch's unless MPI launched
    # the job without env://'s variables.
    import importlib
    # (The module: torch.distributed's attribute of that name is its rendezvous() function.)
    handlers = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers or getattr(handlers["env"], "torchloom_mpi", False):
        return
    handlers["env"] = _env_rendezvous_or_mpi(handlers["env"])


def is_registered() -> bool:
    """True when torch.distributed knows the "loom" backend."""
    return _dist.is_available() and BACKEND_NAME in _dist.Backend.backend_list


def _register() -> None:
    if not _dist.is_available() or is_registered():
        return
    _dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
    _serve_env_rendezvous_under_mpi()


_register()

__all__ = ["BACKEND_NAME", "is_registered"]
