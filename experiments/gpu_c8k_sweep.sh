#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_c8k_sweep.sh
# The HyTopK defaults of 2026-12-04: the benchmark sweep 8K-256K (time and peak memory; at
# 128K and 256K the default runs 2 and 4 kernel calls of 65536 query rows), the query-chunk
# cost at 256K (one kernel call for all rows), then the layer and model tests.
. experiments/gpu_env.sh gpu_c8k_sweep
stamp "sweep 8K-32K" | tee -a "$LOG"
timeout 200 python3 experiments/bench_selection.py --reps 5 --sizes 8192,16384,32768 \
  --out-dir "$OUT/sweep_8k_32k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -14
stamp "sweep 64K-256K" | tee -a "$LOG"
timeout 200 python3 experiments/bench_selection.py --reps 3 --sizes 65536,131072,262144 \
  --impls pallas,pallas_kernel --out-dir "$OUT/sweep_64k_256k" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -10
stamp "one kernel call at 256K" | tee -a "$LOG"
timeout 60 python3 experiments/bench_selection.py --sizes 262144 --reps 3 --out-dir "$OUT/one_call" \
  --variants default,one_call 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -4
stamp "pytest layer, model" | tee -a "$LOG"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_layer.py tests/test_nn.py \
  2>&1 | grep -E "FAILED|ERROR|passed|failed" | tee -a "$LOG" | tail -4
stamp "done" | tee -a "$LOG"
