#!/usr/bin/env bash
# The main job's training run, on a build that exists (scripts/run_demo.sh sets up and builds
# first; CTest's main_job_np4 runs this on its build directory, BUILD_DIR): train_gpt launched by
# loomrun, 4 ranks = TP 2 x DP 2 (NP, TP), 1000 steps, held-out loss against unigram, bigram and
# trigram count models, checkpoints every 250 steps, the loss curve as BUILD_DIR/demo-loss.png.
# Extra arguments go to train_gpt. Exits non-zero unless the model's held-out loss ends below the
# trigram count model's.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
source scripts/mpi_env.sh
source scripts/python_env.sh
# Live progress on a terminal; a line every 20 steps when the output goes to a file or a pipe.
progress=lines
[[ -t 1 ]] && progress=live
# The job's settings, each unless the arguments name it themselves (train_gpt takes an option once:
# `--steps 2000` replaces the 1000 here).
defaults=(--steps 1000 --eval-every 250 --checkpoint-dir "$build/demo-checkpoints" --save-every 250
          --loss-csv "$build/demo-loss.csv" --progress "$progress")
settings=()
for ((i = 0; i < ${#defaults[@]}; i += 2)); do
  case " $* " in
    *" ${defaults[i]} "* | *" ${defaults[i]}="*) ;;
    *) settings+=("${defaults[i]}" "${defaults[i + 1]}") ;;
  esac
done
status=0
"$build/loomrun" -np "${NP:-4}" --tp "${TP:-2}" -- \
  "$build/examples/train_gpt" "${settings[@]}" --must-beat-trigram "$@" | tee "$build/demo-output.txt" || status=$?
trigram=$(sed -n 's/.*trigram count model.s \([0-9.]*\).*/\1/p' "$build/demo-output.txt" | tail -1)
"$PYTHON" examples/plot_loss.py "$build/demo-loss.csv" "$build/demo-loss.png" ${trigram:+--trigram "$trigram"} || true
exit "$status"
