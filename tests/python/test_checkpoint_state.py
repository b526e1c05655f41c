"""A user's own checkpoint state from Python, on the same seam as C++'s (torchloom.checkpoint.
StateProvider): a Python provider for a data loader's position, written to the schema of the docs'
C++ example (examples/data_position.h: section "data", tensor "data/order"). What Python saves loads
into the C++ provider and what C++ saves loads into the Python one (tests/python/data_position_tool.cpp
is the C++ side), each resumed loader handing out exactly what an uninterrupted one does; a refusal
in the Python provider's plan changes nothing. CTest runs it under mpirun -np 1."""
import json
import os
import subprocess

import pytest
import torch

import torchloom
from torchloom.checkpoint import StateProvider, need_for

TOOL = os.environ.get("LOOM_DATA_POSITION_TOOL", "")


class ShuffledOrder:
    """examples/data_position.h's loader: sample indices in an order reshuffled each epoch."""

    def __init__(self, samples, seed):
        self.samples, self.seed, self.epoch, self.position = samples, seed, 0, 0
        self._shuffle()

    def _shuffle(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.order = torch.randperm(self.samples, generator=generator)

    def next(self):
        if self.position == self.samples:
            self.epoch, self.position = self.epoch + 1, 0
            self._shuffle()
        value = int(self.order[self.position])
        self.position += 1
        return value

    def take(self, n):
        return [self.next() for _ in range(n)]


class DataPosition(StateProvider):
    """The loader's position: seed, epoch, position and sample count as section "data", the
    epoch's order as the tensor "data/order". Nothing live changes before apply."""

    def __init__(self, loader):
        super().__init__()
        self.loader = loader
        self.saved = None

    def collect(self, rank, out):
        l = self.loader
        out.set_section("data", json.dumps({"seed": l.seed, "epoch": l.epoch, "position": l.position,
                                            "samples": l.samples}))
        out.add_tensor("data/order", l.order)

    def plan(self, context, needs, problems):
        text = context.section("data")
        if not text:
            problems.append('the checkpoint holds no data position (section "data")')
            return
        saved = json.loads(text)
        if saved["samples"] != self.loader.samples:
            problems.append(f"data position: saved over {saved['samples']} samples; the loader has {self.loader.samples}")
            return
        record = context.record("data/order")
        if record is None:
            problems.append("data position: the checkpoint holds no data/order")
            return
        mismatch = need_for(context.live.find("data/order"), record, needs)
        if mismatch:
            problems.append("data position: " + mismatch)
        self.saved = saved

    def verify(self, context, data, problems):
        if not torch.equal(data["data/order"].sort().values, torch.arange(self.loader.samples)):
            problems.append(f"data position: data/order is not a permutation of the {self.loader.samples} samples")

    def apply(self, context, data):
        l, s = self.loader, self.saved
        l.seed, l.epoch, l.position = s["seed"], s["epoch"], s["position"]
        l.order.copy_(data["data/order"])


def uninterrupted(after, n):
    loader = ShuffledOrder(10, 5)
    loader.take(after)
    return loader.take(n)


def test_python_saved_data_position_loads_into_the_cpp_provider(directory):
    assert TOOL, "LOOM_DATA_POSITION_TOOL names the C++ side"
    loader = ShuffledOrder(10, 5)
    loader.take(13)
    ckpt = torchloom.Checkpointer(torchloom.world_comm(), directory, async_=False)
    ckpt.state("data", DataPosition(loader))
    ckpt.save(torchloom.TrainingProgress(step=13))
    with open(os.path.join(directory, "step_000013", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["state"]["data"] == {"seed": 5, "epoch": 1, "position": 3, "samples": 10}
    assert "data/order" in manifest["tensors"]
    out = subprocess.run([TOOL, "load", directory, "15"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    epoch, position, *rest = [int(v) for v in out.stdout.split()]
    assert (epoch, position) == (1, 3)
    assert rest == uninterrupted(13, 15)


def test_cpp_saved_data_position_loads_into_the_python_provider(directory):
    assert TOOL, "LOOM_DATA_POSITION_TOOL names the C++ side"
    out = subprocess.run([TOOL, "save", directory], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loader = ShuffledOrder(10, 99)
    loader.take(4)
    ckpt = torchloom.Checkpointer(torchloom.world_comm(), directory)
    ckpt.state("data", DataPosition(loader))
    info = ckpt.load_latest()
    assert info.progress.step == 13
    assert (loader.seed, loader.epoch, loader.position) == (5, 1, 3)
    assert loader.take(15) == uninterrupted(13, 15)


def test_a_python_provider_refusal_changes_nothing(directory):
    loader = ShuffledOrder(10, 5)
    loader.take(4)
    ckpt = torchloom.Checkpointer(torchloom.world_comm(), directory, async_=False)
    ckpt.state("data", DataPosition(loader))
    ckpt.save(torchloom.TrainingProgress(step=4))
    other = ShuffledOrder(12, 5)
    other.take(7)
    order = other.order.clone()
    reader = torchloom.Checkpointer(torchloom.world_comm(), directory)
    reader.state("data", DataPosition(other))
    with pytest.raises(torchloom.CheckpointError, match="saved over 10 samples; the loader has 12"):
        reader.load_latest()
    assert other.position == 7 and torch.equal(other.order, order)
