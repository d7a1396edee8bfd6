#!/usr/bin/env bash
# One device call (< 4 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_seed_tests2.sh
# Written 2026-12-04 (fifteenth session), the session's last device time: the public dispatch
# test (its pallas_call count now includes the seed's re-run), the clocks diagnostic at the
# seeded default, the fused schedule's all-equal/NaN case, and the seeded kernel at rate 32
# on the long non-causal shape (20000 keys).
. experiments/gpu_runs/gpu_env.sh gpu_seed_tests2
step "pytest compiled tests at the default, continued"
compiled_tests 215 tests/test_hytopk_pallas.py::test_public_dispatch_name_and_determinism \
  "test_clocks_diagnostic" "test_all_equal_and_nan_at_scale[fused-0]" \
  "test_seed_rates_exact_vs_reference[32-300-20000-16-64-2048-False-bfloat16]" \
  "test_seed_rates_exact_vs_reference[0-4096-4096-32-128-2048-True-bfloat16]"
step "done"
