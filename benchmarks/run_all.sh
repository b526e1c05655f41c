#!/usr/bin/env bash
# Runs every benchmark (each prints ours against the reference, measured in the same run) and
# writes JSON next to the tables. Machines are noisy: the programs report medians, and only
# ratios from one run should be compared.
#   bash benchmarks/run_all.sh [results-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-build/benchmark-results}
mkdir -p "$RESULTS"
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
for np in 2 4; do
  echo "== all_reduce, $np ranks"
  mpirun -np $np $LOOM_MPIRUN_FLAGS build/benchmarks/allreduce_bench --min-bytes 4096 --json "$RESULTS/allreduce_np$np.json"
done
echo "results in $RESULTS"
