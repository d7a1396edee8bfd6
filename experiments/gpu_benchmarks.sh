#!/usr/bin/env bash
# The two kernel benchmarks, one device call (< 9 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_benchmarks.sh
# 1. sparse attention (issue 4): bench_attention.py --quick, H in {64, 16}, pallas/cudnn/xla;
# 2. HyTopK selection (issue 3): bench_selection.py, T = S in {8K ... 256K}.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LOG="$OUT/gpu_benchmarks.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"

stamp "attention benchmark" | tee -a "$LOG"
timeout 200 python3 experiments/bench_attention.py --quick --heads 64 16 \
  --impls pallas cudnn xla --reps 5 --out "$OUT/bench_attention" 2>&1 | grep -v -i deprecat \
  | tail -22 | tee -a "$LOG"

stamp "selection benchmark" | tee -a "$LOG"
timeout 300 python3 experiments/bench_selection.py --reps 5 --out-dir "$OUT" 2>&1 \
  | grep -v -i deprecat | tail -30 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
