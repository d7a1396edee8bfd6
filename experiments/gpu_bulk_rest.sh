#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_bulk_rest.sh
# 2026-12-04 (tenth session): compiled HyTopK tests gpu_bulk.sh did not reach, at the same
# default (bulk first run), then 128K and 256K. (It ran as this same command line inline.)
. experiments/gpu_env.sh gpu_bulk_rest
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
stamp "pytest rest" | tee -a "$LOG"
timeout 400 python3 -m pytest -v -rs -p no:cacheprovider \
  "$C::test_exact_vs_reference" "$C::test_query_chunks_exact_vs_reference" \
  "$C::test_clocks_diagnostic" "$C::test_sort_width_all_equal_and_nan_at_scale" \
  "$F::test_public_dispatch_name_and_determinism" "$F::test_query_chunks_match_oracle" \
  "$C::test_sampled_pivots_exact_vs_reference" "$C::test_compaction_options_exact_vs_reference" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -40
stamp "256K and 128K" | tee -a "$LOG"
timeout 170 python3 experiments/bench_selection.py --sizes 131072,262144 --impls pallas --reps 3 \
  --out-dir "$OUT/long" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -12
stamp done | tee -a "$LOG"
