"""Single-process tests of the torchloom module: import, info, errors mirrored with the C++
messages, GradScaler against torch.amp.GradScaler, clean exits, the stubs."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import torchloom


def run_python(code, env_extra=None, args=()):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args, "-c", code] if code else [sys.executable, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_versions_and_info():
    assert torchloom.__version__ == torchloom._C.__version__
    r = subprocess.run([sys.executable, "-m", "torchloom.info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"torchloom {torchloom.__version__}" in r.stdout
    assert f"torch {torch.__version__}" in r.stdout
    assert "MPI " in r.stdout and "Open MPI" in r.stdout
    assert "NCCL " in r.stdout
    assert "world: rank 0 of 1" in r.stdout


def test_exception_hierarchy():
    E = torchloom
    assert issubclass(E.InvalidArgumentError, E.Error) and issubclass(E.InvalidArgumentError, ValueError)
    assert issubclass(E.TimeoutError, E.CommError) and issubclass(E.TimeoutError, TimeoutError)
    for cls in (E.ConfigError, E.CommError, E.MismatchError, E.CheckpointError):
        assert issubclass(cls, E.Error)
    assert issubclass(E.Error, RuntimeError)
    assert E.TimeoutError.__module__ == "torchloom"


def test_import_without_init_exits_cleanly():
    r = run_python("import torch, torchloom; print(torchloom.world().size)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
    assert r.stderr == ""


def test_init_without_finalize_exits_cleanly():
    r = run_python("import torch, torchloom; c = torchloom.init().world_comm; t = torch.ones(3); "
                   "c.all_reduce(t).wait(); print(t.sum().item())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3.0"


def test_bad_arguments_raise_mirrored_errors_with_the_cpp_message(loom):
    comm = loom.world_comm()
    with pytest.raises(torchloom.InvalidArgumentError) as e:
        comm.broadcast(torch.ones(4), group_src=3)
    msg = str(e.value)
    assert msg.startswith("[rank 0] broadcast"), msg
    assert "root" in msg and "3" in msg
    # a non-contiguous tensor: the C++ check, its message
    with pytest.raises(torchloom.InvalidArgumentError, match=r"contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    # the communicator stays usable after a rejected argument
    t = torch.ones(2)
    comm.all_reduce(t).wait()
    assert t.tolist() == [1.0, 1.0]
    # TP configuration checked by the C++ side
    with pytest.raises(torchloom.InvalidArgumentError, match=r"ColumnParallelLinear.*out_features"):
        torchloom.ColumnParallelLinear(4, 0, None)
    with pytest.raises(torchloom.InvalidArgumentError, match=r"ColumnParallelLinear: init must be 'master' or 'sharded'"):
        torchloom.ColumnParallelLinear(4, 4, None, init="random")
    with pytest.raises(torchloom.InvalidArgumentError, match=r"GradScaler.*growth_factor must be > 1.0"):
        torchloom.GradScaler(growth_factor=0.5)
    with pytest.raises(torchloom.InvalidArgumentError, match=r"timeout"):
        comm.barrier(timeout=-1)


def test_work_handle(loom):
    comm = loom.world_comm()
    t = torch.arange(6, dtype=torch.float32)
    w = comm.all_reduce(t, torchloom.ReduceOp.MAX)
    assert w.wait() is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert "all_reduce" in repr(w)
    assert comm.size == 1 and comm.rank == 0 and comm.backend == "mpi"


# ---- GradScaler -------------------------------------------------------------------------------

def test_gradscaler_has_torch_methods_and_signatures():
    ref = torch.amp.GradScaler
    public = [n for n in dir(ref) if not n.startswith("_")]
    for name in public:
        assert hasattr(torchloom.GradScaler, name), name
        ps = list(inspect.signature(getattr(ref, name)).parameters)
        ls = list(inspect.signature(getattr(torchloom.GradScaler, name)).parameters)
        assert ls[:len(ps)] == ps, (name, ps, ls)
    # torch's methods, and only one of torchloom's own: pipeline stages before the last say that
    # another rank scaled their gradients (docs/pipeline-parallel.md).
    extras = {"scaled_by_another_rank"}
    ours = [n for n in dir(torchloom.GradScaler) if not n.startswith("_")]
    assert sorted(set(ours) - extras) == sorted(public) and extras <= set(ours)
    init_ref = list(inspect.signature(ref.__init__).parameters)
    init_ours = list(inspect.signature(torchloom.GradScaler.__init__).parameters)
    assert init_ours[:len(init_ref)] == init_ref


def _scaler_run(scaler, steps=14):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trace = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        if step in (2, 7):
            model[0].weight.grad[0, 0] = float("inf")
        if step in (5, 11):
            model[2].bias.grad[1] = float("nan")
        if step % 3 == 1:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        result = scaler.step(opt)
        if step == 9:
            scaler.update(1024.0)
        else:
            scaler.update()
        trace.append((scaler.get_scale(), scaler._get_growth_tracker(), result,
                      [p.detach().clone() for p in model.parameters()]))
    return trace, scaler.state_dict()


def test_gradscaler_equals_torch_gradscaler():
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref, ref_state = _scaler_run(torch.amp.GradScaler("cpu", **kwargs))
    ours, our_state = _scaler_run(torchloom.GradScaler("cpu", **kwargs))
    scales = [t[0] for t in ref]
    assert len(set(scales)) > 3  # backoffs, growths and update(new_scale) all happened
    for step, (r, o) in enumerate(zip(ref, ours)):
        assert r[0] == o[0], (step, r[0], o[0])
        assert r[1] == o[1], (step, r[1], o[1])
        assert r[2] == o[2], step  # optimizer.step()'s return value, None when skipped
        for a, b in zip(r[3], o[3]):
            assert torch.equal(a, b), step
    assert our_state == ref_state
    assert [type(v) for v in our_state.values()] == [type(v) for v in ref_state.values()]


def test_gradscaler_state_dict_round_trip_and_setters():
    s = torchloom.GradScaler(init_scale=8.0, growth_interval=5)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    assert s.state_dict() == ref.state_dict()
    s.set_growth_factor(3.0), ref.set_growth_factor(3.0)
    s.set_backoff_factor(0.25), ref.set_backoff_factor(0.25)
    s.set_growth_interval(7), ref.set_growth_interval(7)
    assert s.state_dict() == ref.state_dict()
    t = torchloom.GradScaler()
    t.load_state_dict(ref.state_dict())
    assert t.state_dict() == ref.state_dict()
    with pytest.raises(torchloom.InvalidArgumentError, match="missing key 'scale'"):
        t.load_state_dict({"growth_factor": 2.0})
    assert torchloom.GradScaler(enabled=False).state_dict() == {}
    with pytest.raises(torchloom.InvalidArgumentError, match=r"unscale_\(\) has already been called"):
        m = torch.nn.Linear(2, 1)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        t.scale(m(torch.ones(1, 2)).sum()).backward()
        t.unscale_(o)
        t.unscale_(o)


# ---- tensor parallelism without a group (TP degree 1) ---------------------------------------------

def test_tp_layers_without_group_equal_plain_layers():
    torch.manual_seed(3)
    col = torchloom.ColumnParallelLinear(6, 8, None, init="master")
    torch.manual_seed(3)
    plain = torch.nn.Linear(6, 8)
    assert torch.equal(col.weight, plain.weight) and torch.equal(col.bias, plain.bias)
    x = torch.randn(4, 6)
    col(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(col.weight.grad, plain.weight.grad)
    assert [n for n, _ in col.named_parameters()] == ["weight", "bias"]


# ---- stubs ------------------------------------------------------------------------------------

def test_stubs_match_module():
    import ast
    stubs = os.path.join(os.path.dirname(torchloom.__file__), "_C.pyi")
    assert os.path.exists(stubs), stubs
    tree = ast.parse(open(stubs).read())
    declared = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    declared |= {t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target]}
    runtime = {n for n in dir(torchloom._C) if not n.startswith("__")}
    assert runtime - declared == set(), "in the module, not in _C.pyi"
    assert {n for n in declared if not n.startswith("__")} - runtime - {"_Timeout"} == set(), "in _C.pyi only"
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and not issubclass(getattr(torchloom._C, cls.name), BaseException):
            members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            members |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
            live = {n for n in vars(getattr(torchloom._C, cls.name)) if not n.startswith("_")}
            assert live <= members, (cls.name, live - members)
    # Every name the stubs take from torch (mypy does not follow torch's stubs: stubtest_mypy.ini).
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            assert hasattr(torch, node.attr), f"_C.pyi names torch.{node.attr}, which torch does not have"
    try:
        import mypy.stubtest  # noqa: F401
    except ImportError:
        pytest.skip("mypy not installed (requirements.txt lists it)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(torchloom.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    allowlist = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubtest_allowlist.txt")
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "torchloom._C", "--allowlist", allowlist,
                        "--mypy-config-file", os.path.join(os.path.dirname(allowlist), "stubtest_mypy.ini")],
                       capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(stubs))
    assert r.returncode == 0, r.stdout + r.stderr
