#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_hoist_default.sh
# Twelfth session (2026-12-04), after gpu_hoist.sh: hoist_queries=True is the default. 1. the
# default against pipeline depths 1 and 3 at 32K (every row checked against the reference);
# 2. the compiled tests of the default kernel, most basic first.
. experiments/gpu_runs/gpu_env.sh gpu_hoist_default
step "32K: default (hoisted queries), num_stages 1 and 3"
timed_bench 170 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,ns1=num_stages:1,ns3=num_stages:3"
step "pytest compiled tests of the default kernel"
T=tests/test_hytopk_pallas.py::TestCompiledGPU
timed_pytest 420 $T::test_exact_vs_reference $T::test_all_equal_and_nan_at_scale \
  $T::test_deterministic_and_matches_xla $T::test_random_floats_up_to_near_ties \
  $T::test_query_chunks_exact_vs_reference $T::test_clocks_diagnostic
step "done"
