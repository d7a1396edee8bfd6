#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_stable_rest.sh
# After gpu_stable.sh (whose bench used its 330 s before the last two variants):
# 1. which lax.sort forms XLA runs as CUB's radix sort here (experiments/probe_sort.py);
# 2. the variants gpu_stable.sh did not reach, against the default in the same run;
# 3. the compiled tests of the new options gpu_stable.sh did not reach.
. experiments/gpu_runs/gpu_env.sh gpu_stable_rest
stamp "sort forms" | tee -a "$LOG"
timeout 150 python3 experiments/probe_sort.py 2>&1 | grep -v -i deprecat | tee -a "$LOG"
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 200 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --ref-max 0 --variants default,stable,clocks_stable_w4k 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -14
stamp "pytest compiled: epilogues and sort widths" | tee -a "$LOG"
timeout 200 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "(sort_width_exact and 777) or sort_width_all_equal" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -12
stamp "done" | tee -a "$LOG"
