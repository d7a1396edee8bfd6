#!/usr/bin/env bash
# The indexer-loss kernels on the GPU (issue 5), one device call (< 5 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_indexer_loss.sh
# 1. the compiled kernel tests (tests/test_indexer_loss_pallas.py, TestCompiledGPU) and the
#    layer tests, 2. tile sizes of the kernels at T=32K (experiments/tune_indexer_loss.py).
. experiments/gpu_runs/gpu_env.sh gpu_indexer_loss

stamp "pytest" | tee -a "$LOG"
timeout 150 python3 -m pytest tests/test_indexer_loss_pallas.py tests/test_layer.py -q -rs \
  -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"

stamp "tile sizes at 32K" | tee -a "$LOG"
timeout 170 python3 experiments/tune_indexer_loss.py --T 32768 --reps 5 --out "$OUT" 2>&1 \
  | grep -v -i deprecat | tail -12 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
