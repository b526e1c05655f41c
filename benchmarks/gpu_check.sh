#!/usr/bin/env bash
# The GPU check: on a machine with one GPU (or more), builds what the GPU tests need and runs them,
# in a few minutes, then prints a PASS/FAIL table and the NCCL / CUDA runtime the tests loaded.
# Exits non-zero when anything failed.
#
# What runs (tests/gpu/):
#   test_nccl           the NCCL communicator: every collective x dtype against the CPU, stream
#                       ordering, c10d Work semantics, split, rejected input, timeouts; at two ranks
#                       also raise-mode abort releasing the stream, a peer that never connects, and a
#                       batched exchange that cannot deadlock
#   test_cuda_training  DDP over NCCL against one process on the whole batch, the fp16 hook, the
#                       GradScaler with float16 autocast (and a state loaded before the first scale),
#                       the device loom::init() chooses, tensor-parallel layers over NCCL
#   exit without finalize  test_cuda_training --exit-without-finalize: exit status 0, no crash
# each at `mpirun -np 1`, and at `-np 2` on the same GPU: each rank gets its own NCCL_HOSTID, so
# NCCL treats them as two hosts talking over loopback sockets (NCCL refuses two ranks on one device
# of one host). At one rank NCCL skips in-place sum/min/max/product and broadcast entirely; the
# two-rank run is what checks the dtype/op mapping and real communication.
#   train_gpt   the flagship example for 80 steps on the GPU (fp16 autocast + GradScaler, NCCL)
#   test_cuda_checkpoint  CUDA parameters, Adam state and GradScaler through an asynchronous
#               checkpoint (pinned staging; weights changed right after save() must not reach it),
#               the CUDA generator restored, the same checkpoint loaded on the CPU.
#
# Usage: bash benchmarks/gpu_check.sh [--no-setup] [--no-build]
#   --no-setup  skip scripts/setup.sh (a machine without network access, dependencies present)
#   --no-build  use an existing build (GPU_BUILD_DIR, default build-gpu; or build/ if that has the tests)
# Each run gets at most GPU_TEST_TIMEOUT seconds (default 180).
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
BUILD_DIR=${GPU_BUILD_DIR:-build-gpu}
if ((build == 0)) && [[ ! -x "$BUILD_DIR/tests/gpu/test_nccl" && -x build/tests/gpu/test_nccl ]]; then BUILD_DIR=build; fi
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-180}
LOG_DIR="$BUILD_DIR/gpu_check"
start=$SECONDS
phase() { echo "[gpu_check] $* (t=$((SECONDS - start)) s)"; }

# Without a visible GPU every test would skip and the check would pass without checking anything.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L | grep -q '^GPU '; then
  echo "[gpu_check] FAIL: no GPU visible (nvidia-smi -L lists none); this check needs one" >&2
  exit 1
fi
nvidia-smi -L
nvidia-smi --query-gpu=driver_version --format=csv,noheader | sed 's/^/driver /'

if ((setup)); then
  phase "setup"
  bash scripts/setup.sh || { echo "[gpu_check] FAIL: scripts/setup.sh" >&2; exit 1; }
fi
if ((build)); then
  phase "build ($BUILD_DIR: the library and the GPU tests only)"
  PYTHON=${PYTHON:-python3}
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_BUILD_EXAMPLES=ON \
      -DLOOM_BUILD_BENCHMARKS=OFF -DLOOM_WITH_NCCL=ON \
      -DCMAKE_PREFIX_PATH="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
      -DPython3_EXECUTABLE="$(command -v "$PYTHON")" >"$BUILD_DIR.configure.log" 2>&1 ||
      { tail -n 30 "$BUILD_DIR.configure.log"; echo "[gpu_check] FAIL: configure" >&2; exit 1; }
  fi
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target test_nccl test_cuda_training test_cuda_checkpoint train_gpt ||
    { echo "[gpu_check] FAIL: build" >&2; exit 1; }
fi
if [[ ! -x "$BUILD_DIR/tests/gpu/test_nccl" || ! -x "$BUILD_DIR/tests/gpu/test_cuda_training" ]]; then
  echo "[gpu_check] FAIL: $BUILD_DIR/tests/gpu has no test_nccl / test_cuda_training (NCCL found at configure time?)" >&2
  exit 1
fi

source scripts/mpi_env.sh
mkdir -p "$LOG_DIR"
echo "[gpu_check] libraries the tests load:"
ldd "$BUILD_DIR/tests/gpu/test_nccl" | grep -E 'nccl|cudart|torchloom' | sed 's/^/    /'

names=()
results=()
failed=0
# run NAME NP COMMAND...: one job under mpirun with NP ranks on this GPU.
run() {
  local name=$1 np=$2
  shift 2
  local log="$LOG_DIR/$name.log"
  phase "run $name"
  local t0=$SECONDS
  local extra=()
  if ((np > 1)); then
    # Two "hosts" on one GPU: a host id per rank, sockets over loopback, no InfiniBand.
    extra=(-x NCCL_SOCKET_IFNAME=lo -x NCCL_IB_DISABLE=1 -x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1)
  fi
  # shellcheck disable=SC2086  # LOOM_MPIRUN_FLAGS is a list of flags
  timeout --kill-after=10 "$TEST_TIMEOUT" mpirun -np "$np" ${LOOM_MPIRUN_FLAGS} -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN \
    "${extra[@]}" bash -c 'NCCL_HOSTID=loom-check-$OMPI_COMM_WORLD_RANK exec "$@"' bash "$@" >"$log" 2>&1
  local rc=$?
  count() { sed -n "s/^\[  $1 *\] \([0-9][0-9]*\) tests*[,.].*/\1/p" "$log" | tail -n 1; }
  local passed skipped failures verdict
  passed=$(count PASSED)
  skipped=$(count SKIPPED)
  failures=$(count FAILED)
  if grep -qE 'Segmentation fault|signal 11|core dumped' "$log"; then
    verdict="FAIL (crash)"
    rc=1
  elif ((rc == 0)); then
    verdict="PASS"
  elif ((rc == 124 || rc == 137)); then
    verdict="FAIL (timed out after ${TEST_TIMEOUT} s)"
  else
    verdict="FAIL (exit $rc)"
  fi
  names+=("$name")
  results+=("$(printf '%-28s %4d passed %3d skipped %3d failed %4d s' "$verdict" "${passed:-0}" "${skipped:-0}" \
    "${failures:-0}" $((SECONDS - t0)))")
  if ((rc != 0)); then
    failed=1
    echo "---- last lines of $log ----"
    tail -n 60 "$log"
    echo "----"
  fi
}

for np in 1 2; do
  run "test_nccl.np$np" "$np" "$BUILD_DIR/tests/gpu/test_nccl"
  run "test_cuda_training.np$np" "$np" "$BUILD_DIR/tests/gpu/test_cuda_training"
  run "exit_without_finalize.np$np" "$np" "$BUILD_DIR/tests/gpu/test_cuda_training" --exit-without-finalize
done
run "test_cuda_checkpoint.np1" 1 "$BUILD_DIR/tests/gpu/test_cuda_checkpoint"
# The flagship on the device: NCCL groups, sharded initialisation on the GPU, fp16 + GradScaler.
run "train_gpt.np1" 1 "$BUILD_DIR/examples/train_gpt" --tp 1 --steps 80 --log-every 20 --progress lines

echo
echo "GPU check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $((SECONDS - start)) s)"
grep -h "^NCCL loaded" "$LOG_DIR"/test_nccl.np1.log 2>/dev/null | head -n 1 | sed 's/^/  /'
for i in "${!names[@]}"; do
  printf '  %-28s %s\n' "${names[$i]}" "${results[$i]}"
done
echo "logs: $LOG_DIR/"
if ((failed)); then
  echo "GPU check: FAIL"
  exit 1
fi
echo "GPU check: PASS"
