#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_stable.sh
# The stable one-key epilogue (BlockSizes.order="xla_stable": XLA's sort rewriter should hand it
# to CUB's segmented radix sort; it did not at these widths, see probe_sort.py in
# gpu_stable_rest.sh) and wider final buffers (BlockSizes.sort_width), 2026-12-03
# (seventh session):
# 1. variants at 32K against the default in the same run, each verified against the reference,
#    each epilogue timed alone with a note whether it compiled to CUB; clocks of one of them;
# 2. the compiled tests of the new options (exact vs topk_reference).
. experiments/gpu_runs/gpu_env.sh gpu_stable
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 330 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,stable,stable_w4k,stable_w8k,xla_sort_w4k,pallas_w4k,clocks_stable_w4k \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -14
stamp "pytest compiled: epilogues and sort widths" | tee -a "$LOG"
timeout 240 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "sort_width_exact or sort_width_all_equal or bad_block" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -6
stamp "done" | tee -a "$LOG"
