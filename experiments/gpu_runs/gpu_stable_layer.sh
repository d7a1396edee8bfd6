#!/usr/bin/env bash
# One short device call, from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_stable_layer.sh
# The layer and model tests with the stable one-key XLA epilogue as the default (2026-12-03,
# seventh session).
. experiments/gpu_runs/gpu_env.sh gpu_stable_layer
stamp "pytest layer and model" | tee -a "$LOG"
timeout 110 python3 -m pytest -v -rs -p no:cacheprovider tests/test_layer.py tests/test_nn.py 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -4
stamp "done" | tee -a "$LOG"
