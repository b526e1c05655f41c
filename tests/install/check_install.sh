#!/usr/bin/env bash
# Installs torchloom from BUILD_DIR into a fresh prefix (as an unprivileged user when run as root,
# so that writing anything outside the prefix fails), builds tests/install/consumer against it with
# LibTorch found through Torch_DIR rather than the prefix path the library was built with, and runs
# the consumer under mpirun at 2 ranks.
#   bash tests/install/check_install.sh BUILD_DIR MPIRUN
set -euo pipefail
build=$(cd "$1" && pwd)
mpirun=$2
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
chmod 755 "$work"  # the unprivileged installer must reach the prefix
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
mkdir -p "$prefix"
if [[ $(id -u) -eq 0 ]] && id nobody >/dev/null 2>&1 && command -v setpriv >/dev/null; then
  chown nobody "$prefix"
  setpriv --reuid=nobody --regid=nogroup --clear-groups cmake --install "$build" --prefix "$prefix"
else
  cmake --install "$build" --prefix "$prefix"
fi
test -f "$prefix/share/torchloom/install_manifest.txt"
if grep -q "$build" "$prefix"/lib/cmake/torchloom/*.cmake; then
  echo "FAIL: the installed CMake package names the build tree"; exit 1
fi
if grep -qE 'site-packages|/usr/local/cuda' "$prefix"/lib/cmake/torchloom/torchloomTargets.cmake; then
  echo "FAIL: the installed targets hard-code dependency paths:"
  grep -nE 'site-packages|/usr/local/cuda' "$prefix"/lib/cmake/torchloom/torchloomTargets.cmake; exit 1
fi
torch_dir=$(python3 -c 'import torch, os; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')
cmake -S "$source_dir/tests/install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$torch_dir" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$mpirun" --oversubscribe --bind-to none -np 2 "$work/consumer/consumer"
