#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_interp.sh
# 2026-12-03 (eighth session): compaction count passes with interpolated pivots
# (BlockSizes.interpolate):
# 1. the compiled tests of the option (exact vs topk_reference, all-equal and NaN at 4096);
# 2. variants at 32K against the default in the same run, each verified against the
#    reference, with clocks and work counters.
. experiments/gpu_runs/gpu_env.sh gpu_interp
stamp "pytest compiled: interpolated pivots" | tee -a "$LOG"
timeout 150 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "(compaction_options and True-True-8) or sort_width_all_equal" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -5
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 400 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,interp8,interp4,interp8_w2176,clocks_interp8,stats_interp8,stats_stable \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -22
stamp "done" | tee -a "$LOG"
