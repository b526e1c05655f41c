#!/usr/bin/env python3
"""Prometheus metrics of a real training run, read with Prometheus' own parser (prometheus_client).

1. LOOM_METRICS=file:DIR: train_gpt at 2 ranks (TP 1 x DP 2) writes DIR/torchloom_rank<r>.prom;
   both files parse, carry their rank, local_rank and host labels, and hold what the run did:
   the steps, the tokens each rank processed (steps x batch per replica x sequence), the bytes
   all-reduced (every step reduces every parameter once, in float32: steps x parameters x 4),
   a finite loss, resident memory, exposed communication within the step time.
2. LOOM_METRICS=port:N: the same program at 1 rank answers an HTTP scrape while it trains.
3. Hostile clients: while a short run trains, a silent client and a slow one (a byte a second) hold
   connections open at all times (reconnecting when the server closes them) and 100 scrapes run at
   once; every scrape is answered, and the job exits within a second of printing its final loss
   (the exporter never waits on a client). A client on another interface than loopback is not
   served by default (port:N binds 127.0.0.1).
4. File sink safety: a symlink planted at the old fixed temporary name (torchloom_rank0.prom.tmp)
   is not followed (its target is unchanged), and removing the metrics directory mid-run costs one
   logged warning, not the run (exit 0, final loss printed).

  check_metrics.py --mpirun mpirun --program build/examples/train_gpt
"""
import argparse
import concurrent.futures
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound, time_scale_note  # noqa: E402  (tests/time_scale.py)

STEPS, BATCH, SEQ = 12, 8, 16
# The project's docs as the text (the runs' lengths and losses were tuned on it, not on the main
# job's corpus).
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")
MODEL = ["--data", DOCS, "--hidden", "32", "--layers", "1", "--heads", "2", "--seq", str(SEQ), "--batch", str(BATCH),
         "--accumulate", "2", "--eval-every", "0", "--sample-bytes", "8", "--log-every", "4"]
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = (s.value, s.labels)
    return out


def file_mode(a):
    directory = tempfile.mkdtemp(prefix="loom_metrics_")
    env = dict(os.environ, LOOM_METRICS="file:" + directory, LOOM_METRICS_INTERVAL="0", OMP_NUM_THREADS="1")
    cmd = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", a.program, "--tp", "1",
           "--steps", str(STEPS)] + MODEL
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    print(run.stdout + run.stderr)
    check(run.returncode in (0, 1) and "final loss" in run.stdout, f"train_gpt ran (exit {run.returncode})")
    m = re.search(r"(\d+) parameters on this rank", run.stdout)
    check(m is not None, "the run printed its parameter count")
    parameters = int(m.group(1)) if m else 0
    for rank in (0, 1):
        path = os.path.join(directory, f"torchloom_rank{rank}.prom")
        check(os.path.exists(path), f"{path} written")
        if not os.path.exists(path):
            continue
        got = samples(open(path).read())
        value = lambda name: got.get(name, (float("nan"), {}))[0]
        labels = got.get("loom_steps_total", (0, {}))[1]
        check(labels.get("rank") == str(rank) and labels.get("local_rank") == str(rank) and labels.get("host"),
              f"rank {rank}: labels {labels}")
        check(value("loom_steps_total") == STEPS and value("loom_step") == STEPS,
              f"rank {rank}: {value('loom_steps_total')} steps recorded, last step {value('loom_step')}; expected {STEPS}")
        tokens = STEPS * (BATCH // 2) * SEQ
        check(value("loom_tokens_total") == tokens, f"rank {rank}: {value('loom_tokens_total')} tokens; expected {tokens}")
        reduced = STEPS * parameters * 4
        check(value("loom_communicated_bytes_total") == reduced,
              f"rank {rank}: {value('loom_communicated_bytes_total')} bytes all-reduced; expected {reduced} "
              f"({STEPS} steps x {parameters} float32 parameters)")
        check(math.isfinite(value("loom_loss")) and 0 < value("loom_loss") < 10, f"rank {rank}: loss {value('loom_loss')}")
        check(value("loom_host_memory_resident_bytes") > 50e6,
              f"rank {rank}: resident memory {value('loom_host_memory_resident_bytes')} bytes")
        check(0 <= value("loom_exposed_communication_seconds_total") <= value("loom_step_seconds_total"),
              f"rank {rank}: exposed communication {value('loom_exposed_communication_seconds_total')} s within "
              f"{value('loom_step_seconds_total')} s of steps")
        check(value("loom_tokens_per_second") > 0, f"rank {rank}: {value('loom_tokens_per_second')} tokens/s")


def port_mode(a):
    with socket.socket() as s:  # a free port, released for the program to take
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LOOM_METRICS=f"port:{port}", OMP_NUM_THREADS="1")
    cmd = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", a.program, "--tp", "1",
           "--steps", "100000"] + MODEL
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    page = r.read().decode()
                if "loom_steps_total" in page and samples(page)["loom_steps_total"][0] >= 2:
                    text = page
                    break
            except OSError:
                pass
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    check(text is not None, f"port {port} answered a scrape during training")
    if text:
        got = samples(text)
        check(got["loom_steps_total"][1].get("rank") == "0", f"scraped labels {got['loom_steps_total'][1]}")
        check(got["loom_tokens_total"][0] == got["loom_steps_total"][0] * BATCH * SEQ,
              "scraped tokens = steps x batch x sequence")


def free_port():
    with socket.socket() as s:  # a free port, released for the program to take
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def non_loopback_address():
    """An IPv4 address of this machine other than 127.x, or None (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            address = s.getsockname()[0]
        return None if address.startswith("127.") else address
    except OSError:
        return None


def hostile_clients_mode(a):
    port = free_port()
    env = dict(os.environ, LOOM_METRICS=f"port:{port}", OMP_NUM_THREADS="1")
    # stdbuf: the rank's stdout line by line, so "final loss" is seen when printed, not at exit.
    cmd = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", "stdbuf", "-oL", a.program, "--tp", "1",
           "--steps", "800", "--lr", "0.03", "--progress", "lines", "--log-every", "100"] + MODEL[:-2]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []  # (time, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), l) for l in proc.stdout), daemon=True)
    reader.start()
    stop = threading.Event()
    counts = {"silent": 0, "slow": 0, "slow_closed": 0}

    def connect():
        while not stop.is_set():
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                time.sleep(0.05)
        return None

    def silent():  # connects and sends nothing; reconnects when the server gives up on it
        while not stop.is_set():
            s = connect()
            if s is None:
                return
            counts["silent"] += 1
            with s:
                s.settimeout(0.2)
                while not stop.is_set():
                    try:
                        if s.recv(4096) == b"":
                            break
                    except socket.timeout:
                        continue
                    except OSError:
                        break

    def slow():  # a request one byte a second; reconnects when cut off
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64 + b"\r\n\r\n"
        while not stop.is_set():
            s = connect()
            if s is None:
                return
            counts["slow"] += 1
            with s:
                try:
                    for i in range(len(request)):
                        s.sendall(request[i:i + 1])
                        if stop.wait(1.0):
                            break
                except OSError:
                    counts["slow_closed"] += 1

    workers = [threading.Thread(target=f, daemon=True) for f in (silent, slow)]
    for w in workers:
        w.start()

    def scrape(_):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.status, r.read().decode()

    results = []
    try:
        deadline = time.monotonic() + 90
        while counts["silent"] == 0 or counts["slow"] == 0:  # both hostile clients are connected
            if time.monotonic() > deadline or proc.poll() is not None:
                check(False, "the endpoint opened and took a silent and a slow client")
                return
            time.sleep(0.05)
        time.sleep(0.2)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
            results = list(pool.map(lambda i: _try(scrape, i), range(100)))
        took = time.monotonic() - start
        ok = [r for r in results if isinstance(r, tuple) and r[0] == 200 and "loom_steps_total" in r[1]]
        check(len(ok) == 100, f"100 concurrent scrapes beside a silent and a slow client: {len(ok)} answered in "
                              f"{took:.2f} s ({[r for r in results if r not in ok][:3]})")
        check(proc.poll() is None and not any("final loss" in l for _, l in lines),
              "the scrapes ran while the job trained (else the run is too short for this check)")
        addr = non_loopback_address()
        if addr:
            try:
                socket.create_connection((addr, port), timeout=2).close()
                check(False, f"port:{port} is not reachable on {addr} (loopback only by default)")
            except OSError:
                check(True, f"port:{port} is not reachable on {addr} (loopback only by default)")
        try:
            proc.wait(timeout=60)  # the run trains for a few seconds
        except subprocess.TimeoutExpired:
            check(False, "the job ended within 60 s with a silent and a slow client connected")
            return
        exited = time.monotonic()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    final = [t for t, l in lines if l.startswith("final loss")]
    check(proc.returncode == 0, f"train_gpt exit status {proc.returncode} with hostile clients connected")
    check(len(final) == 1, "the run printed its final loss")
    if final:
        after = exited - final[0]
        print(f"exit {after:.3f} s after the final loss; silent connections {counts['silent']}, "
              f"slow connections {counts['slow']} (cut off {counts['slow_closed']})")
        check(after < time_bound(1.0), f"the job exited {after:.3f} s after its final loss (limit "
                                       f"{time_bound(1.0):.2f} s{time_scale_note()}) with a silent and a slow client "
                                       "connected")
    if failures:
        print("".join(l for _, l in lines[-30:]))


def sink_mode(a):
    directory = tempfile.mkdtemp(prefix="loom_metrics_sink_")
    victim = os.path.join(tempfile.mkdtemp(prefix="loom_metrics_victim_"), "victim")
    with open(victim, "w") as f:
        f.write("victim\n")
    os.symlink(victim, os.path.join(directory, "torchloom_rank0.prom.tmp"))
    env = dict(os.environ, LOOM_METRICS="file:" + directory, LOOM_METRICS_INTERVAL="0", OMP_NUM_THREADS="1")
    cmd = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", a.program, "--tp", "1",
           "--steps", "3000", "--lr", "0.03", "--progress", "lines", "--log-every", "1000"] + MODEL[:-2]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = os.path.join(directory, "torchloom_rank0.prom")
    deadline = time.monotonic() + 90
    while not os.path.exists(target) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(victim) as f:
        check(f.read() == "victim\n", "a symlink at the old fixed temporary name was not followed")
    time.sleep(0.3)  # a few steps' writes
    # The metrics disk goes away mid-run. Renamed first, in one step: a plain rm -rf races with the
    # exporter, which writes a new temporary file there every step (interval 0), so the directory
    # was at times "not empty" for rmdir and stayed, and no write ever failed.
    gone = directory + ".gone"
    os.rename(directory, gone)
    subprocess.run(["rm", "-rf", gone])
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    check(proc.returncode == 0 and "final loss" in out,
          f"the run went on after its metrics directory vanished (exit {proc.returncode})")
    warnings = [l for l in out.splitlines() if "LOOM_METRICS" in l and "failed" in l]
    check(len(warnings) == 1, f"one warning for the failed metrics writes, not one per step: {warnings[:3]}")
    if failures:
        print(out[-3000:])


def _try(f, *args):
    try:
        return f(*args)
    except Exception as e:  # a failed scrape is counted, not raised
        return repr(e)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpirun", required=True)
    p.add_argument("--program", required=True)
    p.add_argument("--only", choices=["file", "port", "hostile", "sink"], help="run one part only")
    a = p.parse_args()
    for name, mode in (("file", file_mode), ("port", port_mode), ("hostile", hostile_clients_mode), ("sink", sink_mode)):
        if a.only in (None, name):
            mode(a)
    if failures:
        sys.exit(f"FAILED: {len(failures)} check(s)")
    print("OK")


if __name__ == "__main__":
    main()
