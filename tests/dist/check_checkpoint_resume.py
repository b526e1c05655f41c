#!/usr/bin/env python3
"""Resume equals no interruption, with real processes: an example training program is run three
times under mpirun with --checkpoint-dir / --save-every and a deterministic setup.

  A  runs all steps uninterrupted (saving as it goes);
  B  runs the same command and is killed (SIGKILL to every process of the job) as soon as its
     first checkpoint is published, while it keeps training and saving;
  C  starts a new job with --resume on B's directory and runs to the end.

C must report the step it resumed from (after B's first checkpoint, before the end), log exactly
A's losses (17 significant digits) for every step after it and the same final loss, and leave
checkpoints byte-identical to A's for every step both kept after the resume point: manifest and
every shard, so weights, optimizer state, loss scale, RNG streams and accumulation position are
all equal.

  check_checkpoint_resume.py --mpirun mpirun --np 2 --program build/examples/train_ddp -- --steps 40 ...
"""
import argparse
import filecmp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def run(command, env, timeout=120):
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def kill_session(leader):
    """SIGKILL every process of the job (mpirun puts ranks in their own process groups, in its session)."""
    ps = subprocess.run(["ps", "-eo", "pid,sid"], capture_output=True, text=True).stdout.split("\n")[1:]
    for line in ps:
        fields = line.split()
        if len(fields) == 2 and int(fields[1]) == leader:
            try:
                os.kill(int(fields[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def losses(output):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step\s+(\d+)/\d+\s+loss\s+(\S+)", output, re.M)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--np", type=int, required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the program's arguments")
    a = parser.parse_args()
    program_args = [x for x in a.args if x != "--"]
    steps = int(program_args[program_args.index("--steps") + 1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = tempfile.mkdtemp(prefix="loom_resume_")
    base = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(a.np), a.program] + program_args + \
        ["--log-every", "1", "--loss-digits", "17"]
    failures = []
    try:
        dir_a, dir_b = os.path.join(work, "a"), os.path.join(work, "b")
        rc_a, out_a = run(base + ["--checkpoint-dir", dir_a], env)
        print(f"--- A (uninterrupted): exit {rc_a}\n{out_a}")
        if rc_a not in (0, 1) or "final loss" not in out_a:
            failures.append(f"run A failed (exit {rc_a})")
            raise SystemExit

        proc = subprocess.Popen(base + ["--checkpoint-dir", dir_b], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(dir_b, "latest")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        kill_session(proc.pid)
        out_b = proc.communicate(timeout=30)[0]
        print(f"--- B (killed once its first checkpoint was published): exit {proc.returncode}\n{out_b}")
        if proc.returncode == 0 or "final loss" in out_b:
            failures.append("run B finished before it was killed: nothing was interrupted")
            raise SystemExit
        time.sleep(0.3)
        left = [l for l in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.split("\n")
                if a.program in l and dir_b in l]
        if left:
            failures.append("processes of the killed job are left: " + "; ".join(left))

        rc_c, out_c = run(base + ["--checkpoint-dir", dir_b, "--resume"], env)
        print(f"--- C (resumed): exit {rc_c}\n{out_c}")
        m = re.search(r"resumed from (\S+) at step (\d+)", out_c)
        if not m:
            failures.append("run C did not resume from a checkpoint")
            raise SystemExit
        resumed = int(m.group(2))
        if not 0 < resumed < steps:
            failures.append(f"run C resumed at step {resumed}; expected one between 1 and {steps - 1}")
        if rc_c != rc_a:
            failures.append(f"exit status {rc_c} after the resume, {rc_a} uninterrupted")

        la, lc = losses(out_a), losses(out_c)
        expected_steps = list(range(resumed + 1, steps + 1))
        if sorted(lc) != expected_steps:
            failures.append(f"run C logged steps {sorted(lc)}; expected {expected_steps}")
        for s in expected_steps:
            if lc.get(s) != la.get(s):
                failures.append(f"step {s}: loss {lc.get(s)} after the resume, {la.get(s)} uninterrupted")
        final_a = re.findall(r"^final loss (\S+)$", out_a, re.M)
        final_c = re.findall(r"^final loss (\S+)$", out_c, re.M)
        if final_a != final_c or not final_a:
            failures.append(f"final loss {final_c} after the resume, {final_a} uninterrupted")
        for line in out_a.splitlines():
            if line.startswith("sample:") and line not in out_c:
                failures.append(f"the sample differs: {line!r} uninterrupted")

        compared = 0
        for name in sorted(os.listdir(dir_a)):
            if not name.startswith("step_") or int(name[5:]) <= resumed:
                continue
            if not os.path.isdir(os.path.join(dir_b, name)):
                continue
            files = sorted(os.listdir(os.path.join(dir_a, name)))
            if files != sorted(os.listdir(os.path.join(dir_b, name))):
                failures.append(f"{name}: files differ")
                continue
            for f in files:
                if not filecmp.cmp(os.path.join(dir_a, name, f), os.path.join(dir_b, name, f), shallow=False):
                    failures.append(f"{name}/{f} differs between the uninterrupted and the resumed run")
                compared += 1
        if not os.path.isdir(os.path.join(dir_a, f"step_{steps:06d}")) or compared == 0:
            failures.append(f"no common checkpoint after step {resumed} to compare (final step_{steps:06d})")
        print(f"resumed at step {resumed} of {steps}; {len(expected_steps)} losses and {compared} checkpoint files compared")
    except SystemExit:
        pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAIL " + f)
    if not failures:
        print("OK: the resumed run equals the uninterrupted one")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
