#!/usr/bin/env bash
# One device call (< 8 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_rest.sh
# 1. The layer and model tests at the current kernel defaults (gpu_scale_one.sh's pytest step
#    ran out of time after 31 passes, counting the epilogue tests), with test names.
# 2. Two selection probes at 32K: min_steps=8 at the default capacity 4096 (every in-stream
#    compaction to exactly k), and min_steps=8 at capacity 8192 with the Pallas epilogue.
. experiments/gpu_runs/gpu_env.sh gpu_rest
stamp "pytest layer, model" | tee -a "$LOG"
timeout 300 python3 -m pytest -v -rs -p no:cacheprovider tests/test_layer.py tests/test_nn.py \
  2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tee -a "$LOG" | tail -4
stamp "selection probes at 32K" | tee -a "$LOG"
timeout 150 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,bk256_ms8_c4k,bk256_ms8_order_pallas 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -5
stamp "done" | tee -a "$LOG"
