#!/usr/bin/env bash
# The main job: installs dependencies, builds, and trains a GPT-style byte-level language model on
# a fixed corpus (examples/data/licenses.txt: the license texts every Debian system carries) with
# tensor x data parallelism (examples/train_gpt.cpp), launched by loomrun over mpirun: 4 ranks =
# TP 2 x DP 2, bf16 autocast where the CPU has bf16 arithmetic (fp32 elsewhere), gradient accumulation, a checkpoint every 250 steps
# (build/demo-checkpoints), a live progress line, the held-out loss beside unigram, bigram and
# trigram count models on the same bytes, where the time went, a sample of generated text, and the
# loss curve as build/demo-loss.png. Extra arguments go to train_gpt, e.g. --steps 2000, --resume
# (continue from the newest checkpoint), --sequence-parallel, --recompute, --data FILE. NP sets the
# number of ranks, TP the tensor-parallel degree. It exits non-zero unless the model's held-out
# loss ends below the trigram count model's. The training run itself is scripts/main_job.sh (also a
# CTest, main_job_np4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
exec bash scripts/main_job.sh "$@"
