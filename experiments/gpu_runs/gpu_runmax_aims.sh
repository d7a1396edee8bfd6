#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_runmax_aims.sh
# 2026-12-03 (ninth session): the runs' largest key as per-lane maxima (BlockSizes.lazy_run_max)
# and mid-stream compactions aimed lower in [k, target] (BlockSizes.stream_aims), both the
# new defaults, plus the interpolated pivots' exact span (not an option):
# 1. variants at 32K against interp8 (the eighth session's default) in the same run, every
#    row checked against the reference, with clocks and work counters of the new default;
# 2. the compiled HyTopK tests that run the default kernel, the eighth session's unreached
#    ones first, then the new options' own.
. experiments/gpu_runs/gpu_env.sh gpu_runmax_aims
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 250 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants interp8,lazy_max,aims_low,lazy_aims_low,aims_lower,lazy_aims_lower,clocks_lazy_aims_low,stats_lazy_aims_low \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -24
stamp "pytest compiled HyTopK at the new default" | tee -a "$LOG"
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
timeout 320 python3 -m pytest -v -rs -p no:cacheprovider \
  "$C::test_random_floats_up_to_near_ties" "$C::test_deterministic_and_matches_xla" \
  "$C::test_exact_vs_reference" "$C::test_all_equal_and_nan_at_scale[phased-32]" \
  "$C::test_query_chunks_exact_vs_reference" "$C::test_run_options_exact_vs_reference" \
  "$F::test_public_dispatch_name_and_determinism" "$F::test_query_chunks_match_oracle" \
  "$C::test_sampled_pivots_exact_vs_reference" "$C::test_compaction_options_exact_vs_reference" \
  "$C::test_all_equal_and_nan_at_scale" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -40
stamp "done" | tee -a "$LOG"
