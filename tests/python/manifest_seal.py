"""Rewrites a checkpoint's manifest.json on purpose and recomputes its own checksum, as a tool
would (the `xxhash` package, independently of the C++ writer): the forgeries the tests feed the
loader get past the checksum and reach the checks behind it."""
import json

import xxhash


def reseal(path, change):
    """Applies change(manifest) to the manifest at path and recomputes its checksum."""
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    manifest.pop("manifest_xxh3_64", None)
    compact = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False).encode()
    manifest["manifest_xxh3_64"] = xxhash.xxh3_64_hexdigest(compact)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
