#!/usr/bin/env python3
"""Reads every shard of a torchloom checkpoint with the Python `safetensors` package and checks
it against the manifest (each shard holds exactly the slices the manifest places in it, with the
manifest's dtype and shape; each shard's XXH3-64 is the manifest's, and the manifest's own checksum
matches its content, both computed with the `xxhash` package) and against the expected values the
C++ test wrote (float64 lists).

Usage: check_safetensors.py CHECKPOINT_DIR EXPECTED_JSON   (exit status 0: all good)
"""
import json
import os
import sys

import xxhash
from safetensors import safe_open

DTYPES = {"F32": "torch.float32", "F64": "torch.float64", "F16": "torch.float16", "BF16": "torch.bfloat16",
          "I8": "torch.int8", "U8": "torch.uint8", "I16": "torch.int16", "I32": "torch.int32", "I64": "torch.int64",
          "BOOL": "torch.bool"}


def manifest_checksum_failure(manifest):
    """The manifest's own checksum: XXH3-64 of its compact JSON without that member, in file order
    (json.load keeps the order; the separators and raw UTF-8 are those of the C++ writer's dump())."""
    content = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    compact = json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()
    found = xxhash.xxh3_64_hexdigest(compact)
    if manifest.get("manifest_xxh3_64") != found:
        return f"manifest checksum {manifest.get('manifest_xxh3_64')}, content hashes to {found}"
    return None


def main():
    directory, expected_path = sys.argv[1], sys.argv[2]
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    with open(expected_path) as f:
        expected = json.load(f)
    failures = []
    if (failure := manifest_checksum_failure(manifest)) is not None:
        failures.append(failure)
    placed = {i: {} for i in range(len(manifest["shards"]))}
    for name, record in manifest["tensors"].items():
        for s in record["slices"]:
            shape = list(record["shape"])
            if record["split_dim"] is not None:
                shape[record["split_dim"]] = s["length"]
            placed[s["shard"]][name] = (record["dtype"], shape)
    found = {}
    for i, shard in enumerate(manifest["shards"]):
        path = os.path.join(directory, shard["file"])
        if os.path.getsize(path) != shard["bytes"]:
            failures.append(f"{path}: {os.path.getsize(path)} bytes, manifest says {shard['bytes']}")
        with open(path, "rb") as f:
            digest = xxhash.xxh3_64_hexdigest(f.read())
        if digest != shard["xxh3_64"]:
            failures.append(f"{path}: XXH3-64 {digest}, manifest says {shard['xxh3_64']}")
        with safe_open(path, framework="pt") as f:
            if f.metadata().get("format") != "pt":
                failures.append(f"{path}: metadata {f.metadata()} lacks format=pt")
            keys = set(f.keys())
            if keys != set(placed[i]):
                failures.append(f"{path}: holds {sorted(keys)}, manifest places {sorted(placed[i])}")
            for key in keys:
                t = f.get_tensor(key)
                dtype, shape = placed[i].get(key, (None, None))
                if str(t.dtype) != DTYPES.get(dtype) or list(t.shape) != shape:
                    failures.append(f"{path}: {key} is {t.dtype} {list(t.shape)}, manifest says {dtype} {shape}")
                found.setdefault(key, []).append(t)
    for name, want in expected.items():
        pieces = found.get(name, [])
        if len(pieces) != 1:
            failures.append(f"{name}: found in {len(pieces)} shards, expected exactly one")
            continue
        t = pieces[0]
        values = t.double().flatten().tolist()
        if list(t.shape) != want["shape"] or values != want["values"]:
            failures.append(f"{name}: {list(t.shape)} {values[:6]}... differs from the expected "
                            f"{want['shape']} {want['values'][:6]}...")
    for failure in failures:
        print("FAIL " + failure)
    print(f"check_safetensors: {len(manifest['shards'])} shards, {len(found)} tensors read, "
          f"{len(expected)} compared, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
