#!/usr/bin/env bash
# pip install --no-build-isolation ./python, linked against this build's library installed into a
# scratch prefix, into a scratch target directory; then `import torch, torchloom` from there runs
# a collective. Usage: check_pip_install.sh <build dir> <python>
set -euo pipefail
build=$1
python=${2:-python3}
src=$(cd "$(dirname "$0")/../.." && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/torchloom-pip.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
# The binding's own build directory lives in the scratch space, not in the source tree. Compiled
# without optimisation: what this checks is the packaging (the build, the install, the import),
# and -O0 takes about 40% off the compile that is most of this test's time.
"$python" -m pip install --no-build-isolation --no-deps --disable-pip-version-check -q \
  --target "$scratch/site" \
  -Ccmake.define.torchloom_DIR="$scratch/prefix/lib/cmake/torchloom" \
  -Cbuild-dir="$scratch/build" -Ccmake.build-type=Release "-Ccmake.define.CMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" \
  "$src/python"
cd "$scratch"
SITE="$scratch/site" PYTHONPATH="$scratch/site" "$python" - <<'PY'
import torch, torchloom, os
assert torchloom.__file__.startswith(os.environ["SITE"]), torchloom.__file__
print("imported", torchloom.__version__, "from", torchloom.__file__)
t = torch.ones(3)
torchloom.init().world_comm.all_reduce(t).wait()
assert t.tolist() == [1.0, 1.0, 1.0]
torchloom.finalize()
PY
info=$(PYTHONPATH="$scratch/site" "$python" -m torchloom.info)
grep "^torchloom " <<<"$info"
# The checkpoint tools are a subpackage: installed with it.
PYTHONPATH="$scratch/site" "$python" -m torchloom.checkpoint --help | grep -q consolidate
echo "pip install: OK"
