#!/usr/bin/env bash
# The CPU test subset under sanitizers, in a build directory of its own (the regular build/ is
# untouched). Each run prints its figures and exits non-zero on any sanitizer report.
#
#   bash scripts/sanitize.sh                  # AddressSanitizer + UndefinedBehaviorSanitizer, build-asan/
#   bash scripts/sanitize.sh thread           # ThreadSanitizer on the comm core's own tests, build-tsan/
#   SANITIZE_BUILD_ONLY=1 bash scripts/sanitize.sh   # configure and build, run nothing
#
# What runs (kept small: a build of LibTorch-heavy code with sanitizers is slow):
#   address,undefined  loom_unit_tests and loom_topology_tests whole; loom_dist_tests at 2 ranks for
#                      collectives, point-to-point, bad and hostile input, async operations, and
#                      whole under torchrun (the Gloo backend); loom_checkpoint_tests whole at 2
#                      ranks (round trips, resharding, forged manifests and training state)
#   thread             the metrics server, loom_unit_tests whole (comm core: waiter hand-off,
#                      device-fault paths; checkpoint hashing and populating threads) and
#                      loom_dist_tests whole at 2 ranks (progress thread, watchdog, async
#                      operations, DataParallel's backward hooks), under mpirun and again under
#                      torchrun (the Gloo backend, its callbacks and the store's side channel)
# LibTorch, MPI and the system libraries are not instrumented. Suppressions, each explained, are
# in tests/sanitize/.
set -euo pipefail
cd "$(dirname "$0")/.."
SANITIZE=${1:-address,undefined}
case "$SANITIZE" in
  address,undefined|address|undefined) DIR=${BUILD_DIR:-build-asan} ;;
  thread) DIR=${BUILD_DIR:-build-tsan} ;;
  *) echo "sanitize.sh: expected address,undefined (default), address, undefined or thread; found '$SANITIZE'" >&2; exit 2 ;;
esac
source scripts/python_env.sh
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
if [[ ! -f "$DIR/build.ninja" ]]; then
  cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_SANITIZE="$SANITIZE" \
        -DLOOM_WITH_NCCL=OFF -DLOOM_BUILD_BENCHMARKS=OFF -DLOOM_BUILD_PYTHON=OFF \
        -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${CMAKE_ARGS:-}
fi
TARGETS=(loom_metrics_server_tests loom_unit_tests loom_dist_tests)
# The topology parsers (no threads) and hostile manifests across ranks: AddressSanitizer's alone.
[[ "$SANITIZE" == thread ]] || TARGETS+=(loom_topology_tests loom_checkpoint_tests)
# SANITIZE_TARGETS narrows the build (and the runs to what was built), e.g. the LibTorch-free
# loom_metrics_server_tests alone.
[[ -n "${SANITIZE_TARGETS:-}" ]] && read -r -a TARGETS <<< "$SANITIZE_TARGETS"
cmake --build "$DIR" -j "${BUILD_JOBS:-$(nproc)}" --target "${TARGETS[@]}"
[[ -n "${SANITIZE_BUILD_ONLY:-}" ]] && exit 0

source scripts/mpi_env.sh
export LOOM_TIMEOUT=120
SUPP=$PWD/tests/sanitize
# halt_on_error: the first report fails the run; the reports go to stderr with the test's output.
# alloc_dealloc_mismatch=0: a false report inside libstdc++'s headers, std::stable_sort's
# temporary buffer (operator new, then freed through the uninstrumented library's sized delete);
# neither side is this project's code.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1:alloc_dealloc_mismatch=0
export LSAN_OPTIONS=suppressions=$SUPP/lsan.supp:print_suppressions=0
# hwloc's PCI plugin (libpciaccess) leaks its state and is unloaded before the leak check, so its
# allocations show as "<unknown module>", which no suppression can name; detection here runs
# without it (these CPU tests do not look at PCI devices).
export HWLOC_PLUGINS_BLACKLIST=hwloc_pci
# Open MPI unloads its components (dlclose) at MPI_Finalize: their allocations would show as
# "<unknown module>", which no suppression can name. Kept loaded for the leak check.
export OMPI_MCA_mca_base_component_disable_dlclose=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp
MPIRUN=(mpirun $LOOM_MPIRUN_FLAGS -x ASAN_OPTIONS -x LSAN_OPTIONS -x UBSAN_OPTIONS -x TSAN_OPTIONS -x LOOM_TIMEOUT
        -x OMPI_MCA_mca_base_component_disable_dlclose -x HWLOC_PLUGINS_BLACKLIST)

status=0
run() {  # name, command...
  local name=$1; shift
  local arg  # the test program: the first argument inside the build directory
  for arg in "$@"; do
    [[ "$arg" == "$DIR/"* ]] || continue
    [[ -x "$arg" ]] || { printf '%-28s skipped (not built)\n' "$name"; return; }
    break
  done
  local start=$SECONDS
  if "$@" > "$DIR/sanitize_$name.log" 2>&1; then result=ok; else result=FAILED; status=1; fi
  local reports
  reports=$(grep -c -E "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|WARNING: ThreadSanitizer" "$DIR/sanitize_$name.log" || true)
  printf '%-28s %-6s %3d s  %s sanitizer report(s)  (%s)\n' "$name" "$result" $((SECONDS - start)) "$reports" "$DIR/sanitize_$name.log"
  [[ "$reports" == 0 ]] || status=1
  # What failed, where only this script's output is kept (CI): the failing tests, their messages and
  # the fuzz seeds that replay them (LOOM_FUZZ_SEED), the first sanitizer report's opening lines.
  if [[ "$result" == FAILED || "$reports" != 0 ]]; then
    grep -E "\[  FAILED  \]|Failure|LOOM_FUZZ_SEED|^iteration|ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|WARNING: ThreadSanitizer" \
      "$DIR/sanitize_$name.log" | head -40 | sed 's/^/    /' || true
  fi
}
run metrics_server "$DIR/tests/loom_metrics_server_tests"
if [[ "$SANITIZE" == thread ]]; then
  run unit "$DIR/tests/loom_unit_tests"
  run dist_np2 "${MPIRUN[@]}" -np 2 "$DIR/tests/loom_dist_tests"
  # The same suite over the Gloo backend (torchrun: env:// rendezvous, store side channel). Without
  # TSan's deadlock detector (data races are still reported): every wait on a c10d ProcessGroupGloo
  # work without a future (reduce_scatter, all_to_all) on the Gloo waiter thread leaves one lock
  # held in the detector's view, and its 64-entry table per thread overflows into a CHECK failure
  # after about 64 of them: 80 repetitions of the all_to_all tests alone end so, and ZeRO's tests
  # make hundreds of reduce_scatters. The mpirun run above keeps the detector.
  TSAN_OPTIONS=$TSAN_OPTIONS:detect_deadlocks=0 \
    run dist_torchrun_np2 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
      "$DIR/tests/loom_dist_tests"
else
  run unit "$DIR/tests/loom_unit_tests"
  run topology "$DIR/loom_topology_tests"
  # Full allocation stacks (fast_unwind_on_malloc=0) for the MPI run only: Open MPI is built without
  # frame pointers, so the fast unwinder stops inside it and its leaks could not be matched to
  # libmpi's suppressions. Slow for LibTorch-heavy tests (the checkpoint tests below take ~20 s).
  ASAN_OPTIONS=$ASAN_OPTIONS:fast_unwind_on_malloc=0 LSAN_OPTIONS=$LSAN_OPTIONS:fast_unwind_on_malloc=0 \
    run dist_np2 "${MPIRUN[@]}" -np 2 "$DIR/tests/loom_dist_tests" \
      --gtest_filter='Collectives*:PointToPoint*:BadInput*:InputSafety*:Async*'
  # The whole suite over the Gloo backend (torchrun), whose code is new and small enough to cover.
  run dist_torchrun_np2 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
      "$DIR/tests/loom_dist_tests"
  ASAN_OPTIONS=$ASAN_OPTIONS:fast_unwind_on_malloc=0 LSAN_OPTIONS=$LSAN_OPTIONS:fast_unwind_on_malloc=0 \
    run checkpoint_np2 "${MPIRUN[@]}" -np 2 "$DIR/tests/loom_checkpoint_tests"
fi
exit $status
