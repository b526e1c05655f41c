# pytest configuration for torchloom's Python tests: run with PYTHONPATH=<build>/python (CTest sets it).
import os
import sys

import pytest


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


@pytest.fixture(scope="session")
def tcp_init_method(loom):
    """A function giving torch.distributed an init_method under mpirun, where no launcher sets
    MASTER_ADDR/MASTER_PORT: rank 0 finds a free port and torchloom broadcasts it. A collective:
    every rank calls it. One port per call (a group torn down leaves its port in TIME_WAIT)."""
    import socket
    import torch

    def make():
        comm = loom.world_comm()
        port = torch.zeros(1, dtype=torch.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, src=0)
        return f"tcp://127.0.0.1:{int(port)}"

    return make
