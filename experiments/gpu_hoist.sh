#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_hoist.sh
# Twelfth session (2026-12-04). The scoring-core probe (gpu_probe_ir.sh) showed the key block's
# MMA fragments are loaded once per key block, not per head; what each head reloads per key
# block is its queries. Triton can hoist those loop-invariant loads out of score_only's loop
# (no stores) but not out of the real kernel's runs. BlockSizes.hoist_queries loads them once
# per program. 1. scoring alone and the full selection at 32K with and without, every full row
# checked against the reference; 2. the compiled hoist_queries tests.
. experiments/gpu_env.sh gpu_hoist
step "hoisted queries at 32K"
SO=diagnostic:score_only
timed_bench 300 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"so_default=$SO,so_hoist=$SO/hoist_queries:1,default,hoist=hoist_queries:1"
step "pytest compiled hoist_queries tests"
timed_pytest 200 tests/test_hytopk_pallas.py::TestCompiledGPU::test_run_options_exact_vs_reference -k True-True
step "done"
