#!/usr/bin/env python3
"""loomrun's pass-through, output, restart and Slurm options, with real mpirun (Open MPI) jobs.

  environment   on hosts whose daemons start with a bare login environment (clean_env_rsh.sh),
                ranks see PATH, LD_LIBRARY_PATH, PYTHONPATH, LOOM_* and -x NAME / -x NAME=VALUE as
                loomrun had them; plain mpirun on the same hosts (the reference) forwards none of it
  mca           --mca orte_xml_output 1 makes mpirun print XML; without it, plain lines
  mpi_arg       --mpi-arg --bind-to --mpi-arg core binds each rank to one CPU (loomrun's own
                --bind-to none steps aside), --mpi-arg=--display-map prints the job map; without
                them a rank may run on every CPU
  output        --output-dir: one stdout and one stderr file per rank, holding that rank's lines
                and nothing else; --tag-output: terminal lines prefixed [job,rank]<stream>:
  restarts      --max-restarts: a job failing while LOOM_RESTART_COUNT < 2 succeeds on the third
                attempt (exit 0, two restarts logged with the exit status, one output directory
                per attempt); too few restarts end with the last status; a SIGTERM to loomrun is
                not a failure to restart from
  slurm         SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE become the hosts: ranks run on the
                allocation's (fake) hosts, as many on each as the allocation says
  errors        bad -x, --mca, --mpi-arg, --output-dir and --max-restarts values exit 2, naming
                what was expected, before anything starts

The cases that need fake hosts (environment, slurm) need root for unshare (tests/dist/fake_rsh.sh)
and are skipped, said so, without it. Every wait has a deadline.
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
FAILURES = []
ROOT_FLAGS = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print("FAIL:", message, flush=True)
    return condition


def env_with(**extra):
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
    env.setdefault("OMPI_MCA_pml", "ob1")
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]  # a test run inside an allocation must not change what loomrun sees
    env.update(extra)
    return env


def run(command, timeout=90, **extra):
    return subprocess.run(command, env=env_with(**extra), capture_output=True, text=True, timeout=timeout)


def fake_hosts_usable():
    return os.geteuid() == 0 and shutil.which("unshare") and shutil.which("nsenter")


PRINT_ENV = ('printf "%s|py=%s|ld=%s|path=%s|loom=%s|kept=%s|set=%s\\n" "$(hostname)" "$PYTHONPATH" '
             '"$LD_LIBRARY_PATH" "$PATH" "$LOOM_OPTIONS_MARK" "$KEPT" "$SETV"')


def case_environment(loomrun):
    if not fake_hosts_usable():
        print("environment: skipped (fake hosts need root, unshare and nsenter)")
        return
    agent = os.path.join(HERE, "clean_env_rsh.sh")
    path = "/marker/bin:" + os.environ["PATH"]
    values = dict(OMPI_MCA_plm_rsh_agent=agent, PYTHONPATH="/marker/py", LD_LIBRARY_PATH="/marker/lib",
                  PATH=path, LOOM_OPTIONS_MARK="m1", KEPT="a b,c")
    setv = "x=1; y, z $HOME"
    hosts = ["-H", "fakeA:1,fakeB:1"]
    out = run([loomrun, "-np", "2"] + hosts + ["-x", "KEPT", "-x", "SETV=" + setv, "--", "/bin/sh", "-c", PRINT_ENV],
              **values)
    lines = sorted(l for l in out.stdout.splitlines() if "|py=" in l)
    expected = sorted(f"{h}|py=/marker/py|ld=/marker/lib|path={path}|loom=m1|kept=a b,c|set={setv}"
                      for h in ("fakeA", "fakeB"))
    check(out.returncode == 0 and lines == expected,
          f"environment: loomrun gave {out.returncode}, ranks saw {lines!r}, expected {expected!r}; {out.stderr[-800:]}")
    # The reference: plain mpirun to the same hosts forwards none of it, so the hosts are really bare.
    ref = run(["mpirun", "-np", "2"] + ROOT_FLAGS + hosts + ["/bin/sh", "-c", PRINT_ENV], **values)
    ref_lines = [l for l in ref.stdout.splitlines() if "|py=" in l]
    check(ref.returncode == 0 and len(ref_lines) == 2 and
          all("py=|ld=|" in l and "loom=|kept=|set=" in l and "/marker/bin" not in l for l in ref_lines),
          f"environment: the reference mpirun was not bare: {ref_lines!r} {ref.stderr[-500:]}")
    print("environment: both fake hosts got PATH, LD_LIBRARY_PATH, PYTHONPATH, LOOM_*, -x NAME and -x NAME=VALUE",
          flush=True)


def case_mca(loomrun):
    script = "echo plain-line"
    out = run([loomrun, "-np", "1", "--mca", "orte_xml_output", "1", "--", "/bin/sh", "-c", script])
    check(out.returncode == 0 and '<stdout rank="0">plain-line' in out.stdout and "<mpirun>" in out.stdout,
          f"mca: --mca orte_xml_output 1 gave {out.returncode} {out.stdout[:300]!r}")
    out = run([loomrun, "-np", "1", "--", "/bin/sh", "-c", script])
    check(out.returncode == 0 and out.stdout.strip() == "plain-line", f"mca: without it {out.stdout[:300]!r}")


def case_mpi_arg(loomrun):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("mpi_arg: skipped (needs 2 CPUs)")
        return
    script = 'echo "rank=$OMPI_COMM_WORLD_RANK $(grep Cpus_allowed_list /proc/self/status | cut -f2)"'

    def allowed(out):
        return dict(l.split(" ", 1) for l in out.stdout.splitlines() if l.startswith("rank="))

    bound = run([loomrun, "-np", "2", "--mpi-arg", "--bind-to", "--mpi-arg", "core", "--mpi-arg=--display-map", "--",
                 "/bin/sh", "-c", script])
    seen = allowed(bound)
    single = [v for v in seen.values() if re.fullmatch(r"\d+", v)]
    check(bound.returncode == 0 and len(seen) == 2 and len(single) == 2 and len(set(single)) == 2,
          f"mpi_arg: --bind-to core gave {bound.returncode}, ranks on {seen} {bound.stderr[-500:]}")
    # Open MPI's default for 2 ranks is also one core each: --display-map shows the words arrived.
    check("JOB MAP" in bound.stdout, f"mpi_arg: --display-map printed no map: {bound.stdout[:300]!r}")
    free = allowed(run([loomrun, "-np", "2", "--", "/bin/sh", "-c", script]))
    check(len(free) == 2 and all(not re.fullmatch(r"\d+", v) for v in free.values()),
          f"mpi_arg: without it the ranks were bound anyway: {free}")


def case_output(loomrun, tmp):
    logs = os.path.join(tmp, "logs")
    script = 'echo "out-$OMPI_COMM_WORLD_RANK"; echo "err-$OMPI_COMM_WORLD_RANK" >&2'
    out = run([loomrun, "-np", "2", "--output-dir", logs, "--", "/bin/sh", "-c", script])
    check(out.returncode == 0, f"output: loomrun exited {out.returncode}: {out.stderr[-500:]}")
    for rank in (0, 1):
        for stream, text in (("stdout", f"out-{rank}\n"), ("stderr", f"err-{rank}\n")):
            files = glob.glob(os.path.join(logs, "attempt_0", "*", f"rank.{rank}", stream))
            content = open(files[0]).read() if len(files) == 1 else None
            check(content == text, f"output: {stream} of rank {rank}: files {files}, content {content!r}")
    # mpirun keeps a copy on the terminal.
    check(sorted(out.stdout.split()) == ["out-0", "out-1"], f"output: terminal had {out.stdout!r}")
    tagged = run([loomrun, "-np", "2", "--tag-output", "--", "/bin/sh", "-c", script])
    check(sorted(tagged.stdout.splitlines()) == ["[1,0]<stdout>:out-0", "[1,1]<stdout>:out-1"] and
          sorted(l for l in tagged.stderr.splitlines() if "err-" in l) ==
          ["[1,0]<stderr>:err-0", "[1,1]<stderr>:err-1"],
          f"output: --tag-output gave {tagged.stdout!r} {tagged.stderr[-300:]!r}")


def case_restarts(loomrun, tmp):
    logs = os.path.join(tmp, "restart_logs")
    script = ('echo "count=$LOOM_RESTART_COUNT elastic=$TORCHELASTIC_RESTART_COUNT"; '
              '[ "$LOOM_RESTART_COUNT" -ge 2 ] || exit 7')
    out = run([loomrun, "-np", "2", "--max-restarts", "3", "--output-dir", logs, "--", "/bin/sh", "-c", script], 120)
    counts = sorted(re.findall(r"count=(\d) elastic=(\d)", out.stdout))
    logged = re.findall(r"loomrun: the job failed \(exit status 7 after [\d.]+ s\); starting it again: "
                        r"restart (\d) of 3, LOOM_RESTART_COUNT=(\d)", out.stderr)
    check(out.returncode == 0, f"restarts: the third attempt should succeed, loomrun exited {out.returncode}")
    check(counts == [(c, c) for c in "001122"], f"restarts: ranks saw {counts}")
    check(logged == [("1", "1"), ("2", "2")], f"restarts: logged {logged}: {out.stderr[-800:]}")
    for attempt in range(3):
        files = sorted(glob.glob(os.path.join(logs, f"attempt_{attempt}", "*", "rank.*", "stdout")))
        contents = [open(f).read() for f in files]
        check(contents == [f"count={attempt} elastic={attempt}\n"] * 2,
              f"restarts: attempt {attempt}'s files {files} hold {contents}")
    check(not os.path.exists(os.path.join(logs, "attempt_3")), "restarts: a fourth attempt after success")

    out = run([loomrun, "-np", "1", "--max-restarts", "1", "--", "/bin/sh", "-c", script], 120)
    check(out.returncode == 7 and out.stdout.count("count=") == 2 and
          "--max-restarts 1 reached, giving up" in out.stderr,
          f"restarts: out of restarts gave {out.returncode} {out.stdout!r} {out.stderr[-500:]}")

    # Asked to stop: a SIGTERM to loomrun ends the job, and nothing starts again.
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([loomrun, "-np", "2", "--max-restarts", "5", "--", "/bin/sh", "-c",
                             'echo "started $LOOM_RESTART_COUNT"; exec sleep 60'],
                            env=env_with(LOOM_TEST_MARKER=marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and count_marked_sleepers(marker) < 2:
            time.sleep(0.1)
        check(count_marked_sleepers(marker) == 2, "restarts: the sleepers did not start")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        check(proc.returncode != 0 and "starting it again" not in stderr and stdout.count("started") == 2,
              f"restarts: SIGTERM gave {proc.returncode} {stdout!r} {stderr[-500:]!r}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def count_marked_sleepers(marker):
    n = 0
    needle = ("LOOM_TEST_MARKER=" + marker).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = needle in f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += marked and f.read().split(b"\0")[0] == b"sleep"
        except OSError:
            pass
    return n


def case_slurm(loomrun):
    allocation = dict(SLURM_JOB_NODELIST="sl[1-2]", SLURM_TASKS_PER_NODE="2(x2)", SLURM_JOB_CPUS_PER_NODE="8(x2)")
    dry = run([loomrun, "-np", "4", "--tp", "2", "--dry-run", "--", "x"], **allocation)
    check(dry.returncode == 0 and " -H sl1:2,sl2:2 " in dry.stdout and "hosts from the Slurm allocation" in dry.stdout,
          f"slurm: --dry-run printed {dry.stdout!r} {dry.stderr!r}")
    if not fake_hosts_usable():
        print("slurm: the real run skipped (fake hosts need root, unshare and nsenter)")
        return
    out = run([loomrun, "-np", "4", "--", "/bin/sh", "-c", 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"'],
              OMPI_MCA_plm_rsh_agent=os.path.join(HERE, "..", "dist", "fake_rsh.sh"), **allocation)
    placed = sorted(re.findall(r"rank (\d) on (\S+)", out.stdout))
    check(out.returncode == 0 and placed == [("0", "sl1"), ("1", "sl1"), ("2", "sl2"), ("3", "sl2")],
          f"slurm: loomrun gave {out.returncode}, ranks {placed} {out.stderr[-800:]}")


def case_errors(loomrun):
    for args, message in [
            (["-x", "2BAD=1"], "-x '2BAD=1': expected NAME or NAME=VALUE"),
            (["-x", "UNSET_FOR_SURE_42"], "UNSET_FOR_SURE_42 is not set in loomrun's environment"),
            (["--mca", "bad.key", "1"], "expected an MCA parameter name"),
            (["--mpi-arg", ":"], "start of a second program"),
            (["--mpi-arg", "--hostfile"], "use loomrun's -H or --hostfile"),
            (["--output-dir", "a:nocopy"], "would be read by mpirun as directives"),
            (["--max-restarts", "x"], "--max-restarts x: expected an integer")]:
        out = run([loomrun, "-np", "1"] + args + ["--", "/bin/echo", "STARTED"])
        check(out.returncode == 2 and message in out.stderr and "STARTED" not in out.stdout,
              f"errors: {args} gave {out.returncode} {out.stderr!r}")
    out = run([loomrun, "-np", "1", "--output-dir", "/tmp", "--mca"])
    check(out.returncode == 2 and "--mca needs KEY VALUE (found nothing)" in out.stderr, f"errors: {out.stderr!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loomrun", required=True)
    ap.add_argument("--only", help="run one case")
    args = ap.parse_args()
    loomrun = os.path.abspath(args.loomrun)
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "environment": lambda: case_environment(loomrun),
            "mca": lambda: case_mca(loomrun),
            "mpi_arg": lambda: case_mpi_arg(loomrun),
            "output": lambda: case_output(loomrun, tmp),
            "restarts": lambda: case_restarts(loomrun, tmp),
            "slurm": lambda: case_slurm(loomrun),
            "errors": lambda: case_errors(loomrun),
        }
        for name, case in cases.items():
            if args.only and name != args.only:
                continue
            print(f"== {name}", flush=True)
            case()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("all loomrun option checks passed")


if __name__ == "__main__":
    main()
