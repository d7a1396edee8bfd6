#!/usr/bin/env bash
# block_k=256 (the new default) on the H200, one device call (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_bk256.sh
# 1. The compiled HyTopK exactness tests at the new default (not the option-only ones).
# 2. bench_selection variants at T=32K: old (bk128) and new default in the same run, and
#    probes around it (Pallas epilogue, 4 warps, block_k=512, per-phase clocks).
# 3. The selection benchmark at 8K-64K (the main record; 128K and 256K in a second call).
. experiments/gpu_runs/gpu_env.sh gpu_bk256

stamp "compiled HyTopK tests (default BlockSizes)" | tee -a "$LOG"
timeout 240 python3 -m pytest -q tests/test_hytopk_pallas.py -k "TestCompiledGPU and (exact_vs_reference and not sampled and not order or all_equal or deterministic or random_floats or clocks)" \
  2>&1 | tail -3 | tee -a "$LOG"

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 190 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants bk128,default,bk256_order_pallas,bk256_w4,bk512,bk512_c8k,bk256_clocks,score_only_bk512 \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -14

stamp "selection benchmark 8K-64K" | tee -a "$LOG"
timeout 120 python3 experiments/bench_selection.py --reps 5 --sizes 8192,16384,32768,65536 \
  --out-dir "$OUT/selection" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -8
stamp "done" | tee -a "$LOG"
