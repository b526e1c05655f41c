#!/usr/bin/env python3
"""Several hosts on one machine: Open MPI starts a daemon per host through fake_rsh.sh, each in a
UTS namespace named after the host, so `-H hostA:2,hostB:2` runs 2 ranks per host with TCP
between the hosts and shared memory inside them.

  same-loss     train_gpt TP 2 x DP 2 on two hosts (TP groups inside a host, DP across) ends with
                the same final loss, to the last digit, as on one host
  zero-same-loss
                the same with ZeRO stage 2 and the parameter all-gather overlapping the forward
                (reduce-scatters and all-gathers of the DP groups over TCP between the hosts):
                the same final loss, to the last digit, as plain data parallelism on one host
  host-killed   every rank of hostB killed by SIGKILL mid-run: the job ends within seconds,
                non-zero, and its output names hostB
  resume-fewer  a checkpoint written by 4 ranks on two hosts resumes on one host at 2 ranks
                (TP 2 x DP 1): resharded, training continues from its step
  restart-without-host
                loomrun --max-restarts 1 --drop-dead-hosts: hostB goes down (its ranks killed, its
                "ssh" refused) after a checkpoint; loomrun starts the job again on hostA alone at 2
                ranks, which resumes from the newest checkpoint (resharded to DP 1) and finishes
  per-host-topology
                LOOM_TOPOLOGY names one path, and each host holds its own file there (hostA two
                NVLink-bridged RTX 3090s on 6 CPUs, hostB two PCIe RTX 5090s on 64): the plan joins
                both nodes as each described itself

Usage: check_multihost.py --loomrun PATH --train-gpt PATH --work DIR CASE
Exit 0: passed; 1: failed; 77: cannot run here (not root, or no unshare/nsenter).
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from time_scale import time_bound, time_scale_note  # noqa: E402  (tests/time_scale.py)

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ["--layers", "2", "--hidden", "64", "--seq", "32", "--batch", "8", "--eval-every", "0", "--progress", "lines"]


def environment():
    env = dict(os.environ)
    env["OMPI_MCA_plm_rsh_agent"] = os.path.join(HERE, "fake_rsh.sh")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(args, command, timeout):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment())


def final_loss(output):
    found = re.search(r"^final loss (\S+)$", output, re.M)
    return found.group(1) if found else None


def same_loss(args):
    # Ranks 0, 1 on hostA and 2, 3 on hostB: TP groups (consecutive ranks) inside a host.
    where = run(args, [args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--", "/bin/sh", "-c",
                       "echo rank $OMPI_COMM_WORLD_RANK on $(hostname)"], 60)
    placed = sorted(re.findall(r"rank (\d) on (\w+)", where.stdout))
    if placed != [("0", "hostA"), ("1", "hostA"), ("2", "hostB"), ("3", "hostB")]:
        print("FAIL placement:", placed, where.stderr[-1500:])
        return 1
    train = [args.train_gpt, "--steps", "20", "--deterministic"] + SMALL
    two = run(args, [args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "--"] + train, 300)
    one = run(args, [args.loomrun, "-np", "4", "--tp", "2", "--"] + train, 300)
    a, b = final_loss(two.stdout), final_loss(one.stdout)
    print(f"final loss on two hosts {a}, on one host {b}")
    if a is None or a != b:
        print(two.stdout[-2000:], two.stderr[-2000:])
        return 1
    return 0


def zero_same_loss(args):
    train = [args.train_gpt, "--steps", "20", "--deterministic"] + SMALL
    zero = run(args, [args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "--"] + train +
               ["--zero", "2", "--zero-overlap", "--bucket-cap-mb", "0.05"], 300)
    plain = run(args, [args.loomrun, "-np", "4", "--tp", "2", "--"] + train, 300)
    a, b = final_loss(zero.stdout), final_loss(plain.stdout)
    print(f"final loss with ZeRO 2 (overlapped gather) on two hosts {a}, plain DP on one host {b}")
    if "ZeRO" not in zero.stdout + zero.stderr:
        print("FAIL: the two-host run does not say it trained with ZeRO\n", zero.stdout[-2000:], zero.stderr[-2000:])
        return 1
    if a is None or a != b:
        print(zero.stdout[-2000:], zero.stderr[-2000:])
        return 1
    return 0


def ranks_on(args, wanted):
    """The process ids of train_gpt ranks running on fake host `wanted`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if args.train_gpt.encode() not in f.read():
                    continue
            host = subprocess.run(["nsenter", "-t", pid, "-u", "hostname"], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if host == wanted:
            found.append(int(pid))
    return found


def kill_host_b_when(args, job, ready, limit, before=lambda: None):
    """Once ready() holds, runs before() and SIGKILLs the 2 ranks on hostB; then waits for the job to
    end, `limit` seconds in all. The time of the kill, or None (said why) when there were not 2
    ranks to kill or the job did not end."""
    killed_at = None
    deadline = time.time() + limit
    while job.poll() is None and time.time() < deadline:
        if killed_at is None and ready():
            before()
            victims = ranks_on(args, "hostB")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
            print(f"killed the {len(victims)} ranks of hostB: {victims}")
            if len(victims) != 2:
                job.kill()
                return None
        time.sleep(0.05)
    if job.poll() is None:
        job.kill()
        print(f"FAIL: the job did not end within {limit} s")
        return None
    if killed_at is None:
        print(f"FAIL: the job ended (status {job.returncode}) before hostB's ranks were killed")
    return killed_at


def host_killed(args):
    train = [args.train_gpt, "--steps", "400"] + SMALL
    job = subprocess.Popen([args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "--"] + train,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
    output = []
    reader = threading.Thread(target=lambda: output.extend(iter(job.stdout.readline, "")), daemon=True)
    reader.start()
    killed_at = kill_host_b_when(args, job, lambda: re.search(r"^step +\d+/", "".join(output), re.M), 120)
    if killed_at is None:
        return 1
    reader.join(timeout=10)
    text = "".join(output)
    ended = time.time() - killed_at
    print(f"job ended {ended:.1f} s after the kill, exit status {job.returncode}")
    named = "hostB" in text
    if job.returncode == 0 or ended > time_bound(20) or not named:
        print("FAIL:", "exit 0" if job.returncode == 0 else "",
              f"{ended:.1f} s{time_scale_note()}" if ended > time_bound(20) else "",
              "" if named else "hostB not named", text[-2000:])
        return 1
    return 0


def resume_fewer(args):
    ckpt = os.path.join(args.work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    first = run(args, [args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "--", args.train_gpt,
                       "--steps", "12", "--save-every", "6", "--checkpoint-dir", ckpt] + SMALL, 300)
    if not os.path.exists(os.path.join(ckpt, "step_000012", "manifest.json")):
        print("FAIL: no checkpoint at step 12", first.stdout[-1500:], first.stderr[-1500:])
        return 1
    second = run(args, [args.loomrun, "-np", "2", "--tp", "2", "--", args.train_gpt, "--steps", "18", "--resume",
                        "--checkpoint-dir", ckpt] + SMALL, 300)
    resumed = re.search(r"resumed from .*step_000012 at step 12", second.stdout)
    steps = re.findall(r"^step +(\d+)/18", second.stdout, re.M)
    print(f"resumed at 2 ranks: {bool(resumed)}, steps run {steps[:1]}..{steps[-1:]}, "
          f"final loss {final_loss(second.stdout)}, exit {second.returncode}")
    # Exit 1 is train_gpt's own verdict on a run this short (loss not below 60% of its start).
    verdict_only = second.returncode == 1 and "FAILED, the loss did not fall" in second.stdout
    if not resumed or not steps or int(steps[0]) <= 12 or final_loss(second.stdout) is None or \
            (second.returncode != 0 and not verdict_only):
        print(second.stdout[-2000:], second.stderr[-2000:])
        return 1
    return 0


def restart_without_host(args):
    ckpt = os.path.join(args.work, "ckpt-restart")
    down = os.path.join(args.work, "down")
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(down, ignore_errors=True)
    os.makedirs(down)
    env = environment()
    env["LOOM_TEST_DOWN_HOSTS"] = down  # fake_rsh.sh refuses the hosts named there
    steps = 120
    job = subprocess.Popen([args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "--max-restarts", "1",
                            "--drop-dead-hosts", "--", args.train_gpt, "--steps", str(steps), "--save-every", "10",
                            "--checkpoint-dir", ckpt, "--resume"] + SMALL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output, stamped = [], []  # lines, and (time, line) for the timing
    def read():
        for line in iter(job.stdout.readline, ""):
            output.append(line)
            stamped.append((time.time(), line))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # hostB is off (no new daemon starts there) and its ranks die, once the checkpoint of step 10 exists.
    killed_at = kill_host_b_when(args, job, lambda: os.path.exists(os.path.join(ckpt, "step_000010", "manifest.json")),
                                 240, before=lambda: open(os.path.join(down, "hostB"), "w").close())
    if killed_at is None:
        print("".join(output)[-3000:])
        return 1
    reader.join(timeout=10)
    text = "".join(output)
    shrunk = re.search(r"hostB did not answer .*starting again without it: -np 2 -H hostA:2", text)
    resumed = re.search(r"resumed from .*step_0000(\d\d) at step (\d+)", text)
    after = [(t, line) for t, line in stamped if killed_at and t > killed_at and re.match(r"step +\d+/", line)]
    restarted_first_step = next((t for t, line in after if resumed and int(re.match(r"step +(\d+)/", line).group(1)) >
                                 int(resumed.group(2))), None)
    ranks_line = re.findall(r"train_gpt: (\d) ranks = TP 2 x DP (\d)", text)
    for line in re.findall(r"^loomrun: .*$", text, re.M):
        print(line)
    print(f"shrunk: {bool(shrunk)}; resumed: {resumed.group(0) if resumed else None}; runs: {ranks_line}; "
          f"exit {job.returncode}; final loss {final_loss(text)}")
    if restarted_first_step:
        print(f"kill of hostB to the first step after the restart: {restarted_first_step - killed_at:.2f} s")
    verdict_only = job.returncode == 1 and "FAILED, the loss did not fall" in text
    if not shrunk or not resumed or ranks_line[-1:] != [("2", "1")] or final_loss(text) is None or \
            not re.search(rf"^step +{steps}/{steps}", text, re.M) or (job.returncode != 0 and not verdict_only):
        print(text[-4000:])
        return 1
    return 0


def per_host_topology(args):
    fixtures = os.path.join(HERE, "..", "fixtures", "topology")
    path = os.path.join(args.work, "topology.txt")
    # What the launching machine itself would read at that path: neither host's.
    shutil.copy(os.path.join(fixtures, "gtx1080ti_2gpu_phb_numa_na.txt"), path)
    shutil.copy(os.path.join(fixtures, "rtx3090_2gpu_nvlink_bridge_nv4.txt"), path + ".hostA")
    shutil.copy(os.path.join(fixtures, "rtx5090_2gpu_phb_workstation.txt"), path + ".hostB")
    env = environment()
    env["LOOM_TEST_PER_HOST_FILE"] = path  # fake_rsh.sh mounts PATH.HOST onto PATH on each host
    job = subprocess.run([args.loomrun, "-np", "4", "-H", "hostA:2,hostB:2", "--tp", "2", "-x", "LOOM_TOPOLOGY=" + path,
                          "--", args.train_gpt, "--steps", "2"] + SMALL,
                         capture_output=True, text=True, timeout=300, env=env)
    text = job.stdout
    rows = {r: (h, c) for r, h, c in re.findall(r"^  (\d)     (host\w) +\d +(\S+)", text, re.M)}
    tp_links = re.findall(r"^  \d     \d,\d +(host\w):\d,\d +(\w+)", text, re.M)
    print(f"ranks (host, CPUs): {rows}; TP groups (host, link): {tp_links}; exit {job.returncode}")
    expected_rows = {"0": ("hostA", "0-2"), "1": ("hostA", "3-5"), "2": ("hostB", "0-31"), "3": ("hostB", "32-63")}
    # Exit 1 is train_gpt's own verdict on a run this short (loss not below 60% of its start).
    verdict_only = job.returncode == 1 and "FAILED, the loss did not fall" in text
    if "on 2 nodes" not in text or rows != expected_rows or sorted(tp_links) != [("hostA", "NV4"), ("hostB", "PHB")] \
            or final_loss(text) is None or (job.returncode != 0 and not verdict_only):
        print(text[-3000:], job.stderr[-2000:])
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loomrun", required=True)
    parser.add_argument("--train-gpt", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("case", choices=["same-loss", "zero-same-loss", "host-killed", "resume-fewer", "restart-without-host",
                                         "per-host-topology"])
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        print("SKIP: fake hosts need root, unshare and nsenter")
        return 77
    os.makedirs(args.work, exist_ok=True)
    return {"same-loss": same_loss, "zero-same-loss": zero_same_loss, "host-killed": host_killed, "resume-fewer": resume_fewer,
            "restart-without-host": restart_without_host, "per-host-topology": per_host_topology}[args.case](args)


if __name__ == "__main__":
    sys.exit(main())
