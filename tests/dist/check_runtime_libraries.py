#!/usr/bin/env python3
"""The process loads one CUDA runtime and one NCCL, LibTorch's, whatever LD_LIBRARY_PATH says.

1. The library's and the programs' run paths name only directories that exist (no empty entry,
   which the loader reads as the working directory), and are DT_RPATH, which the loader searches
   before LD_LIBRARY_PATH (RUNPATH comes after it).
2. With the CUDA toolkit's own library directory first on LD_LIBRARY_PATH (older libcudart and
   libnccl there), an example still resolves libcudart.so.13 and libnccl.so.2 to LibTorch's.
3. A process that loads an older CUDA runtime anyway (LD_PRELOAD) gets no device: with LOOM_NCCL=on
   init() raises, naming both versions; with the default it runs on the CPU.
"""
import argparse
import os
import re
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--library", required=True)
parser.add_argument("--program", required=True, help="examples/train_ddp")
parser.add_argument("--mpirun", required=True)
parser.add_argument("--toolkit-lib", default="/usr/local/cuda/lib64")
args = parser.parse_args()
failures = []


def dynamic_section(path):
    return subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout


for path in (args.library, args.program):
    section = dynamic_section(path)
    if "(RUNPATH)" in section:
        failures.append(f"{path}: has RUNPATH (searched after LD_LIBRARY_PATH), expected RPATH")
    m = re.search(r"\(RPATH\)\s+Library rpath: \[(.*)\]", section)
    if not m:
        failures.append(f"{path}: no RPATH")
        continue
    entries = m.group(1).split(":")
    print(f"{os.path.basename(path)} RPATH: {entries}")
    for entry in entries:
        if entry == "":
            failures.append(f"{path}: an empty RPATH entry (the working directory)")
        elif not os.path.isdir(entry):
            failures.append(f"{path}: RPATH entry {entry} does not exist")

env = dict(os.environ, LD_LIBRARY_PATH=args.toolkit_lib + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
resolved = subprocess.run(["ldd", args.program], capture_output=True, text=True, env=env).stdout
torch_side = None
for name in ("libcudart.so.13", "libnccl.so.2"):
    m = re.search(rf"^\s*{re.escape(name)} => (\S+)", resolved, re.M)
    if not m:
        continue  # a build without NCCL
    print(f"with LD_LIBRARY_PATH={args.toolkit_lib}: {name} => {m.group(1)}")
    if m.group(1).startswith(args.toolkit_lib) or "/nvidia/" not in m.group(1):
        failures.append(f"{name} resolves to {m.group(1)}, not LibTorch's copy")

old_runtime = os.path.join(args.toolkit_lib, "libcudart.so.13")
if "libcudart.so.13" in resolved and os.path.exists(old_runtime):
    base = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "1", "-x", f"LD_PRELOAD={old_runtime}"]
    on = subprocess.run(base + ["-x", "LOOM_NCCL=on", args.program, "--steps", "5"], capture_output=True, text=True,
                        timeout=120)
    text = on.stdout + on.stderr
    wanted = "LOOM_NCCL=on but rank 0: the CUDA runtime loaded (13.0) is older than LibTorch's (13."
    if on.returncode == 0 or wanted not in text:
        failures.append(f"LD_PRELOAD of {old_runtime} with LOOM_NCCL=on: expected a ConfigError with '{wanted}', "
                        f"found exit {on.returncode}:\n{text[-2000:]}")
    auto = subprocess.run(base + [args.program, "--steps", "100"], capture_output=True, text=True, timeout=120)
    if auto.returncode != 0:
        failures.append(f"LD_PRELOAD of {old_runtime} with LOOM_NCCL=auto: expected a CPU run, found exit "
                        f"{auto.returncode}:\n{(auto.stdout + auto.stderr)[-2000:]}")
else:
    print(f"SKIP the older-runtime case: {old_runtime} is not here")

for f in failures:
    print("FAIL", f)
print("PASS" if not failures else "FAILED")
sys.exit(1 if failures else 0)
