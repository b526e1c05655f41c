#!/usr/bin/env bash
# libFuzzer targets for every parser of outside input, with AddressSanitizer and UBSan, built with
# clang into build-fuzz/ (not part of scripts/run_tests.sh; CI's .ci/run runs it after the suite;
# clang and libFuzzer come from scripts/setup.sh).
#
#   bash scripts/fuzz.sh                 # every target for FUZZ_SECONDS (default 60) each
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh nccl_xml
#   bash scripts/fuzz.sh --replay        # only the seeds and kept regressions, once each (seconds)
#
# Targets: topology_json, nvidia_smi, nccl_xml, hosts (-H and hostfiles), loomrun_args, env_values,
# checkpoint_manifest and safetensors (checkpoint files; built against LibTorch's c10 headers).
# Properties: no crash or sanitizer report; a refusal is the parser's typed error (any other
# exception is reported as a crash); an accepted topology validates and survives a JSON round
# trip; memory stays bounded (-malloc_limit_mb, -rss_limit_mb); the parsers keep no state, so a
# refused input changes nothing. Each run uses a fresh seed, printed by libFuzzer ("INFO: Seed:");
# replay one with FUZZ_SEED. A crashing input is written to build-fuzz/crashes/<target>/; copy it
# to tests/fuzz/regressions/<target>/ (with the fix) so every later run replays it.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${FUZZ_CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang)"; exit 2; }
DIR=${FUZZ_BUILD_DIR:-build-fuzz}
ALL=(topology_json nvidia_smi nccl_xml hosts loomrun_args env_values checkpoint_manifest safetensors)
REPLAY=0
TARGETS=()
for a in "$@"; do
  if [[ "$a" == --replay ]]; then REPLAY=1; else TARGETS+=("$a"); fi
done
((${#TARGETS[@]})) || TARGETS=("${ALL[@]}")

FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=all -Iinclude -Isrc -Itests/fuzz)
TOPOLOGY=(model cpu_list link_costs text_lines parse_nvidia_smi xml_scan pcie_path parse_nccl_xml json_io load_file
          merge nvml_loader detect cost_model ordering grouping placement cpu_share explain render)
LAUNCHER=(launcher/launcher_args launcher/hosts launcher/slurm launcher/mpirun_command)
CORE=(core/env core/error_context core/parallel_layout)
CHECKPOINT=(train/checkpoint_manifest train/safetensors train/checkpoint_checksum train/checkpoint_files)
mkdir -p "$DIR/obj"
compile() {  # source -> object, when newer
  local src=$1 obj=$DIR/obj/$(echo "$1" | tr / _).o
  # Rebuilt when the source or any project header is newer (or the flags changed: delete build-fuzz/).
  if [[ ! -f "$obj" || "$src" -nt "$obj" || -n "$(find src include -name '*.h' -newer "$obj" -print -quit)" ]]; then
    "$CXX" "${FLAGS[@]}" $(pkg-config --cflags hwloc) -c "$src" -o "$obj"
  fi
  echo "$obj"
}
OBJS=()
for s in "${TOPOLOGY[@]}"; do OBJS+=("$(compile src/topology/$s.cpp)"); done
for s in "${LAUNCHER[@]}" "${CORE[@]}"; do OBJS+=("$(compile src/$s.cpp)"); done
# The checkpoint parsers name dtypes with c10's ScalarType (header-only here; libc10 is linked for
# anything it does not inline), checksum with xxHash and log (file removal) through spdlog: built
# only when a checkpoint target is asked for (the others need no LibTorch).
CHECKPOINT_OBJS=()
if [[ " ${TARGETS[*]} " == *" checkpoint_manifest "* || " ${TARGETS[*]} " == *" safetensors "* ]]; then
  source scripts/python_env.sh
  TORCH_LIB=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  TORCH_INCLUDE=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
  # core/log first, without LibTorch's include directory: it ships an fmt of its own, which the
  # system's spdlog was not built against.
  CHECKPOINT_OBJS=("$(FLAGS+=($(pkg-config --cflags spdlog)); compile src/core/log.cpp)")
  FLAGS+=(-isystem "$TORCH_INCLUDE")
  for s in "${CHECKPOINT[@]}"; do CHECKPOINT_OBJS+=("$(compile src/$s.cpp)"); done
fi
for t in "${TARGETS[@]}"; do
  extra=()
  [[ "$t" == checkpoint_manifest || "$t" == safetensors ]] &&
    extra=("${CHECKPOINT_OBJS[@]}" -lxxhash $(pkg-config --libs spdlog) -L"$TORCH_LIB" -lc10 -Wl,-rpath,"$TORCH_LIB")
  "$CXX" "${FLAGS[@]/fuzzer-no-link/fuzzer}" "tests/fuzz/fuzz_$t.cpp" "${OBJS[@]}" "${extra[@]}" \
         $(pkg-config --libs hwloc) -ldl -o "$DIR/fuzz_$t"
done

status=0
printf '%-20s %8s %10s %8s %s\n' target seconds executions crashes seed
for t in "${TARGETS[@]}"; do
  seeds=tests/fuzz/corpus/$t
  kept=tests/fuzz/regressions/$t
  mkdir -p "$DIR/corpus/$t" "$DIR/crashes/$t"
  log=$DIR/fuzz_$t.log
  # The seeds and every kept regression input, once each.
  inputs=("$seeds"/*)
  [[ -d "$kept" ]] && inputs+=("$kept"/*)
  if ! "$DIR/fuzz_$t" -rss_limit_mb=2048 -malloc_limit_mb=1024 "${inputs[@]}" > "$log.replay" 2>&1; then
    echo "$t: a seed or kept regression fails (see $log.replay)"; status=1
  fi
  ((REPLAY)) && continue
  seconds=${FUZZ_SECONDS:-60}
  set +e
  "$DIR/fuzz_$t" "$DIR/corpus/$t" "$seeds" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      -max_len=65536 -timeout=10 -artifact_prefix="$DIR/crashes/$t/" ${FUZZ_SEED:+-seed=$FUZZ_SEED} > "$log" 2>&1
  rc=$?
  set -e
  # (|| true: a crash before libFuzzer's first status line leaves nothing to find, and the row and
  # the reason must still be printed)
  runs=$( (grep -oE '^#[0-9]+' "$log" || true) | tail -1 | tr -d '#')
  seed=$( (grep -oE 'Seed: [0-9]+' "$log" || true) | head -1 | cut -d' ' -f2)
  crashes=$(ls "$DIR/crashes/$t" | wc -l)
  printf '%-20s %8s %10s %8s %s\n' "$t" "$seconds" "${runs:-0}" "$crashes" "$seed"
  if ((rc != 0)); then echo "$t: libFuzzer exited $rc (see $log; inputs in $DIR/crashes/$t)"; status=1; fi
done
exit $status
