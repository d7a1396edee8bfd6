#!/usr/bin/env bash
# One device call (< 7 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_c8k_rest.sh
# What gpu_c8k.sh's 400 s pytest limit left (the last 10 compiled HyTopK tests), the default
# at 128K and 256K (time and peak memory), then the layer and model tests.
. experiments/gpu_runs/gpu_env.sh gpu_c8k_rest
stamp "pytest compiled HyTopK, the rest" | tee -a "$LOG"
timeout 240 python3 -m pytest -v -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  -k "TestCompiledGPU and (pallas_order and (777-1500-100-False-2-8 or 512-1024 or 300-700) or query_chunks or deterministic or random_floats)" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -12
stamp "128K, 256K" | tee -a "$LOG"
timeout 150 python3 experiments/bench_selection.py --reps 3 --sizes 131072,262144 \
  --impls pallas --out-dir "$OUT/sweep_128k_256k" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -6
stamp "pytest layer, model" | tee -a "$LOG"
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_layer.py tests/test_nn.py \
  2>&1 | grep -E "FAILED|ERROR|passed|failed" | tee -a "$LOG" | tail -4
stamp "done" | tee -a "$LOG"
