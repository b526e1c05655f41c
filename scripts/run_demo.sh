#!/usr/bin/env bash
# The main job: installs dependencies, builds, and trains an MLP data-parallel on 2 ranks
# (examples/train_ddp.cpp; extra arguments go to it, e.g. --steps 500 --accumulate 4). It exits
# non-zero when the model did not learn. The collectives demo: build/examples/allreduce_demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
mpirun -np "${NP:-2}" ${LOOM_MPIRUN_FLAGS} -x OMP_NUM_THREADS=1 build/examples/train_ddp "$@"
