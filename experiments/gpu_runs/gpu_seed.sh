#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_seed.sh
# Written 2026-12-04 (fifteenth session). Seeded thresholds (BlockSizes.seed_rate): each
# program scores a 1/rate sample of its keys first and starts its stream at a threshold that
# about 2k keys beat, instead of at the floor, so the buffers rarely need a mid-stream
# compaction (at the default: in-stream compaction ~4.5 ms of the kernel's cycles at 32K, the
# final one ~4.2 ms on up to 8192 entries per row).
# 1. the full selection at 32K, every row checked against the reference: the default first
#    and last, seeded at rates 16 and 32, a narrower margin, and the clocks of one;
# 2. the compiled tests of the seeded kernel, then the default's own shape tests.
# (Run at a7ed67b. test_seeded_exact_vs_reference has since become
# test_seed_rates_exact_vs_reference, at rates 0 and 32: rate 16 is the default.)
. experiments/gpu_runs/gpu_env.sh gpu_seed
step "seeded thresholds at 32K"
timed_bench 270 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,seed16=seed_rate:16,seed32=seed_rate:32,seed16_s4=seed_rate:16/seed_sigmas:4,clocks_seed16=seed_rate:16/diagnostic:clocks,seed16_2=seed_rate:16,default_2="
step "pytest compiled seeded tests, then the default's shape tests"
compiled_tests 230 "test_seeded_all_equal_nan_and_failure_at_scale" \
  "test_seeded_exact_vs_reference" "test_exact_vs_reference"
step "done"
