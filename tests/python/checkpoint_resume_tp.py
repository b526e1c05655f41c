"""A Python run resumed at another layout equals the uninterrupted one (CTest runs it twice).

--phase save (4 ranks, TP 2 x DP 2): trains a tensor-parallel model (column- and row-parallel
layers and a replicated head) with Adam and a StepLR scheduler for STEPS steps, saving a
checkpoint after step SAVE_AT through torchloom.Checkpointer, and writes the full final weights
(TP slices gathered) to DIR/final.pt.

--phase resume (2 ranks, TP 1 x DP 2; or --tp 4 on 4 ranks, TP 4 x DP 1): loads the checkpoint
into a model built at that layout with a fresh optimizer whose lazy state does not exist yet and a
fresh scheduler, trains the remaining steps on the same data, and compares every weight with
DIR/final.pt. The runs reduce their row-parallel partial products in different orders, so the
comparison allows float32 rounding (rtol 1e-5); with the optimizer's state, the learning-rate
schedule or a slice missed, the weights differ by far more (each was checked to fail this test).
Before it, the same checkpoint with its tp_ranks forged (resealed) is refused, changing nothing.
"""
import argparse
import os
import shutil
import sys

import torch
import torch.nn as nn

import torchloom

STEPS = 6
SAVE_AT = 3


def build(ps):
    torch.manual_seed(0)
    group = ps.tp_group
    model = nn.ModuleDict({
        "col": torchloom.ColumnParallelLinear(8, 16, group, init="master"),
        "row": torchloom.RowParallelLinear(16, 8, group, init="master"),
        "head": nn.Linear(8, 2),
    })
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


REPLICAS = 2  # the saved run's data-parallel degree: its replicas' batches make each step's global batch


def train_step(model, opt, sched, ps, step):
    # This rank's share of the global batch (at DP 1, both replicas' batches): the same step at any
    # layout. Equal shares, so the average of the ranks' mean losses is the global mean.
    batches = []
    for replica in range(ps.dp_rank, REPLICAS, ps.dp_degree):
        g = torch.Generator().manual_seed(1000 * step + replica)
        batches.append((torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    opt.zero_grad()
    out = model["head"](model["row"](torch.nn.functional.gelu(model["col"](x))))
    torch.nn.functional.mse_loss(out, y).backward()
    for p in model.parameters():  # data parallelism by hand: average over the replicas
        ps.dp_group.all_reduce(p.grad, torchloom.ReduceOp.AVG).wait()
    opt.step()
    sched.step()


def full_weights(model, ps):
    """Every parameter as the whole tensor (TP slices gathered along their split dimension)."""
    out = {}
    for name, p in model.named_parameters():
        layer = model[name.split(".")[0]]
        info = layer.shard_info().get(name.split(".")[1]) if hasattr(layer, "shard_info") else None
        if info is None or info["dim"] < 0 or ps.tp_group is None:
            out[name] = p.detach().clone()
            continue
        pieces = [torch.empty_like(p) for _ in range(ps.tp_degree)]
        ps.tp_group.all_gather(pieces, p.detach().contiguous()).wait()
        out[name] = torch.cat(pieces, dim=info["dim"])
    return out


def check_consolidated(work_dir, ckpt_dir, model, opt):
    """python -m torchloom.checkpoint consolidate on the TP 2 checkpoint, read back with the
    safetensors package: the joined tensors equal what the TP 1 load put in the model and optimizer."""
    import subprocess
    from safetensors.torch import load_file
    out = os.path.join(work_dir, "consolidated.safetensors")
    done = subprocess.run([sys.executable, "-m", "torchloom.checkpoint", "consolidate", ckpt_dir, out, "--optimizer"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tensors" in done.stdout and not done.stderr, (done.stdout, done.stderr)
    tensors = load_file(out)
    names = {n for n, _ in model.named_parameters()}  # as a C++ model's (model/<name>, without model/)
    assert names <= set(tensors), sorted(tensors)
    for n, p in model.named_parameters():
        assert torch.equal(tensors[n], p.detach()), n
        assert torch.equal(tensors[f"optim/{n}/exp_avg"], opt.state[p]["exp_avg"]), n
    assert not any(k.startswith("rng") or k.startswith("objects/") for k in tensors), sorted(tensors)
    # A damaged checkpoint: exit status 2 and the reason, no output file.
    bad = subprocess.run([sys.executable, "-m", "torchloom.checkpoint", "consolidate", work_dir + "/nowhere",
                          out + ".bad"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no complete checkpoint" in bad.stderr, (bad.returncode, bad.stderr)
    print(f"consolidated {len(tensors)} tensors from the TP 2 checkpoint: equal to the TP 1 load", flush=True)


def check_forged_tp_ranks_refused(work_dir, ckpt_dir, ckpt, model, opt, comm):
    """The checkpoint with its world's tp_ranks flipped (resealed, as a tool would): the shards'
    slices contradict them (rank 1 holds slice 1, TP rank 1's), and a load at another layout would
    follow them to give ranks the RNG streams of the wrong TP rank. Refused on every rank, the
    fresh model and optimizer unchanged."""
    from manifest_seal import reseal
    latest = torchloom.Checkpointer.find_latest(ckpt_dir)
    forged = os.path.join(work_dir, f"forged_tp_ranks_{comm.size}", os.path.basename(latest))
    if comm.rank == 0:
        shutil.rmtree(os.path.dirname(forged), ignore_errors=True)
        shutil.copytree(latest, forged)

        def flip(manifest):
            assert manifest["world"]["tp_ranks"] == [0, 1, 0, 1], manifest["world"]
            manifest["world"]["tp_ranks"] = [1, 0, 1, 0]
        reseal(os.path.join(forged, "manifest.json"), flip)
    comm.barrier().wait()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        ckpt.load(forged)
        raise AssertionError(f"rank {comm.rank}: the checkpoint with forged tp_ranks loaded")
    except torchloom.CheckpointError as e:
        assert '"tp_ranks" makes rank ' in str(e), str(e)
    assert not opt.state, "a refused load created optimizer state"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"a refused load changed {k}"
    print(f"rank {comm.rank}: forged tp_ranks refused, nothing changed", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--tp", type=int, default=1, help="the resume phase's tensor-parallel degree")
    args = parser.parse_args()
    torchloom.init()
    comm = torchloom.world_comm()
    ckpt_dir = os.path.join(args.dir, "ckpt")
    if args.phase == "save":
        assert comm.size == 4, "the save phase runs at TP 2 x DP 2"
        if comm.rank == 0:
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
        comm.barrier().wait()
        ps = torchloom.ParallelState(comm, tensor_parallel=2)
    else:
        assert (args.tp, comm.size) in {(1, 2), (4, 4)}, "the resume phase runs at TP 1 x DP 2 or TP 4 x DP 1"
        ps = torchloom.ParallelState(comm, tensor_parallel=args.tp)
    model, opt, sched = build(ps)
    ckpt = torchloom.Checkpointer(comm, ckpt_dir, keep_last=2)
    ckpt.model(model).optimizer(opt).object("lr_scheduler", sched)

    if args.phase == "save":
        for step in range(1, STEPS + 1):
            train_step(model, opt, sched, ps, step)
            if step == SAVE_AT:
                handle = ckpt.save(torchloom.TrainingProgress(step=step))
        handle.wait()
        weights = full_weights(model, ps)
        if comm.rank == 0:
            torch.save(weights, os.path.join(args.dir, "final.pt"))
        comm.barrier().wait()
        torchloom.finalize()
        return 0

    assert not opt.state, "the fresh optimizer has no state before the load"
    check_forged_tp_ranks_refused(args.dir, ckpt_dir, ckpt, model, opt, comm)
    info = ckpt.load_latest()
    assert info is not None and info.progress.step == SAVE_AT, info
    assert sched.last_epoch == SAVE_AT, sched.state_dict()
    assert opt.param_groups[0]["lr"] == 0.02 * 0.5, opt.param_groups[0]["lr"]
    if comm.rank == 0 and args.tp == 1:  # the consolidated tensors are whole: compared with TP 1's
        check_consolidated(args.dir, ckpt_dir, model, opt)
    for step in range(SAVE_AT + 1, STEPS + 1):
        train_step(model, opt, sched, ps, step)
    expected = torch.load(os.path.join(args.dir, "final.pt"))
    failures = []
    for name, w in full_weights(model, ps).items():
        if not torch.allclose(w, expected[name], rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: max difference {(w - expected[name]).abs().max().item():.3g}")
    for f in failures:
        print(f"rank {comm.rank}: FAIL {f}", flush=True)
    print(f"rank {comm.rank}: resumed at TP {ps.tp_degree} x DP {ps.dp_degree} from step {SAVE_AT}: "
          f"{len(expected) - len(failures)} of "
          f"{len(expected)} weights equal the uninterrupted TP 2 x DP 2 run", flush=True)
    torchloom.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
