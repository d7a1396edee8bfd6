#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_hoist_next.sh
# Written 2026-12-04 (twelfth session); ran in the thirteenth at 3122500
# (results/hytopk_hoist_next/).
# At the hoisted-queries default (1ea1429): 1. where the time goes now (clocks, work
# counters) and the run/stream settings tuned before the queries were hoisted, re-tried since
# register pressure and load traffic in the runs changed (lazy_run_max lost 0.5 ms before,
# plausibly from registers); every full row checked against the reference; 2. the compiled
# tests not yet run at this default, except the sort-width and Pallas-epilogue options.
. experiments/gpu_runs/gpu_env.sh gpu_hoist_next
step "32K: clocks, counters and run settings at the hoisted default"
timed_bench 220 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,clocks_h=diagnostic:clocks,stats_h=diagnostic:stats,lazy_max=lazy_run_max:1,c16k=capacity:16384,ms4=min_steps:4,ms16=min_steps:16"
step "pytest compiled tests not yet run at this default"
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
timed_pytest 320 \
  "$F::test_bulk_placeholders_when_few_real_keys" "$F::test_stats_counters_and_diagnostics" \
  "$F::test_public_dispatch_name_and_determinism" "$F::test_query_chunks_match_oracle" \
  "$C::test_sort_width_all_equal_and_nan_at_scale" \
  "$C::test_run_options_exact_vs_reference" -k "not 4096-4096-2048 and not True-True"
step "done"
