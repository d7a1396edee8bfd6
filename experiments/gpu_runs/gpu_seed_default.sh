#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_seed_default.sh
# Written 2026-12-04 (fifteenth session), after gpu_seed.sh: seeded thresholds are the new
# default (BlockSizes.seed_rate=16).
# 1. 32K: the default against the unseeded stream (seed_rate 0), alternated, every row
#    checked against the reference;
# 2. the sweep's long end at the default, 64K-256K (sampled rows checked);
# 3. the compiled tests at the default: shapes, all-equal/NaN, the seed's failure path,
#    determinism, query chunks, random floats.
. experiments/gpu_runs/gpu_env.sh gpu_seed_default
step "32K: seeded default against unseeded"
timed_bench 150 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,floor=seed_rate:0,default_2="
step "sweep 64K-256K"
timed_bench 130 --sizes 65536,131072,262144 --impls pallas --reps 3 --out-dir "$OUT/sweep_64k_256k"
step "pytest compiled tests at the default"
compiled_tests 245 "test_exact_vs_reference" "test_seeded_all_equal_nan_and_failure_at_scale" \
  "test_all_equal_and_nan_at_scale" "test_deterministic_and_matches_xla" \
  "test_query_chunks_exact_vs_reference" "test_random_floats_up_to_near_ties"
step "done"
