#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_exact_span_rest.sh
# 2026-12-03 (ninth session): the compiled option tests gpu_exact_span_default.sh did not
# reach before its time limit, at the same default. (It ran as this same command line inline.)
. experiments/gpu_runs/gpu_env.sh gpu_exact_span_rest
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
step "pytest compiled: the rest of the option tests at the default"
timed_pytest 380 \
  "$C::test_sort_width_all_equal_and_nan_at_scale" "$C::test_run_options_exact_vs_reference" \
  "$C::test_compaction_options_exact_vs_reference" "$C::test_sampled_pivots_exact_vs_reference"
step done
