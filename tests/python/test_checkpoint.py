"""Python checkpoints in one process (CTest runs it under mpirun -np 1): a run resumed from a
checkpoint continues exactly as the uninterrupted run (model, any torch.optim optimizer with lazy
state, an LR scheduler, the GradScaler); a load that fails changes nothing; an edited manifest is
refused. The manifest is resealed by manifest_seal (the `xxhash` package), independently of the
C++ writer."""
import copy
import os
import re

import pytest
import torch
import torch.nn as nn

import torchloom
from manifest_seal import reseal


def make(optimizer_kind, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    if optimizer_kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True)
    elif optimizer_kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    else:
        opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, centered=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    scaler = torchloom.GradScaler(init_scale=256.0, growth_interval=2)
    return model, opt, sched, scaler


def steps(model, opt, sched, scaler, first, last):
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd", "rmsprop"])
def test_resumed_run_equals_uninterrupted_run(directory, optimizer_kind):
    comm = torchloom.world_comm()
    model, opt, sched, scaler = make(optimizer_kind, 1)
    ckpt = torchloom.Checkpointer(comm, directory)
    ckpt.model(model).optimizer(opt).object("lr_scheduler", sched).scaler(scaler)
    steps(model, opt, sched, scaler, 1, 4)
    handle = ckpt.save(torchloom.TrainingProgress(step=4))
    steps(model, opt, sched, scaler, 5, 8)  # training goes on while the save writes
    assert handle.wait().progress.step == 4
    assert handle.done()
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt, fresh_sched, fresh_scaler = make(optimizer_kind, 2)  # other weights, no optimizer state
    assert not fresh_opt.state
    resume = torchloom.Checkpointer(comm, directory)
    resume.model(fresh).optimizer(fresh_opt).object("lr_scheduler", fresh_sched).scaler(fresh_scaler)
    info = resume.load_latest()
    assert info.progress.step == 4
    assert fresh_sched.last_epoch == 4
    steps(fresh, fresh_opt, fresh_sched, fresh_scaler, 5, 8)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, uninterrupted[k]), k
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_scaler.get_scale() == scaler.get_scale()


def test_refused_load_changes_nothing(directory):
    """The issue's reproduction: a tensor and a GradScaler saved, growth_factor 0.5 written into the
    (resealed) manifest: CheckpointError, and neither the tensor nor the scaler changed."""
    comm = torchloom.world_comm()
    weights = torch.arange(6.0)
    scaler = torchloom.GradScaler(init_scale=64.0)
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.tensor("weights", weights).scaler(scaler)
    ckpt.save(torchloom.TrainingProgress(step=1))
    weights.mul_(-1)
    scaler.update(8.0)
    path = torchloom.Checkpointer.find_latest(directory)
    reseal(os.path.join(path, "manifest.json"), lambda m: m["state"]["scaler"].update(growth_factor=0.5))
    with pytest.raises(torchloom.CheckpointError, match="growth_factor must be > 1.0"):
        ckpt.load(path)
    assert torch.equal(weights, -torch.arange(6.0))
    assert scaler.get_scale() == 8.0


def test_edited_manifest_is_refused(directory):
    comm = torchloom.world_comm()
    model, opt, sched, scaler = make("adamw", 3)
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.model(model).optimizer(opt).object("lr_scheduler", sched)
    steps(model, opt, sched, scaler, 1, 2)
    ckpt.save(torchloom.TrainingProgress(step=2))
    path = torchloom.Checkpointer.find_latest(directory)
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        text = f.read()
    with open(manifest_path, "w") as f:
        f.write(text.replace('"last_epoch": 2', '"last_epoch": 9'))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(torchloom.CheckpointError, match="was changed after it was written"):
        ckpt.load(path)
    assert sched.last_epoch == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_optimizer_of_another_kind_or_groups_is_refused_before_anything_changes(directory):
    comm = torchloom.world_comm()
    model, opt, sched, scaler = make("adamw", 4)
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.model(model).optimizer(opt)
    steps(model, opt, sched, scaler, 1, 2)
    ckpt.save(torchloom.TrainingProgress(step=2))
    other, other_opt, _, _ = make("sgd", 5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    loader = torchloom.Checkpointer(comm, directory)
    loader.model(other).optimizer(other_opt)
    with pytest.raises(torchloom.CheckpointError, match="the checkpoint's optimizer is AdamW; the live one is SGD"):
        loader.load_latest()
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not other_opt.state


def _everything(model, opt, sched, scaler):
    """Every value a load may change, deep-copied: model, optimizer (state and groups), scheduler,
    scaler."""
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "scale": scaler.get_scale()}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _forge_optimizer_state_tensor(m):
    """One parameter's exp_avg renamed: its state lacks a tensor AdamW keeps (the load used to fail
    on such state after the model had changed)."""
    name = sorted(k for k in m["tensors"] if k.startswith("optim/") and k.endswith("/exp_avg"))[0]
    m["tensors"][name[:-len("exp_avg")] + "exp_avgs"] = m["tensors"].pop(name)


@pytest.mark.parametrize("forgery, message", [
    # Hyper-parameters torch.optim's load_state_dict would take as they are.
    (lambda m: m["state"]["optimizer"]["param_groups"][0]["options"].update(lr=-1.0),
     "the saved options are not valid for AdamW: Invalid learning rate"),
    (lambda m: m["state"]["optimizer"]["param_groups"][0]["options"].update(betas="x"),
     "the saved options are not valid for AdamW"),
    # One the constructor takes but float32 parameters cannot: the first step after it would fail.
    (lambda m: m["state"]["optimizer"]["param_groups"][0]["options"].update(weight_decay=1e308),
     "option 'weight_decay' is 1e+308, which the parameters' dtype torch.float32 cannot hold"),
    # A tensor the checkpoint does not hold (the load used to fail on it after the model changed).
    (_forge_optimizer_state_tensor, "lacks exp_avg, which AdamW with these options keeps for every parameter"),
    # A scheduler value of the wrong kind.
    (lambda m: m["state"]["objects"]["lr_scheduler"].update(last_epoch="x"), "OneCycleLR state 'last_epoch' is 'x'"),
])
def test_forged_object_state_is_refused_before_anything_changes(directory, forgery, message):
    comm = torchloom.world_comm()
    model, opt, sched, scaler = make("adamw", 6)
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.model(model).optimizer(opt).object("lr_scheduler", sched).scaler(scaler)
    steps(model, opt, sched, scaler, 1, 2)
    ckpt.save(torchloom.TrainingProgress(step=2))
    steps(model, opt, sched, scaler, 3, 3)  # the live state moves on: a partial load would show
    path = torchloom.Checkpointer.find_latest(directory)
    reseal(os.path.join(path, "manifest.json"), forgery)
    before = copy.deepcopy(_everything(model, opt, sched, scaler))
    with pytest.raises(torchloom.CheckpointError, match=re.escape(message)):
        ckpt.load(path)
    assert _same(_everything(model, opt, sched, scaler), before)


def test_rng_tracker_streams_and_the_default_generator_round_trip(directory):
    """Checkpointer.rng(): the tracker's streams and torch's default generator are restored, so the
    random numbers drawn after the load are the ones drawn after the save; a load inside the
    tracker's fork() is refused and changes nothing."""
    comm = torchloom.world_comm()
    tracker = torchloom.tensor_parallel.rng_tracker()  # the process's CPU tracker
    tracker.reset()
    tracker.add("model-parallel", 123)
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.tensor("weights", torch.zeros(4)).rng(tracker)
    torch.manual_seed(7)
    with tracker.fork():
        torch.rand(3)  # the stream moves on before the save
    ckpt.save(torchloom.TrainingProgress(step=1))
    with tracker.fork():
        expected_stream = torch.rand(5)
    expected_default = torch.rand(5)

    tracker.reset()  # other streams and another default generator state
    tracker.add("model-parallel", 999)
    torch.manual_seed(99)
    with tracker.fork():
        before = {k: v.clone() for k, v in tracker.get_states().items()}
        default_before = torch.get_rng_state()
        with pytest.raises(torchloom.CheckpointError, match="an RNG tracker cannot take the saved streams now"):
            ckpt.load_latest()
        assert torch.equal(torch.get_rng_state(), default_before)
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in before.items())
    ckpt.load_latest()
    with tracker.fork():
        assert torch.equal(torch.rand(5), expected_stream)
    assert torch.equal(torch.rand(5), expected_default)
    tracker.reset()


def test_state_of_any_object_round_trips_with_tensors_tuples_and_non_finite_floats(directory):
    class Sampler:
        def __init__(self):
            self.position, self.order, self.extra = 0, torch.arange(4), (1, float("inf"), {3: "x"})

        def state_dict(self):
            return {"position": self.position, "order": self.order, "extra": self.extra}

        def load_state_dict(self, state):
            if state["position"] < 0:
                raise ValueError("negative position")
            self.position, self.order, self.extra = state["position"], state["order"].clone(), state["extra"]

    comm = torchloom.world_comm()
    sampler = Sampler()
    sampler.position, sampler.order = 17, torch.tensor([3, 1, 0, 2])
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.object("sampler", sampler)
    ckpt.save(torchloom.TrainingProgress(step=5))
    restored = Sampler()
    loader = torchloom.Checkpointer(comm, directory)
    loader.object("sampler", restored)
    loader.load_latest()
    assert restored.position == 17 and torch.equal(restored.order, torch.tensor([3, 1, 0, 2]))
    assert restored.extra == (1, float("inf"), {3: "x"})
    # A state the object refuses (checked on a deep copy first): nothing changed.
    sampler.position = -1
    ckpt.save(torchloom.TrainingProgress(step=6))
    with pytest.raises(torchloom.CheckpointError, match="negative position"):
        loader.load_latest()
    assert restored.position == 17


def test_state_that_cannot_be_saved_is_a_checkpoint_error_through_the_agreement(directory):
    """An object whose state holds something unsavable: CheckpointError from save() (raised through
    the save's agreement, as every rank would see it), nothing published."""
    class Opaque:
        def state_dict(self):
            return {"handle": object()}

        def load_state_dict(self, state):
            pass

    comm = torchloom.world_comm()
    ckpt = torchloom.Checkpointer(comm, directory, async_=False)
    ckpt.object("opaque", Opaque())
    with pytest.raises(torchloom.CheckpointError, match="cannot save objects/opaque/handle of type object"):
        ckpt.save(torchloom.TrainingProgress(step=1))
    assert torchloom.Checkpointer.find_latest(directory) is None
