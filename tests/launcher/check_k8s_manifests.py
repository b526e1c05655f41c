#!/usr/bin/env python3
"""The Kubernetes manifests (examples/kubernetes/*.yaml), checked without a cluster.

  static       both files parse; the PyTorchJob's pods run `torchrun --no-python .../train_gpt`
               from one image, request as many GPUs (nvidia.com/gpu) as nprocPerNode, resume from
               a checkpoint directory on the shared ReadWriteMany claim; the MPIJob's launcher runs
               loomrun over /etc/mpi/hostfile with -np = workers x slotsPerWorker, requests no GPU,
               and each worker requests slotsPerWorker GPUs
  pytorchjob   every pod of the PyTorchJob started on this machine as the training operator would:
               the variables it sets (training-operator 1.7-1.9, envvar.go and master.go: MASTER_ADDR,
               MASTER_PORT, WORLD_SIZE, RANK, PET_*), the manifest's own env, the manifest's command
               (torchrun reads its options from the PET_ variables), each pod in a UTS namespace
               named after the pod. Every rank's loom::init() must log the rank, world, local rank
               and node that the pod and process indices imply, over the env:// bootstrap
               (launcher torchrun), and the training must end and write its checkpoint
  mpijob       the MPIJob's launcher command (loomrun) run as in the launcher pod: the operator's
               OMPI_MCA_ variables and a hostfile as it writes it (one FQDN per worker with
               slots=slotsPerWorker); Open MPI reaches each worker through tests/dist/fake_rsh.sh
               (a UTS namespace named after the host) where the cluster uses ssh. Every rank's init()
               must log rank, world, local rank and node as Open MPI placed it (launcher openmpi)

What cannot be the same here, and is replaced: the master's Service name (MASTER_ADDR) by
127.0.0.1, port 23456 by a free port, an interface the manifest names that this machine lacks by
lo, the image's paths by the build's, ssh by fake_rsh.sh (and the ssh-only plm_rsh_args dropped),
and the training by a small model for a few steps (--steps 60, 2 layers), with the checkpoint
directory in a temporary folder.

Usage: check_k8s_manifests.py --examples DIR [--train-gpt PATH --loomrun PATH] CASE
Exit 0: passed; 1: failed; 77: cannot run here (no PyYAML; for the runs: not root, no unshare, no
torch.distributed.run).
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SKIP = 77
SMALL = ["--layers", "2", "--hidden", "64", "--seq", "32", "--batch", "8", "--eval-every", "0",
         "--progress", "lines", "--sample-bytes", "0"]
INIT_LINE = re.compile(r"initialized: rank (\d+)/(\d+) local (\d+)/(\d+) node (\d+) \((\S+)\) launcher (\S+)")

try:
    import yaml
except ImportError:
    yaml = None


class Failed(Exception):
    pass


def expect(condition, message):
    if not condition:
        raise Failed(message)


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def of_kind(documents, kind):
    found = [d for d in documents if d.get("kind") == kind]
    expect(len(found) == 1, f"expected one {kind}, found {len(found)}")
    return found[0]


def gpus(container, where):
    resources = container.get("resources", {})
    limit = resources.get("limits", {}).get("nvidia.com/gpu")
    request = resources.get("requests", {}).get("nvidia.com/gpu")
    expect(request is None or request == limit,
           f"{where}: nvidia.com/gpu request {request} differs from the limit {limit} (extended resources "
           "must be equal)")
    return 0 if limit is None else int(limit)


def option(args, name):
    """The value of --name=VALUE or --name VALUE in a list of arguments; None when absent."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def checkpoint_on_shared_claim(pod_spec, container, program_args, claims, where):
    directory = option(program_args, "--checkpoint-dir")
    expect(directory is not None, f"{where}: train_gpt has no --checkpoint-dir")
    expect("--resume" in program_args, f"{where}: train_gpt has no --resume: a restarted pod would start over")
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if directory == mount["mountPath"] or directory.startswith(mount["mountPath"].rstrip("/") + "/"):
            claim = volumes[mount["name"]].get("persistentVolumeClaim", {}).get("claimName")
            expect(claim in claims, f"{where}: --checkpoint-dir {directory} is not on a declared claim")
            expect("ReadWriteMany" in claims[claim]["spec"]["accessModes"],
                   f"{where}: claim {claim} is not ReadWriteMany: pods on several nodes write one directory")
            return directory
    raise Failed(f"{where}: --checkpoint-dir {directory} is on no mounted volume")


def pytorchjob_of(examples):
    documents = load(os.path.join(examples, "pytorchjob.yaml"))
    claims = {d["metadata"]["name"]: d for d in documents if d.get("kind") == "PersistentVolumeClaim"}
    return of_kind(documents, "PyTorchJob"), claims


def mpijob_of(examples):
    documents = load(os.path.join(examples, "mpijob.yaml"))
    claims = {d["metadata"]["name"]: d for d in load(os.path.join(examples, "pytorchjob.yaml"))
              if d.get("kind") == "PersistentVolumeClaim"}
    return of_kind(documents, "MPIJob"), claims


def check_pytorchjob_static(job, claims):
    expect(job["apiVersion"] == "kubeflow.org/v1", f"PyTorchJob apiVersion {job['apiVersion']}")
    specs = job["spec"]["pytorchReplicaSpecs"]
    expect(set(specs) == {"Master", "Worker"}, f"replica types {sorted(specs)}, expected Master and Worker")
    expect(specs["Master"]["replicas"] == 1, "more than one Master")
    nproc = job["spec"].get("nprocPerNode")
    expect(nproc is not None and str(nproc).isdigit(),
           f"nprocPerNode {nproc!r}: a number, so that WORLD_SIZE counts processes without Python's torch")
    images = set()
    for kind, spec in specs.items():
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        where = f"PyTorchJob {kind}"
        expect(container["name"] == "pytorch", f"{where}: container '{container['name']}': the operator "
               "takes MASTER_PORT from the container named pytorch")
        images.add(container["image"])
        command = container["command"]
        expect(command[:2] == ["torchrun", "--no-python"] and command[2].endswith("/examples/train_gpt"),
               f"{where}: command {command}, expected torchrun --no-python .../examples/train_gpt")
        ports = [p for p in container.get("ports", []) if p.get("name") == "pytorchjob-port"]
        expect(len(ports) == 1, f"{where}: no port named pytorchjob-port")
        expect(gpus(container, where) == int(nproc),
               f"{where}: nvidia.com/gpu {gpus(container, where)} but nprocPerNode {nproc}: one process per GPU")
        expect(spec.get("restartPolicy") == "OnFailure", f"{where}: restartPolicy {spec.get('restartPolicy')}")
        checkpoint_on_shared_claim(pod, container, container.get("args", []), claims, where)
    expect(len(images) == 1, f"the pods run different images: {sorted(images)}")


def check_mpijob_static(job, claims):
    expect(job["apiVersion"] == "kubeflow.org/v2beta1", f"MPIJob apiVersion {job['apiVersion']}")
    specs = job["spec"]["mpiReplicaSpecs"]
    slots = job["spec"]["slotsPerWorker"]
    workers = specs["Worker"]["replicas"]
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
    worker_pod = specs["Worker"]["template"]["spec"]
    worker = worker_pod["containers"][0]
    expect(launcher["image"] == worker["image"], "launcher and workers run different images")
    expect(gpus(launcher, "MPIJob Launcher") == 0, "the launcher requests GPUs it does not use")
    expect(gpus(worker, "MPIJob Worker") == slots,
           f"workers request {gpus(worker, 'MPIJob Worker')} GPUs for slotsPerWorker {slots}")
    expect(launcher["command"][0].endswith("/loomrun"), f"launcher command {launcher['command']}")
    args = launcher["args"]
    expect("--" in args, "loomrun's program is not after --")
    ours, program = args[:args.index("--")], args[args.index("--") + 1:]
    expect(option(ours, "--hostfile") == "/etc/mpi/hostfile", "loomrun does not use the operator's hostfile")
    expect(option(ours, "-np") == str(workers * slots),
           f"loomrun -np {option(ours, '-np')}, expected workers x slotsPerWorker = {workers * slots}")
    tp = int(option(ours, "--tp") or 1)
    expect(slots % tp == 0, f"--tp {tp} does not divide slotsPerWorker {slots}: a TP group across pods")
    expect(program[0].endswith("/examples/train_gpt"), f"loomrun runs {program[0]}")
    expect(worker["command"][0].endswith("sshd"), "the workers do not serve ssh: v2beta1's mpirun needs it")
    checkpoint_on_shared_claim(worker_pod, worker, program[1:], claims, "MPIJob Worker")


def can_run_pods():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (a UTS namespace per pod)"
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        return "unshare --uts is not allowed here"
    if subprocess.run([sys.executable, "-c", "import torch.distributed.run"], capture_output=True).returncode:
        return "no torch.distributed.run (torchrun) in this Python"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interface(name):
    """The manifest's interface where this machine has it, else lo."""
    return name if os.path.exists(f"/sys/class/net/{name}") else "lo"


def training_args(args, checkpoint_dir, data):
    """The manifest's train_gpt arguments with the substitutions the docstring lists."""
    out = []
    for a in args:
        name = a.split("=", 1)[0]
        if name == "--steps":
            a = "--steps=60"
        elif name == "--checkpoint-dir":
            a = "--checkpoint-dir=" + checkpoint_dir
        elif name == "--data":
            a = "--data=" + data
        elif name == "--save-every":
            a = "--save-every=0"
        out.append(a)
    return out + SMALL


def base_environment():
    """This machine's environment without any launcher's or torchloom's variables (a pod starts
    clean), but with the test suite's Open MPI settings (OMPI_MCA_*) and LOOM_TIMEOUT."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD_", "PMIX_", "PMI_", "SLURM_", "LOOM_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT", "OMPI_MCA_plm_rsh_agent", "OMPI_MCA_orte_default_hostfile")}
    if "LOOM_TIMEOUT" in os.environ:
        env["LOOM_TIMEOUT"] = os.environ["LOOM_TIMEOUT"]
    env["OMP_NUM_THREADS"] = "1"
    env["LOOM_NCCL"] = "off"  # no GPU here; the device communicator is the part left to a GPU cluster
    return env


def init_lines(output):
    return {int(m.group(1)): m.groups() for m in INIT_LINE.finditer(output)}


def run_pytorchjob(job, train_gpt, work):
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    nproc = int(job["spec"]["nprocPerNode"])
    pods = []  # (pod name, replica type, pod index)
    for kind in ("Master", "Worker"):
        for i in range(specs[kind]["replicas"]):
            pods.append((f"{name}-{kind.lower()}-{i}", kind, len(pods)))
    total = len(pods)
    port = free_port()
    checkpoint_dir = os.path.join(work, "checkpoints")
    processes = []
    for pod_name, kind, index in pods:
        container = specs[kind]["template"]["spec"]["containers"][0]
        manifest_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
        expect(manifest_port == 23456, "the example's port changed; update the substitution")
        env = base_environment()
        for item in container.get("env", []):
            value = item["value"]
            if item["name"].endswith("_SOCKET_IFNAME"):
                value = interface(value)
            env[item["name"]] = value
        # What the training operator adds (release 1.9: envvar.go setPodEnv, master.go).
        env.update({
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1",   # the Service f"{name}-master-0"
            "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(total * nproc),
            "RANK": str(index), "PET_NODE_RANK": str(index),
            "PET_NPROC_PER_NODE": str(job["spec"]["nprocPerNode"]),
            "PET_NNODES": str(total),
        })
        command = container["command"]
        torchrun = [sys.executable, "-m", "torch.distributed.run"] + command[1:2] + [train_gpt]
        program = torchrun + training_args(container.get("args", []), checkpoint_dir,
                                           os.path.join(REPO, "examples", "data", "licenses.txt"))
        shell = 'hostname "$0" && exec "$@"'
        log = open(os.path.join(work, pod_name + ".log"), "w+")
        processes.append((pod_name, index, log, subprocess.Popen(
            ["unshare", "--uts", "/bin/sh", "-c", shell, pod_name] + program,
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)))
    failures = []
    seen = {}
    for pod_name, index, log, p in processes:
        try:
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.seek(0)
        output = log.read()
        print(f"--- pod {pod_name}: exit {p.returncode}")
        for line in output.splitlines():
            if "initialized:" in line or line.startswith("final loss"):
                print("   ", line)
        if p.returncode != 0:
            failures.append(f"pod {pod_name} exited with {p.returncode}:\n{output[-3000:]}")
        for rank, groups in init_lines(output).items():
            seen[rank] = (pod_name, index, groups)
    for rank in range(total * nproc):
        pod_index, local = divmod(rank, nproc)
        pod_name = pods[pod_index][0]
        want = (str(rank), str(total * nproc), str(local), str(nproc), str(pod_index), pod_name, "torchrun")
        got = seen.get(rank)
        if got is None:
            failures.append(f"rank {rank}: no 'initialized:' line")
        elif got[2] != want:
            failures.append(f"rank {rank}: init() says {got[2]}, expected {want} (pod {pod_name}, local {local})")
    manifests = [f for f in os.listdir(checkpoint_dir)] if os.path.isdir(checkpoint_dir) else []
    if not manifests:
        failures.append(f"no checkpoint in {checkpoint_dir}")
    if failures:
        raise Failed("\n".join(failures))
    print(f"pytorchjob: {total} pods x {nproc} processes: every rank's init() agrees with the operator's "
          f"variables; checkpoint written ({', '.join(sorted(manifests))})")


def run_mpijob(job, loomrun, train_gpt, work):
    name = job["metadata"]["name"]
    slots = job["spec"]["slotsPerWorker"]
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    hosts = [f"{name}-worker-{i}.{name}.default.svc" for i in range(workers)]
    hostfile = os.path.join(work, "hostfile")
    with open(hostfile, "w") as f:  # as newConfigMap writes it for Open MPI
        f.writelines(f"{h} slots={slots}\n" for h in hosts)
    env = base_environment()
    for item in launcher.get("env", []):
        value = item["value"]
        if item["name"].endswith("_SOCKET_IFNAME"):
            value = interface(value)
        env[item["name"]] = value
    env.update({  # the operator's launcher variables (ompiEnvVars, launcherEnvVars, the slots)
        "K_MPI_JOB_ROLE": "launcher",
        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "OMPI_MCA_orte_default_hostfile": hostfile,
        "OMPI_MCA_orte_set_default_slots": str(slots),
        "NVIDIA_VISIBLE_DEVICES": "",
        "OMPI_MCA_plm_rsh_agent": os.path.join(REPO, "tests", "dist", "fake_rsh.sh"),
    })
    args = launcher["args"]
    ours, program = args[:args.index("--")], args[args.index("--") + 1:]
    command = [loomrun]
    i = 0
    while i < len(ours):
        if ours[i] == "--mca" and ours[i + 1] == "plm_rsh_args":
            i += 3  # ssh's options; fake_rsh.sh takes none
            continue
        if ours[i] == "--mca" and ours[i + 1].endswith("_if_include"):
            command += ["--mca", ours[i + 1], interface(ours[i + 2])]
            i += 3
            continue
        if ours[i] == "--hostfile":
            command += ["--hostfile", hostfile]
            i += 2
            continue
        command.append(ours[i])
        i += 1
    checkpoint_dir = os.path.join(work, "checkpoints")
    command += ["--", train_gpt] + training_args(program[1:], checkpoint_dir,
                                                 os.path.join(REPO, "examples", "data", "licenses.txt"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=work)
    output = done.stdout + done.stderr
    print(f"--- launcher: exit {done.returncode}")
    for line in output.splitlines():
        if "initialized:" in line or line.startswith("final loss"):
            print("   ", line)
    failures = []
    if done.returncode != 0:
        failures.append(f"loomrun exited with {done.returncode}:\n{output[-3000:]}")
    seen = init_lines(output)
    for rank in range(workers * slots):
        node, local = divmod(rank, slots)
        want = (str(rank), str(workers * slots), str(local), str(slots), str(node), hosts[node], "openmpi")
        if seen.get(rank) != want:
            failures.append(f"rank {rank}: init() says {seen.get(rank)}, expected {want}")
    if not (os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir)):
        failures.append(f"no checkpoint in {checkpoint_dir}")
    if failures:
        raise Failed("\n".join(failures))
    print(f"mpijob: {workers} workers x {slots} slots: every rank's init() agrees with Open MPI's placement; "
          "checkpoint written")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", default=os.path.join(REPO, "examples", "kubernetes"))
    parser.add_argument("--train-gpt")
    parser.add_argument("--loomrun")
    parser.add_argument("--work")
    parser.add_argument("case", choices=["static", "pytorchjob", "mpijob"])
    args = parser.parse_args()
    args.train_gpt = args.train_gpt and os.path.abspath(args.train_gpt)
    args.loomrun = args.loomrun and os.path.abspath(args.loomrun)
    if yaml is None:
        print("SKIP: PyYAML is not installed (pip install pyyaml)")
        return SKIP
    try:
        pytorchjob, claims = pytorchjob_of(args.examples)
        mpijob, mpi_claims = mpijob_of(args.examples)
        check_pytorchjob_static(pytorchjob, claims)
        check_mpijob_static(mpijob, mpi_claims)
        if args.case == "static":
            print("static: both manifests request one GPU per rank and run the right programs")
            return 0
        why = can_run_pods()
        if why:
            print("SKIP:", why)
            return SKIP
        work = args.work or tempfile.mkdtemp(prefix="k8s_manifests_")
        work = os.path.join(work, args.case)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        if args.case == "pytorchjob":
            run_pytorchjob(pytorchjob, args.train_gpt, work)
        else:
            run_mpijob(mpijob, args.loomrun, args.train_gpt, work)
    except Failed as e:
        print("FAILED:", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
