"""torchloom.ZeroRedundancyOptimizer (CTest runs this file under mpirun -np 2 and -np 4) against
PyTorch's own: DistributedDataParallel over Gloo with torch.distributed.optim.ZeroRedundancyOptimizer,
started inside the same processes, on the same model, data and optimizer, with gradient
accumulation and clipping; memory against the ZeRO formulas; refusals."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import torchloom

STEPS = 8
MICRO = 2
MAX_NORM = 0.5


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 29), nn.Tanh(), nn.Linear(29, 4))


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)


def train(step_fn, zero_grad, model, no_sync, rank, clip):
    norms = []
    for step in range(STEPS):
        zero_grad()
        for micro in range(MICRO):
            x, y = batch(step, micro, rank)
            ctx = no_sync() if micro < MICRO - 1 else torch.enable_grad()
            with ctx:
                (((model(x) - y) ** 2).mean() / MICRO).backward()
        norms.append(float(clip()))
        step_fn()
    return norms


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_equals_torch_ddp_with_torch_zero(loom, gloo, stage, overlap):
    """overlap: the parameter all-gathers run past step(), each submodule's forward pre-hook waits
    for its own parameters."""
    rank = loom.world_comm().rank
    ref_model = make_model()
    ddp = nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = TorchZero(ref_model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    ref_norms = train(ref_opt.step, ref_opt.zero_grad, ddp, ddp.no_sync, rank,
                      lambda: nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM))

    model = make_model()
    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                             bucket_cap_mb=0.0005, lr=0.01, weight_decay=0.01,
                                             overlap_param_gather=overlap, module=model if overlap else None)
    buckets = len(zero.optim.param_groups[0]["params"])
    assert buckets > 2  # several buckets, shards cut parameters
    norms = train(zero.step, zero.zero_grad, model, zero.no_sync, rank, lambda: zero.clip_grad_norm_(MAX_NORM))
    if overlap and loom.world_comm().size > 1:
        assert zero._zero.unwaited_buckets() == buckets, "step() returned with every all-gather running"
        model[0](batch(0, 0, rank)[0])  # the first layer's pre-hook waits for its parameters only
        assert 0 < zero._zero.unwaited_buckets() < buckets
        zero.wait_parameters()
    assert zero._zero.unwaited_buckets() == 0
    for a, b in zip(ref_norms, norms):
        assert b == pytest.approx(a, rel=1e-5)
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"stage {stage}: parameter {name}")
    assert zero.stats()["steps"] == STEPS


def memory_after_two_adam_steps(stage, dtype, bucket_cap_mb):
    """A 256-512-256 MLP's parameters in dtype after two Adam steps of ZeRO at stage: (memory, count)."""
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(dtype)
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    zero = torchloom.ZeroRedundancyOptimizer(params, torch.optim.Adam, stage=stage, bucket_cap_mb=bucket_cap_mb, lr=1e-3)
    x = torch.randn(4, 256).to(dtype)
    for _ in range(2):
        zero.zero_grad()
        h = torch.relu(torch.nn.functional.linear(x, params[0], params[1]))
        torch.nn.functional.linear(h, params[2], params[3]).square().mean().backward()
        zero.step()
    return zero.memory(), sum(p.numel() for p in params)


def test_memory_matches_the_formulas(loom):
    n = loom.world_comm().size
    for stage, grads in ((1, 4.0), (2, 4.0 / n)):
        m, count = memory_after_two_adam_steps(stage, torch.float32, 0.25)
        assert m["parameters"] == pytest.approx(4.0 * count, rel=0.05)
        assert m["gradients"] == pytest.approx(grads * count, rel=0.05), stage
        assert m["optimizer_state"] == pytest.approx(8.0 * count / n, rel=0.05), stage


SMALL_LR = 2e-4  # below half a bf16 ulp of most weights: only fp32 masters keep the updates


def bf16_model():
    return make_model().to(torch.bfloat16)


def test_bf16_master_weights_and_scaler_equal_fp32_masters_kept_beside_torch_ddp(loom, gloo):
    """bf16 parameters: torchloom's ZeRO (stage 2, fp32 master shards, torchloom.GradScaler) against
    PyTorch's DDP over Gloo on the bf16 model with fp32 masters of every parameter kept by hand and
    torch.amp.GradScaler unscaling them. A step overflows on rank 1 alone: both skip it everywhere.
    Exact at 2 ranks; at 4, Gloo and MPI add the bf16 gradients in other orders."""
    comm = loom.world_comm()
    rank, n = comm.rank, comm.size
    steps = 10

    def overflow(model, step, loss):
        return loss + model[4].bias.sum() * float("inf") if (step == 7 and rank == 1) else loss

    ref_model = bf16_model()
    ddp = nn.parallel.DistributedDataParallel(ref_model)
    masters = [p.detach().float() for p in ref_model.parameters()]
    ref_opt = torch.optim.Adam(masters, lr=SMALL_LR)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    for step in range(steps):
        ddp.zero_grad()
        x, y = batch(step, 0, rank)
        loss = ((ddp(x.bfloat16()) - y.bfloat16()) ** 2).mean()
        ref_scaler.scale(overflow(ref_model, step, loss)).backward()
        for m, p in zip(masters, ref_model.parameters()):
            m.grad = p.grad.float()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()):
                p.copy_(m)

    model = bf16_model()
    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, bucket_cap_mb=0.0005,
                                             lr=SMALL_LR)
    assert all(t.dtype == torch.float32 for t in zero.optim.param_groups[0]["params"]), "fp32 master shards"
    scaler = torchloom.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    for step in range(steps):
        zero.zero_grad()
        x, y = batch(step, 0, rank)
        loss = ((model(x.bfloat16()) - y.bfloat16()) ** 2).mean()
        scaler.scale(overflow(model, step, loss)).backward()
        scaler.unscale_(zero)
        assert all(g.dtype == torch.float32 for g in zero.shard_gradients())
        scaler.step(zero)
        scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == (128.0 if n > 1 else 256.0)
    moved = max((a - b).abs().max().item() for a, b in zip(ref_model.parameters(), bf16_model().parameters()))
    assert moved > 1e-3
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0 if n <= 2 else 1e-2, msg=f"parameter {name}")


def test_bf16_memory_with_masters_matches_the_mixed_precision_formulas(loom):
    """bf16 parameters, fp32 masters and Adam: stage 1 4 + 12/N, stage 2 2 + 14/N bytes per parameter."""
    n = loom.world_comm().size
    for stage, formula in ((1, 4 + 12 / n), (2, 2 + 14 / n)):
        m, count = memory_after_two_adam_steps(stage, torch.bfloat16, 0.125)
        assert m["master_weights"] == pytest.approx(4.0 * count / n, rel=0.05), stage
        assert sum(m.values()) == pytest.approx(formula * count, rel=0.05), (stage, m)


def test_refusals_name_what_was_expected(loom):
    model = make_model()
    with pytest.raises(torchloom.InvalidArgumentError, match="expected an element-wise optimizer class.*found LBFGS"):
        torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)
    with pytest.raises(torchloom.InvalidArgumentError, match="one parameter group"):
        torchloom.ZeroRedundancyOptimizer([{"params": list(model.parameters())}], torch.optim.SGD, lr=0.1)
    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(torchloom.InvalidArgumentError, match="no synchronised backward since the last step"):
        zero.step()
    with pytest.raises(torchloom.InvalidArgumentError, match="overlap_param_gather needs module="):
        torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, overlap_param_gather=True)


# ---- Checkpoints: the plain optimizer's format, any DP size, to and from a plain optimizer -------

MICRO_PER_STEP = 4  # one global step: 4 micro-batches split over the DP ranks


def shared_dir(comm):
    """A fresh directory every rank of comm names alike (rank 0's, broadcast)."""
    import tempfile
    name = torch.zeros(256, dtype=torch.uint8)
    if comm.rank == 0:
        encoded = tempfile.mkdtemp(prefix="zero_ckpt_").encode()
        name[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    comm.broadcast(name, src=0)
    return bytes(name[name.nonzero().flatten()].tolist()).decode()


def global_steps(model, group, zero_grad, step, no_sync, first, last, dtype=torch.float32):
    """Global steps first..last-1, each of MICRO_PER_STEP micro-batches split over group's ranks."""
    mine = MICRO_PER_STEP // group.size
    for s in range(first, last):
        zero_grad()
        for k in range(mine):
            x, y = batch(s, 0, group.rank * mine + k)
            with no_sync() if k + 1 < mine else torch.enable_grad():
                (((model(x.to(dtype)) - y.to(dtype)) ** 2).mean() / mine).backward()
        step()


def zero_over(model, group, stage, **kwargs):
    return torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, stage=stage,
                                             bucket_cap_mb=0.0005, lr=0.01, weight_decay=0.01, **kwargs)


def zero_steps(model, zero, group, first, last, dtype=torch.float32):
    global_steps(model, group, zero.zero_grad, zero.step, zero.no_sync, first, last, dtype)


def half_group(comm):
    if comm.size == 1:
        return comm
    return comm.split(0 if comm.rank < comm.size // 2 else -1, comm.rank, "half")


def fresh(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 29), nn.Tanh(), nn.Linear(29, 4)).to(dtype)


def test_checkpoint_resumes_at_another_dp_size_and_converts_to_and_from_a_plain_optimizer(loom):
    """Saved by stage 2 over N ranks at step 5, loaded by stage 1 over N/2 ranks; loaded by a plain
    AdamW beside torchloom's DDP; and a plain AdamW's checkpoint loaded by ZeRO: each trained to step
    10 equals the 10 uninterrupted steps (1e-6)."""
    comm = loom.world_comm()
    want = fresh(3)
    zero = zero_over(want, comm, 2)
    zero_steps(want, zero, comm, 0, 10)

    from_zero, from_plain = shared_dir(comm), shared_dir(comm)
    model = fresh(3)
    zero = zero_over(model, comm, 2)
    zero_steps(model, zero, comm, 0, 5)
    torchloom.Checkpointer(comm, from_zero, async_=False).model(model).optimizer(zero).save(
        torchloom.TrainingProgress(step=5))

    plain_model = fresh(3)
    ddp = torchloom.DistributedDataParallel(plain_model, process_group=comm)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01, weight_decay=0.01)
    global_steps(ddp, comm, plain.zero_grad, plain.step, ddp.no_sync, 0, 5)
    torchloom.Checkpointer(comm, from_plain, async_=False).model(plain_model).optimizer(plain).save(
        torchloom.TrainingProgress(step=5))

    def check(model, what):
        for (name, a), b in zip(want.named_parameters(), model.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"{what}: parameter {name}")

    group = half_group(comm)
    if group is not None:
        model = fresh(99)  # other weights: everything comes from the checkpoint
        zero = zero_over(model, group, 1)
        assert torchloom.Checkpointer(group, from_zero).model(model).optimizer(zero).load_latest() is not None
        zero_steps(model, zero, group, 5, 10)
        check(model, f"ZeRO stage 1 at DP {group.size} from stage 2 at DP {comm.size}")

    model = fresh(99)
    ddp = torchloom.DistributedDataParallel(model, process_group=comm)
    plain = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    assert torchloom.Checkpointer(comm, from_zero).model(model).optimizer(plain).load_latest() is not None
    global_steps(ddp, comm, plain.zero_grad, plain.step, ddp.no_sync, 5, 10)
    check(model, "plain AdamW from a ZeRO checkpoint")

    model = fresh(99)
    zero = zero_over(model, comm, 2)
    assert torchloom.Checkpointer(comm, from_plain).model(model).optimizer(zero).load_latest() is not None
    zero_steps(model, zero, comm, 5, 10)
    check(model, "ZeRO from a plain AdamW checkpoint")


def test_checkpoint_keeps_the_fp32_master_weights_of_bf16_parameters(loom):
    """bf16 parameters: the masters are saved, so stage 1 resumed from stage 2's checkpoint equals the
    uninterrupted run exactly; a failed load (wrong optimizer class) changes nothing."""
    comm = loom.world_comm()
    want = fresh(3, torch.bfloat16)
    zero = zero_over(want, comm, 2)
    zero_steps(want, zero, comm, 0, 10, torch.bfloat16)

    directory = shared_dir(comm)
    model = fresh(3, torch.bfloat16)
    zero = zero_over(model, comm, 2)
    zero_steps(model, zero, comm, 0, 5, torch.bfloat16)
    torchloom.Checkpointer(comm, directory, async_=False).model(model).optimizer(zero).save(
        torchloom.TrainingProgress(step=5))
    manifest = json.load(open(os.path.join(directory, "step_000005", "manifest.json")))
    assert any(name.startswith("master/") for name in manifest["tensors"]), "master weights saved (C++'s names)"

    model = fresh(99, torch.bfloat16)
    wrong = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=1, bucket_cap_mb=0.0005, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torchloom.CheckpointError, match="the live one is SGD"):
        torchloom.Checkpointer(comm, directory).model(model).optimizer(wrong).load_latest()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b), "a failed load changed the model"

    model = fresh(99, torch.bfloat16)
    zero = zero_over(model, comm, 1)
    assert torchloom.Checkpointer(comm, directory).model(model).optimizer(zero).load_latest() is not None
    zero_steps(model, zero, comm, 5, 10, torch.bfloat16)
    for (name, a), b in zip(want.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"bf16 with masters resumed: parameter {name}")


def test_checkpoint_of_shards_that_stepped_differently_is_refused_on_every_rank_at_once(loom):
    """Rank 1's first shard lost its state: the ranks agree on the keys first and every rank refuses
    at once (without the agreement they would wait on each other until the group's timeout)."""
    import time
    comm = loom.world_comm()
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = fresh(3)
    zero = zero_over(model, comm, 2)
    zero_steps(model, zero, comm, 0, 2)
    if comm.rank == 1:
        del zero.optim.state[zero.optim.param_groups[0]["params"][0]]
    started = time.monotonic()
    with pytest.raises(torchloom.CheckpointError, match="differs between ranks"):
        torchloom.Checkpointer(comm, shared_dir(comm), async_=False).model(model).optimizer(zero).save(
            torchloom.TrainingProgress(step=2)).wait()
    assert time.monotonic() - started < 10, "refused at once, not after the group's timeout"



def shorten_by_one_row(step_dir, name):
    """Rewrites the shard holding tensor `name` with that tensor one row short, and the manifest
    to match (shape, the shard's size and checksum), resealed as a tool would: every check of the
    file's integrity passes, and what is left is a tensor that does not fit its parameter."""
    import xxhash
    from safetensors import safe_open
    from safetensors.torch import save_file

    from manifest_seal import reseal
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    shard = manifest["shards"][manifest["tensors"][name]["slices"][0]["shard"]]
    path = os.path.join(step_dir, shard["file"])
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, path, metadata=metadata)
    with open(path, "rb") as f:
        data = f.read()

    def change(m):
        m["tensors"][name]["shape"][0] -= 1
        for s in m["shards"]:
            if s["file"] == shard["file"]:
                s["bytes"], s["xxh3_64"] = len(data), xxhash.xxh3_64_hexdigest(data)
    reseal(os.path.join(step_dir, "manifest.json"), change)


def test_checkpoint_with_a_master_weight_one_row_short_is_refused_changing_nothing(loom):
    """A ZeRO stage-2 checkpoint of bf16 parameters whose fp32 master of one parameter is one row
    short (shard and manifest rewritten and resealed): refused with CheckpointError on every rank
    before anything changes. It once replaced the model, the masters and the optimizer state and
    then failed copying the short master (a RuntimeError)."""
    comm = loom.world_comm()
    directory = shared_dir(comm)
    model = fresh(3, torch.bfloat16)
    zero = zero_over(model, comm, 2)
    zero_steps(model, zero, comm, 0, 2, torch.bfloat16)
    torchloom.Checkpointer(comm, directory, async_=False).model(model).optimizer(zero).save(
        torchloom.TrainingProgress(step=2))
    step_dir = os.path.join(directory, "step_000002")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        victim = sorted(k for k in json.load(f)["tensors"] if k.startswith("master/") and k.endswith("0.weight"))[0]
    comm.barrier().wait()  # every rank read the manifest before rank 0 rewrites it
    if comm.rank == 0:
        shorten_by_one_row(step_dir, victim)
    comm.barrier().wait()

    live = fresh(99, torch.bfloat16)
    live_zero = zero_over(live, comm, 2)
    zero_steps(live, live_zero, comm, 0, 1, torch.bfloat16)  # optimizer state and masters of its own

    def state():
        shards = live_zero.optim.param_groups[0]["params"]
        return ([p.detach().clone() for p in live.parameters()] + [s.detach().clone() for s in shards] +
                [v.clone() for s in shards for v in live_zero.optim.state[s].values() if torch.is_tensor(v)])
    before = state()
    with pytest.raises(torchloom.CheckpointError, match=f"master weights {victim} "):
        torchloom.Checkpointer(comm, directory).model(live).optimizer(live_zero).load_latest()
    after = state()
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"a refused load changed state tensor {i}"
