#!/usr/bin/env bash
# One device call per group (< 10 minutes each), from the repo root:
#   OUT=/some/dir bash experiments/gpu_seed_rest.sh GROUP      (GROUP: 1, 2, 3 or 4)
# Written 2026-12-04 (fifteenth session), not yet run: the compiled HyTopK tests that did not
# run at the seeded default (BlockSizes.seed_rate=16) this session. 16 of the class's 81 ran
# (results/hytopk_seed/); these are the other 65, which now reach the seeded kernel through
# the default. The seeded kernel compiles slower (two kernels: the seeded one and its re-run),
# ~20-60 s per test, hence four calls.
. experiments/gpu_env.sh "gpu_seed_rest_$1"
step "pytest compiled tests at the seeded default, group $1"
case "$1" in
  1) compiled_tests 540 "test_sampled_pivots_exact_vs_reference" \
       "test_compaction_options_exact_vs_reference" \
       "test_all_equal_and_nan_at_scale[phased-0]" ;;
  2) compiled_tests 540 "test_run_options_exact_vs_reference" \
       "test_query_chunks_exact_vs_reference" "test_seed_rates_exact_vs_reference" \
       -k "not (query_chunks and 1000-3001) and not (seed_rates and (0-4096 or 32-4096 or 32-300))" ;;
  3) compiled_tests 540 "test_pallas_order_exact_vs_reference" \
       "test_sort_width_all_equal_and_nan_at_scale[xla_stable]" ;;
  4) compiled_tests 540 "test_order_and_sort_width_exact_vs_reference" ;;
  *) step "unknown group '$1' (1-4)"; exit 2 ;;
esac
step "done"
