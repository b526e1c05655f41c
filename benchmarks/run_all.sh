#!/usr/bin/env bash
# Runs every benchmark (each prints ours against the reference, measured in the same run) and
# writes JSON next to the tables. Machines are noisy: the programs report medians, and only
# ratios from one run should be compared.
#   bash benchmarks/run_all.sh [results-dir]
# The last step writes benchmarks/report/README.md and its plots from the results (REPORT=0 skips
# it; on its own: python3 benchmarks/report.py [results-dir]).
# BENCHMARKS selects which run (default: all of "allreduce ddp zero python tp pipeline amp placement soak checkpoint"); DDP_ROUNDS how many times the
# loom/PyTorch DDP pair is repeated, alternating which goes first (default 3); TORCHRUN_ROUNDS how many
# times the all-reduce pair under torchrun (loom over Gloo) is run (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-build/benchmark-results}
mkdir -p "$RESULTS"
bash scripts/setup.sh
bash scripts/build.sh
source scripts/mpi_env.sh
# Every benchmark here uses all cores: another busy process skews the numbers by 2x, not by percent.
# (Measured over one second now: the load average would still count the build that just ran.)
busy=$( { head -1 /proc/stat; sleep 1; head -1 /proc/stat; } |
        awk '{ idle[NR] = $5 + $6; total[NR] = 0; for (i = 2; i <= NF; ++i) total[NR] += $i }
             END { printf "%d", 100 * (1 - (idle[2] - idle[1]) / (total[2] - total[1])) }')
if ((busy > 20)); then
  echo "WARNING: the CPUs are ${busy}% busy before the benchmarks start (another process): results will be noisy"
fi
BENCHMARKS=${BENCHMARKS:-allreduce ddp zero python tp pipeline amp placement soak checkpoint}
source scripts/python_env.sh
# What machine and run the results come from (CPU, cores, host, date, commit, these settings): the
# report prints it under every plot.
"$PYTHON" benchmarks/report.py --write-machine "$RESULTS/machine.json" --setting "BENCHMARKS=$BENCHMARKS" \
  --setting "DDP_ROUNDS=${DDP_ROUNDS:-3}" --setting "TORCHRUN_ROUNDS=${TORCHRUN_ROUNDS:-3}" --setting "CHECKPOINT_ROUNDS=${CHECKPOINT_ROUNDS:-7}" \
  --setting "cpu_busy_before_start=${busy}%" --setting "results=$RESULTS"
if [[ " $BENCHMARKS " == *" allreduce "* ]]; then
  # Ranks pinned to cores when there are enough (2 here): floating ranks and progress threads
  # land on the same core in some runs and not others, which alone moves 1 MB results by 30%.
  cores=$(getconf _NPROCESSORS_ONLN)  # not nproc: it follows OMP_NUM_THREADS=1
  for np in 2 4; do
    binding="--bind-to none"
    ((np <= cores)) && binding="--bind-to core"
    echo "== all_reduce, $np ranks ($binding)"
    mpirun -np $np --oversubscribe $binding build/benchmarks/allreduce_bench --min-bytes 4 \
      --json "$RESULTS/allreduce_np$np.json"
    # The same sizes through PyTorch's torch.distributed on Gloo, the third line of the report's plot.
    echo "== all_reduce, PyTorch (gloo), $np ranks"
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node $np benchmarks/allreduce_gloo.py --min-bytes 4 \
      --json "$RESULTS/allreduce_gloo_np$np.json"
  done
  # ZeRO's collectives in their in-place forms, against raw MPI in the same processes.
  for np in 2 4; do
    binding="--bind-to none"
    ((np <= cores)) && binding="--bind-to core"
    echo "== reduce_scatter and all_gather, $np ranks ($binding)"
    mpirun -np $np --oversubscribe $binding build/benchmarks/shard_collectives_bench \
      --json "$RESULTS/shard_collectives_np$np.json"
  done
  # Under torchrun, without MPI: torchloom's world communicator is loom's core over LibTorch's
  # ProcessGroupGloo. Against torch.distributed over Gloo (Python, same processes) and against a
  # ProcessGroupGloo called directly from C++ (same processes); in rounds, as this machine drifts.
  for round in $(seq 1 "${TORCHRUN_ROUNDS:-3}"); do
    echo "== all_reduce under torchrun, torchloom vs torch.distributed (gloo), 2 ranks (round $round)"
    PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m torch.distributed.run --standalone \
      --nproc_per_node 2 benchmarks/allreduce_torchrun.py --json "$RESULTS/allreduce_torchrun_np2_r$round.json"
    if [[ -x build/benchmarks/allreduce_gloo_bench ]]; then  # built when LibTorch's Gloo headers compile
      echo "== all_reduce under torchrun, loom vs c10d::ProcessGroupGloo (C++), 2 ranks (round $round)"
      "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
        build/benchmarks/allreduce_gloo_bench --json "$RESULTS/allreduce_gloo_cpp_np2_r$round.json"
    fi
  done
fi
if [[ " $BENCHMARKS " == *" ddp "* ]]; then
  # (a) loom DDP against PyTorch's DDP (Gloo, torchrun) on the same model: separate programs, so the
  # pair is run in rounds, alternating which goes first, and the summary takes each side's fastest
  # round (a busy neighbour only ever slows a run down; this machine's speed drifts 2x between runs).
  # (c) comes from the same loom runs; (b) needs world size 1.
  ours=() ref=()
  for round in $(seq 1 "${DDP_ROUNDS:-3}"); do
    order="pytorch loom"
    ((round % 2)) || order="loom pytorch"
    for side in $order; do
      if [[ $side == loom ]]; then
        echo "== DDP step, loom, 2 ranks (round $round)"
        mpirun -np 2 $LOOM_MPIRUN_FLAGS build/benchmarks/ddp_bench --json "$RESULTS/ddp_loom_np2_r$round.json"
        ours+=("$RESULTS/ddp_loom_np2_r$round.json")
      else
        echo "== DDP step, PyTorch (gloo), 2 ranks (round $round)"
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/ddp_reference.py \
          --json "$RESULTS/ddp_pytorch_np2_r$round.json"
        ref+=("$RESULTS/ddp_pytorch_np2_r$round.json")
      fi
    done
  done
  echo "== DDP step, loom, world size 1"
  mpirun -np 1 $LOOM_MPIRUN_FLAGS build/benchmarks/ddp_bench --iters 100 --json "$RESULTS/ddp_loom_np1.json"
  echo "== DDP summary"
  "$PYTHON" benchmarks/ddp_reference.py --summarize --ours "${ours[@]}" --pytorch "${ref[@]}" \
    --ours-single "$RESULTS/ddp_loom_np1.json" --json "$RESULTS/ddp_summary.json"
fi
if [[ " $BENCHMARKS " == *" zero "* ]]; then
  # ZeRO stages 1 and 2 against loom DDP with Adam on ddp_bench's MLP, interleaved in the same
  # processes: step time (paired ratios), training state per rank counted from live storages,
  # bytes communicated. At 1, 2 and 4 ranks (the memory plot's x axis); 2 ranks in 3 rounds.
  for np in 1 4; do
    echo "== ZeRO against DDP, $np rank(s)"
    mpirun -np $np $LOOM_MPIRUN_FLAGS build/benchmarks/zero_bench --json "$RESULTS/zero_np$np.json"
  done
  for round in 1 2 3; do
    echo "== ZeRO against DDP, 2 ranks (round $round)"
    mpirun -np 2 $LOOM_MPIRUN_FLAGS build/benchmarks/zero_bench --json "$RESULTS/zero_np2_r$round.json"
  done
  # Once more with malloc keeping freed memory in the heap (as the CUDA caching allocator does): a
  # control that stage 2's released buckets no longer cost page faults on glibc's defaults
  # (zero_bench.cpp explains).
  for round in 1; do
    echo "== ZeRO against DDP, 2 ranks, malloc keeping freed memory (round $round)"
    GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=1073741824 \
      mpirun -np 2 -x GLIBC_TUNABLES $LOOM_MPIRUN_FLAGS build/benchmarks/zero_bench \
      --json "$RESULTS/zero_np2_tunables_r$round.json"
  done
fi
if [[ " $BENCHMARKS " == *" python "* ]]; then
  # The torchloom Python module: its DDP against PyTorch's (Gloo) in the same processes, and the
  # per-call overhead of a Python collective over the C++ call.
  echo "== Python: torchloom DDP vs torch DDP (gloo), 2 ranks; per-call overhead"
  PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" mpirun -np 2 $LOOM_MPIRUN_FLAGS "$PYTHON" \
    benchmarks/python_ddp_bench.py --json "$RESULTS/python_ddp_np2.json"
  # PyTorch's own DDP over torch.distributed backend "loom" against over "gloo", same processes.
  for np in 2 4; do
    echo "== PyTorch DDP over backend loom vs gloo, $np ranks"
    PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" mpirun -np $np $LOOM_MPIRUN_FLAGS "$PYTHON" \
      benchmarks/ddp_backend_bench.py --json "$RESULTS/ddp_backend_np$np.json"
  done
  echo "== PyTorch FSDP2 (fully_shard) over backend loom vs gloo, 2 ranks"
  PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" mpirun -np 2 $LOOM_MPIRUN_FLAGS "$PYTHON" \
    benchmarks/ddp_backend_bench.py --wrapper fsdp --json "$RESULTS/fsdp_backend_np2.json"
  # torchloom's FullyShardedDataParallel (zero_bench) against FSDP2 over gloo on zero_bench's model.
  echo "== FullyShardedDataParallel against PyTorch FSDP2 over gloo, same model, 2 ranks"
  "$PYTHON" benchmarks/fsdp_vs_fsdp2.py --np 2 --runs 3 --json "$RESULTS/fsdp_vs_fsdp2_np2.json"
fi
if [[ " $BENCHMARKS " == *" tp "* ]]; then
  echo "== tensor-parallel MLP, TP=2 against TP=1, 2 ranks"
  mpirun -np 2 $LOOM_MPIRUN_FLAGS build/benchmarks/tp_bench --json "$RESULTS/tp_np2.json"
fi
if [[ " $BENCHMARKS " == *" pipeline "* ]]; then
  echo "== pipeline schedules: measured bubble against the proven one, activation peak, 2 ranks"
  mpirun -np 2 $LOOM_MPIRUN_FLAGS build/benchmarks/pipeline_bench --json "$RESULTS/pipeline_np2.json"
  echo "== torchloom's 1F1B against torch.distributed.pipelining's (Gloo), same stages, 2 ranks"
  PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" mpirun -np 2 $LOOM_MPIRUN_FLAGS "$PYTHON" \
    benchmarks/pipeline_torch_bench.py --json "$RESULTS/pipeline_torch_np2.json"
  echo "== torchloom's ZB-H1 against torch.distributed.pipelining's 1F1B (Gloo), same stages, 2 ranks"
  PYTHONPATH="build/python${PYTHONPATH:+:$PYTHONPATH}" mpirun -np 2 $LOOM_MPIRUN_FLAGS "$PYTHON" \
    benchmarks/pipeline_torch_bench.py --schedule zero-bubble --json "$RESULTS/pipeline_torch_zb_np2.json"
fi
if [[ " $BENCHMARKS " == *" amp "* ]]; then
  # Python's torch.amp.GradScaler first: amp_bench reads its JSON and sets loom's numbers against it.
  echo "== GradScaler unscale_, PyTorch"
  "$PYTHON" benchmarks/amp_reference.py --json "$RESULTS/amp_python.json"
  echo "== GradScaler unscale_, loom (against a copy, a naive loop and PyTorch)"
  build/benchmarks/amp_bench --python-json "$RESULTS/amp_python.json" --json "$RESULTS/amp.json"
fi
if [[ " $BENCHMARKS " == *" placement "* ]]; then
  # Modelled (no GPU needed): planned against naive all-reduce times on every fixture and on
  # simulated clusters up to 1,024 nodes, and the planner's run time. One process, one core.
  echo "== placement: planned vs naive layout (modelled), planner time"
  build/benchmarks/placement_bench --json "$RESULTS/placement.json"
fi
if [[ " $BENCHMARKS " == *" soak "* ]]; then
  # The long load run (the suite runs 1,000 operations): 10,000 mixed asynchronous collectives,
  # 8 ranks on this machine's cores, every result checked, memory flat after warm-up.
  echo "== soak: 10,000 collectives, 8 ranks"
  mpirun -np 8 $LOOM_MPIRUN_FLAGS build/tests/loom_soak --ops 10000 --max-bytes 4194304 --in-flight 24 |
    tee "$RESULTS/soak.txt"
fi
if [[ " $BENCHMARKS " == *" checkpoint "* ]]; then
  # On the disk of the results directory: durable save against write+fdatasync of the same bytes,
  # cold load against read() and torch::load, the async stall against a memory copy.
  echo "== checkpoint save/load, ~300 MB of model + Adam state, 1 process"
  build/benchmarks/checkpoint_bench --dir "$RESULTS/checkpoint-scratch" --rounds "${CHECKPOINT_ROUNDS:-7}" \
    --json "$RESULTS/checkpoint.json"
fi
echo "results in $RESULTS"
if [[ ${REPORT:-1} != 0 ]]; then
  echo "== report"
  "$PYTHON" benchmarks/report.py "$RESULTS"
fi
