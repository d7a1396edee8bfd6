#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_exact_span_default.sh
# 2026-12-03 (ninth session): the default back at the eighth session's settings
# (lazy_run_max=False, stream_aims=(0.75, 0.25)), with the interpolated pivots' exact span:
# 1. the compiled HyTopK tests that run the default kernel, then the new options' own and the
#    all-equal/NaN sort-width test, then the other option tests while time lasts;
# 2. 32K and 128K at the default (time and compiled memory; rows sampled, no reference).
. experiments/gpu_runs/gpu_env.sh gpu_exact_span_default
step "pytest compiled HyTopK at the default"
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
timed_pytest 390 \
  "$C::test_random_floats_up_to_near_ties" "$C::test_deterministic_and_matches_xla" \
  "$C::test_exact_vs_reference" "$C::test_all_equal_and_nan_at_scale" \
  "$C::test_query_chunks_exact_vs_reference" "$F::test_public_dispatch_name_and_determinism" \
  "$F::test_query_chunks_match_oracle" "$C::test_run_options_exact_vs_reference" \
  "$C::test_sort_width_all_equal_and_nan_at_scale" "$C::test_compaction_options_exact_vs_reference" \
  "$C::test_sampled_pivots_exact_vs_reference"
step "selection at 32K and 128K"
timed_bench 170 --sizes 32768,131072 --impls pallas --reps 5 --ref-max 0 \
  --out-dir "$OUT/sweep_32k_128k"
step "done"
