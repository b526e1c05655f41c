#!/usr/bin/env bash
# The GPU check: what only a GPU can show, on a machine with one GPU (an H200 with 16 cores here),
# in at most 8 minutes from a prebuilt tree, each step under its own time limit. Prints a PASS/FAIL
# table, what each row proves (at one rank NCCL enqueues nothing for some in-place calls and the
# reducer short-circuits: those rows prove little, and say so), the NCCL and CUDA runtime loaded,
# and the figures measured. Exits non-zero when a step failed.
#
# Usage: bash benchmarks/gpu_check.sh [--no-setup] [--no-build] [--dry-run] [--only REGEX]
#   --no-setup  skip scripts/setup.sh (a machine without network access, dependencies present)
#   --no-build  use the binaries in GPU_BUILD_DIR (default: build-gpu, else build) as they are;
#               without it the four targets are built when missing or when their libraries do not
#               resolve (binaries carried from another machine name its paths)
#   --dry-run   list the steps and exit 0 (CI runs this, so the script cannot rot)
#   --only      run only the steps whose name matches REGEX
# Logs and the summary go to OUT (default: GPU_BUILD_DIR/gpu_check).
#
# Two ranks on the one GPU: LOOM_DEVICE=0 on each (sharing a GPU is refused unless asked for) and a
# distinct NCCL_HOSTID per rank, so NCCL takes them for two hosts talking over loopback sockets.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

setup=1 build=1 dry=0 only=""
while (($#)); do
  case "$1" in
    --no-setup) setup=0 ;;
    --no-build) build=0 ;;
    --dry-run) dry=1 ;;
    --only) only=${2:-}; shift ;;
    *) echo "usage: $0 [--no-setup] [--no-build] [--dry-run] [--only REGEX]" >&2; exit 2 ;;
  esac
  shift
done
B=${GPU_BUILD_DIR:-build-gpu}
if [[ ! -d "$B" && -d build ]]; then B=build; fi
OUT=${OUT:-$PWD/$B/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-480}  # seconds for the whole check; steps that would start later are skipped
TARGETS=(test_nccl test_cuda_training test_cuda_checkpoint train_gpt torchloom_python)
start=$SECONDS

# ---- The steps: name, time limit (s), what a PASS proves, command (run with bash -c) ----------
names=() limits=() proves=() commands=()
step() { names+=("$1"); limits+=("$2"); proves+=("$3"); commands+=("$4"); }
NP1="mpirun -np 1 \$LOOM_MPIRUN_FLAGS -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN -x LD_LIBRARY_PATH"
NP2="mpirun -np 2 \$LOOM_MPIRUN_FLAGS -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN -x LD_LIBRARY_PATH -x LOOM_DEVICE=0 \
-x NCCL_SOCKET_IFNAME=lo -x NCCL_IB_DISABLE=1"
HOSTS="bash -c 'NCCL_HOSTID=loom-check-\$OMPI_COMM_WORLD_RANK exec \"\$@\"' bash"  # a host id per rank
SKIP_ALONE="--gtest_filter=-NcclDeviceFault.*:Nccl.IssueCost"
GPT="$B/examples/train_gpt --tp 1 --batch 16 --seq 64 --hidden 128 --heads 4 --layers 2 --progress lines --sample-bytes 0"

step nccl.np1 120 "stream order, Work semantics, timeouts, split; not the dtype/op mapping (one rank: in-place sum, min, max, product and broadcast enqueue nothing)" \
  "$NP1 $B/tests/gpu/test_nccl $SKIP_ALONE"
step training.np1 120 "AMP + GradScaler in fp16 on the device, the device init() picks; DDP and TP math only (a group of one communicates nothing but the explicit Avg hook)" \
  "$NP1 $B/tests/gpu/test_cuda_training"
step checkpoint.np1 90 "CUDA parameters, Adam state, scaler and CUDA generator through an asynchronous checkpoint, staged before later writes" \
  "$NP1 $B/tests/gpu/test_cuda_checkpoint"
step exit_nofinalize.np1 60 "leaving main without finalize: NCCL torn down before the CUDA runtime, exit status 0, no crash" \
  "$NP1 $B/tests/gpu/test_cuda_training --exit-without-finalize"
step device_fault.np1 60 "a device-side assert while a collective is in flight ends in CommError and a broken communicator, not a hang" \
  "$NP1 -x LOOM_TEST_DEVICE_FAULT=1 $B/tests/gpu/test_nccl --gtest_filter=NcclDeviceFault.*; grep -q 'PASSED  ] 1 test' \"\$LOG\" && grep -q 'device fault: failed' \"\$LOG\""
step nccl.np2 180 "real two-rank NCCL: every collective x dtype x op against the CPU, p2p, raise-mode abort releasing the stream, a peer that never connects, batched exchange" \
  "$NP2 $HOSTS $B/tests/gpu/test_nccl $SKIP_ALONE"
step training.np2 150 "DDP over NCCL equal to one process on the whole batch, the fp16 hook, scaler found-inf agreed over two ranks, TP layers over NCCL, ZeRO stages 1 and 2 over NCCL equal to DDP" \
  "$NP2 $HOSTS $B/tests/gpu/test_cuda_training"
step exit_nofinalize.np2 60 "two ranks leave without finalize: no hang, no crash" \
  "$NP2 $HOSTS $B/tests/gpu/test_cuda_training --exit-without-finalize"
step issue_cost.np2 60 "host time to issue one small all_reduce, nonblocking communicators (the default)" \
  "$NP2 $HOSTS $B/tests/gpu/test_nccl --gtest_filter=Nccl.IssueCost"
step issue_cost_blocking.np2 60 "the same with blocking communicators (NCCL_COMM_BLOCKING=1): the comparison that chooses the mode" \
  "$NP2 -x NCCL_COMM_BLOCKING=1 $HOSTS $B/tests/gpu/test_nccl --gtest_filter=Nccl.IssueCost"
step gpt_resume.np1 180 "train_gpt in fp16 with loom::GradScaler and dropout, killed after a checkpoint and resumed: every later loss and checkpoint byte equal to the uninterrupted run (GPU RNG streams saved)" \
  "python3 tests/dist/check_checkpoint_resume.py --mpirun mpirun --np 1 --program $B/examples/train_gpt -- --tp 1 --steps 30 --save-every 10 --accumulate 2 --batch 16 --seq 64 --hidden 128 --heads 4 --layers 2 --dropout 0.1 --deterministic"
step gpt_metrics.np1 120 "NVML gauges of the rank's own GPU in the Prometheus file; ms per step with metrics written every step" \
  "$NP1 -x LOOM_METRICS=file:\$OUT/metrics -x LOOM_METRICS_INTERVAL=0 $GPT --steps 60 --log-every 30 && grep -E '^loom_gpu_memory_used_bytes\{.*\} [1-9]' \$OUT/metrics/torchloom_rank0.prom"
step gpt_plain.np1 120 "the same run without metrics: its ms per step beside gpt_metrics' is the cost of sampling NVML" \
  "$NP1 $GPT --steps 60 --log-every 30"
step python_rng.np2 90 "from Python, TP 2: GPU draws and dropout masks inside torchloom.tensor_parallel.fork() differ per TP rank, outside they agree (ParallelState.seed seeds the CUDA tracker)" \
  "$NP2 -x PYTHONPATH=$B/python $HOSTS python3 tests/gpu/check_python_rng.py"
step python_backend_cuda.np2 120 "torch.distributed backend loom on CUDA tensors (NCCL underneath): all_reduce, all_gather_into_tensor, reduce_scatter_tensor against Gloo on the CPU, PyTorch's DDP over it equal to over Gloo (fails if the test skips)" \
  "$NP2 -x PYTHONPATH=$B/python $HOSTS python3 -m pytest -q -p no:cacheprovider tests/python/test_dist_backend.py -k cuda_tensors; grep -q '1 passed' \"\$LOG\""

if ((dry)); then
  echo "gpu_check steps (build dir $B, budget $BUDGET s):"
  for i in "${!names[@]}"; do
    printf '  %-24s limit %3d s  proves: %s\n      $ %s\n' "${names[$i]}" "${limits[$i]}" "${proves[$i]}" "${commands[$i]}"
  done
  exit 0
fi

# ---- Preflight -----------------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L | grep -q '^GPU '; then
  echo "[gpu_check] FAIL: no GPU visible (nvidia-smi -L lists none); this check needs one" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda)' ||
  exit 1
if ((setup)); then
  bash scripts/setup.sh || { echo "[gpu_check] FAIL: scripts/setup.sh" >&2; exit 1; }
fi
missing() {
  local t
  for t in "$B/tests/gpu/test_nccl" "$B/tests/gpu/test_cuda_training" "$B/tests/gpu/test_cuda_checkpoint" "$B/examples/train_gpt"; do
    [[ -x $t ]] || return 0
    ldd "$t" | grep -q 'not found' && return 0
  done
  return 1
}
if ((build)) && missing; then
  B=build-gpu
  echo "[gpu_check] building ${TARGETS[*]} in $B"
  if [[ ! -f $B/build.ninja ]]; then
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WITH_NCCL=ON -DLOOM_BUILD_PYTHON=ON \
      -DLOOM_BUILD_BENCHMARKS=OFF -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
      >"$B.configure.log" 2>&1 || { tail -n 30 "$B.configure.log"; echo "[gpu_check] FAIL: configure" >&2; exit 1; }
  fi
  cmake --build "$B" -j "$(nproc)" --target "${TARGETS[@]}" >"$B.build.log" 2>&1 ||
    { tail -n 40 "$B.build.log"; echo "[gpu_check] FAIL: build" >&2; exit 1; }
  OUT=${GPU_CHECK_OUT:-$PWD/$B/gpu_check}
  for i in "${!commands[@]}"; do commands[$i]=${commands[$i]//build\//$B/}; done
fi
if missing; then echo "[gpu_check] FAIL: the binaries in $B are missing or do not resolve their libraries" >&2; exit 1; fi
mkdir -p "$OUT"
export OUT
# shellcheck disable=SC1091
source scripts/mpi_env.sh
export LOOM_MPIRUN_FLAGS
echo "[gpu_check] libraries the tests load:"
ldd "$B/tests/gpu/test_nccl" | grep -E 'libnccl|libcudart|libtorchloom' | sed 's/^/    /'

# ---- Run -----------------------------------------------------------------------------------------
verdicts=() failed=0
for i in "${!names[@]}"; do
  name=${names[$i]}
  if [[ -n $only && ! $name =~ $only ]]; then verdicts+=("skipped (--only)"); continue; fi
  if ((SECONDS - start + limits[i] > BUDGET + 60)); then verdicts+=("SKIPPED (out of time)"); failed=1; continue; fi
  log="$OUT/$name.log"
  t0=$SECONDS
  LOG=$log timeout -k 10 "${limits[$i]}" bash -c "${commands[$i]}" >"$log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  if grep -qE 'Segmentation fault|signal 11 \(|core dumped' "$log"; then
    verdict="FAIL (crash)"
  elif ((rc == 0)); then
    verdict="PASS"
  elif ((rc == 124 || rc == 137)); then
    verdict="FAIL (hung: limit ${limits[$i]} s)"
  else
    verdict="FAIL (exit $rc)"
  fi
  [[ $verdict == PASS ]] || { failed=1; echo "---- $name: last lines of $log ----"; tail -n 40 "$log"; }
  verdicts+=("$(printf '%-26s %4d s' "$verdict" "$took")")
  echo "[gpu_check] $name: $verdict ($took s)"
done

# ---- Summary -------------------------------------------------------------------------------------
{
  echo
  echo "GPU check on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $((SECONDS - start)) s"
  grep -h '^NCCL loaded' "$OUT"/nccl.np*.log 2>/dev/null | head -n 1 | sed 's/^/  /'
  for i in "${!names[@]}"; do
    printf '  %-24s %s\n      %s\n' "${names[$i]}" "${verdicts[$i]:-}" "${proves[$i]}"
  done
  echo "figures:"
  grep -h '^issue cost' "$OUT"/issue_cost*.log 2>/dev/null | sed 's/^/  /'
  grep -h '^device fault' "$OUT"/device_fault.np1.log 2>/dev/null | sed 's/^/  /'
  for f in gpt_metrics gpt_plain; do
    grep -h 'ms per step' "$OUT/$f.np1.log" 2>/dev/null | sed "s/^/  $f: /"
  done
  echo "logs: $OUT/"
  if ((failed)); then echo "GPU check: FAIL"; else echo "GPU check: PASS"; fi
} | tee "$OUT/summary"
exit "$failed"
