"""Multi-rank tests (CTest runs this file under mpirun -np 2 and -np 4): torchloom's data
parallelism against PyTorch's DistributedDataParallel (Gloo, started inside the same processes)
step for step and against one process on the whole batch; tensor-parallel layers against the
plain torch layers; collectives and groups; GradScaler agreement across ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchloom
from conftest import RENDEZVOUS_TIMEOUT
from time_scale import time_scale

STEPS = 6
MICRO = 2
BATCH = 4  # per micro-batch and rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 6 * 6, 10)
        self.aux = nn.Linear(8 * 6 * 6, 10)  # used on some steps only

    def forward(self, x, use_aux):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def uses_aux(step, rank):
    return step != 4 and (step + rank) % 2 == 0  # step 4: unused on every rank


def batch(step, micro, rank, shape=(3, 8, 8), out=10):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, *shape, generator=g), torch.randn(BATCH, out, generator=g)


def make_net(rank):
    torch.manual_seed(0)
    model = Net()
    model.conv.bias.requires_grad_(False)  # frozen
    with torch.no_grad():
        model.conv.bias.add_(rank)  # differs per rank before wrapping: both DDPs broadcast rank 0's
    return model


def test_ddp_equals_torch_ddp_step_for_step(loom, gloo):
    comm = loom.world_comm()
    rank = comm.rank
    ref_model, our_model = make_net(rank), make_net(rank)
    ref = nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True)
    ours = torchloom.DistributedDataParallel(our_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)
    our_opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)
    assert torch.equal(our_model.conv.bias, ref_model.conv.bias)  # frozen parameter broadcast from rank 0
    for step in range(STEPS):
        for ddp, opt in ((ref, ref_opt), (ours, our_opt)):
            opt.zero_grad(set_to_none=True)
            for micro in range(MICRO):
                x, y = batch(step, micro, rank)
                if micro < MICRO - 1:
                    with ddp.no_sync():
                        (((ddp(x, uses_aux(step, rank)) - y) ** 2).mean() / MICRO).backward()
                else:
                    (((ddp(x, uses_aux(step, rank)) - y) ** 2).mean() / MICRO).backward()
            opt.step()
        for (name, a), (_, b) in zip(ref_model.named_parameters(), our_model.named_parameters()):
            assert (a.grad is None) == (b.grad is None), (step, name)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step} parameter {name}")
        for (name, a), (_, b) in zip(ref_model.named_buffers(), our_model.named_buffers()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step} buffer {name}")
    stats = ours.stats()
    assert stats["synchronized_iterations"] == STEPS and stats["iterations"] == STEPS * MICRO


@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True},
                                     {"find_unused_parameters": True, "static_graph": True}],
                         ids=["defaults", "bucket_views", "static_graph"])
def test_ddp_equals_one_process_on_the_whole_batch(loom, options):
    comm = loom.world_comm()
    n, rank = comm.size, comm.rank

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    ours, whole = torchloom.DistributedDataParallel(mlp(), bucket_cap_mb=0.0002, **options), mlp()
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    whole_opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        our_opt.zero_grad()
        whole_opt.zero_grad()
        for micro in range(MICRO):
            shards = [batch(step, micro, r, shape=(5,), out=3) for r in range(n)]
            x, y = shards[rank]
            ctx = ours.no_sync() if micro < MICRO - 1 else torch.enable_grad()
            with ctx:
                (((ours(x) - y) ** 2).mean() / MICRO).backward()
            X, Y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
            (((whole(X) - Y) ** 2).mean() / MICRO).backward()
        our_opt.step()
        whole_opt.step()
        for (name, a), b in zip(whole.named_parameters(), ours.module.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step} parameter {name}")
    # the options reached the reducer
    storages = {p.grad.untyped_storage().data_ptr() for p in ours.module.parameters()}
    buckets = len(ours.bucket_layout())
    assert buckets > 1  # a cap given applies to the first bucket too, as in torch's DDP
    expected = buckets if options.get("gradient_as_bucket_view", False) else len(list(ours.module.parameters()))
    assert len(storages) == expected, storages  # views into a bucket share its storage
    agreements = ours.stats()["used_set_agreements"]
    assert agreements == (1 if options.get("static_graph") else 0), agreements


def test_ddp_comm_hooks(loom):
    comm = loom.world_comm()

    def run(hook):
        torch.manual_seed(2)
        model = nn.Linear(4, 4)
        ddp = torchloom.DistributedDataParallel(model)
        calls = []
        if hook == "python":
            def average(state, bucket):  # torchloom's collectives: returns a Work
                calls.append((bucket.index(), bucket.is_last(), [tuple(p.shape) for p in bucket.parameters()],
                              [tuple(g.shape) for g in bucket.gradients()]))
                bucket.buffer().div_(bucket.divisor)
                return bucket.group.all_reduce(bucket.buffer(), async_op=True)
            ddp.register_comm_hook(None, average)
        elif hook == "future":
            def average_now(state, bucket):  # torch's signature: a Future of the averaged buffer
                assert state == "state"
                calls.append(bucket.index())
                bucket.group.all_reduce(bucket.buffer())  # blocks
                future = torch.futures.Future()
                future.set_result([bucket.buffer() / bucket.divisor])  # a new tensor: copied into the bucket
                return future
            ddp.register_comm_hook("state", average_now)
        elif hook is not None:
            ddp.register_comm_hook(None, hook)
        x = torch.full((2, 4), float(comm.rank + 1))
        ddp(x).sum().backward()
        return model.weight.grad.clone(), calls

    plain, _ = run(None)
    python, calls = run("python")
    # one bucket, the last, holding the weight and the bias, their gradients shaped as they are
    [(index, last, parameter_shapes, gradient_shapes)] = calls  # one bucket: weight and bias
    assert index == 0 and last and sorted(parameter_shapes) == [(4,), (4, 4)], calls
    assert gradient_shapes == parameter_shapes, calls
    torch.testing.assert_close(python, plain)
    later, calls = run("future")
    assert calls == [0], calls
    torch.testing.assert_close(later, plain)
    for builtin in (torchloom.comm_hooks.fp16_compress_hook, torchloom.comm_hooks.bf16_compress_hook):
        g, _ = run(builtin)
        torch.testing.assert_close(g, plain, rtol=1e-2, atol=1e-2)
    with pytest.raises(torchloom.InvalidArgumentError, match="register_comm_hook"):
        torchloom.DistributedDataParallel(nn.Linear(1, 1)).register_comm_hook(None, 3)


def test_ddp_hook_future_never_completed_is_a_timeout_naming_the_bucket(loom):
    """A torch-style hook whose future nobody completes: backward raises torchloom.TimeoutError after
    the group's timeout (2 s here) on every rank, naming the bucket, instead of waiting forever."""
    comm = loom.world_comm()
    group = comm.split(0, comm.rank, "short", group_timeout=2)
    assert group.default_timeout == pytest.approx(2.0)
    model = nn.Linear(4, 4)
    ddp = torchloom.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(torchloom.TimeoutError, match=r"bucket 0: the hook's future was not completed within 2 s"):
        ddp(torch.ones(2, 4)).sum().backward()
    comm.barrier()


def test_ddp_takes_torchs_arguments(loom):
    """torch.nn.parallel.DistributedDataParallel's arguments, in its order and with its defaults;
    what torchloom does not do is refused by name."""
    comm = loom.world_comm()
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    # torch's positional order: module, device_ids, output_device, dim, broadcast_buffers, init_sync, process_group
    # (a sub-group, not the world: a process_group argument read from the wrong position would
    # fall back to the world and pass unnoticed)
    sub = comm.split(0, comm.rank, "ddp-positional")
    ddp = torchloom.DistributedDataParallel(model, None, None, 0, True, True, sub)
    assert ddp.process_group is sub
    ddp(torch.ones(2, 3)).sum().backward()
    assert model.weight.grad.untyped_storage().data_ptr() != model.bias.grad.untyped_storage().data_ptr()  # copies
    assert torchloom.DistributedDataParallel(nn.Linear(3, 2), group=comm).process_group is comm  # the older name
    refusals = [
        ({"device_ids": [0]}, rf"\[rank {comm.rank}\] DistributedDataParallel: device_ids must be None for a "
                              "module on the CPU"),
        ({"output_device": "cuda:0"}, "output_device cuda:0 is not the module's device cpu"),
        ({"dim": 1}, "dim must be 0"),
        ({"mixed_precision": object()}, "mixed_precision is not supported"),
        ({"device_mesh": object()}, "device_mesh is not supported"),
        ({"process_group": comm, "group": comm}, "process_group or group"),
        ({"process_group": "world"}, "process_group must be a torchloom.Communicator.*found str"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(torchloom.InvalidArgumentError, match=message):
            torchloom.DistributedDataParallel(nn.Linear(3, 2), **kwargs)
    with pytest.raises(torchloom.InvalidArgumentError, match="join: uneven inputs are not supported"):
        with ddp.join():
            pass
    from torch.distributed.algorithms import Join
    with pytest.raises(torchloom.InvalidArgumentError, match="uneven inputs"):
        with Join([ddp]):
            pass


def test_ddp_errors_name_parameters(loom):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ddp = torchloom.DistributedDataParallel(model)
    model[1].weight.requires_grad_(False)
    with pytest.raises(torchloom.InvalidArgumentError, match=r"parameter 1\.weight was frozen after construction"):
        ddp(torch.ones(1, 2))
    comm = loom.world_comm()
    different = nn.Linear(2, 3 if comm.rank == comm.size - 1 else 2)
    with pytest.raises(torchloom.MismatchError, match=r"weight"):
        torchloom.DistributedDataParallel(different)


def test_collectives_and_groups(loom):
    comm = loom.world_comm()
    n, r = comm.size, comm.rank
    t = torch.full((3,), float(r))
    comm.all_reduce(t, torchloom.ReduceOp.SUM).wait()
    assert t.tolist() == [float(sum(range(n)))] * 3
    out = torch.empty(n * 2)
    comm.all_gather(out, torch.full((2,), float(r))).wait()
    assert out.tolist() == [float(i) for i in range(n) for _ in range(2)]
    outs = [torch.empty(2) for _ in range(n)]
    comm.all_gather(outs, torch.full((2,), float(r))).wait()
    assert [o[0].item() for o in outs] == [float(i) for i in range(n)]
    rs = torch.empty(1)
    comm.reduce_scatter(rs, torch.arange(n, dtype=torch.float32)).wait()
    assert rs.item() == float(r * n)
    works = [comm.all_reduce(torch.ones(1000)) for _ in range(8)]
    for w in works:
        w.wait()
        assert w.is_completed()
    sub = comm.split(r % 2, r, f"parity{r % 2}")
    assert sub.size == (n + 1 - r % 2) // 2 and sub.name == f"parity{r % 2}"
    x = torch.ones(1)
    sub.all_reduce(x).wait()
    assert x.item() == sub.size
    if n >= 2:
        ps = torchloom.ParallelState(comm, tensor_parallel=2)
        assert ps.tp_degree == 2 and ps.dp_degree == n // 2 and ps.tp_group.size == 2
        groups = torchloom.make_parallel_groups(comm, 2)
        assert groups.tp_rank == r % 2 and groups.dp_rank == r // 2


def test_parallel_layout_groups_hold_the_ranks_agreeing_elsewhere(loom):
    # Every dimension's communicator holds exactly the ranks whose coordinates agree on the other
    # dimensions, counted here in Python from itertools.product (dp outermost, tp innermost).
    import itertools
    comm = loom.world_comm()
    n, r = comm.size, comm.rank
    for tp, pp in [(t, p) for t in (1, 2) for p in (1, 2) if n % (t * p) == 0]:
        ps = torchloom.ParallelState(comm, tensor_parallel=tp, pipeline_parallel=pp)
        dp = n // (tp * pp)
        assert str(ps.layout) == f"dp={dp},pp={pp},tp={tp}"
        coords = list(itertools.product(range(dp), range(pp), range(tp)))  # position -> (dp, pp, tp)
        mine = coords[r]
        assert (ps.dp_rank, ps.pp_rank, ps.tp_rank) == mine
        for axis, name, group in [(0, "dp", ps.dp_group), (1, "pp", ps.pp_group), (2, "tp", ps.tp_group)]:
            members = [q for q, c in enumerate(coords) if all(c[i] == mine[i] for i in range(3) if i != axis)]
            x = torch.tensor([float(r)])
            group.all_reduce(x).wait()
            assert group.size == len(members) and x.item() == float(sum(members)), (name, tp, pp)
            assert ps.groups.group(name).size == len(members)
            assert ps.layout.group(r, [name]) == members
    with pytest.raises(torchloom.InvalidArgumentError, match="the pp size 3"):
        torchloom.ParallelLayout.standard(4, 1, 3)
    layout = torchloom.ParallelLayout([("dp", n)])
    groups = torchloom.make_parallel_groups(comm, layout)
    assert groups.group("dp").size == n and groups.group("pp").size == 1 and groups.position == r


def test_tensor_parallel_layers_equal_plain_layers(loom):
    comm = loom.world_comm()
    tp = comm.size if comm.size <= 2 else 2
    ps = torchloom.ParallelState(comm, tensor_parallel=tp)
    group = ps.tp_group
    torch.manual_seed(5)
    col = torchloom.ColumnParallelLinear(6, 8, group, init="master")
    row = torchloom.RowParallelLinear(8, 6, group, init="master")
    emb = torchloom.VocabParallelEmbedding(16, 6, group, init="master")
    out = torchloom.ColumnParallelLinear(6, 16, group, bias=False, init="master")
    torch.manual_seed(5)
    p_col, p_row, p_emb, p_out = nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(16, 6), nn.Linear(6, 16, bias=False)
    ids = torch.randint(0, 16, (5,), generator=torch.Generator().manual_seed(9))
    target = torch.randint(0, 16, (5,), generator=torch.Generator().manual_seed(10))
    target[1] = -100

    def forward(e, c, r, o, ce):
        h = r(torch.nn.functional.gelu(c(e(ids))))
        return ce(o(h))

    loss = forward(emb, col, row, out, lambda z: torchloom.vocab_parallel_cross_entropy(z, target, group,
                                                                                       label_smoothing=0.1))
    ref = forward(p_emb, p_col, p_row, p_out, lambda z: torch.nn.functional.cross_entropy(z, target,
                                                                                         label_smoothing=0.1))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    t, k = ps.tp_rank, tp
    sl = lambda w, dim: w.chunk(k, dim)[t]  # noqa: E731
    torch.testing.assert_close(col.weight.grad, sl(p_col.weight.grad, 0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(col.bias.grad, sl(p_col.bias.grad, 0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row.weight.grad, sl(p_row.weight.grad, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row.bias.grad, p_row.bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(emb.weight.grad, sl(p_emb.weight.grad, 0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.weight.grad, sl(p_out.weight.grad, 0), rtol=1e-5, atol=1e-6)
    assert col.shard_info()["weight"]["global_shape"] == [8, 6]
    # the RNG tracker: per-TP-rank stream inside fork, default stream identical everywhere
    ps.seed(1234)
    tracker = torchloom.tensor_parallel.rng_tracker()
    with tracker.fork():
        inside = torch.rand(4)
    outside = torch.rand(4)
    both = torch.empty(2 * comm.size, 4)
    comm.all_gather(both, torch.stack([inside, outside])).wait()
    both = both.view(comm.size, 2, 4)
    for r in range(comm.size):
        assert torch.equal(both[r, 1], outside)
        if r != comm.rank and r // tp == comm.rank // tp:
            assert not torch.equal(both[r, 0], inside)
    ps.seed(1234)  # the device-independent fork: on the CPU, the CPU tracker's stream
    with torchloom.tensor_parallel.fork():
        assert torch.equal(torch.rand(4), inside)


def test_gradscaler_agrees_across_ranks(loom):
    comm = loom.world_comm()
    scaler = torchloom.GradScaler(init_scale=64.0, sync_groups=[comm])
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    if comm.rank == comm.size - 1:
        model.weight.grad[0, 0] = float("inf")  # on one rank only: every rank skips
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.get_scale() == 32.0
    assert torch.equal(model.weight, before)


def test_blocking_calls_release_the_gil(loom):
    """While rank 0 waits in a collective that rank 1 joins late, another Python thread of rank 0 runs."""
    import threading
    import time
    comm = loom.world_comm()
    comm.barrier().wait()
    if comm.rank != 0:
        time.sleep(1.0)
        comm.all_reduce(torch.ones(1)).wait()
        comm.barrier().wait()
        return
    samples = []
    stop = threading.Event()

    def sample():  # a time stamp about every 5 ms, whenever this thread gets the GIL
        while not stop.is_set():
            samples.append(time.monotonic())
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    time.sleep(0.05)
    start = time.monotonic()
    comm.all_reduce(torch.ones(1)).wait()     # about 1 s, waiting for rank 1
    end = time.monotonic()
    stop.set()
    t.join()
    comm.barrier().wait()
    during = [x for x in samples if start + 0.05 < x < end - 0.05]
    assert end - start > 0.5, end - start
    # (A share of the ticks the sampler would get alone: less where the cores are busy.)
    assert len(during) > 0.3 / time_scale() * (end - start - 0.1) / 0.005, (len(during), end - start, time_scale())


def test_checkpoint_round_trip(loom):
    import os
    import shutil
    comm = loom.world_comm()
    token = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    comm.broadcast(token, src=0)
    directory = f"/tmp/torchloom-pytest-ckpt-{int(token)}"
    try:
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        scaler = torchloom.GradScaler(init_scale=128.0, growth_interval=5)
        extra = torch.arange(5.0)
        ckpt = torchloom.Checkpointer(comm, directory, keep_last=2)
        ckpt.model(model).scaler(scaler).tensor("extra", extra)
        assert ckpt.load_latest() is None  # nothing saved yet: start fresh
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(torchloom.TrainingProgress(step=3, epoch=1, sample=40), {"note": "python"})
        info = ckpt.wait()
        assert info.path.endswith("step_000003") or "3" in os.path.basename(info.path), info.path
        assert torchloom.Checkpointer.find_latest(directory) == info.path
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            model[1].running_mean.fill_(7)
        extra.zero_()
        scaler.update(8.0)
        loaded = ckpt.load_latest()
        assert loaded.progress.step == 3 and loaded.progress.epoch == 1 and loaded.progress.sample == 40
        assert loaded.user["note"] == "python"
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
        assert torch.equal(extra, torch.arange(5.0))
        assert scaler.get_scale() == 128.0
        with pytest.raises(torchloom.CheckpointError):
            ckpt.load(os.path.join(directory, "step_999999"))
    finally:
        comm.barrier().wait()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def test_collectives_block_unless_async_op(loom):
    """As torch.distributed: the call returns once the tensor holds the result; async_op=True hands
    back a Work to wait on instead."""
    comm = loom.world_comm()
    n = comm.size
    big = torch.full((1 << 22,), float(comm.rank + 1))  # 16 MiB: not done by the time a call returns on its own
    work = comm.all_reduce(big)
    assert work.is_completed()
    assert torch.equal(big, torch.full_like(big, n * (n + 1) / 2))
    pending = comm.all_reduce(big, async_op=True)
    pending.wait()
    assert torch.equal(big, torch.full_like(big, n * n * (n + 1) / 2))
    out = torch.empty(n * 4)
    comm.all_gather(out, torch.full((4,), float(comm.rank)))
    assert torch.equal(out, torch.arange(n).repeat_interleave(4).float())
    assert comm.barrier().is_completed()


def test_peers_are_global_ranks_in_a_sub_group(loom):
    """src and dst name global ranks, as torch.distributed's do; group_src/group_dst name ranks of
    the group. The group is ordered backwards (group rank = n - 1 - global rank), so reading one as
    the other would pick another rank (or wait for one that never sends)."""
    comm = loom.world_comm()
    n, me = comm.size, comm.rank
    backwards = comm.split(0, -me, "backwards")
    assert backwards.members == list(reversed(range(n)))
    t = torch.full((4,), float(me))
    backwards.broadcast(t, src=0)  # global rank 0 (group rank n - 1)
    assert torch.equal(t, torch.zeros(4))
    t = torch.full((4,), float(me))
    backwards.broadcast(t, group_src=0)  # group rank 0 = global rank n - 1
    assert torch.equal(t, torch.full((4,), float(n - 1)))
    # A ring over global ranks: each sends its rank to global rank me + 1 and receives from me - 1.
    right, left = (me + 1) % n, (me - 1) % n
    got = torch.empty(2)
    receive = backwards.recv(got, left, timeout=30, async_op=True)
    backwards.send(torch.full((2,), float(me)), right, timeout=30)
    receive.wait()
    assert torch.equal(got, torch.full((2,), float(left)))
    # The mistakes are named, before anything is sent.
    with pytest.raises(torchloom.InvalidArgumentError, match="give src .* or group_src .*not both"):
        backwards.broadcast(t, src=0, group_src=0)
    with pytest.raises(torchloom.InvalidArgumentError, match="found neither"):
        backwards.broadcast(t)
    if n > 1:
        half = comm.split(me % 2, me, f"parity{me % 2}")
        outsider = (me + 1) % n  # the other parity: not in this rank's group
        with pytest.raises(torchloom.InvalidArgumentError, match=f"dst={outsider} is a global rank that is not in "
                                                                 "this group"):
            half.send(torch.ones(1), outsider)
    t = torch.full((4,), float(me))
    with pytest.warns(DeprecationWarning, match=r"root=\) is a rank of this group"):
        backwards.broadcast(t, root=0)
    assert torch.equal(t, torch.full((4,), float(n - 1)))


def test_group_dropped_while_its_operation_runs(loom):
    """A group whose last Python reference goes while its operation is still in flight: its C++
    destructor waits for the progress thread, which, finishing the operation, drops the last
    reference to a tensor whose Python object then needs the GIL. The destructor must not hold the
    GIL while it waits (seen: both threads waiting for each other forever, at the end of a test whose
    sub-groups went out of scope)."""
    import time
    comm = loom.world_comm()
    for i in range(3):
        sub = comm.split(0, comm.rank, f"short-lived-{i}")
        if comm.rank == comm.size - 1:
            time.sleep(0.3)  # the peers' all-reduce is still running when they drop the group
        sub.all_reduce(torch.ones(1 << 10), async_op=True)  # neither the tensor nor the Work is kept
        del sub
    comm.barrier()
