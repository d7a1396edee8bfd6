#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_atomics.sh
# 2026-12-03 (eighth session):
# 1. which atomic instructions the sparse-attention backward compiles to (probe_atomics.py);
# 2. the attention floors at today's defaults (diagnose_bounds.py, block_k_bwd=64);
# 3. the compiled tests that had only run in interpret mode: the layer and the model on the
#    Pallas kernels under replay, and the buffers-in-index-order test.
. experiments/gpu_runs/gpu_env.sh gpu_atomics
stamp "probe_atomics" | tee -a "$LOG"
timeout 150 python3 experiments/probe_atomics.py --out "$OUT/probe_atomics" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -8
stamp "diagnose_bounds (attention floors, T=32K, H=64)" | tee -a "$LOG"
timeout 200 python3 experiments/diagnose_bounds.py --no-epilogue --out "$OUT/bounds" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -4
stamp "pytest: kernel-path layer/model tests, buffer order" | tee -a "$LOG"
timeout 220 python3 -m pytest -v -rs -p no:cacheprovider tests/test_layer.py tests/test_nn.py \
  tests/test_hytopk_pallas.py -k "kernel or buffers_in_index_order" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -14
stamp "done" | tee -a "$LOG"
