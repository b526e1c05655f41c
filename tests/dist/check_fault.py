#!/usr/bin/env python3
"""Runs one fault scenario of loom_fault_program under mpirun (or loomrun, or torchrun) and checks what
happened.

A hang is a failure: every run has a hard limit well below CTest's. Each scenario states the
exit status it expects, which typed error each rank must report, the bounds on how long that
took (relative to the operation timeout), what the messages must say (the culprit rank among
it), what the output must never contain (a crash), and that no process of the job is left.
The culprit ("victim") is always the last rank, so a scenario means the same at 2 and 4 ranks.
"""
import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound, time_scale_note  # noqa: E402  (tests/time_scale.py)

T = 2.0  # LOOM_TIMEOUT for the scenarios: short, so the suite stays fast
CRASHES = ["Segmentation fault", "signal 11", "double free", "corruption", "munmap_chunk", "terminate called",
           "signal 6 (Aborted)"]


def expect(kind, low, high, *parts):
    return {"kind": kind, "low": low, "high": high, "parts": list(parts)}


def size_mismatch(others, victim):
    """Ranks pass an all_reduce `others` floats, the victim `victim`: every rank names both."""
    def call(numel):
        return f"all_reduce(seq=0, dtype=Float, numel={numel}, op=sum)"
    return dict(
        env={"LOOM_ON_ERROR": "raise"}, success=True,
        survivors=lambda r, n: expect("MismatchError", 0, 1.0,
                                      f"this rank called {call(others)} but rank {n - 1} called {call(victim)}"),
        victim=lambda v, n: expect("MismatchError", 0, 1.0,
                                   f"this rank called {call(victim)} but rank 0 called {call(others)}"))


# torchrun's summary of a rank killed by SIGKILL (its own wording, not the program's).
TORCHRUN_KILLED = [lambda n: f"rank      : {n - 1} (local_rank: {n - 1})", lambda n: "exitcode  : -9"]


# Each scenario: env, whether the job must exit 0, expectations for "victim" / "survivors" / "all"
# (a dict or a function of (rank, n) returning one), extra output checks, and a wall-clock bound.
SCENARIOS = {
    "bad_input_one_rank": dict(
        env={"LOOM_ON_ERROR": "raise"}, success=True,
        victim=lambda v, n: expect("InvalidArgumentError", 0, 0.5, f"[rank {v}] all_reduce group=world (rank {v} of {n})",
                                   "expected a contiguous tensor, found shape [4, 6]"),
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T,
                                      f"[rank {r}] all_reduce seq=0 group=world (rank {r} of {n}) shape=[4, 6] "
                                      f"dtype=Float op=sum timed out after", "(timeout 2.0 s)",
                                      f"not arrived: {n - 1} (called nothing on it yet)")),
    "skipped_call": dict(
        env={"LOOM_ON_ERROR": "raise"}, success=True,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, f"[rank {r}] all_reduce seq=0",
                                      f"rank not arrived: {n - 1} (called nothing on it yet)")),
    "missing_call_abort": dict(
        env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, f"[rank {r}] all_reduce seq=0 group=world",
                                      f"rank not arrived: {n - 1}")),
    "mismatch_detected": dict(
        env={"LOOM_CHECK_COLLECTIVES": "1", "LOOM_ON_ERROR": "raise"}, success=True,
        survivors=lambda r, n: expect("MismatchError", 0, 1.0,
                                      "collective mismatch: this rank called all_reduce(seq=0, dtype=Float, numel=24, "
                                      f"op=sum) but rank {n - 1} called broadcast(seq=0, dtype=Double, numel=12, root=0)"),
        victim=lambda v, n: expect("MismatchError", 0, 1.0,
                                   "collective mismatch: this rank called broadcast(seq=0, dtype=Double, numel=12, "
                                   "root=0) but rank 0 called all_reduce(seq=0, dtype=Float, numel=24, op=sum)")),
    # Diverged code paths (barrier on some ranks, all_reduce on another, at seq 1) under the default
    # configuration (600 s timeout, abort on error): every rank learns it by asking the others
    # (0.5 s after the call), fails within 2 s with both calls named, and the job ends.
    "diverged_collectives": dict(
        env={}, keep_default_timeout=True, success=False,
        survivors=lambda r, n: expect("MismatchError", 0, 2.0,
                                      "collective mismatch: this rank called barrier(seq=1)",
                                      f"but rank {n - 1} called all_reduce(seq=1, dtype=Float, numel=24, op=sum)",
                                      "the timeout of 600.0 s cannot resolve it"),
        victim=lambda v, n: expect("MismatchError", 0, 2.0,
                                   "collective mismatch: this rank called all_reduce(seq=1, dtype=Float, numel=24, "
                                   "op=sum) but rank 0 called barrier(seq=1)")),
    # Without LOOM_CHECK_COLLECTIVES: the always-on check before host collectives of >= 256 bytes.
    "size_mismatch": size_mismatch(1024, 2048),
    "dtype_mismatch": dict(
        env={"LOOM_ON_ERROR": "raise"}, success=True,
        survivors=lambda r, n: expect("MismatchError", 0, 1.0, f"but rank {n - 1} called all_reduce(seq=0, "
                                                               "dtype=Double, numel=1024, op=sum)")),
    "op_mismatch": dict(
        env={"LOOM_ON_ERROR": "raise"}, success=True,
        survivors=lambda r, n: expect("MismatchError", 0, 1.0, f"but rank {n - 1} called all_reduce(seq=0, "
                                                               "dtype=Float, numel=1024, op=max)")),
    # 16 vs 64 bytes, below LOOM_SIZE_CHECK_BYTES: all-reduces up to 256 KB are checked in band at
    # any size, so every rank gets MismatchError naming both sides at once.
    "small_size_mismatch": size_mismatch(4, 16),
    # A device communicator demanded where there is no GPU: a clear error on every rank at init.
    "nccl_on_without_gpu": dict(
        env={"LOOM_NCCL": "on"}, success=True,
        all=lambda r, n: expect("ConfigError", 0, 5.0, f"[rank {r}] init: LOOM_NCCL=on but")),
    # A LOOM_ variable set on the victim only (a multi-node mpirun without -x).
    "config_differs": dict(
        env={}, victim_env={"LOOM_NCCL": "off"}, success=True,
        all=lambda r, n: expect("ConfigError", 0, 5.0, f"[rank {r}] init: LOOM_NCCL is not the same on every rank: "
                                                       f"'off' on rank {n - 1}, unset on rank")),
    # Malformed values are found at init on every rank (they once broke the abort, or terminated).
    "bad_config_value": dict(
        env={"LOOM_ABORT_GRACE": "abc"}, success=True,
        all=lambda r, n: expect("ConfigError", 0, 5.0, f"[rank {r}] environment variable: LOOM_ABORT_GRACE='abc': "
                                                       "expected seconds between 0 and 600")),
    "timeline_unwritable": dict(
        env={"LOOM_TIMELINE": "/nonexistent/dir/trace"}, success=True,
        all=lambda r, n: expect("ConfigError", 0, 5.0, "LOOM_TIMELINE: creating /nonexistent/dir/trace.rank")),
    # A killed rank: Open MPI's runtime ends the others, naming the killed rank; nobody is left.
    "sigkill_rank": dict(env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
                         output=[lambda n: f"process rank {n - 1} with PID"], output_torchrun=TORCHRUN_KILLED),
    "sigkill_in_ddp_backward": dict(env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
                                    output=[lambda n: f"process rank {n - 1} with PID"], output_torchrun=TORCHRUN_KILLED),
    "sigkill_in_tp_forward": dict(env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
                                  output=[lambda n: f"process rank {n - 1} with PID"], output_torchrun=TORCHRUN_KILLED),
    "sigkill_in_zero_step": dict(env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
                                 output=[lambda n: f"process rank {n - 1} with PID"], output_torchrun=TORCHRUN_KILLED),
    # Stopped with the parameter all-gathers in flight (ZeRO, overlapped with the next forward),
    # under LOOM_ON_ERROR=raise: the survivors' wait_parameters() raises the all-gather's timeout
    # naming the stopped rank (not swallowed to fail later in another collective), and they leave.
    "sigstop_in_zero_overlapped_gather": dict(
        env={"LOOM_ON_ERROR": "raise"}, success=False, exit_code=1,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, "all_gather", "timed out after",
                                      f"no answer from rank {n - 1}")),
    # A pipeline's last stage dies or stops in the middle of a step: the job ends (mpirun names the
    # dead rank); stopped, every other stage times out naming its pipeline rank and the message
    # group it waited in, the stopped stage's neighbour naming the stopped stage.
    "sigkill_in_pipeline_stage": dict(env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
                                      output=[lambda n: f"process rank {n - 1} with PID"],
                                      output_torchrun=TORCHRUN_KILLED),
    "sigstop_in_pipeline_stage": dict(
        env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, f"PipelineExecutor pipeline rank {r}: ",
                                      "did not complete", "timed out after",
                                      *([f"s{n - 1}>s{n - 2}"] if r == n - 2 else []))),
    # A stopped rank never answers: the others time out, say it does not answer, and end the job.
    "sigstop_rank": dict(
        env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, "seq=1", f"no answer from rank {n - 1}")),
    "sigstop_in_ddp_backward": dict(
        env={"LOOM_ON_ERROR": "abort", "LOOM_ABORT_GRACE": "0.5"}, success=False,
        survivors=lambda r, n: expect("TimeoutError", T, 2 * T, "timed out after", f"no answer from rank {n - 1}")),
    # Leaving main without finalize after a timeout, with debug logging: no crash at exit, and the
    # exit code is the program's own (1), every time.
    # At 4 ranks a survivor that reported its timeout and left first is named, with its timeout,
    # in the others' error if theirs has not fired yet (a departure notice). That notice reaches a
    # survivor whose call started later (a loaded machine: 300 ms apart made a rank report after
    # 1.84 s) before its own T, so the lower bound is T / 2: still far above an error that did not
    # wait for the timeout at all.
    "exit_without_finalize": dict(
        env={"LOOM_ON_ERROR": "raise", "LOOM_LOG_LEVEL": "debug"}, success=False, exit_code=1,
        survivors=lambda r, n: expect(("TimeoutError", "CommError"), T / 2, 2 * T, "timed out after")),
    # A rank that leaves with an ordinary error under the default configuration (600 s timeout,
    # abort): the others fail at once naming it, its exit status and the exception's text, and the
    # job ends within seconds (measured from the victim's "LEAVING" line), not at the timeout.
    "rank_throws": dict(
        env={}, keep_default_timeout=True, success=False, ends_within=5.0,
        # The victim's own end: an uncaught exception terminates and aborts, as it should.
        expected_crashes=["terminate called", "signal 6 (Aborted)"],
        output=[lambda n: f"rank {n - 1} ended by an uncaught exception (the data loader found a corrupt record)"],
        survivor_logs=lambda r, n: ["all_reduce seq=5", f"rank {n - 1} ended by an uncaught exception "
                                    "(the data loader found a corrupt record)"]),
    # The victim leaves right after completing a broadcast the others have called but not yet
    # waited for: that broadcast completes there with its values (the departure notice says how far
    # the victim got), and the next call fails naming it, one sequence number later.
    "leaves_after_completing": dict(
        env={}, keep_default_timeout=True, success=False, ends_within=5.0,
        expected_crashes=["terminate called", "signal 6 (Aborted)"],
        survivors=lambda r, n: expect("CommError", 0, 1.0, f"[rank {r}] all_reduce seq=5 group=world",
                                      f"rank {n - 1} ended by an uncaught exception (left right after its broadcast)")),
    "rank_returns_error": dict(
        env={}, keep_default_timeout=True, success=False, ends_within=5.0,
        survivor_logs=lambda r, n: ["all_reduce seq=5", f"rank {n - 1} exited with status 3"]),
    # The same from Python: the exception's text comes from torchloom's excepthook.
    "py_rank_throws": dict(
        env={}, keep_default_timeout=True, success=False, ends_within=5.0, python=True,
        survivor_logs=lambda r, n: ["all_reduce seq=5", f"rank {n - 1} exited with status 1 "
                                    "(RuntimeError: the data loader found a corrupt record)"]),
    "py_rank_exits_3": dict(
        env={}, keep_default_timeout=True, success=False, ends_within=5.0, python=True,
        survivor_logs=lambda r, n: ["all_reduce seq=5", f"rank {n - 1} exited with status 3"]),
    "stall_warning": dict(
        env={"LOOM_TIMEOUT": "4", "LOOM_STALL_WARNING": "0.25"}, success=True,
        all=lambda r, n: expect("none", 0, 4.0),
        output=[lambda n: "still pending after 1.", lambda n: f"rank not arrived: {n - 1}"]),
    # A timeline on a full disk is found at init (its file is created and written there)...
    "timeline_disk_full": dict(
        env={"LOOM_TIMELINE": "@FULL@"}, success=True,
        all=lambda r, n: expect("ConfigError", 0, 5.0, f"[rank {r}] LOOM_TIMELINE: creating",
                                "failed: No space left on device")),
    # ... and one that fails later (the file grows past what the disk takes) is reported at
    # finalize, without ending a successful run with a crash.
    "timeline_write_fails": dict(
        env={"LOOM_TIMELINE": "@TMP@"}, success=True,
        output=[lambda n: "LOOM_TIMELINE: writing", lambda n: "failed: File too large"]),
}

RESULT = re.compile(r"^RESULT rank=(\d+) kind=(\S+) elapsed=([\d.]+) message=(.*)$")


def gpu_visible():
    """Whether nvidia-smi lists a GPU (the scenario needs a machine without one)."""
    import shutil
    if not shutil.which("nvidia-smi"):
        return False
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listing.returncode == 0 and "GPU" in listing.stdout


def leftovers(program, scenario):
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    found = []
    for line in ps.splitlines()[1:]:
        pid, stat, command = line.split(None, 2)
        if int(pid) == os.getpid():
            continue  # this script names the program among its own arguments
        if (program + " ") in command and command.rstrip().endswith(" " + scenario) and not stat.startswith("Z"):
            found.append(line)
    return found


def run_watching(command, env, limit, marker):
    """Runs the job, noting when a line containing `marker` first appears on its stdout. Returns
    (CompletedProcess, marker time or None, end time), or (None, ..) when it ran past `limit`."""
    import threading
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, seen = [], []

    def read_stdout():
        for line in proc.stdout:
            if marker in line and not seen:
                seen.append(time.monotonic())
            lines.append(line)
    reader = threading.Thread(target=read_stdout)
    reader.start()
    errors = []
    err_reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()))
    err_reader.start()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join()
        err_reader.join()
        print("".join(lines) + "".join(errors))
        return None, None, time.monotonic()
    ended = time.monotonic()
    reader.join()
    err_reader.join()
    return (subprocess.CompletedProcess(command, proc.returncode, "".join(lines), "".join(errors)),
            seen[0] if seen else None, ended)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--loomrun", help="start the job with this loomrun instead of mpirun (its exit status too)")
    parser.add_argument("--torchrun", action="store_true",
                        help="start the job with torchrun (env:// rendezvous, Gloo) instead of mpirun")
    args = parser.parse_args()
    spec = SCENARIOS[args.scenario]
    n = args.np
    if args.scenario == "nccl_on_without_gpu" and gpu_visible():
        print("SKIP nccl_on_without_gpu: a GPU is visible here (benchmarks/gpu_check.sh covers this machine)")
        return 0

    env = dict(os.environ, LOOM_TIMEOUT=str(T), OMP_NUM_THREADS="1")
    for k in [k for k in env if k.startswith("LOOM_")]:
        if k != "LOOM_TIMEOUT" or spec.get("keep_default_timeout"):
            del env[k]  # the scenario's environment only; the suite runs under the defaults
    extra = dict(spec["env"])
    workdir = None
    if extra.get("LOOM_TIMELINE") == "@FULL@":
        import tempfile
        workdir = tempfile.mkdtemp(prefix="loom_full_")
        for r in range(n):
            os.symlink("/dev/full", os.path.join(workdir, f"trace.rank{r}.json"))
        extra["LOOM_TIMELINE"] = os.path.join(workdir, "trace")
    if extra.get("LOOM_TIMELINE") == "@TMP@":
        import tempfile
        workdir = tempfile.mkdtemp(prefix="loom_trace_")
        extra["LOOM_TIMELINE"] = os.path.join(workdir, "trace")
    env.update(extra)
    base = [args.mpirun, "--oversubscribe", "--bind-to", "none"]
    program = [args.program]
    if spec.get("python"):
        program = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                                "departure_program.py")]
    if "victim_env" in spec:
        # MPMD: the victim gets its own environment (mpirun -x sets it for that part only).
        exports = [x for k, v in spec["victim_env"].items() for x in ("-x", f"{k}={v}")]
        command = base + ["-np", str(n - 1)] + program + [args.scenario, ":", "-np", "1"] + exports + \
            program + [args.scenario]
    elif args.torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)] + \
            (["--no-python"] if not spec.get("python") else []) + \
            (program if not spec.get("python") else program[1:]) + [args.scenario]
    elif args.loomrun:
        command = [args.loomrun, "-np", str(n), "--"] + program + [args.scenario]
    else:
        command = base + ["-np", str(n)] + program + [args.scenario]
    start = time.monotonic()
    # torchrun ends a stopped rank only after its own 30 s grace for SIGTERM (the survivors'
    # reports, checked below, still come within the timeout).
    stopped_under_torchrun = args.torchrun and args.scenario.startswith("sigstop")
    limit = 75 if stopped_under_torchrun else 45
    proc, leaving_at, ended_at = run_watching(command, env, limit, "LEAVING")
    if proc is None:
        print(f"FAIL {args.scenario}: the job hung (still running after {limit} s)")
        return 1
    wall = ended_at - start
    output = proc.stdout + proc.stderr
    print(f"--- {args.scenario} at {n} ranks: exit {proc.returncode} after {wall:.1f} s ---\n{output}\n---")

    failures = []
    if spec["success"] and proc.returncode != 0:
        failures.append(f"expected exit status 0, found {proc.returncode}")
    if not spec["success"] and proc.returncode == 0:
        failures.append("expected the job to be ended with a non-zero status, found 0")
    if "exit_code" in spec and proc.returncode != spec["exit_code"]:
        failures.append(f"expected exit status {spec['exit_code']} (the program's), found {proc.returncode}")
    if not spec["success"] and wall > (45 if stopped_under_torchrun else 30):
        failures.append(f"the job took {wall:.1f} s to end; the ranks sleep 60 s, so it was not ended by the fault")
    for crash in CRASHES:
        # An expected one is the victim's own end: once, never a survivor's too.
        if output.count(crash) > (1 if crash in spec.get("expected_crashes", []) else 0):
            failures.append(f"a rank crashed: the output contains '{crash}'")
    for make in spec.get("output_torchrun" if args.torchrun else "output", spec.get("output", [])):
        if make(n) not in output:
            failures.append(f"the output lacks '{make(n)}'")
    if "ends_within" in spec:
        # From the victim's departure to mpirun's exit, by the clock of this script: the victim's
        # line is timestamped as it arrives.
        if leaving_at is None:
            failures.append("the victim never reached its departure")
        elif ended_at - leaving_at > time_bound(spec["ends_within"]):
            failures.append(f"the job ended {ended_at - leaving_at:.1f} s after the victim left, expected at most "
                            f"{time_bound(spec['ends_within']):.1f} s{time_scale_note()}")
        else:
            print(f"the job ended {ended_at - leaving_at:.2f} s after the victim left")
    for r in range(n - 1):
        for part in (spec["survivor_logs"](r, n) if "survivor_logs" in spec else []):
            if not any(f"[rank {r}/{n}]" in line and part in line for line in output.splitlines()):
                failures.append(f"rank {r} logged no line with '{part}'")
    time.sleep(0.5)
    left = leftovers(program[-1], args.scenario)
    if left:
        failures.append("processes left behind:\n  " + "\n  ".join(left))

    results = {}
    for line in proc.stdout.splitlines():
        m = RESULT.match(line.strip())
        if m:
            results[int(m.group(1))] = (m.group(2), float(m.group(3)), m.group(4))
    expected = {}
    for r in range(n):
        role = "victim" if r == n - 1 else "survivors"
        make = spec.get(role) or spec.get("all")
        if make:
            expected[r] = make(r, n)
    for rank, e in expected.items():
        aborts = spec["env"].get("LOOM_ON_ERROR", "abort") == "abort"  # (abort is the default)
        if rank not in results and e["kind"] in ("TimeoutError", "MismatchError") and aborts:
            # With LOOM_ON_ERROR=abort a waiter may itself be running the collective (the
            # submit-then-wait fast path) and so cannot raise: the watchdog's logged error and
            # the job's end are the report, as with c10d's asynchronous error handling.
            found_after = r"(?:timed out after|found by asking the other ranks after) ([\d.]+) s"
            logged = [line for line in output.splitlines()
                      if f"[rank {rank}/" in line and "[error]" in line and re.search(found_after, line)]
            if logged:
                m = re.search(found_after, logged[0])
                results[rank] = (e["kind"], float(m.group(1)), logged[0])
        if rank not in results:
            failures.append(f"rank {rank} reported nothing (expected {e['kind']})")
            continue
        got_kind, elapsed, message = results[rank]
        kinds = e["kind"] if isinstance(e["kind"], tuple) else (e["kind"],)
        if got_kind not in kinds:
            failures.append(f"rank {rank}: expected {' or '.join(kinds)}, found {got_kind}: {message}")
        # The upper bound is the reference machine's: what lies beyond the lower one (the timeout
        # itself, for a TimeoutError) is scaled to this machine now (tests/time_scale.py).
        high = e["low"] + time_bound(e["high"] - e["low"])
        if not (e["low"] <= elapsed <= high):
            failures.append(f"rank {rank}: reported after {elapsed:.3f} s, expected between {e['low']} and "
                            f"{high:.2f} s{time_scale_note()}")
        for part in e["parts"]:
            if part not in message:
                failures.append(f"rank {rank}: message lacks '{part}': {message}")
    if args.scenario.startswith("sig") and "SIGNALLING ITSELF" not in output:
        failures.append("the victim never reached the signal")

    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else "FAILED", args.scenario)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
