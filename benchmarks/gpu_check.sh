#!/usr/bin/env bash
# The GPU check: what only a GPU can show, on a machine with one GPU (an H100 or H200 with 16 cores),
# in at most 8 minutes (GPU_CHECK_SECONDS, default 480) including the build, which makes only the
# targets the chosen steps run. The steps get what the preflight and the build left of it
# (GPU_CHECK_BUDGET overrides that figure): each has its own time limit (what a hang costs, cut
# to the time left) and an expected duration (what the plan uses: a step expected to end past the
# budget is skipped, and the run fails saying so). Prints a
# PASS/FAIL table, what each row proves (at one rank NCCL enqueues nothing for some in-place calls
# and the reducer short-circuits: those rows prove little, and say so), the NCCL and CUDA runtime
# loaded, and the figures measured. Exits non-zero when a step failed or was skipped for time.
#
# Usage: bash benchmarks/gpu_check.sh [--no-setup] [--no-build] [--dry-run] [--only REGEX]
#   --no-setup  skip scripts/setup.sh (a machine without network access, dependencies present)
#   --no-build  use the binaries in GPU_BUILD_DIR (default: build-gpu, else build) as they are;
#               without it the targets the chosen steps need are built when missing or when their
#               libraries do not resolve (binaries carried from another machine name its paths)
#   --dry-run   list the chosen steps, the targets they need and the budget, write the list to OUT,
#               and exit 0 (CI runs this, so the script cannot rot)
#   --only      run only the steps whose name matches REGEX
# Logs and the summary go to OUT (default: GPU_BUILD_DIR/gpu_check); a caller's OUT is kept as
# given, and nothing in it is removed. The steps run most telling first: the two-rank NCCL rows,
# then the one-rank diagnostics, so a run cut short loses the least.
#
# Two ranks on the one GPU: LOOM_DEVICE=0 on each (sharing a GPU is refused unless asked for) and a
# distinct NCCL_HOSTID per rank, so NCCL takes them for two hosts talking over loopback sockets. On
# a machine with several GPUs one more row runs a rank per GPU (up to 8), without either: the first
# run of NVLink/PCIe peer transports and of the device mapping by bus id.
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
OUT_GIVEN=${OUT:-}
TOTAL=${GPU_CHECK_SECONDS:-480}  # the whole check, build included

# ---- The steps: name, time limit (s), expected (s), targets it runs, what a PASS proves, command ----
# Expected durations: one H100 with 16 cores, two ranks time-slicing GPU 0 over loopback sockets
# (the upper end of the GPU review's estimates). Commands run with bash -c; $B is the build folder.
names=() limits=() expects=() needs=() proves=() commands=()
step() { names+=("$1"); limits+=("$2"); expects+=("$3"); needs+=("$4"); proves+=("$5"); commands+=("$6"); }
NP1="mpirun -np 1 \$LOOM_MPIRUN_FLAGS -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN -x LD_LIBRARY_PATH"
NP2="mpirun -np 2 \$LOOM_MPIRUN_FLAGS -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN -x LD_LIBRARY_PATH -x LOOM_DEVICE=0 \
-x NCCL_SOCKET_IFNAME=lo -x NCCL_IB_DISABLE=1"
HOSTS="bash -c 'NCCL_HOSTID=loom-check-\$OMPI_COMM_WORLD_RANK exec \"\$@\"' bash"  # a host id per rank
SKIP_ALONE="--gtest_filter=-NcclDeviceFault.*:Nccl.IssueCost"
GPT="\$B/examples/train_gpt --tp 1 --batch 16 --seq 64 --hidden 128 --heads 4 --layers 2 --progress lines --sample-bytes 0"

step nccl.np2 180 90 test_nccl "real two-rank NCCL: every collective x dtype x op against the CPU, p2p, raise-mode abort releasing the stream, a peer that never connects, batched exchange, a CUDA-graph capture refused by name" \
  "$NP2 $HOSTS \$B/tests/gpu/test_nccl $SKIP_ALONE"
step training.np2 150 50 test_cuda_training "DDP over NCCL equal to one process on the whole batch, the fp16 hook, scaler found-inf agreed over two ranks, TP layers over NCCL, ZeRO stages 1 and 2 over NCCL equal to DDP" \
  "$NP2 $HOSTS \$B/tests/gpu/test_cuda_training"
step checkpoint.np1 90 12 test_cuda_checkpoint "CUDA parameters, Adam state, scaler and CUDA generator through an asynchronous checkpoint, staged before later writes" \
  "$NP1 \$B/tests/gpu/test_cuda_checkpoint"
step device_fault.np1 60 10 test_nccl "a device-side assert while a collective is in flight ends in CommError and a broken communicator, not a hang" \
  "$NP1 -x LOOM_TEST_DEVICE_FAULT=1 \$B/tests/gpu/test_nccl --gtest_filter=NcclDeviceFault.* && grep -q 'PASSED  ] 1 test' \"\$LOG\" && grep -q 'device fault: failed' \"\$LOG\""
step exit_nofinalize.np2 60 10 test_cuda_training "two ranks leave without finalize: no hang, no crash" \
  "$NP2 $HOSTS \$B/tests/gpu/test_cuda_training --exit-without-finalize"
step python_backend_cuda.np2 120 40 torchloom_python "torch.distributed backend loom on CUDA tensors (NCCL underneath): all_reduce, all_gather_into_tensor, reduce_scatter_tensor against Gloo on the CPU, PyTorch's DDP over it equal to over Gloo (fails if the test skips)" \
  "$NP2 -x PYTHONPATH=\$B/python $HOSTS python3 -m pytest -q -p no:cacheprovider tests/python/test_dist_backend.py -k cuda_tensors && [[ \$(grep -c '1 passed' \"\$LOG\") == 2 ]]"
step gpt_resume.np1 180 45 train_gpt "train_gpt in fp16 with loom::GradScaler and dropout, killed after a checkpoint and resumed: every later loss and checkpoint byte equal to the uninterrupted run (GPU RNG streams saved)" \
  "python3 tests/dist/check_checkpoint_resume.py --mpirun mpirun --np 1 --program \$B/examples/train_gpt -- --tp 1 --steps 30 --save-every 10 --accumulate 2 --batch 16 --seq 64 --hidden 128 --heads 4 --layers 2 --dropout 0.1 --deterministic"
step issue_cost.np2 60 12 test_nccl "host time to issue one small all_reduce, nonblocking communicators (the default)" \
  "$NP2 $HOSTS \$B/tests/gpu/test_nccl --gtest_filter=Nccl.IssueCost"
step issue_cost_blocking.np2 60 12 test_nccl "the same with blocking communicators (NCCL_COMM_BLOCKING=1): the comparison that chooses the mode" \
  "$NP2 -x NCCL_COMM_BLOCKING=1 $HOSTS \$B/tests/gpu/test_nccl --gtest_filter=Nccl.IssueCost"
step gpt_metrics.np1 120 15 train_gpt "NVML gauges of the rank's own GPU in the Prometheus file; ms per step with metrics written every step" \
  "$NP1 -x LOOM_METRICS=file:\$OUT/metrics -x LOOM_METRICS_INTERVAL=0 $GPT --steps 60 --log-every 30 && grep -E '^loom_gpu_memory_used_bytes\{.*\} [1-9]' \$OUT/metrics/torchloom_rank0.prom"
step gpt_plain.np1 120 10 train_gpt "the same run without metrics: its ms per step beside gpt_metrics' is the cost of sampling NVML" \
  "$NP1 $GPT --steps 60 --log-every 30"
step nccl.np1 120 25 test_nccl "stream order, Work semantics, timeouts, split; not the dtype/op mapping (one rank: in-place sum, min, max, product and broadcast enqueue nothing)" \
  "$NP1 \$B/tests/gpu/test_nccl $SKIP_ALONE"
step training.np1 120 25 test_cuda_training "AMP + GradScaler in fp16 on the device, the device init() picks; DDP and TP math only (a group of one communicates nothing but the explicit Avg hook)" \
  "$NP1 \$B/tests/gpu/test_cuda_training"
step exit_nofinalize.np1 60 6 test_cuda_training "leaving main without finalize: NCCL torn down before the CUDA runtime, exit status 0, no crash" \
  "$NP1 \$B/tests/gpu/test_cuda_training --exit-without-finalize"
step python_rng.np2 90 20 torchloom_python "from Python, TP 2: GPU draws and dropout masks inside torchloom.tensor_parallel.fork() differ per TP rank, outside they agree (ParallelState.seed seeds the CUDA tracker)" \
  "$NP2 -x PYTHONPATH=\$B/python $HOSTS python3 tests/gpu/check_python_rng.py"
GPUS=0
if command -v nvidia-smi >/dev/null; then GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); fi
if ((GPUS >= 2)); then
  NPN=$((GPUS < 8 ? GPUS : 8))
  step "nccl.np$NPN" 180 60 test_nccl "a rank per GPU ($NPN): NCCL's peer transports (NVLink/PCIe P2P, SHM) and the device chosen by bus id, not one GPU time-sliced over sockets" \
    "mpirun -np $NPN \$LOOM_MPIRUN_FLAGS -x OMP_NUM_THREADS=1 -x NCCL_DEBUG=WARN -x LD_LIBRARY_PATH \$B/tests/gpu/test_nccl $SKIP_ALONE"
fi

# ---- The chosen steps and the targets they run ----------------------------------------------------
chosen=() targets=()
for i in "${!names[@]}"; do
  [[ -n $only && ! ${names[$i]} =~ $only ]] && continue
  chosen+=("$i")
  [[ " ${targets[*]} " == *" ${needs[$i]} "* ]] || targets+=("${needs[$i]}")
done
planned=0
for i in "${chosen[@]}"; do planned=$((planned + expects[i])); done

if ((dry)); then
  OUT=${OUT_GIVEN:-$PWD/$B/gpu_check}
  mkdir -p "$OUT"
  {
    echo "gpu_check steps (build dir $B; targets to build: ${targets[*]:-none}):"
    for i in "${chosen[@]}"; do
      printf '  %-24s limit %3d s  expected %3d s  proves: %s\n      $ %s\n' "${names[$i]}" "${limits[$i]}" \
        "${expects[$i]}" "${proves[$i]}" "${commands[$i]}"
    done
    echo "budget: the steps are expected to take ${planned} s; the check has ${TOTAL} s in all (GPU_CHECK_SECONDS)," \
      "the steps ${GPU_CHECK_BUDGET:-what the build leaves of it} (GPU_CHECK_BUDGET)"
  } | tee "$OUT/dry_run.txt"
  echo "listing kept in $OUT/dry_run.txt"
  exit 0
fi

# ---- Preflight -----------------------------------------------------------------------------------
if ((GPUS == 0)); then
  echo "[gpu_check] FAIL: no GPU visible (nvidia-smi -L lists none); this check needs one" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv,noheader
# Two ranks share GPU 0 in the np=2 rows: a GPU that admits one process (Exclusive_Process) or none
# (Prohibited) fails every one of them while creating its context, so they are skipped, by name.
compute_mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader -i 0 | tr -d ' ')
shared_gpu_problem=""
[[ $compute_mode == Default ]] || shared_gpu_problem="GPU 0's compute mode is $compute_mode: two ranks cannot share it"
python3 -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda)' ||
  exit 1
if ((setup)); then
  bash scripts/setup.sh || { echo "[gpu_check] FAIL: scripts/setup.sh" >&2; exit 1; }
fi
target_file() {
  case $1 in
    test_nccl | test_cuda_training | test_cuda_checkpoint) echo "$B/tests/gpu/$1" ;;
    train_gpt) echo "$B/examples/train_gpt" ;;
    torchloom_python) compgen -G "$B/python/torchloom/_C*.so" | head -n 1 || echo "$B/python/torchloom/_C.so" ;;
  esac
}
missing() {
  local t f
  for t in "${targets[@]}"; do
    f=$(target_file "$t")
    [[ -n $f && -e $f ]] || return 0
    ldd "$f" | grep -q 'not found' && return 0
  done
  return 1
}
build_seconds=0
if ((build)) && missing; then
  B="build-gpu"
  echo "[gpu_check] building ${targets[*]} in $B"
  t0=$SECONDS
  if [[ ! -f $B/build.ninja && ! -f $B/Makefile ]]; then
    generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
    cmake -S . -B "$B" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLOOM_WITH_NCCL=ON -DLOOM_BUILD_PYTHON=ON \
      -DLOOM_BUILD_BENCHMARKS=OFF -DPython3_EXECUTABLE="$(command -v python3)" \
      -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
      >"$B.configure.log" 2>&1 || { tail -n 30 "$B.configure.log"; echo "[gpu_check] FAIL: configure" >&2; exit 1; }
  fi
  cmake --build "$B" -j "$(nproc)" --target "${targets[@]}" >"$B.build.log" 2>&1 ||
    { tail -n 40 "$B.build.log"; echo "[gpu_check] FAIL: build" >&2; exit 1; }
  build_seconds=$((SECONDS - t0))
  echo "[gpu_check] built in $build_seconds s (not counted in the steps' budget)"
fi
if missing; then echo "[gpu_check] FAIL: the binaries in $B are missing or do not resolve their libraries" >&2; exit 1; fi
OUT=${OUT_GIVEN:-$PWD/$B/gpu_check}
mkdir -p "$OUT"
export OUT B
# shellcheck disable=SC1091
source scripts/mpi_env.sh
export LOOM_MPIRUN_FLAGS
echo "[gpu_check] libraries the tests load:"
ldd "$(target_file "${targets[0]}")" | grep -E 'libnccl|libcudart|libtorchloom' | sed 's/^/    /'
start=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-$((TOTAL - SECONDS))}
echo "[gpu_check] ${#chosen[@]} steps expected to take $planned s, in a budget of $BUDGET s"

# ---- Run -----------------------------------------------------------------------------------------
verdicts=() failed=0
for i in "${!names[@]}"; do
  name=${names[$i]}
  if [[ -n $only && ! $name =~ $only ]]; then verdicts+=("skipped (--only)"); continue; fi
  if [[ -n $shared_gpu_problem && $name == *.np2 ]]; then verdicts+=("SKIPPED ($shared_gpu_problem)"); failed=1; continue; fi
  if ((SECONDS - start + expects[i] > BUDGET)); then verdicts+=("SKIPPED (out of time)"); failed=1; continue; fi
  log="$OUT/$name.log"
  t0=$SECONDS
  limit=$((BUDGET - (SECONDS - start)))
  ((limit < limits[i])) || limit=${limits[$i]}
  LOG=$log timeout -k 10 "$limit" bash -c "${commands[$i]}" >"$log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  if grep -qE 'Segmentation fault|signal 11 \(|core dumped' "$log"; then
    verdict="FAIL (crash)"
  elif ((rc == 0)); then
    verdict="PASS"
  elif ((rc == 124 || rc == 137)); then
    verdict="FAIL (hung or cut: limit $limit s)"
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
  echo "GPU check on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1): steps $((SECONDS - start)) s (budget $BUDGET s), build $build_seconds s"
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
