#!/usr/bin/env bash
# One device call (< 2.5 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_seed_tests3.sh
# Written 2026-12-04 (fifteenth session), with the session's last device seconds: the seeded
# kernel at rate 32 at 32 heads, and the default epilogue's all-equal/NaN case at scale.
. experiments/gpu_runs/gpu_env.sh gpu_seed_tests3
step "pytest compiled tests at the default, continued"
compiled_tests 115 "test_seed_rates_exact_vs_reference[32-4096-4096-32-128-2048-True-bfloat16]" \
  "test_sort_width_all_equal_and_nan_at_scale[xla_position]" \
  "test_seed_rates_exact_vs_reference[32-1000-3001-32-128-512-True-bfloat16]"
step "done"
