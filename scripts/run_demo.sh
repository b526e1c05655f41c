#!/usr/bin/env bash
# The main job: installs dependencies, builds, and trains a GPT-style byte-level language model on
# this project's documentation with tensor x data parallelism (examples/train_gpt.cpp), launched by
# loomrun over mpirun: 4 ranks = TP 2 x DP 2, bf16 autocast, gradient accumulation, a checkpoint
# every 100 steps (build/demo-checkpoints), a live progress line, the held-out loss, where the time
# went, and a sample of generated text. Extra arguments go to train_gpt, e.g. --steps 800,
# --resume (continue from the newest checkpoint), --sequence-parallel, --recompute, --data FILE.
# NP sets the number of ranks, TP the tensor-parallel degree. It exits non-zero when the model did
# not learn.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
# Live progress on a terminal; a line every 20 steps when the output goes to a file or a pipe.
progress=lines
[[ -t 1 ]] && progress=live
build/loomrun -np "${NP:-4}" --tp "${TP:-2}" -- \
  build/examples/train_gpt --checkpoint-dir build/demo-checkpoints --save-every 100 --progress "$progress" "$@"
