#!/usr/bin/env bash
# One device call (< 10 minutes) on the one-GPU machine, from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_scale_one.sh
# 1. Compiled tests not yet run on the GPU: the Pallas epilogue at k=1 and k=2 (with the other
#    epilogue cases), the layer and model tests at the current kernel defaults.
# 2. Issue 7's scaling script at N=1 (all one GPU allows): the 1-device mesh against the
#    unsharded model, weak/strong N=1 points at 128K, the longest T at N=1 for hyscale/replay
#    and the materialized baseline. Multi-GPU: the same script with --devices 1,2,4,8.
. experiments/gpu_runs/gpu_env.sh gpu_scale_one

stamp "pytest: epilogue (k=1, 2 included), layer, model" | tee -a "$LOG"
timeout 180 python3 -m pytest -q -rs -p no:cacheprovider tests/test_hytopk_pallas.py \
  tests/test_layer.py tests/test_nn.py -k "(TestCompiledGPU and pallas_order) or test_layer or test_nn" \
  2>&1 | tail -6 | tee -a "$LOG"

stamp "scale_parallel --preset h200 --devices 1" | tee -a "$LOG"
timeout 400 python3 experiments/scale_parallel.py --preset h200 --devices 1 --budget-s 360 \
  --out "$OUT" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -30
stamp "done" | tee -a "$LOG"
