#!/usr/bin/env bash
# Configures and builds torchloom (library, tests, examples, benchmarks) in ./build.
# BUILD_DIR and CMAKE_BUILD_TYPE may be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
source scripts/python_env.sh
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" \
        -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${CMAKE_ARGS:-}
fi
cmake --build "$BUILD_DIR" -j "${BUILD_JOBS:-$(nproc)}"
