#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_rest_tests.sh
# Thirteenth session: the compiled HyTopK tests not yet run at the hoisted-queries default
# (1ea1429): the epilogue and sort-width options (18) and the Pallas bitonic epilogue (10).
. experiments/gpu_runs/gpu_env.sh gpu_rest_tests
step "pytest compiled sort-width and Pallas-epilogue tests"
C=tests/test_hytopk_pallas.py::TestCompiledGPU
timed_pytest 560 "$C::test_order_and_sort_width_exact_vs_reference" \
  "$C::test_pallas_order_exact_vs_reference"
step "done"
