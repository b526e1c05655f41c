"""torchloom.ZeroRedundancyOptimizer (CTest runs this file under mpirun -np 2 and -np 4) against
PyTorch's own: DistributedDataParallel over Gloo with torch.distributed.optim.ZeroRedundancyOptimizer,
started inside the same processes, on the same model, data and optimizer, with gradient
accumulation and clipping; memory against the ZeRO formulas; refusals."""
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


@pytest.mark.parametrize("stage", [1, 2])
def test_equals_torch_ddp_with_torch_zero(loom, gloo, stage):
    rank = loom.world_comm().rank
    ref_model = make_model()
    ddp = nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = TorchZero(ref_model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    ref_norms = train(ref_opt.step, ref_opt.zero_grad, ddp, ddp.no_sync, rank,
                      lambda: nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM))

    model = make_model()
    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                             bucket_cap_mb=0.0005, lr=0.01, weight_decay=0.01)
    assert len(zero.optim.param_groups[0]["params"]) > 2  # several buckets, shards cut parameters
    norms = train(zero.step, zero.zero_grad, model, zero.no_sync, rank, lambda: zero.clip_grad_norm_(MAX_NORM))
    for a, b in zip(ref_norms, norms):
        assert b == pytest.approx(a, rel=1e-5)
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"stage {stage}: parameter {name}")
    assert zero.stats()["steps"] == STEPS


def test_memory_matches_the_formulas(loom):
    n = loom.world_comm().size
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    count = sum(p.numel() for p in model.parameters())
    for stage, grads in ((1, 4.0), (2, 4.0 / n)):
        params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        zero = torchloom.ZeroRedundancyOptimizer(params, torch.optim.Adam, stage=stage, bucket_cap_mb=0.25, lr=1e-3)
        x = torch.randn(4, 256)
        for _ in range(2):
            zero.zero_grad()
            h = torch.relu(torch.nn.functional.linear(x, params[0], params[1]))
            torch.nn.functional.linear(h, params[2], params[3]).square().mean().backward()
            zero.step()
        m = zero.memory()
        assert m["parameters"] == pytest.approx(4.0 * count, rel=0.05)
        assert m["gradients"] == pytest.approx(grads * count, rel=0.05), stage
        assert m["optimizer_state"] == pytest.approx(8.0 * count / n, rel=0.05), stage


def test_refusals_name_what_was_expected(loom):
    model = make_model()
    with pytest.raises(torchloom.InvalidArgumentError, match="expected an element-wise optimizer class.*found LBFGS"):
        torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)
    with pytest.raises(torchloom.InvalidArgumentError, match="one parameter group"):
        torchloom.ZeroRedundancyOptimizer([{"params": list(model.parameters())}], torch.optim.SGD, lr=0.1)
    zero = torchloom.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(torchloom.InvalidArgumentError, match="no synchronised backward since the last step"):
        zero.step()
