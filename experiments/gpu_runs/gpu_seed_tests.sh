#!/usr/bin/env bash
# One device call (< 7 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_seed_tests.sh
# Written 2026-12-04 (fifteenth session): the compiled tests at the seeded default that
# gpu_seed_default.sh did not reach (its time limit stopped it after three shapes), most
# important first: the other two shapes, determinism, all-equal/NaN at the default, one
# query-chunk case, random floats.
. experiments/gpu_runs/gpu_env.sh gpu_seed_tests
step "pytest compiled tests at the default, continued"
compiled_tests 370 "test_exact_vs_reference[512-4096-8-128-1-True-float32]" \
  "test_exact_vs_reference[300-5000-16-64-2048-False-bfloat16]" \
  "test_deterministic_and_matches_xla" "test_all_equal_and_nan_at_scale[phased-32]" \
  "test_query_chunks_exact_vs_reference[1000-3001-512-True]" \
  "test_random_floats_up_to_near_ties"
step "done"
