#!/usr/bin/env bash
# Issue 5 on the GPU, one device call (< 9 minutes), run from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_reproduce.sh
# 1. End to end: one training step of the h200 preset's 4-layer model for materialized/full,
#    hyscale/replay and dense/full (cuDNN) at T=32K, the longest power of two the materialized
#    baseline can run (its table cannot exist from 64K on: >= 2**31 entries), then 64K and
#    128K (4x) for the others.
# 2. Where a HyScale layer's time goes (experiments/bench_layer_parts.py) at 8K and 32K,
#    the Pallas indexer loss against the xla one.
# Each stage has a time budget; records are written also when a budget cuts it short.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # peak memory per point is the point's own
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/gpu_reproduce.log"

stamp "end to end" | tee -a "$OUT/gpu_reproduce.log"
timeout 345 python3 experiments/reproduce.py --preset h200 --only e2e \
  --sizes 32768,65536,131072 --reps 3 --budget-s 330 --out "$OUT" 2>&1 \
  | grep -E "^\[|^ +[0-9]+ \||median|wrote|Error|error" | tee -a "$OUT/gpu_reproduce.log"

stamp "layer parts" | tee -a "$OUT/gpu_reproduce.log"
timeout 150 python3 experiments/bench_layer_parts.py --T 8192 32768 --reps 3 --out "$OUT" 2>&1 \
  | grep -v -i deprecat | tail -8 | tee -a "$OUT/gpu_reproduce.log"
stamp "done" | tee -a "$OUT/gpu_reproduce.log"
