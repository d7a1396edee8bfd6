#!/usr/bin/env bash
# One device call (< 7 minutes, the session's last device time), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_position_rest.sh
# Written 2026-12-04 (fourteenth session), at the xla_position default:
# 1. the full selection at 32K twice more (every row checked against the reference);
# 2. the compiled tests of the kernel options that run the default epilogue (sampled pivots,
#    compaction and run options, clocks, the fused schedule's all-equal/NaN rows), as many as
#    fit the time limit.
. experiments/gpu_runs/gpu_env.sh gpu_position_rest
step "32K at the default, twice"
timed_bench 90 --sizes 32768 --reps 7 --out-dir "$OUT/variants" --variants "default,default_2="
step "pytest compiled option tests at the default epilogue"
C=tests/test_hytopk_pallas.py::TestCompiledGPU
timed_pytest 270 "$C::test_clocks_diagnostic" "$C::test_all_equal_and_nan_at_scale" \
  "$C::test_sampled_pivots_exact_vs_reference" "$C::test_run_options_exact_vs_reference" \
  "$C::test_compaction_options_exact_vs_reference" -k "not phased"
step "done"
