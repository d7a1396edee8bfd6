#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_position_default.sh
# Written 2026-12-04 (fourteenth session): BlockSizes.order="xla_position" as the default.
# 1. the compiled HyTopK tests that run the default epilogue (the order tests of both two-key
#    epilogues passed in gpu_position2.sh);
# 2. the headline sweep at the new default: reference and Pallas at 8K-32K, Pallas alone at
#    64K-256K (sampled rows checked there), for results/bench_selection.json.
. experiments/gpu_runs/gpu_env.sh gpu_position_default
step "pytest compiled tests at the default"
C=tests/test_hytopk_pallas.py::TestCompiledGPU
timed_pytest 280 "$C::test_exact_vs_reference" "$C::test_deterministic_and_matches_xla" \
  "$C::test_random_floats_up_to_near_ties" "$C::test_query_chunks_exact_vs_reference" \
  "$C::test_all_equal_and_nan_at_scale" \
  tests/test_hytopk_pallas.py::test_public_dispatch_name_and_determinism -k "not fused"
step "sweep 8K-32K"
timed_bench 150 --sizes 8192,16384,32768 --impls reference,pallas --reps 5 --out-dir "$OUT/sweep_8k_32k"
step "sweep 64K-256K"
timed_bench 160 --sizes 65536,131072,262144 --impls pallas --reps 3 --out-dir "$OUT/sweep_64k_256k"
step "done"
