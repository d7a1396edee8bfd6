#!/usr/bin/env bash
# One device call (< 6 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_last.sh
# 1. Larger candidate buffers at block_k=256 (32K): capacity 8192 / 16384 with min_steps 8 / 16,
#    against the default and capacity 8192 + min_steps 8 (the best of gpu_next.sh) in one run.
# 2. Issue 7 at N=1: does one H200 train the e2e model at T=1M (512K took 70 GiB)?
. experiments/gpu_env.sh gpu_last
stamp "selection probes at 32K" | tee -a "$LOG"
timeout 170 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,bk256_ms8,bk256_c8k_ms16,bk256_c16k_ms8,bk256_c16k_ms16 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -6
stamp "scale_parallel: longest T at N=1 from 1M" | tee -a "$LOG"
timeout 200 python3 experiments/scale_parallel.py --preset h200 --devices 1 --only longest \
  --longest-start 1048576 --longest-cap 1048576 --budget-s 190 --out "$OUT/scale_1m" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -6
stamp "done" | tee -a "$LOG"
