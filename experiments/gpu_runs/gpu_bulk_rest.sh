#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_bulk_rest.sh
# 2026-12-04 (tenth session): compiled HyTopK tests gpu_bulk.sh did not reach, at the same
# default (bulk first run), then 128K and 256K. (It ran as the same commands inline.)
. experiments/gpu_runs/gpu_env.sh gpu_bulk_rest
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
step "pytest rest"
timed_pytest 400 \
  "$C::test_exact_vs_reference" "$C::test_query_chunks_exact_vs_reference" \
  "$C::test_clocks_diagnostic" "$C::test_sort_width_all_equal_and_nan_at_scale" \
  "$F::test_public_dispatch_name_and_determinism" "$F::test_query_chunks_match_oracle" \
  "$C::test_sampled_pivots_exact_vs_reference" "$C::test_compaction_options_exact_vs_reference"
step "256K and 128K"
timed_bench 170 --sizes 131072,262144 --impls pallas --reps 3 --out-dir "$OUT/long"
step done
