#!/usr/bin/env python3
"""loomrun --max-restarts (or torchrun --max-restarts, with --torchrun) with a real training job: a
rank of train_gpt is killed (SIGKILL) mid-run, the launcher starts the job again, train_gpt resumes
from its newest complete checkpoint (--checkpoint-dir ... --resume) and ends with the same final
loss, to the last digit, as the same run uninterrupted under the same launcher (--deterministic).

Under torchrun the restarted workers meet in the agent's store, which still holds the keys of the
attempt that died: each attempt's keys are its own (TORCHELASTIC_RESTART_COUNT), or the new
attempt's ranks connect to the dead one's Gloo addresses ("Connection refused") or wait for them.

Measured per run, from the merged output's lines as they arrive:
  failure -> restart   the kill to loomrun's "starting it again" (mpirun noticing the dead rank and
                       ending the job)
  restart -> resumed   to train_gpt's "resumed from ..." (a new mpirun, process start, init, the load)
  resumed -> step      to the first step line after the restart
  failure -> step      the total: what --max-restarts costs on this machine

Usage: check_restart.py (--loomrun PATH | --torchrun) --train-gpt PATH --work DIR [--runs N]
Exit 0: every run passed; 1: a run failed.
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

SMALL = ["--layers", "2", "--hidden", "64", "--seq", "32", "--batch", "8", "--eval-every", "0", "--progress", "lines",
         "--log-every", "1", "--deterministic"]
STEPS = 300
KILL_AFTER_STEP = 45  # the checkpoint of step 40 (every 20) is complete by then, or that of step 20


def environment():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
    env.setdefault("OMPI_MCA_pml", "ob1")
    env["LOGLEVEL"] = "INFO"  # torchrun's agent says at INFO that it restarts the worker group
    return env


def final_loss(text):
    found = re.search(r"^final loss (\S+)$", text, re.M)
    return found.group(1) if found else None


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def launch(args, *arguments):
    """The command that starts train_gpt on 2 ranks with the launcher under test."""
    if args.torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                *arguments, "--no-python", args.train_gpt]
    return [args.loomrun, "-np", "2", *arguments, "--", args.train_gpt]


# The launcher's line saying it starts the job again after the kill.
RESTART_LINE = {
    "loomrun": r"^loomrun: the job failed \(exit status 137 \(128 \+ signal 9\) after [\d.]+ s\); starting it again: "
               r"restart 1 of 2, LOOM_RESTART_COUNT=1",
    "torchrun": r"Worker group FAILED\. 2/2 attempts left; will restart worker group",
}


def rank_pid(train_gpt, rank, ancestor):
    """The pid of train_gpt's rank `rank` (from its OMPI_COMM_WORLD_RANK, or torchrun's RANK) among
    `ancestor`'s descendants: never a process of another job on this machine."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] != train_gpt.encode():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                variables = f.read().split(b"\0")
                if f"OMPI_COMM_WORLD_RANK={rank}".encode() not in variables and f"RANK={rank}".encode() not in variables:
                    continue
            up = int(pid)
            while up > 1 and up != ancestor:
                up = parent_of(up)
            if up == ancestor:
                return int(pid)
        except (OSError, ValueError, IndexError):
            pass
    return None


def one_run(args, ckpt):
    shutil.rmtree(ckpt, ignore_errors=True)
    command = launch(args, "--max-restarts", "2") + ["--steps", str(STEPS), "--save-every", "20", "--checkpoint-dir",
                                                     ckpt, "--resume"] + SMALL
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
    lines = []  # (arrival time, line)
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), l)) for l in iter(job.stdout.readline, "")],
                              daemon=True)
    reader.start()
    killed_at = None
    killed_after = None
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline:
        if killed_at is None and any(re.match(rf"step +{KILL_AFTER_STEP}/", l) for _, l in list(lines)):
            pid = rank_pid(args.train_gpt, 1, job.pid)
            if pid is None:
                print("FAIL: rank 1 not found")
                job.kill()
                return None
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            killed_after = re.match(r"step +(\d+)/", lines[-1][1])
            killed_after = killed_after.group(1) if killed_after else "?"
        time.sleep(0.01)
    if job.poll() is None:
        job.kill()
        print("FAIL: the job did not end within 240 s")
        return None
    reader.join(timeout=10)
    text = "".join(l for _, l in lines)

    def first(pattern, after):
        return next(((t, l) for t, l in lines if t >= after and re.search(pattern, l)), (None, None))

    launcher = "torchrun" if args.torchrun else "loomrun"
    restart_t, restart_line = first(RESTART_LINE[launcher], killed_at or 0)
    resumed_t, resumed_line = first(r"^resumed from .*step_0*(\d+) at step (\d+)", restart_t or float("inf"))
    step_t, step_line = first(r"^step +\d+/", resumed_t or float("inf"))
    resumed_step = int(re.search(r"at step (\d+)", resumed_line).group(1)) if resumed_line else None
    first_step = int(re.match(r"step +(\d+)/", step_line).group(1)) if step_line else None
    ok = (killed_at is not None and restart_t is not None and resumed_step is not None and resumed_step >= 20 and
          first_step == resumed_step + 1 and len(re.findall(RESTART_LINE[launcher], text, re.M)) == 1 and
          (job.returncode == 0 or (job.returncode == 1 and "FAILED, the loss did not fall" in text)))
    if not ok:
        print("FAIL:", f"killed {'at ' + str(killed_at) if killed_at else 'nothing'}, exit {job.returncode}, restart line {restart_line!r}, resumed {resumed_line!r}, "
              f"first step after it {step_line!r}")
        print(text[-3000:])
        return None
    return dict(loss=final_loss(text), resumed=resumed_step, killed_after=killed_after, detect=restart_t - killed_at,
                start=resumed_t - restart_t, step=step_t - resumed_t, total=step_t - killed_at,
                exit_line=restart_line.strip())


def main():
    parser = argparse.ArgumentParser()
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--loomrun", help="loomrun's path: restart with loomrun --max-restarts")
    which.add_argument("--torchrun", action="store_true", help="restart with torchrun --max-restarts")
    parser.add_argument("--train-gpt", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    args.train_gpt = os.path.abspath(args.train_gpt)
    os.makedirs(args.work, exist_ok=True)
    ckpt = os.path.join(args.work, "restart_ckpt")

    reference = subprocess.run(launch(args) + ["--steps", str(STEPS)] + SMALL,
                               capture_output=True, text=True, timeout=240, env=environment())
    expected = final_loss(reference.stdout)
    print(f"uninterrupted: final loss {expected}")
    if expected is None:
        print(reference.stdout[-2000:], reference.stderr[-2000:])
        return 1
    results = []
    for i in range(args.runs):
        r = one_run(args, ckpt)
        if r is None:
            return 1
        print(f"run {i + 1}: rank 1 killed after step {r['killed_after']}; {r['exit_line']}; resumed at step "
              f"{r['resumed']}; failure->restart {r['detect']:.2f} s, restart->resumed {r['start']:.2f} s, "
              f"resumed->first step {r['step']:.2f} s, failure->first step {r['total']:.2f} s; final loss {r['loss']}",
              flush=True)
        if r["loss"] != expected:
            print(f"FAIL: final loss {r['loss']} after the restart, {expected} uninterrupted")
            return 1
        results.append(r)
    if len(results) > 1:
        med = {k: statistics.median(r[k] for r in results) for k in ("detect", "start", "step", "total")}
        print(f"median of {len(results)}: failure->restart {med['detect']:.2f} s, restart->resumed {med['start']:.2f} s, "
              f"resumed->first step {med['step']:.2f} s, failure->first step {med['total']:.2f} s "
              f"(min {min(r['total'] for r in results):.2f}, max {max(r['total'] for r in results):.2f})")
    shutil.rmtree(ckpt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
