#!/usr/bin/env bash
# The main job: installs dependencies, builds, and trains a GPT-style byte-level language model on
# a fixed corpus (examples/data/licenses.txt: the license texts every Debian system carries) with
# tensor x data parallelism (examples/train_gpt.cpp), launched by loomrun over mpirun: 4 ranks =
# TP 2 x DP 2, bf16 autocast, gradient accumulation, a checkpoint every 250 steps
# (build/demo-checkpoints), a live progress line, the held-out loss beside unigram, bigram and
# trigram count models on the same bytes, where the time went, a sample of generated text, and the
# loss curve as build/demo-loss.png. Extra arguments go to train_gpt, e.g. --steps 2000, --resume
# (continue from the newest checkpoint), --sequence-parallel, --recompute, --data FILE. NP sets the
# number of ranks, TP the tensor-parallel degree. It exits non-zero unless the model's held-out
# loss ends below the trigram count model's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
source scripts/python_env.sh
# Live progress on a terminal; a line every 20 steps when the output goes to a file or a pipe.
progress=lines
[[ -t 1 ]] && progress=live
status=0
build/loomrun -np "${NP:-4}" --tp "${TP:-2}" -- \
  build/examples/train_gpt --steps 1000 --eval-every 250 --checkpoint-dir build/demo-checkpoints --save-every 250 \
  --must-beat-trigram --loss-csv build/demo-loss.csv --progress "$progress" "$@" | tee build/demo-output.txt || status=$?
trigram=$(sed -n 's/.*trigram count model.s \([0-9.]*\).*/\1/p' build/demo-output.txt | tail -1)
"$PYTHON" examples/plot_loss.py build/demo-loss.csv build/demo-loss.png ${trigram:+--trigram "$trigram"} || true
exit "$status"
