#!/usr/bin/env bash
# The GPU check: on a machine with one GPU, builds torchloom and runs the tests that need a GPU,
# in a few minutes, then prints a PASS/FAIL table. Exits non-zero when anything failed.
#
# What it checks (tests/gpu/):
#   test_nccl   the NCCL communicator at world size 1 (mpirun -np 1): every collective x dtype
#               against values computed on the CPU; in-place and list forms; operations ordered
#               after the caller's CUDA stream; inputs freed right after a call not reused while the
#               NCCL stream reads them; Work::wait() ordering the current stream without blocking
#               the host, synchronize() blocking it, wait(timeout) giving up; rejected input (CPU
#               tensor, avg on integers, non-contiguous, bad device index); the watchdog's timeout
#               breaking a communicator; split by color and key.
#   test_cuda_training  data parallelism over NCCL on CUDA parameters equals one process on the
#               whole batch (with accumulation, small buckets); the fp16 compression hook on the
#               device; GradScaler + float16 autocast: an overflow skips the step and halves the
#               scale, and training still learns; Column/RowParallelLinear and the
#               vocabulary-parallel cross-entropy over an NCCL group equal the plain layers.
#   test_cuda_checkpoint  CUDA parameters, Adam state and GradScaler through an asynchronous
#               checkpoint (pinned staging; weights changed right after save() must not reach it),
#               the CUDA generator restored, the same checkpoint loaded on the CPU.
#   test_*      any other GPU test binary built into build/tests/gpu/, each under mpirun -np 1.
#
# Usage: bash benchmarks/gpu_check.sh [--no-setup] [--no-build]
#   --no-setup  skip scripts/setup.sh (a machine without network access, dependencies present)
#   --no-build  use the existing build (BUILD_DIR, default build/)
# Each test binary gets at most GPU_TEST_TIMEOUT seconds (default 150).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

setup=1
build=1
for arg in "$@"; do
  case "$arg" in
    --no-setup) setup=0 ;;
    --no-build) build=0 ;;
    *) echo "usage: $0 [--no-setup] [--no-build]" >&2; exit 2 ;;
  esac
done
BUILD_DIR=${BUILD_DIR:-build}
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-150}
LOG_DIR="$BUILD_DIR/gpu_check"
start=$SECONDS

phase() { echo "[gpu_check] $* (t=$((SECONDS - start)) s)"; }

# Without a visible GPU every test would skip and the check would pass without checking anything.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L | grep -q '^GPU '; then
  echo "[gpu_check] FAIL: no GPU visible (nvidia-smi -L lists none); this check needs one" >&2
  exit 1
fi
nvidia-smi -L

if ((setup)); then
  phase "setup"
  bash scripts/setup.sh || { echo "[gpu_check] FAIL: scripts/setup.sh" >&2; exit 1; }
fi
if ((build)); then
  phase "build"
  BUILD_DIR="$BUILD_DIR" bash scripts/build.sh || { echo "[gpu_check] FAIL: scripts/build.sh" >&2; exit 1; }
fi

source scripts/mpi_env.sh
mkdir -p "$LOG_DIR"

if [[ ! -x "$BUILD_DIR/tests/gpu/test_nccl" ]]; then
  echo "[gpu_check] FAIL: $BUILD_DIR/tests/gpu/test_nccl was not built (was NCCL found at configure time?)" >&2
  exit 1
fi
tests=("$BUILD_DIR/tests/gpu/test_nccl")
for t in "$BUILD_DIR"/tests/gpu/test_*; do
  [[ -f "$t" && -x "$t" && "$t" != "${tests[0]}" ]] && tests+=("$t")
done

names=()
results=()
failed=0
for t in "${tests[@]}"; do
  name=$(basename "$t")
  log="$LOG_DIR/$name.log"
  phase "run $name"
  t0=$SECONDS
  # shellcheck disable=SC2086  # LOOM_MPIRUN_FLAGS is a list of flags
  timeout --kill-after=10 "$TEST_TIMEOUT" mpirun -np 1 ${LOOM_MPIRUN_FLAGS} -x OMP_NUM_THREADS=1 "$t" >"$log" 2>&1
  rc=$?
  # GoogleTest's closing lines: "[  PASSED  ] 17 tests.", "[  SKIPPED ] 2 tests, listed below:", ...
  count() { sed -n "s/^\[  $1 *\] \([0-9][0-9]*\) tests*[,.].*/\1/p" "$log" | tail -n 1; }
  passed=$(count PASSED)
  skipped=$(count SKIPPED)
  failures=$(count FAILED)
  if ((rc == 0)); then
    verdict="PASS"
  elif ((rc == 124 || rc == 137)); then
    verdict="FAIL (timed out after ${TEST_TIMEOUT} s)"
  else
    verdict="FAIL (exit $rc)"
  fi
  names+=("$name")
  results+=("$(printf '%-26s %4d passed %3d skipped %3d failed %4d s' "$verdict" "${passed:-0}" "${skipped:-0}" \
    "${failures:-0}" $((SECONDS - t0)))")
  if ((rc != 0)); then
    failed=1
    echo "---- last lines of $log ----"
    tail -n 60 "$log"
    echo "----"
  fi
done

echo
echo "GPU check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $((SECONDS - start)) s)"
for i in "${!names[@]}"; do
  printf '  %-24s %s\n' "${names[$i]}" "${results[$i]}"
done
echo "logs: $LOG_DIR/"
if ((failed)); then
  echo "GPU check: FAIL"
  exit 1
fi
echo "GPU check: PASS"
