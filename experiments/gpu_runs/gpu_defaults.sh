#!/usr/bin/env bash
# The new defaults on the H200, one device call (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_defaults.sh
# 1. Every compiled HyTopK test (lazy_reduce + tie_free_rewrite defaults, and the old paths).
# 2. bench_selection variants at T=32K: the default against the acd98f5 kernel ("sampled"),
#    tie ranks always computed, 3 pivots, 128-entry chunks; per-phase clocks of the default.
# 3. The full selection benchmark (8K-256K) at the default: bench_selection.{json,png}.
# 4. Sparse attention at T=128K (pallas against cuDNN dense, both H).
. experiments/gpu_runs/gpu_env.sh gpu_defaults

stamp "compiled HyTopK tests" | tee -a "$LOG"
timeout 170 python3 -m pytest -q tests/test_hytopk_pallas.py -k TestCompiledGPU 2>&1 | tail -4 \
  | tee -a "$LOG"

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 130 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,sampled,lazy_tiefree_clocks,lazy_ranked,lazy_tiefree_p3,lazy_tiefree_ch128 \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -3

stamp "selection benchmark" | tee -a "$LOG"
timeout 190 python3 experiments/bench_selection.py --reps 5 --out-dir "$OUT/selection" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -3

stamp "attention at 128K" | tee -a "$LOG"
timeout 90 python3 experiments/bench_attention.py --seq 131072 --heads 64 16 --impls pallas cudnn \
  --reps 3 --out "$OUT/bench_attention_128k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -3
stamp "done" | tee -a "$LOG"
