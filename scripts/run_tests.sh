#!/usr/bin/env bash
# One command for every test: installs dependencies, builds, and runs the whole suite
# (unit tests, multi-rank tests under mpirun with 2 and 4 ranks, fault tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure --timeout 300 "$@"
