#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_slack.sh
# 2026-12-03 (eighth session): final buffers a little wider than k (sort_width 2176-3072):
# 1. the stable sort alone at those widths (probe_sort.py);
# 2. the variants at 32K against the default in the same run, each verified against the
#    reference, plus the clocks of sort_width 2304.
. experiments/gpu_runs/gpu_env.sh gpu_slack
stamp "stable sort by width" | tee -a "$LOG"
(cd experiments && PYTHONPATH=.. timeout 120 python3 probe_sort.py --forms stable_iota \
  --shapes 32768x2048,32768x2176,32768x2304,32768x2560,32768x3072,32768x4096) 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -7
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 420 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,stable_w2176,stable_w2304,stable_w2560,stable_w3072,clocks_stable_w2304 \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -16
stamp "done" | tee -a "$LOG"
