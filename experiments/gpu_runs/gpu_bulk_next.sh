#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_bulk_next.sh
# Written 2026-12-04 (tenth session); ran in the eleventh at 7f6bd5a (results/hytopk_bulk/gpu_bulk_next.log):
# 1. work counters and clocks of the bulk default and of 16384 slots, and 16384 slots with
#    mid-stream aims lowered to 8192's counts, against the default in the same run (every row
#    checked against the reference);
# 2. the compiled HyTopK tests not yet run at the bulk default (sort widths, Pallas epilogue,
#    two sampled-pivot cases, the query-chunk oracle test).
. experiments/gpu_runs/gpu_env.sh gpu_bulk_next
step "selection variants at 32K"
timed_bench 280 --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,stats_bulk,bulk_c16k_low,clocks_bulk_c16k,clocks_bulk_c16k_low
step "pytest compiled HyTopK, not yet run at the bulk default"
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
timed_pytest 290 \
  "$C::test_sampled_pivots_exact_vs_reference" "$F::test_query_chunks_match_oracle" \
  "$C::test_order_and_sort_width_exact_vs_reference" "$C::test_pallas_order_exact_vs_reference"
step "done"
