#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_bulk.sh
# 2026-12-04 (tenth session): the bulk first run (BlockSizes.bulk_first_run, the new default):
# 1. variants at 32K against interp8 (the ninth session's default, first run masked) in the
#    same run, every row checked against the reference, with clocks and work counters;
# 2. the compiled HyTopK tests that run the default kernel, the bulk-specific ones first.
. experiments/gpu_runs/gpu_env.sh gpu_bulk
step "selection variants at 32K"
timed_bench 250 --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants interp8,default,bulk_lazy_max,bulk_c16k,clocks_bulk,stats_bulk,clocks_bulk_c16k
step "pytest compiled HyTopK at the new default"
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
timed_pytest 320 \
  "$F::test_bulk_placeholders_when_few_real_keys" "$F::test_stats_counters_and_diagnostics" \
  "$C::test_run_options_exact_vs_reference" "$C::test_all_equal_and_nan_at_scale" \
  "$C::test_random_floats_up_to_near_ties" "$C::test_deterministic_and_matches_xla" \
  "$C::test_exact_vs_reference" "$C::test_query_chunks_exact_vs_reference" \
  "$C::test_clocks_diagnostic" "$C::test_sort_width_all_equal_and_nan_at_scale"
step "done"
