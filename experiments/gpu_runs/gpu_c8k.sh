#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_c8k.sh
# The HyTopK defaults of 2026-12-03 (sixth session) (capacity 8192 at k=2048, min_steps 8, the Pallas
# epilogue, 65536 query rows per kernel call):
# 1. the compiled HyTopK tests, the public dispatch test and the query-chunk tests, with names;
# 2. variants at 32K against the default in the same run: the XLA sort instead of the Pallas
#    epilogue, and the work counters of the new default.
. experiments/gpu_runs/gpu_env.sh gpu_c8k
stamp "pytest compiled HyTopK" | tee -a "$LOG"
timeout 400 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "TestCompiledGPU or dispatch or query_chunks" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -6
stamp "selection variants at 32K" | tee -a "$LOG"
timeout 150 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,xla_sort,stats_c8k 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -8
stamp "done" | tee -a "$LOG"
