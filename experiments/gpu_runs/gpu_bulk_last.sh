#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_bulk_last.sh
# 2026-12-04 (tenth session): the compiled HyTopK tests gpu_bulk_rest.sh did not reach, at the
# same default, in priority order; its 540 s limit stopped it after the first 13. (It ran as
# the same commands inline.)
. experiments/gpu_runs/gpu_env.sh gpu_bulk_last
F=tests/test_hytopk_pallas.py
C=$F::TestCompiledGPU
step "pytest remaining"
timed_pytest 540 \
  "$C::test_sort_width_all_equal_and_nan_at_scale" "$C::test_clocks_diagnostic" \
  "$F::test_public_dispatch_name_and_determinism" "$C::test_compaction_options_exact_vs_reference" \
  "$C::test_sampled_pivots_exact_vs_reference" "$C::test_order_and_sort_width_exact_vs_reference" \
  "$C::test_pallas_order_exact_vs_reference"
step done
