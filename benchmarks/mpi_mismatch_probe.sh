#!/usr/bin/env bash
# Which sizes of a mismatched collective corrupt memory in this MPI? For each collective, rank
# count and (base, factor) pair, runs benchmarks/mpi_mismatch_probe.c and prints what happened:
# a clean MPI_ERR_TRUNCATE, a hang (timed out), a write past a buffer seen in its guard region
# (OVERRUN), or a crash / heap corruption. The result decides
# LOOM_SIZE_CHECK_BYTES' default (docs/design.md, "Mismatched sizes"). Takes several minutes.
#   bash benchmarks/mpi_mismatch_probe.sh [results.txt]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/mpi_env.sh
out=${1:-/dev/stdout}
program=$(mktemp -d)/mpi_mismatch_probe
mpicc -O2 -o "$program" benchmarks/mpi_mismatch_probe.c || exit 1
printf '%-4s %-10s %-9s %-7s %-10s %s\n' np collective base factor outcome details >"$out"
# (base, factor) pairs, in elements of 4 bytes; PROBE_PAIRS="256,2 512,2" and PROBE_RANKS="2 4" narrow a run.
pairs=("1 2" "1 63" "4 16" "16 4" "64 8" "128 2" "128 8" "256 2" "256 8" "384 2" "512 2" "1024 2" "1024 8" "4096 2" "65536 8")
[[ -n ${PROBE_PAIRS:-} ]] && read -ra pairs <<<"${PROBE_PAIRS//,/_}" && pairs=("${pairs[@]//_/ }")
for np in ${PROBE_RANKS:-2 4 8}; do
  for kind in allreduce bcast allgather rscatter alltoall; do
    for pair in "${pairs[@]}"; do
      set -- $pair
      text=$(timeout -k 3 8 mpirun -np "$np" $LOOM_MPIRUN_FLAGS "$program" "$kind" "$1" "$2" 2>&1)
      rc=$?
      crash=$(echo "$text" | grep -oE "corruption|double free|munmap_chunk|Segmentation|signal 11" | sort -u | tr '\n' ' ')
      if [[ -n "$crash" ]]; then outcome=CRASH
      elif echo "$text" | grep -q OVERRUN; then outcome=OVERRUN; crash=$(echo "$text" | grep -m1 "guard bytes")
      elif ((rc == 124 || rc == 137)); then outcome=hang
      elif echo "$text" | grep -q TRUNCATE; then outcome=truncated
      else outcome=ok; fi
      printf '%-4s %-10s %-9s %-7s %-10s %s\n' "$np" "$kind" "$1" "$2" "$outcome" "$crash" >>"$out"
    done
  done
done
