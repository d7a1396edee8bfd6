#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:
#   OUT=/some/dir bash experiments/gpu_runs/gpu_interp_default.sh
# 2026-12-03 (eighth session), BlockSizes.interpolate=8 as the default:
# 1. the compiled HyTopK tests that run the default kernel (the GPU class without the tests
#    that pin other epilogues, sort widths or the clocks diagnostic), dispatch, query chunks;
# 2. the default at 256K (time, memory) and the sweep 8K-128K (reference up to 16K).
. experiments/gpu_runs/gpu_env.sh gpu_interp_default
stamp "pytest compiled HyTopK at the new default" | tee -a "$LOG"
timeout 360 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "(TestCompiledGPU and not pallas_order and not clocks and not sort_width) or dispatch or query_chunks" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -6
stamp "selection at 256K" | tee -a "$LOG"
timeout 100 python3 experiments/bench_selection.py --sizes 262144 --impls pallas --reps 3 \
  --out-dir "$OUT/sweep_256k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -4
stamp "sweep 8K-128K" | tee -a "$LOG"
timeout 120 python3 experiments/bench_selection.py --sizes 8192,16384,65536,131072 --reps 5 \
  --ref-max 16384 --xla-max 16384 --out-dir "$OUT/sweep" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -8
stamp "done" | tee -a "$LOG"
