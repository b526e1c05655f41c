"""torchloom as a torch.distributed backend (backend="loom"), under mpirun at 2 and 4 ranks (CTest).

The reference is PyTorch's own Gloo backend in the same processes: the default group is "loom",
and a second group over every rank is new_group(backend="gloo"). Every operation is run on both
with the same inputs; DDP and FSDP2 train the same model over each; a DCP checkpoint written
through loom is read back through Gloo."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchloom
from conftest import RENDEZVOUS_TIMEOUT

STEPS = 5


@pytest.fixture(scope="module")
def groups(loom, tcp_store):
    """(loom world group, gloo group over the same ranks). Under torchrun torch's store is the
    launcher's (env://); under mpirun rank 0's free port is sent over torchloom."""
    comm = loom.world_comm()
    if loom.world().launcher == "torchrun":
        dist.init_process_group("loom")
    else:
        dist.init_process_group("loom", store=tcp_store(), rank=comm.rank, world_size=comm.size)
    gloo = dist.new_group(backend="gloo", timeout=RENDEZVOUS_TIMEOUT)
    yield dist.group.WORLD, gloo
    dist.destroy_process_group()


def rank_size():
    return dist.get_rank(), dist.get_world_size()


# ---- the backend itself ------------------------------------------------------------------------

def test_registered_and_routed_to_torchloom(groups):
    loom_pg, gloo_pg = groups
    assert torchloom.distributed.is_registered()
    assert dist.get_backend() == "loom" and dist.get_backend(gloo_pg) == "gloo"
    backend = loom_pg._get_backend(torch.device("cpu"))
    assert isinstance(backend, torchloom._C._DistBackend)
    comm = backend.host_comm
    assert (comm.rank, comm.size) == rank_size()
    assert comm.members == torchloom.world_comm().members


def test_rank_other_than_the_launchers_is_refused(groups):
    rank, size = rank_size()
    launcher = torchloom.world().launcher
    with pytest.raises(torchloom.ConfigError, match=rf"torch.distributed says rank {(rank + 1) % size} of {size}, "
                                                     rf"torchloom's launch \({launcher}\) says rank {rank} of {size}"):
        torchloom._C._make_dist_backend((rank + 1) % size, size, None, "wrong")


# ---- each operation against Gloo ---------------------------------------------------------------

def data(rank, n=6, dtype=torch.float32, salt=0):
    # Small integers: sums and products are exact whatever order either backend adds in.
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randint(-4, 5, (n,), generator=g).to(dtype)


def both(groups, fn):
    """fn(group) run on the loom group and the Gloo group; (loom result, gloo result)."""
    loom_pg, gloo_pg = groups
    return fn(loom_pg), fn(gloo_pg)


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_all_reduce(groups, op, dtype):
    rank, _ = rank_size()

    def run(pg):
        t = data(rank, dtype=dtype, salt=1)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=pg)
        return t
    a, b = both(groups, run)
    assert torch.equal(a, b) and not torch.equal(a, data(rank, dtype=dtype, salt=1))


def test_all_reduce_avg_is_sum_over_size(groups):
    rank, size = rank_size()
    loom_pg, gloo_pg = groups
    t = data(rank, salt=2)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=loom_pg)
    ref = data(rank, salt=2)
    dist.all_reduce(ref, group=gloo_pg)  # Gloo has no AVG
    torch.testing.assert_close(t, ref / size, rtol=0, atol=1e-6)


def test_all_reduce_bool_band_bor(groups):
    rank, _ = rank_size()
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR):
        def run(pg):
            t = data(rank, n=16, salt=3) > 0
            dist.all_reduce(t, op=op, group=pg)
            return t
        a, b = both(groups, run)
        assert torch.equal(a, b)


def test_broadcast_and_reduce(groups):
    rank, size = rank_size()
    for root in range(size):
        def bcast(pg):
            t = data(rank, salt=4)
            dist.broadcast(t, src=root, group=pg)
            return t
        a, b = both(groups, bcast)
        assert torch.equal(a, b) and torch.equal(a, data(root, salt=4))

        def reduce(pg):
            t = data(rank, salt=5)
            dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, group=pg)
            return t
        a, b = both(groups, reduce)
        if rank == root:
            assert torch.equal(a, b)
        else:
            assert torch.equal(a, data(rank, salt=5))  # left as it was


def test_all_gather_forms(groups):
    rank, size = rank_size()

    def listed(pg):
        out = [torch.empty(6) for _ in range(size)]
        dist.all_gather(out, data(rank, salt=6), group=pg)
        return torch.stack(out)

    def into_tensor(pg):
        out = torch.empty(size * 6)
        dist.all_gather_into_tensor(out, data(rank, salt=6), group=pg)
        return out.view(size, 6)
    a, b = both(groups, listed)
    assert torch.equal(a, b)
    a, b = both(groups, into_tensor)
    assert torch.equal(a, b) and torch.equal(a, torch.stack([data(r, salt=6) for r in range(size)]))


def test_reduce_scatter_forms(groups):
    rank, size = rank_size()

    def tensor_form(pg):
        out = torch.empty(3)
        dist.reduce_scatter_tensor(out, data(rank, n=3 * size, salt=7), group=pg)
        return out

    def list_form(pg):
        out = torch.empty(3)
        dist.reduce_scatter(out, list(data(rank, n=3 * size, salt=7).chunk(size)), group=pg)
        return out
    a, b = both(groups, tensor_form)
    expected = sum(data(r, n=3 * size, salt=7) for r in range(size)).chunk(size)[rank]
    assert torch.equal(a, b) and torch.equal(a, expected)
    loom_pg, _ = groups
    assert torch.equal(list_form(loom_pg), expected)  # Gloo has no list reduce_scatter
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, data(rank, n=3 * size, salt=7), op=dist.ReduceOp.AVG, group=loom_pg)
    torch.testing.assert_close(out, expected / size, rtol=0, atol=1e-6)


def test_all_to_all_forms(groups):
    rank, size = rank_size()

    def even(pg):
        out = torch.empty(2 * size)
        dist.all_to_all_single(out, data(rank, n=2 * size, salt=8), group=pg)
        return out

    # Uneven: rank r sends r + j + 1 rows to rank j (rows of 3).
    def uneven(pg):
        send = [rank + j + 1 for j in range(size)]
        recv = [j + rank + 1 for j in range(size)]
        inp = data(rank, n=3 * sum(send), salt=9).view(-1, 3)
        out = torch.empty(sum(recv), 3)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=pg)
        return out

    def listed(pg):
        inputs = list(data(rank, n=4 * size, salt=10).chunk(size))
        outputs = [torch.empty(4) for _ in range(size)]
        dist.all_to_all(outputs, inputs, group=pg)
        return torch.stack(outputs)
    for fn in (even, uneven, listed):
        a, b = both(groups, fn)
        assert torch.equal(a, b), fn.__name__


def test_gather_and_scatter(groups):
    rank, size = rank_size()
    root = size - 1

    def gather(pg):
        out = [torch.empty(6) for _ in range(size)] if rank == root else None
        dist.gather(data(rank, salt=11), out, dst=root, group=pg)
        return torch.stack(out) if out else None

    def scatter(pg):
        out = torch.empty(5)
        chunks = list(data(99, n=5 * size, salt=12).chunk(size)) if rank == root else None
        dist.scatter(out, chunks, src=root, group=pg)
        return out
    a, b = both(groups, gather)
    assert (a is None and b is None) or torch.equal(a, b)
    a, b = both(groups, scatter)
    assert torch.equal(a, b) and torch.equal(a, data(99, n=5 * size, salt=12).chunk(size)[rank])


def test_send_recv_ring(groups):
    rank, size = rank_size()
    loom_pg, _ = groups
    got = torch.empty(6)
    if rank % 2 == 0:
        dist.send(data(rank, salt=13), dst=(rank + 1) % size, group=loom_pg)
        dist.recv(got, src=(rank - 1) % size, group=loom_pg)
    else:
        dist.recv(got, src=(rank - 1) % size, group=loom_pg)
        dist.send(data(rank, salt=13), dst=(rank + 1) % size, group=loom_pg)
    assert torch.equal(got, data((rank - 1) % size, salt=13))
    ops = [dist.P2POp(dist.isend, data(rank, salt=14), (rank + 1) % size, group=loom_pg),
           dist.P2POp(dist.irecv, got, (rank - 1) % size, group=loom_pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, data((rank - 1) % size, salt=14))


def test_object_collectives(groups):
    rank, size = rank_size()

    def run(pg):
        gathered = [None] * size
        dist.all_gather_object(gathered, {"rank": rank, "pad": "x" * rank}, group=pg)
        objs = [f"from {rank}", rank * 10] if rank == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0, group=pg)
        one = [None]
        dist.scatter_object_list(one, [f"to {r}" for r in range(size)] if rank == 0 else None, src=0, group=pg)
        at_root = [None] * size if rank == 0 else None
        dist.gather_object(rank * rank, at_root, dst=0, group=pg)
        return gathered, objs, one, at_root
    a, b = both(groups, run)
    assert a == b
    assert a[0][size - 1] == {"rank": size - 1, "pad": "x" * (size - 1)} and a[2] == [f"to {rank}"]


def test_barrier_and_async_work(groups):
    rank, size = rank_size()
    loom_pg, _ = groups
    dist.barrier()
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and work.is_completed() and work.is_success()
    assert torch.equal(t, torch.full((1000,), float(size)))
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((3,), float(size)))
    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((3,), 2.0 * size))
    work = dist.barrier(async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=30))


def test_coalesced_calls(groups):
    """torch's _coalescing_manager hands loom one list per kind (allreduce_coalesced, and the
    all-gather and reduce-scatter into tensors): each runs as loom operations, one Work for all."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    rank, size = rank_size()
    tensors = [data(rank, n=4 + i, salt=20 + i) for i in range(3)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    for i, t in enumerate(tensors):
        assert torch.equal(t, sum(data(r, n=4 + i, salt=20 + i) for r in range(size)))
    gathered = [torch.empty(size * 3) for _ in range(2)]
    with _coalescing_manager():
        for i, out in enumerate(gathered):
            dist.all_gather_into_tensor(out, data(rank, n=3, salt=30 + i))
    for i, out in enumerate(gathered):
        assert torch.equal(out, torch.cat([data(r, n=3, salt=30 + i) for r in range(size)]))
    scattered = [torch.empty(2) for _ in range(2)]
    with _coalescing_manager():
        for i, out in enumerate(scattered):
            dist.reduce_scatter_tensor(out, data(rank, n=2 * size, salt=40 + i))
    for i, out in enumerate(scattered):
        assert torch.equal(out, sum(data(r, n=2 * size, salt=40 + i) for r in range(size)).chunk(size)[rank])


def test_unsupported_operations_name_themselves(groups):
    rank, _ = rank_size()
    t = torch.ones(4, dtype=torch.int64)
    with pytest.raises(torchloom.InvalidArgumentError, match="allreduce.*reduce op BXOR on Long is not supported"):
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    with pytest.raises(RuntimeError, match="loom does not support recvAnysource"):
        dist.recv(torch.empty(1))
    with pytest.raises(RuntimeError, match="monitored"):
        dist.monitored_barrier()
    dist.all_reduce(t)  # the group is still usable
    assert torch.equal(t, torch.full((4,), dist.get_world_size()))


# ---- groups -----------------------------------------------------------------------------------

def test_new_group_and_split_group(groups):
    rank, size = rank_size()
    members = list(range(1, size))  # every rank but 0
    sub = dist.new_group(members)
    if rank == 0:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
    else:
        assert dist.get_rank(sub) == rank - 1 and dist.get_world_size(sub) == size - 1
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        assert t.item() == sum(members)
        comm = sub._get_backend(torch.device("cpu")).host_comm
        assert comm.members == members
    # Ranks in the caller's order, not sorted.
    backwards = list(reversed(range(size)))
    rev = dist.new_group(backwards, sort_ranks=False)
    assert dist.get_rank(rev) == size - 1 - rank
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group_src=0, group=rev)  # group rank 0 is world rank size - 1
    assert t.item() == size - 1
    # split_group: two halves at once.
    half = size // 2
    halves = [list(range(half)), list(range(half, size))]
    split = dist.split_group(split_ranks=halves)
    mine = halves[0] if rank < half else halves[1]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=split)
    assert t.item() == sum(mine)
    assert split._get_backend(torch.device("cpu")).host_comm.members == mine


def test_new_group_timeout_is_the_groups(groups):
    sub = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=42))
    backend = sub._get_backend(torch.device("cpu"))
    assert backend.options._timeout == datetime.timedelta(seconds=42)
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    assert t.item() == dist.get_world_size()
    every = list(range(dist.get_world_size()))
    split = dist.split_group(split_ranks=[every], timeout=datetime.timedelta(seconds=37))
    assert split._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=37)
    # Without one: the parent's (torchloom's own, reported as torch's default).
    split = dist.split_group(split_ranks=[every])
    assert split._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(minutes=30)


# ---- PyTorch's own DDP, FSDP2 and DCP ----------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(12, 16)
        self.l2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))


def make_net(rank, perturb=True):
    torch.manual_seed(0)
    net = Net()
    if perturb:
        with torch.no_grad():
            net.l1.bias.add_(rank)  # differs per rank before wrapping: DDP broadcasts rank 0's
    return net


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)


def train(model, rank, steps=STEPS, device="cpu"):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, rank))
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_ddp_matches_gloo(groups):
    rank, size = rank_size()
    loom_pg, gloo_pg = groups
    over_loom = nn.parallel.DistributedDataParallel(make_net(rank), process_group=loom_pg, bucket_cap_mb=0.001)
    over_gloo = nn.parallel.DistributedDataParallel(make_net(rank), process_group=gloo_pg, bucket_cap_mb=0.001)
    train(over_loom, rank)
    train(over_gloo, rank)
    start = make_net(0)
    for (name, a), b, s in zip(over_loom.module.named_parameters(), over_gloo.module.parameters(), start.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
        assert not torch.equal(a, s), name  # trained
    # Identical on every rank (checked over Gloo).
    flat = torch.cat([p.detach().flatten() for p in over_loom.parameters()])
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat, group=gloo_pg)
    assert all(torch.equal(every[0], e) for e in every)


class PartlyUsed(Net):
    def forward(self, x, use_l2):
        h = torch.relu(self.l1(x))
        return self.head(torch.relu(self.l2(h)) if use_l2 else h)


@pytest.mark.parametrize("hook", [None, "fp16_compress"])
def test_ddp_unused_parameters_no_sync_and_comm_hooks_match_gloo(groups, hook):
    """DDP's other paths: find_unused_parameters (its used-map all-reduce), no_sync accumulation, and
    a communication hook that all-reduces a compressed copy through the future API."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, _ = rank_size()
    loom_pg, gloo_pg = groups
    models = {}
    for name, pg in (("loom", loom_pg), ("gloo", gloo_pg)):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(PartlyUsed(), process_group=pg, find_unused_parameters=True,
                                                  bucket_cap_mb=0.001)
        if hook == "fp16_compress":
            ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(4):
            opt.zero_grad()
            with ddp.no_sync():  # a micro-step without communication
                x, y = batch(100 + step, rank)
                nn.functional.mse_loss(ddp(x, use_l2=True), y).backward()
            x, y = batch(200 + step, rank)
            nn.functional.mse_loss(ddp(x, use_l2=(step + rank) % 2 == 0), y).backward()
            opt.step()
        models[name] = ddp.module
    # fp16 sums differ in their last bits when the two backends add four ranks in different orders.
    rtol, atol = (1e-3, 1e-5) if hook == "fp16_compress" else (1e-6, 1e-7)
    for (name, a), b in zip(models["loom"].named_parameters(), models["gloo"].parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def fsdp_model(rank, pg):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(pg, "cpu")
    model = make_net(rank, perturb=False)
    for layer in (model.l1, model.l2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"])
def test_torchs_comm_hooks_run_unchanged_in_torchloom_ddp(groups, hook):
    """torchloom.DistributedDataParallel over the loom process group, with PyTorch's shipped hooks
    (GradBucket methods, a Future from the backend's Work): the same parameters as PyTorch's DDP with
    the same hook over Gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, size = rank_size()
    loom_pg, gloo_pg = groups
    ours = torchloom.DistributedDataParallel(make_net(rank), process_group=loom_pg, bucket_cap_mb=0.001)
    reference = nn.parallel.DistributedDataParallel(make_net(rank), process_group=gloo_pg, bucket_cap_mb=0.001)
    seen = []

    def recorded(state, bucket):
        seen.append((bucket.index(), bucket.is_last()))
        return getattr(default_hooks, hook)(state, bucket)  # state None: torch's hooks use group.WORLD (loom)

    ours.register_comm_hook(None, recorded)
    reference.register_comm_hook(gloo_pg, getattr(default_hooks, hook))
    train(ours, rank)
    train(reference, rank)
    n = len(ours.bucket_layout())
    assert n > 1 and seen[:n] == [(i, i == n - 1) for i in range(n)], seen  # several buckets, each through it
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if hook == "allreduce_hook" else {"rtol": 1e-2, "atol": 1e-3}
    for (name, a), b in zip(ours.module.named_parameters(), reference.module.parameters()):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_torchloom_ddp_refuses_a_gloo_group(groups):
    _, gloo_pg = groups
    with pytest.raises(torchloom.InvalidArgumentError, match="process group of backend 'loom', found one of backend "
                                                              "'gloo'"):
        torchloom.DistributedDataParallel(make_net(0), process_group=gloo_pg)


def test_fsdp2_matches_gloo(groups):
    rank, _ = rank_size()
    loom_pg, gloo_pg = groups
    over_loom = fsdp_model(rank, loom_pg)
    over_gloo = fsdp_model(rank, gloo_pg)
    over_gloo.set_force_sum_reduction_for_comms(True)  # Gloo has no AVG; loom reduce-scatters with AVG
    train(over_loom, rank)
    train(over_gloo, rank)
    start = make_net(0, perturb=False)
    for (name, a), b, s in zip(over_loom.named_parameters(), over_gloo.parameters(), start.parameters()):
        assert a.device_mesh.get_group() is loom_pg
        full_a, full_b = a.full_tensor(), b.full_tensor()
        torch.testing.assert_close(full_a, full_b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        assert not torch.equal(full_a, s), name


def test_dcp_save_through_loom_load_through_gloo(groups, tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    rank, _ = rank_size()
    loom_pg, gloo_pg = groups
    where = [str(tmp_path_factory.mktemp("dcp")) if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    model = fsdp_model(rank, loom_pg)
    train(model, rank, steps=2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=where[0])
    # Read back through loom into a fresh sharded model, and through Gloo into one sharded over Gloo.
    for pg in (loom_pg, gloo_pg):
        fresh = fsdp_model(rank, pg)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=where[0], process_group=pg)
        fresh.load_state_dict(state["model"])
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), (name, pg)
    assert os.path.exists(os.path.join(where[0], ".metadata"))


# ---- CUDA tensors (the device communicator; skipped where ranks have no GPU of their own) ---------

def test_cuda_tensors_over_the_device_communicator(groups):
    comm = torchloom.device_comm()
    if comm is None:
        pytest.skip("no device communicator here (every rank needs a GPU of its own)")
    rank, size = rank_size()
    loom_pg, gloo_pg = groups
    dev = comm.device
    assert loom_pg._get_backend(dev).device_comm.members == comm.members
    t = data(rank, salt=50).to(dev)
    dist.all_reduce(t)
    ref = data(rank, salt=50)
    dist.all_reduce(ref, group=gloo_pg)
    assert torch.equal(t.cpu(), ref)
    out = torch.empty(size * 6, device=dev)
    dist.all_gather_into_tensor(out, data(rank, salt=51).to(dev))
    assert torch.equal(out.cpu(), torch.cat([data(r, salt=51) for r in range(size)]))
    part = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(part, data(rank, n=3 * size, salt=52).to(dev))
    assert torch.equal(part.cpu(), sum(data(r, n=3 * size, salt=52) for r in range(size)).chunk(size)[rank])
    over_loom = nn.parallel.DistributedDataParallel(make_net(rank).to(dev), device_ids=[dev.index],
                                                    process_group=loom_pg, bucket_cap_mb=0.001)
    over_gloo = nn.parallel.DistributedDataParallel(make_net(rank), process_group=gloo_pg, bucket_cap_mb=0.001)
    train(over_loom, rank, device=dev)
    train(over_gloo, rank)
    for (name, a), b in zip(over_loom.module.named_parameters(), over_gloo.module.parameters()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")  # GPU and CPU kernels round apart
