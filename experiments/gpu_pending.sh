#!/usr/bin/env bash
# NOT YET RUN (written 2026-12-03, eighth session, when the session's device time was spent).
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_pending.sh
# What the eighth session's default (BlockSizes.interpolate=8) has not yet run on the H200:
# 1. the 3 compiled HyTopK tests its call did not reach, and the option tests as re-parametrized
#    after review (interpolate=0; the lazy / tie-free options under interpolation);
# 2. 32K and 128K at the default (time and compiled memory; 128K ran out of its step limit).
. experiments/gpu_env.sh gpu_pending
stamp "pytest compiled: the unreached and re-parametrized HyTopK tests" | tee -a "$LOG"
timeout 300 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "random_floats_up_to_near_ties or deterministic_and_matches_xla or (query_chunks_exact and 777) or compaction_options or sort_width_all_equal or need_fewer" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -16
stamp "selection at 32K and 128K" | tee -a "$LOG"
timeout 200 python3 experiments/bench_selection.py --sizes 32768,131072 --impls pallas --reps 5 \
  --out-dir "$OUT/sweep_32k_128k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -6
stamp "done" | tee -a "$LOG"
