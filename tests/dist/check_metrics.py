#!/usr/bin/env python3
"""Prometheus metrics of a real training run, read with Prometheus' own parser (prometheus_client).

1. LOOM_METRICS=file:DIR: train_gpt at 2 ranks (TP 1 x DP 2) writes DIR/torchloom_rank<r>.prom;
   both files parse, carry their rank, local_rank and host labels, and hold what the run did:
   the steps, the tokens each rank processed (steps x batch per replica x sequence), the bytes
   all-reduced (every step reduces every parameter once, in float32: steps x parameters x 4),
   a finite loss, resident memory, exposed communication within the step time.
2. LOOM_METRICS=port:N: the same program at 1 rank answers an HTTP scrape while it trains.

  check_metrics.py --mpirun mpirun --program build/examples/train_gpt
"""
import argparse
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STEPS, BATCH, SEQ = 12, 8, 16
MODEL = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq", str(SEQ), "--batch", str(BATCH),
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpirun", required=True)
    p.add_argument("--program", required=True)
    a = p.parse_args()
    file_mode(a)
    port_mode(a)
    if failures:
        sys.exit(f"FAILED: {len(failures)} check(s)")
    print("OK")


if __name__ == "__main__":
    main()
