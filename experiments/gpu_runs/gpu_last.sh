#!/usr/bin/env bash
# One device call (< 5 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_last.sh
# Larger candidate buffers at block_k=256 (32K): capacity 8192 / 16384 with min_steps 8 / 16,
# against the default in the same run (capacity 8192 + min_steps 8 + the Pallas epilogue was
# the best of gpu_next.sh / gpu_rest.sh).
. experiments/gpu_runs/gpu_env.sh gpu_last
stamp "selection probes at 32K" | tee -a "$LOG"
timeout 280 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,bk256_ms8_order_pallas,bk256_c16k_ms8,bk256_c8k_ms16,bk256_c16k_ms16 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -12
stamp "done" | tee -a "$LOG"
