#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_hoist.sh
# Twelfth session (2026-12-04). The scoring-core probe's static counts (gpu_probe_ir.sh)
# suggest the key block's MMA fragments are loaded once per key block, not per head; what each
# head does load per key block is its queries. Triton may hoist those loop-invariant loads out
# of score_only's loop (no stores) but not out of the real kernel's runs (a guess, from
# score_only's speed). BlockSizes.hoist_queries loads them once per program. 1. scoring
# alone and the full selection at 32K with and without, every full row checked against the
# reference; 2. the compiled hoist_queries tests. It ran while
# hoist_queries defaulted to False, as plain `default` presets; the variants below spell that
# out, so a rerun measures the same kernels. Record: results/hytopk_hoist/.
. experiments/gpu_runs/gpu_env.sh gpu_hoist
step "hoisted queries at 32K"
SO=diagnostic:score_only
timed_bench 300 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"so_default=$SO/hoist_queries:0,so_hoist=$SO/hoist_queries:1,default=hoist_queries:0,hoist=hoist_queries:1"
step "pytest compiled hoist_queries tests"
timed_pytest 200 tests/test_hytopk_pallas.py::TestCompiledGPU::test_run_options_exact_vs_reference -k True-True
step "done"
