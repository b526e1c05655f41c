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
