#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the multi-rank demo on 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
mpirun -np "${NP:-2}" ${LOOM_MPIRUN_FLAGS} -x OMP_NUM_THREADS=1 build/examples/allreduce_demo "$@"
