#!/usr/bin/env python3
"""loomrun with real processes under mpirun (Open MPI).

Each case starts loomrun and checks what the ranks saw or what is left of them:
  verbatim      an argument full of shell metacharacters reaches every rank unchanged
  exit_code     a rank exiting 3 makes loomrun exit 3; mpirun dying of SIGTERM gives 143
  sigint        SIGINT sent to loomrun (kill) ends every rank within seconds
  sigterm       the same for SIGTERM
  ctrl_c        Ctrl-C typed at a terminal (a pty) ends every rank, signal delivered once
  launcher_killed  SIGKILL to loomrun: mpirun gets SIGTERM (parent-death signal), ranks end
  binding       with a topology, each rank runs on the CPUs the plan gave it (Open MPI rankfile)
  plan          --plan, --plan --json, --svg and --dry-run print/write what they should, start nothing
  errors        bad arguments exit 2 with a message; a missing mpirun exits 127

A hang is a failure: every wait has a deadline. Ranks are found by a marker in their environment
(LOOM_* variables are forwarded to them), so other processes named `sleep` do not matter.
"""
import argparse
import json
import os
import pty
import select
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound  # noqa: E402  (tests/time_scale.py)

FAILURES = []


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print("FAIL:", message, flush=True)
    return condition


def env_with(**extra):
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
    env.setdefault("OMPI_MCA_pml", "ob1")
    env.update(extra)
    return env


def processes_with_marker(marker):
    """PIDs of processes whose environment holds LOOM_TEST_MARKER=<marker>."""
    found = []
    needle = ("LOOM_TEST_MARKER=" + marker).encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def ranks_of(marker, loomrun_pid):
    """Marked processes other than loomrun itself (mpirun and the ranks)."""
    return [p for p in processes_with_marker(marker) if p != loomrun_pid]


def wait_for(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def start_sleepers(loomrun, marker, **popen):
    return subprocess.Popen([loomrun, "-np", "2", "--", "sleep", "60"], env=env_with(LOOM_TEST_MARKER=marker),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)


def count_sleeping_ranks(marker, pid):
    n = 0
    for p in ranks_of(marker, pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                n += f.read().split(b"\0")[0] == b"sleep"
        except OSError:
            pass
    return n


def case_verbatim(loomrun):
    arg = "a b;$(echo x)|*'\"\\`~&>"
    out = subprocess.run([loomrun, "-np", "2", "--", "/bin/sh", "-c", 'printf "[%s]\\n" "$1"', "sh", arg],
                         env=env_with(), capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, f"verbatim: loomrun exited {out.returncode}: {out.stderr}")
    lines = [l for l in out.stdout.splitlines() if l.startswith("[")]
    check(lines == [f"[{arg}]"] * 2, f"verbatim: ranks printed {lines!r}, expected [{arg}] twice")


def case_exit_code(loomrun, fake_mpirun):
    out = subprocess.run([loomrun, "-np", "2", "--", "/bin/sh", "-c", "exit 3"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 3, f"exit_code: a rank exiting 3 gave {out.returncode}")
    out = subprocess.run([loomrun, "-np", "1", "--", "/bin/sh", "-c", "exit 0"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, f"exit_code: success gave {out.returncode}")
    out = subprocess.run([loomrun, "-np", "1", "--mpirun", fake_mpirun, "--", "x"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 128 + signal.SIGTERM, f"exit_code: mpirun killed by SIGTERM gave {out.returncode}, expected 143")


def case_signal(loomrun, sig, name):
    marker = uuid.uuid4().hex
    proc = start_sleepers(loomrun, marker)
    try:
        if not check(wait_for(lambda: count_sleeping_ranks(marker, proc.pid) == 2, 30), f"{name}: ranks did not start"):
            return
        t0 = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            check(False, f"{name}: loomrun still running 20 s after {name}")
            return
        gone = wait_for(lambda: not ranks_of(marker, proc.pid), 5)
        elapsed = time.monotonic() - t0
        check(gone, f"{name}: processes left after loomrun ended: {ranks_of(marker, proc.pid)}")
        check(elapsed < 10, f"{name}: took {elapsed:.1f} s")
        check(proc.returncode != 0, f"{name}: loomrun exited 0 after {name}")
        print(f"{name}: loomrun exited {proc.returncode}, no rank left after {elapsed:.1f} s", flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in ranks_of(marker, proc.pid):
            os.kill(p, signal.SIGKILL)


def case_ctrl_c(loomrun):
    """Ctrl-C typed at a terminal: loomrun runs as the foreground job of a fresh pty."""
    marker = uuid.uuid4().hex
    pid, fd = pty.fork()
    if pid == 0:
        env = env_with(LOOM_TEST_MARKER=marker)
        os.execve(loomrun, [loomrun, "-np", "2", "--", "sleep", "60"], env)
    output = b""

    def drain():
        nonlocal output
        while select.select([fd], [], [], 0)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return
            if not chunk:
                return
            output += chunk

    try:
        if not check(wait_for(lambda: (drain(), count_sleeping_ranks(marker, pid) == 2)[1], 30),
                     "ctrl_c: ranks did not start"):
            return
        t0 = time.monotonic()
        os.write(fd, b"\x03")  # the terminal's interrupt character: SIGINT to the foreground group
        status = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            drain()
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                break
            time.sleep(0.1)
        check(status is not None and os.waitstatus_to_exitcode(status) != 0 if status is not None else False,
              f"ctrl_c: loomrun did not end after Ctrl-C (output {output[-500:]!r})")
        gone = wait_for(lambda: not ranks_of(marker, pid), 5)
        check(gone, f"ctrl_c: processes left: {ranks_of(marker, pid)}")
        # Delivered once: a second SIGINT would make mpirun print that it is forcibly killing.
        check(b"forcibly" not in output, f"ctrl_c: mpirun saw a second interrupt: {output[-500:]!r}")
        print(f"ctrl_c: no rank left after {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        for p in ranks_of(marker, pid):
            os.kill(p, signal.SIGKILL)
        os.close(fd)


def case_binding(loomrun, tmp):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("binding: skipped (needs 2 CPUs)")
        return
    # This machine as a topology: one simulated GPU per CPU, in reverse order, so the plan's binding
    # is not what Open MPI would have chosen by itself.
    chosen = cpus[:2]
    topo = {"nodes": [{"numa_nodes": [{"id": 0, "cpus": chosen}],
                       "gpus": [{"numa": 0, "cpus": [chosen[1]]}, {"numa": 0, "cpus": [chosen[0]]}],
                       "links": {"default": "PIX"}}]}
    path = os.path.join(tmp, "this_machine.json")
    with open(path, "w") as f:
        json.dump(topo, f)
    plan = json.loads(subprocess.run([loomrun, "-np", "2", "--topology", path, "--plan", "--json"], env=env_with(),
                                     capture_output=True, text=True, timeout=60, check=True).stdout)
    expected = {r["rank"]: r["cpus"] for r in plan["ranks"]}
    out = subprocess.run([loomrun, "-np", "2", "--topology", path, "--", "/bin/sh", "-c",
                          'echo "rank=$OMPI_COMM_WORLD_RANK $(grep Cpus_allowed_list /proc/self/status | cut -f2) '
                          'topology=$LOOM_TOPOLOGY"'],
                         env=env_with(), capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, f"binding: loomrun exited {out.returncode}: {out.stderr}")
    seen = {}
    for line in out.stdout.splitlines():
        if line.startswith("rank="):
            rank_word, allowed, topology_word = line.split()
            rank, topology = int(rank_word.split("=", 1)[1]), topology_word.split("=", 1)[1]
            seen[rank] = allowed
            check(topology == path, f"binding: rank {rank} saw LOOM_TOPOLOGY={topology}")
    check(seen == expected, f"binding: ranks ran on {seen}, the plan says {expected}")
    check(expected == {0: str(chosen[1]), 1: str(chosen[0])}, f"binding: unexpected plan {expected}")
    check(not [d for d in os.listdir("/tmp") if d.startswith("loomrun-") and
               os.path.exists(os.path.join("/tmp", d, "rankfile")) and
               os.path.getmtime(os.path.join("/tmp", d)) > time.time() - 30],
          "binding: the rankfile was left behind in /tmp")


def case_plan(loomrun, tmp, fixtures):
    dgx = os.path.join(fixtures, "dgx1_v100_1nic_oneflow.txt")
    out = subprocess.run([loomrun, "-np", "8", "--tp", "2", "--topology", dgx, "--plan"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and "Placement: 8 ranks, TP 2 x DP 4 on 1 node" in out.stdout,
          f"plan: unexpected output {out.stdout[:300]!r} {out.stderr!r}")
    check("NV2" in out.stdout and "naive/planned" in out.stdout, "plan: no link classes or comparison in --plan")
    svg = os.path.join(tmp, "plan.svg")
    out = subprocess.run([loomrun, "-np", "8", "--tp", "2", "--topology", dgx, "--plan", "--json", "--svg", svg],
                         env=env_with(), capture_output=True, text=True, timeout=60)
    plan = json.loads(out.stdout)
    check(plan["tp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]], f"plan: tp_groups {plan['tp_groups']}")
    check(all(b == "NV2" for b in plan["tp_bottlenecks"]), f"plan: bottlenecks {plan['tp_bottlenecks']}")
    check(os.path.exists(svg) and open(svg).read().startswith("<svg"), "plan: --svg wrote no SVG")
    hostfile = os.path.join(tmp, "hosts")
    with open(hostfile, "w") as f:
        f.write("alpha slots=2\nbeta slots=2\n")
    out = subprocess.run([loomrun, "-np", "4", "--hostfile", hostfile, "--dry-run", "--", "./a.out", "x y"],
                         env={"PATH": os.environ["PATH"], "NCCL_DEBUG": "WARN"}, capture_output=True, text=True, timeout=60)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    expected = " ".join(["mpirun", "-np", "4"] + root +
                        ["--hostfile", hostfile, "--map-by", "slot", "--bind-to", "none", "-x", "NCCL_DEBUG", "-x", "PATH", "./a.out",
                         "'x y'"])
    check(out.stdout.strip() == expected, f"dry-run: printed {out.stdout!r}, expected {expected!r}")


def case_errors(loomrun):
    for args, message in [(["-np", "0", "--", "true"], "-np 0: expected at least 1 rank"),
                          (["-np", "3", "--tp", "2", "--", "true"], "not divisible by --tp 2"),
                          (["-np", "2", "-H", "host:abc", "--", "true"], "is not host or host:slots"),
                          (["-np", "2", "--"], "the program is missing"),
                          (["-np", "2", "--hostfile", "/nonexistent", "--", "true"], "cannot read it")]:
        out = subprocess.run([loomrun] + args, env=env_with(), capture_output=True, text=True, timeout=60)
        check(out.returncode == 2 and message in out.stderr, f"errors: {args} gave {out.returncode} {out.stderr!r}")
    # mpirun reads a lone ':' as the start of a second program: refused, nothing started.
    out = subprocess.run([loomrun, "-np", "1", "--", "/bin/echo", "A", ":", "-np", "1", "/bin/echo", "INJECTED"],
                         env=env_with(), capture_output=True, text=True, timeout=60)
    check(out.returncode == 2 and "is ':'" in out.stderr and "INJECTED" not in out.stdout,
          f"errors: a ':' program argument gave {out.returncode} {out.stdout!r} {out.stderr!r}")
    out = subprocess.run([loomrun, "-np", "1", "--", "/bin/echo", "A:", "a : b", "::"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and out.stdout.strip() == "A: a : b ::",
          f"errors: colons inside arguments gave {out.returncode} {out.stdout!r} {out.stderr!r}")
    out = subprocess.run([loomrun, "-np", "1", "--mpirun", "/nonexistent/mpirun", "--", "true"], env=env_with(),
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 127 and "cannot run /nonexistent/mpirun" in out.stderr,
          f"errors: missing mpirun gave {out.returncode} {out.stderr!r}")


def case_hostile(loomrun, tmp):
    """Issue 23's reproductions through loomrun, under a 4 GB address-space limit: each a clean
    error and exit 2 in bounded time (before: a segmentation fault, std::bad_alloc and abort)."""
    deep = os.path.join(tmp, "deep.json")
    with open(deep, "w") as f:
        f.write('{"nodes":[' + "[" * 1000000 + "]" * 1000000 + "]}")
    wide = os.path.join(tmp, "wide.txt")
    with open(wide, "w") as f:
        f.write("GPU0 " + " ".join("n%d" % i for i in range(30000)) + "\n")
    attrs = os.path.join(tmp, "attrs.xml")
    with open(attrs, "w") as f:
        f.write("<system " + " ".join('a%d=""' % i for i in range(100000)) + "/>\n")
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    for args, message in [(["--topology", deep, "--plan"], "exceeds the limit of 32 levels"),
                          (["--topology", wide, "--plan"], "exceeds the limit of 256 NICs per node"),
                          (["--topology", attrs, "--plan"], "attributes: exceeds the limit"),
                          (["--hostfile", "/dev/zero", "--", "true"], "bytes: exceeds the limit")]:
        start = time.monotonic()
        out = subprocess.run([loomrun, "-np", "1"] + args, env=env_with(), capture_output=True, text=True,
                             timeout=60, preexec_fn=limit)
        took = time.monotonic() - start
        check(out.returncode == 2 and message in out.stderr and took < 10,
              f"hostile: {args[:2]} gave {out.returncode} in {took:.1f} s: {out.stderr[:300]!r}")


def case_user_input(loomrun, tmp):
    """Input a new user gets wrong, one at a time: each refused by loomrun itself (exit 2) with a
    message saying what is wrong, before mpirun starts, in bounded time and size."""
    a_file = os.path.join(tmp, "a_file")
    with open(a_file, "w") as f:
        f.write("x")
    dangling = os.path.join(tmp, "dangling")
    os.symlink(os.path.join(tmp, "nowhere"), dangling)
    locked = os.path.join(tmp, "locked")
    os.makedirs(locked)
    os.chmod(locked, 0o500)
    as_root = os.geteuid() == 0  # root writes anywhere: the unwritable directory is not one for root
    foreign = os.path.join(tmp, "foreign_cpus.json")
    with open(foreign, "w") as f:
        json.dump({"nodes": [{"numa_nodes": [{"id": 0, "cpus": "4000-4007"}],
                              "gpus": [{"numa": 0, "cpus": "4000-4003"}, {"numa": 0, "cpus": "4004-4007"}],
                              "links": {"default": "PIX"}}]}, f)
    huge = os.path.join(tmp, "huge_attribute.xml")
    with open(huge, "w") as f:
        f.write('<system version="1"><cpu numaid="0" affinity="' + "f" * (60 << 20) + '"/></system>\n')
    cases = [(["--output-dir", a_file, "--", "true"], "exists and is not a directory"),
             (["--output-dir", dangling, "--", "true"], "a symbolic link to nothing"),
             (["--output-dir", os.path.join(a_file, "sub"), "--", "true"], "is not a directory"),
             (["--max-restarts", "", "--", "true"], "--max-restarts: '': expected an integer"),
             (["--topology", foreign, "--", "true"], "places rank 0 on CPUs 4000-4003"),
             (["--topology", tmp, "--plan"], "the topology file is a directory"),
             (["--topology", huge, "--plan"], "bytes)")]
    if not as_root:
        cases.append((["--output-dir", locked, "--", "true"], "cannot write there"))
    for args, message in cases:
        start = time.monotonic()
        out = subprocess.run([loomrun, "-np", "2"] + args, env=env_with(), capture_output=True, text=True, timeout=60)
        took = time.monotonic() - start
        shown = [a if len(a) < 80 else a[:20] + "..." for a in args]
        check(out.returncode == 2 and message in out.stderr and took < time_bound(10) and len(out.stderr) < 2000,
              f"user input: {shown} gave {out.returncode} in {took:.1f} s ({len(out.stderr)} bytes of stderr): "
              f"{out.stderr[:400]!r}")
    os.chmod(locked, 0o700)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loomrun", required=True)
    ap.add_argument("--only", help="run one case")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(here, "..", "fixtures", "topology")
    with tempfile.TemporaryDirectory() as tmp:
        fake_mpirun = os.path.join(tmp, "mpirun_killed_by_sigterm")
        with open(fake_mpirun, "w") as f:
            f.write("#!/bin/sh\nkill -TERM $$\n")
        os.chmod(fake_mpirun, 0o755)
        cases = {
            "verbatim": lambda: case_verbatim(args.loomrun),
            "exit_code": lambda: case_exit_code(args.loomrun, fake_mpirun),
            "sigint": lambda: case_signal(args.loomrun, signal.SIGINT, "sigint"),
            "sigterm": lambda: case_signal(args.loomrun, signal.SIGTERM, "sigterm"),
            "ctrl_c": lambda: case_ctrl_c(args.loomrun),
            "launcher_killed": lambda: case_signal(args.loomrun, signal.SIGKILL, "launcher_killed"),
            "binding": lambda: case_binding(args.loomrun, tmp),
            "plan": lambda: case_plan(args.loomrun, tmp, fixtures),
            "errors": lambda: case_errors(args.loomrun),
            "hostile": lambda: case_hostile(args.loomrun, tmp),
            "user_input": lambda: case_user_input(args.loomrun, tmp),
        }
        for name, run in cases.items():
            if args.only and name != args.only:
                continue
            print(f"== {name}", flush=True)
            run()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("all loomrun process checks passed")


if __name__ == "__main__":
    main()
