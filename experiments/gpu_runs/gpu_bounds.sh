#!/usr/bin/env bash
# What bounds the kernels, one device call (< 6 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_bounds.sh
# 1. experiments/diagnose_bounds.py at T=32K: the HyTopK epilogue sort (two-key against stable
#    one-key) and the sparse-attention floors (gather-only, atomics-only kernels).
# 2. experiments/bench_attention.py --tune: tile configurations at T=32K, H=64.
. experiments/gpu_runs/gpu_env.sh gpu_bounds

stamp "bounds" | tee -a "$LOG"
timeout 120 python3 experiments/diagnose_bounds.py --T 32768 --reps 5 --out "$OUT" 2>&1 \
  | grep -v -i deprecat | tail -8 | tee -a "$LOG"

stamp "attention tiles at 32K, H=64" | tee -a "$LOG"
timeout 230 python3 experiments/bench_attention.py --tune --seq 8192 --heads 64 --impls pallas \
  --reps 6 --out "$OUT/bench_attention_tune" 2>&1 | grep -E "tune|check|rc|Error" \
  | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
