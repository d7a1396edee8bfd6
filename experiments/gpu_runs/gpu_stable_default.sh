#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_stable_default.sh
# BlockSizes.order="xla_stable" as the default (2026-12-03, seventh session):
# 1. the compiled HyTopK tests that run the default epilogue (those pinning order="pallas" and
#    the clocks test, which orders with order_candidates, run unchanged code and are left
#    out; the sort-width tests ran in gpu_stable*.sh), the dispatch and query-chunk tests;
# 2. the default at 256K: time and memory.
. experiments/gpu_runs/gpu_env.sh gpu_stable_default
stamp "pytest compiled HyTopK at the new default" | tee -a "$LOG"
timeout 420 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "(TestCompiledGPU and not pallas_order and not clocks and not sort_width) or dispatch or query_chunks" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -6
stamp "selection at 256K" | tee -a "$LOG"
timeout 120 python3 experiments/bench_selection.py --sizes 262144 --impls pallas --reps 3 \
  --out-dir "$OUT/sweep_256k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -6
stamp "done" | tee -a "$LOG"
