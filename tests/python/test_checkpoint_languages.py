"""A checkpoint saved from C++ loads in Python and one saved from Python loads in C++, state for
state: parameters and buffers, the optimizer (its state tensors, steps and options; plain and
torchloom.ZeroRedundancyOptimizer), the GradScaler and the RNG tracker's stream with the default
generator. tests/python/training_state_tool.cpp is the C++ side: it trains or loads the same model
and prints the state as JSON, which this side prints alike and compares exactly. CTest runs it under
mpirun -np 1."""
import json
import os
import subprocess

import pytest
import torch
from torch import nn

import torchloom

TOOL = os.environ.get("LOOM_TRAINING_STATE_TOOL", "")

# The tool's optimizers, with the same non-default options.
OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, dampening=0),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01),
}


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def tool(*args):
    assert TOOL, "LOOM_TRAINING_STATE_TOOL names the C++ side"
    out = subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def values(t):
    return [float(v) for v in t.detach().double().reshape(-1)]


def state_json(model, opt, scaler, tracker, names=None):
    """The tool's JSON of the live state (names: parameter -> name, for a ZeRO optimizer's view)."""
    out = {"model": {k: values(v) for k, v in model.state_dict().items()}}
    by_param = {id(p): n for n, p in model.named_parameters()}
    for p, per_param in opt.state.items():
        name = by_param[id(p)]
        for key, value in per_param.items():
            if key == "step":
                out.setdefault("steps", {})[name] = int(value)
            elif torch.is_tensor(value):
                out.setdefault("optim", {}).setdefault(name, {})[key] = values(value)
    out["lr"] = opt.param_groups[0]["lr"]
    out["scale"] = scaler.get_scale()
    out["growth_tracker"] = scaler._get_growth_tracker()
    with tracker.fork():
        out["stream_rand"] = values(torch.rand(3))
    out["rand"] = values(torch.rand(3))
    return out


def live_state(kind, seed, stream_seed, optimizer=None):
    model = make_model(seed)
    opt = (optimizer or OPTIMIZERS[kind])(model.parameters())
    scaler = torchloom.GradScaler(init_scale=1024.0, growth_interval=5)
    tracker = torchloom.tensor_parallel.rng_tracker()
    tracker.reset()
    tracker.add("model-parallel", stream_seed)
    return model, opt, scaler, tracker


def checkpointer(directory, model, opt, scaler, tracker):
    ckpt = torchloom.Checkpointer(torchloom.world_comm(), directory, async_=False)
    return ckpt.model(model).optimizer(opt).scaler(scaler).rng(tracker)


def train_and_save(directory, model, opt, scaler, tracker, step=None):
    """The tool's three steps (its data), then the learning rate changes, the stream moves on and the
    state is saved as step 3."""
    x = torch.arange(24, dtype=torch.float32).view(6, 4).sin()
    y = torch.arange(18, dtype=torch.float32).view(6, 3).cos()
    for _ in range(3):
        (step or opt).zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    opt.param_groups[0]["lr"] = 0.007  # as a scheduler would: the options saved are not the constructor's
    with tracker.fork():
        torch.rand(2)
    checkpointer(directory, model, opt, scaler, tracker).save(torchloom.TrainingProgress(step=3))


def assert_same_state(found, expected):
    assert found.keys() == expected.keys()
    for key in expected:
        assert found[key] == expected[key], f"{key} differs:\n  found    {found[key]}\n  expected {expected[key]}"


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_cpp_checkpoint_loads_in_python_state_for_state(directory, kind):
    saved = tool("save", directory, kind)
    model, opt, scaler, tracker = live_state(kind, 77, 999)
    info = checkpointer(directory, model, opt, scaler, tracker).load_latest()
    assert info.progress.step == 3
    assert_same_state(state_json(model, opt, scaler, tracker), saved)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_python_checkpoint_loads_in_cpp_state_for_state(directory, kind):
    model, opt, scaler, tracker = live_state(kind, 0, 123)
    train_and_save(directory, model, opt, scaler, tracker)
    with open(os.path.join(directory, "step_000003", "manifest.json")) as f:
        manifest = json.load(f)
    # C++'s names, whichever language saved it.
    assert "model/0.weight" in manifest["tensors"] and "model/1.running_mean" in manifest["tensors"]
    assert manifest["state"]["optimizer"]["type"] == type(opt).__name__
    assert not any(name.startswith("extra/") for name in manifest["tensors"])
    expected = state_json(model, opt, scaler, tracker)
    assert_same_state(tool("load", directory, kind), expected)


def test_a_zero_checkpoint_loads_in_cpp_and_a_cpp_one_into_zero(directory, tmp_path):
    """torchloom.ZeroRedundancyOptimizer saves in the plain optimizer's format: C++'s Adam loads it
    as Python's plain Adam does; and a C++ checkpoint loaded into ZeRO and saved again is the C++ state."""
    zero_adam = lambda p: torchloom.ZeroRedundancyOptimizer(  # noqa: E731
        p, torch.optim.Adam, stage=1, bucket_cap_mb=0.0001, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01, amsgrad=True)
    model, zero, scaler, tracker = live_state("adam", 0, 123, zero_adam)
    train_and_save(directory, model, zero, scaler, tracker)
    plain = live_state("adam", 5, 5)
    checkpointer(directory, *plain).load_latest()
    assert_same_state(tool("load", directory, "adam"), state_json(*plain))

    from_cpp, again = str(tmp_path / "from_cpp"), str(tmp_path / "again")
    saved = tool("save", from_cpp, "adam")
    model, zero, scaler, tracker = live_state("adam", 77, 999, zero_adam)
    checkpointer(from_cpp, model, zero, scaler, tracker).load_latest()
    checkpointer(again, model, zero, scaler, tracker).save(torchloom.TrainingProgress(step=3))
    plain = live_state("adam", 5, 5)
    checkpointer(again, *plain).load_latest()
    found = state_json(*plain)
    # The RNG draws come from the state saved again (after the first load), which is the C++ one.
    assert_same_state(found, saved)


def test_a_checkpoint_from_before_python_took_cpp_names_still_loads(directory):
    """tests/fixtures/checkpoints/python-before-cpp-names: the model as extra/model.<name>, the
    optimizer as the object torch.optim/optimizer (its step as a tensor), saved by the earlier Python
    checkpointer after this file's train_and_save; it loads into today's, state for state."""
    import shutil
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoints", "python-before-cpp-names")
    shutil.copytree(os.path.join(fixture, "step_000003"), os.path.join(directory, "step_000003"))
    with open(os.path.join(fixture, "state.json")) as f:
        expected = json.load(f)
    model, opt, scaler, tracker = live_state("adam", 77, 999)
    assert checkpointer(directory, model, opt, scaler, tracker).load_latest().progress.step == 3
    assert_same_state(state_json(model, opt, scaler, tracker), expected)


def test_cpp_refuses_an_option_it_does_not_have_rather_than_dropping_it(directory):
    model, opt, scaler, tracker = live_state("adam", 0, 123, lambda p: torch.optim.Adam(
        p, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01, amsgrad=True, maximize=True))
    train_and_save(directory, model, opt, scaler, tracker)
    out = subprocess.run([TOOL, "load", directory, "adam"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert 'option "maximize" is true, which LibTorch\'s Adam does not have' in out.stderr, out.stderr
