"""torchloom.PipelineExecutor over torch.nn.Module stages, against one process on the whole model
and against torch.distributed.pipelining (Gloo) on the same stages: losses and every gradient to
1e-6, for GPipe, 1F1B and interleaved 1F1B."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchloom

HIDDEN = 8


def blocks(layers, seed, linear=nn.Linear):
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Sequential(linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(layers)])


def data(micro_batches, seed):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(3, HIDDEN, generator=g) for _ in range(micro_batches)],
            [torch.randn(3, HIDDEN, generator=g) for _ in range(micro_batches)])


def reference_grads(model, inputs, targets):
    for x, y in zip(inputs, targets):
        out = x
        for b in model:
            out = b(out)
        (nn.functional.mse_loss(out, y) / len(inputs)).backward()
    return [p.grad.clone() for p in model.parameters()]


def stages_of(model, ranks, virtual, rank):
    """This rank's stages (stage v * ranks + rank) as nn.Sequential, sharing the model's layers."""
    out = []
    for v in range(virtual):
        first, end = torchloom.stage_layers(len(model), ranks * virtual, v * ranks + rank)
        out.append((v * ranks + rank, nn.Sequential(*model[first:end]), range(first, end)))
    return out


CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 1, 1), ("interleaved", None, 2), ("zero-bubble", 8, 1)]


class DeferrableLinear(nn.Linear):
    """nn.Linear through torchloom.pipeline_linear: a zero-bubble plan computes its weight gradient
    in its own W step."""

    def forward(self, x):
        return torchloom.pipeline_linear(x, self.weight, self.bias)


@pytest.mark.parametrize("schedule,micro_batches,virtual", CASES)
def test_executor_equals_one_process(loom, schedule, micro_batches, virtual):
    comm = loom.world_comm()
    ranks, rank = comm.size, comm.rank
    m = micro_batches or 2 * ranks
    layers = 2 * ranks * virtual + 1
    # Zero-bubble: the stages' linears defer their weight gradients to the plan's W steps.
    model = blocks(layers, 3, DeferrableLinear if schedule == "zero-bubble" else nn.Linear)
    reference = blocks(layers, 3)
    inputs, targets = data(m, 4)
    expected = reference_grads(reference, inputs, targets)
    mine = stages_of(model, ranks, virtual, rank)
    pipeline = torchloom.PipelineExecutor(comm, [stage for _, stage, _ in mine], schedule=schedule, micro_batches=m)
    losses = pipeline.step(inputs if pipeline.holds_first_stage else [],
                           (lambda out, k: nn.functional.mse_loss(out, targets[k]) / m)
                           if pipeline.holds_last_stage else None)
    if pipeline.holds_last_stage:
        assert len(losses) == m
    params = list(model.parameters())
    for _, _, layer_range in mine:
        for i in layer_range:
            for j in (2 * i, 2 * i + 1):  # weight, bias of layer i
                torch.testing.assert_close(params[j].grad, expected[j], rtol=0, atol=1e-6)
    assert 0 <= pipeline.last_step.bubble <= 1


@pytest.mark.parametrize("virtual", [1, 2])
def test_forward_only_equals_the_whole_model_for_inputs_of_any_shape(loom, virtual):
    comm = loom.world_comm()
    ranks, rank = comm.size, comm.rank
    layers = ranks * virtual + 1
    model, reference = blocks(layers, 7), blocks(layers, 7)
    mine = stages_of(model, ranks, virtual, rank)
    pipeline = torchloom.PipelineExecutor(comm, [stage for _, stage, _ in mine],
                                          schedule="interleaved" if virtual > 1 else "1f1b", micro_batches=ranks)
    g = torch.Generator().manual_seed(8)
    inputs = [torch.randn(1, HIDDEN, generator=g), torch.randn(4, 2, HIDDEN, generator=g)]
    outputs = pipeline.forward_only(inputs if pipeline.holds_first_stage else [])
    if not pipeline.holds_last_stage:
        assert outputs == []
        return
    with torch.no_grad():
        for x, out in zip(inputs, outputs, strict=True):
            torch.testing.assert_close(out, nn.Sequential(*reference)(x), rtol=0, atol=1e-6)
            assert not out.requires_grad


@pytest.mark.parametrize("schedule,micro_batches,virtual", [c for c in CASES if c[1] != 1 and c[0] != "zero-bubble"])
def test_executor_equals_torch_pipelining_on_the_same_stages(loom, gloo, schedule, micro_batches, virtual):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    comm = loom.world_comm()
    ranks, rank = comm.size, comm.rank
    m = micro_batches or 2 * ranks
    layers = 2 * ranks * virtual
    ours, theirs = blocks(layers, 5), blocks(layers, 5)
    inputs, targets = data(m, 6)
    mine = stages_of(ours, ranks, virtual, rank)
    pipeline = torchloom.PipelineExecutor(comm, [stage for _, stage, _ in mine], schedule=schedule, micro_batches=m)
    ours_losses = pipeline.step(inputs if pipeline.holds_first_stage else [],
                                (lambda out, k: nn.functional.mse_loss(out, targets[k]) / m)
                                if pipeline.holds_last_stage else None)

    stages = [PipelineStage(stage, index, ranks * virtual, torch.device("cpu"))
              for index, stage, _ in stages_of(theirs, ranks, virtual, rank)]
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]
    torch_schedule = kind(stages if virtual > 1 else stages[0], n_microbatches=m, loss_fn=nn.functional.mse_loss)
    losses = []
    holds_first, holds_last = rank == 0, (ranks * virtual - 1) % ranks == rank
    args = (torch.cat(inputs),) if holds_first else ()
    kwargs = {"target": torch.cat(targets), "losses": losses} if holds_last else {}
    torch_schedule.step(*args, **kwargs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        if b.grad is None:
            assert a.grad is None  # another rank's layer
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    if holds_last:
        torch.testing.assert_close(torch.stack(ours_losses) * m, torch.stack([x.detach() for x in losses]),
                                   rtol=0, atol=1e-6)


def test_unknown_schedule_is_refused(loom):
    with pytest.raises(torchloom.InvalidArgumentError, match="schedule must be 'gpipe', '1f1b', 'interleaved' or 'zero-bubble'"):
        torchloom.PipelineExecutor(loom.world_comm(), [lambda x: x], schedule="zb", micro_batches=2)


def test_scaler_skips_every_stage_when_the_last_stage_overflows(loom):
    """Only the last stage scales a loss; the others say so; found-inf is agreed over the pipeline."""
    comm = loom.world_comm()
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    model = blocks(comm.size, 7)
    stage = model[comm.rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    scaler = torchloom.GradScaler(init_scale=1024.0, sync_groups=[comm])
    pipeline = torchloom.PipelineExecutor(comm, [stage], schedule="1f1b", micro_batches=2)
    if not pipeline.holds_last_stage:
        scaler.scaled_by_another_rank("cpu")
    inputs, targets = data(2, 8)
    for overflow in (True, False):
        before = stage[0].weight.detach().clone()
        optimizer.zero_grad()
        pipeline.step(inputs if pipeline.holds_first_stage else [],
                      (lambda out, k: scaler.scale(nn.functional.mse_loss(out, targets[k]) / 2))
                      if pipeline.holds_last_stage else None)
        if overflow and pipeline.holds_last_stage:
            stage[0].weight.grad[0, 0] = float("inf")  # only the last stage's own gradients
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(before, stage[0].weight.detach()) == overflow
        assert scaler.get_scale() == 512.0
