#!/usr/bin/env python3
"""The layering at the level of symbols: no layer's objects call a function defined in a layer above.

The include directories of cmake/LoomLayers.cmake stop an upward #include at compile time, but all
layers are linked into one libtorchloom, so a function of a higher layer declared by hand and
called would compile and link. This reads what each layer's object files leave undefined (nm) and
refuses every symbol that only a layer it may not use defines. Which layer may use which is read
from the same loom_layer_include_dir() calls that build the include directories, so the two checks
cannot drift apart.

  check_layer_symbols.py --layers cmake/LoomLayers.cmake --nm nm core=a.o:b.o comm=c.o ...
  check_layer_symbols.py --self-test --cxx c++      # proves the check refuses an upward call
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

# Third-party libraries and the layers that may call them (mangled or C names).
THIRD_PARTY = [("MPI", re.compile(r"^(P?MPI_|ompi_)"), {"comm"}),
               ("NCCL", re.compile(r"^nccl[A-Z]"), {"comm"}),
               ("the CUDA runtime", re.compile(r"^cuda[A-Z]"), {"comm"}),
               ("spdlog", re.compile(r"6spdlog"), {"core"})]

# Public header entries of loom_layer_include_dir() and the layer each belongs to.
HEADER_LAYER = {"loom/topology": "topology", "loom/comm": "comm", "loom/runtime.h": "runtime",
                "loom/parallel": "parallel", "loom/amp": "amp", "loom/train": "train"}


def allowed_layers(cmake_text):
    """{layer: set of layers it may use} from the loom_layer_include_dir(<layer> ...) calls."""
    allowed = {}
    for layer, entries in re.findall(r"^loom_layer_include_dir\((\w+)([^)]*)\)", cmake_text, re.M):
        uses = {"core", layer}
        for entry in entries.split():
            if entry in HEADER_LAYER:
                uses.add(HEADER_LAYER[entry])
        allowed[layer] = uses
    if not allowed:
        raise SystemExit("no loom_layer_include_dir() calls found: the layer list moved")
    return allowed


def symbols(nm, objects):
    """(defined, undefined) external symbols of the objects, mangled."""
    defined, undefined = set(), set()
    for chunk in range(0, len(objects), 200):
        out = subprocess.run([nm, "-g", "-P", *objects[chunk:chunk + 200]], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 2 or parts[0].endswith(":"):
                continue
            name, kind = parts[0], parts[1]
            (undefined if kind in ("U", "w", "v") else defined).add(name)
    return defined, undefined - defined


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else list(names)


def violations(allowed, layer_objects, nm):
    defined, undefined = {}, {}
    for layer, objects in layer_objects.items():
        defined[layer], undefined[layer] = symbols(nm, objects)
    found = []
    for layer, missing in undefined.items():
        if layer not in allowed:
            raise SystemExit(f"layer {layer} has objects but no loom_layer_include_dir() entry")
        usable = set()
        for other in allowed[layer]:
            usable |= defined.get(other, set())
        for other, names in defined.items():
            if other in allowed[layer]:
                continue
            upward = sorted((missing & names) - usable)
            for plain in demangle(upward):
                found.append(f"{layer} calls {plain}, which only {other} defines")
        for library, pattern, owners in THIRD_PARTY:
            if layer in owners:
                continue
            calls = sorted(name for name in missing if pattern.search(name))
            for plain in demangle(calls)[:5]:
                found.append(f"{layer} calls {plain} of {library}, which only {' and '.join(sorted(owners))} may call")
    return found


def parse_layer_args(specs):
    layer_objects = {}
    for spec in specs:
        layer, _, objects = spec.partition("=")
        files = [f for f in objects.split(":") if f]
        if not files:
            raise SystemExit(f"layer {layer}: no object files given")
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise SystemExit(f"layer {layer}: {len(missing)} object files missing, e.g. {missing[0]} (build first)")
        layer_objects[layer] = files
    return layer_objects


def self_test(cxx, nm):
    """Two one-function layers, the lower calling the upper: the check must refuse exactly that call,
    and accept the same call made downward."""
    cmake = "loom_layer_include_dir(core x)\nloom_layer_include_dir(comm x loom/comm)\n"
    allowed = allowed_layers(cmake)
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(name, code):
            src, obj = os.path.join(tmp, name + ".cpp"), os.path.join(tmp, name + ".o")
            with open(src, "w") as f:
                f.write(code)
            subprocess.run([cxx, "-c", "-o", obj, src], check=True)
            return obj
        lower = compile_one("lower", "namespace loom { int upper_helper(); int lower_entry() { return upper_helper(); } }\n")
        upper = compile_one("upper", "namespace loom { int upper_helper() { return 1; } }\n")
        up = violations(allowed, {"core": [lower], "comm": [upper]}, nm)
        down = violations(allowed, {"comm": [lower], "core": [upper]}, nm)
        mpi_call = "extern \"C\" int MPI_Barrier(void*); int sync_all() { return MPI_Barrier(nullptr); }\n"
        mpi_outside = violations(allowed, {"core": [compile_one("mpi_user", mpi_call)]}, nm)
        mpi_inside = violations(allowed, {"comm": [compile_one("mpi_user", mpi_call)]}, nm)
    ok = (len(up) == 1 and "loom::upper_helper()" in up[0] and "only comm defines" in up[0] and not down and
          len(mpi_outside) == 1 and "MPI_Barrier of MPI" in mpi_outside[0] and not mpi_inside)
    print("self-test: upward call", up or "NOT refused", "| downward:", down or "accepted",
          "| MPI outside comm:", mpi_outside or "NOT refused", "| inside:", mpi_inside or "accepted")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", help="cmake/LoomLayers.cmake")
    p.add_argument("--nm", default="nm")
    p.add_argument("--cxx", default="c++")
    p.add_argument("--self-test", action="store_true")
    p.add_argument("objects", nargs="*", help="<layer>=<object>:<object>...")
    args = p.parse_args()
    if args.self_test:
        return self_test(args.cxx, args.nm)
    with open(args.layers) as f:
        allowed = allowed_layers(f.read())
    layer_objects = parse_layer_args(args.objects)
    found = violations(allowed, layer_objects, args.nm)
    counts = ", ".join(f"{layer} {len(objs)}" for layer, objs in layer_objects.items())
    if found:
        print(f"FAIL: {len(found)} upward calls (objects: {counts}):")
        for line in found:
            print("  " + line)
        return 1
    print(f"no layer calls a layer above it (objects: {counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
