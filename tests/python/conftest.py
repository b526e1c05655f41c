# pytest configuration for torchloom's Python tests: run with PYTHONPATH=<build>/python (CTest sets it).
#
# Multi-rank files run one pytest per rank under mpirun (or torchrun), every rank walking the same
# tests in the same order: a test that fails on some ranks only leaves the others inside a
# collective of that test while it goes on to the next one, and the job hangs until CTest's timeout
# with nothing said. So a failure on any rank of a multi-rank job ends the job there, printing the
# failure first (see pytest_runtest_makereport), and CTest passes -o faulthandler_timeout so a test
# that hangs anyway prints every thread's stack.
import datetime
import os
import sys

import pytest

# tests/time_scale.py (wall-clock bounds scaled to the machine) for the tests of this directory.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)  # as LOOM_TIMEOUT in CTest: torch's default is 30 minutes


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: needs torchloom.init() (run under mpirun by CTest)")


@pytest.fixture(scope="session")
def loom():
    """torchloom, initialised once per process (finalized at the end of the session)."""
    import torch
    import torchloom
    torch.set_num_threads(1)
    torchloom.init()
    yield torchloom
    torchloom.finalize()


@pytest.fixture()
def directory(loom, tmp_path):
    """A fresh checkpoint directory, removed after the test."""
    import shutil
    path = str(tmp_path / "ckpt")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tcp_store(loom):
    """A function giving torch.distributed a store under mpirun, where no launcher sets
    MASTER_ADDR/MASTER_PORT: rank 0 serves a TCPStore on a port the kernel picks (no window in
    which another process can take it) and torchloom broadcasts the port. A collective: every rank
    calls it. Use: dist.init_process_group(backend, store=tcp_store(), rank=..., world_size=...)
    (with timeout=RENDEZVOUS_TIMEOUT for Gloo, whose operations otherwise wait 30 minutes)."""
    import torch
    import torch.distributed as dist

    def make():
        comm = loom.world_comm()
        port = torch.zeros(1, dtype=torch.int64)
        server = None
        if comm.rank == 0:
            server = dist.TCPStore("127.0.0.1", 0, comm.size, True, timeout=RENDEZVOUS_TIMEOUT,
                                   wait_for_workers=False)
            port[0] = server.port
        comm.broadcast(port, src=0)
        if server is not None:
            return server
        return dist.TCPStore("127.0.0.1", int(port), comm.size, False, timeout=RENDEZVOUS_TIMEOUT)

    return make


@pytest.fixture(scope="module")
def gloo(loom, tcp_store):
    """torch.distributed (Gloo) over the same processes, for the module's tests."""
    import torch.distributed as dist
    comm = loom.world_comm()
    dist.init_process_group("gloo", store=tcp_store(), rank=comm.rank, world_size=comm.size,
                            timeout=RENDEZVOUS_TIMEOUT)
    yield
    dist.destroy_process_group()


def _world_size():
    for name in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def _rank():
    for name in ("OMPI_COMM_WORLD_RANK", "RANK", "PMI_RANK"):
        if os.environ.get(name):
            return os.environ[name]
    return "?"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A multi-rank test that failed on this rank: print why and end the job (non-zero), since the
    other ranks may be waiting in one of this test's collectives that this rank will never join."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _world_size() > 1:
        sys.stdout.flush()
        sys.stderr.write(f"\n==== rank {_rank()}: {item.nodeid} failed ({report.when}); the ranks are no "
                         f"longer in step, ending the job ====\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)
