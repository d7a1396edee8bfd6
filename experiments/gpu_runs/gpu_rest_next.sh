#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_rest_next.sh
# Written 2026-12-04 (eleventh session); ran in the twelfth at 6a9e4c0 (the tenth session's
# default; check it out to rerun). Record: results/hytopk_refresh/. What was missing there:
# the 64K row of the headline table (still the eighth session's kernel) and the 10 compiled
# Pallas-epilogue tests.
. experiments/gpu_runs/gpu_env.sh gpu_rest_next
step "64K"
timed_bench 200 --sizes 65536 --impls pallas,pallas_kernel --reps 5 --out-dir "$OUT/sweep_64k"
step "pytest compiled Pallas-epilogue tests"
timed_pytest 350 tests/test_hytopk_pallas.py::TestCompiledGPU::test_pallas_order_exact_vs_reference
step "done"
