#!/usr/bin/env bash
# Which sizes of a mismatched collective corrupt memory in this MPI? For each collective, rank
# count and (base, factor) pair, runs benchmarks/mpi_mismatch_probe.c and prints what happened:
# a clean MPI_ERR_TRUNCATE, a hang (timed out), or a crash / heap corruption. The result decides
# LOOM_SIZE_CHECK_BYTES' default (docs/design.md, "Mismatched sizes"). Takes several minutes.
#   bash benchmarks/mpi_mismatch_probe.sh [results.txt]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/mpi_env.sh
out=${1:-/dev/stdout}
program=$(mktemp -d)/mpi_mismatch_probe
mpicc -O2 -o "$program" benchmarks/mpi_mismatch_probe.c || exit 1
printf '%-4s %-10s %-9s %-7s %-10s %s\n' np collective base factor outcome details >"$out"
for np in 2 4; do
  for kind in allreduce bcast allgather rscatter alltoall; do
    for pair in "1 2" "1 63" "4 16" "16 4" "64 8" "256 2" "256 8" "512 2" "1024 2" "1024 8" "4096 2" "65536 8"; do
      set -- $pair
      text=$(timeout -k 3 8 mpirun -np "$np" $LOOM_MPIRUN_FLAGS "$program" "$kind" "$1" "$2" 2>&1)
      rc=$?
      crash=$(echo "$text" | grep -oE "corruption|double free|munmap_chunk|Segmentation|signal 11" | sort -u | tr '\n' ' ')
      if [[ -n "$crash" ]]; then outcome=CRASH
      elif ((rc == 124 || rc == 137)); then outcome=hang
      elif echo "$text" | grep -q TRUNCATE; then outcome=truncated
      else outcome=ok; fi
      printf '%-4s %-10s %-9s %-7s %-10s %s\n' "$np" "$kind" "$1" "$2" "$outcome" "$crash" >>"$out"
    done
  done
done
