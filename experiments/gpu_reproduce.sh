#!/usr/bin/env bash
# Issue 5 on the GPU, one device call (< 10 minutes), run from the repo root:
#     OUT=/some/dir bash experiments/gpu_reproduce.sh
# End to end first (the paper's claim): one training step of the h200 preset's 4-layer model
# for materialized/full, hyscale/replay and dense/full at T in {16K, 32K, 128K} (the
# materialized table cannot exist from 64K on: >= 2**31 entries); then one layer's
# forward+backward at T in {8K, 32K, 128K}. Each stage has a time budget; records are
# written when a stage ends, also when its budget cut points short.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # peak memory per point is the point's own
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/gpu_reproduce.log"

stamp "end to end" | tee -a "$OUT/gpu_reproduce.log"
timeout 380 python3 experiments/reproduce.py --preset h200 --only e2e --sizes 16384,32768,131072 \
  --reps 3 --budget-s 340 --out "$OUT" 2>&1 | grep -v -i deprecat | tee -a "$OUT/gpu_reproduce.log"

stamp "layer" | tee -a "$OUT/gpu_reproduce.log"
timeout 180 python3 experiments/reproduce.py --preset h200 --only layer --sizes 8192,32768,131072 \
  --reps 5 --budget-s 110 --out "$OUT" 2>&1 | grep -v -i deprecat | tee -a "$OUT/gpu_reproduce.log"
stamp "done" | tee -a "$OUT/gpu_reproduce.log"
