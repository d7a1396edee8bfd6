#!/usr/bin/env bash
# Every kernel and the model on the GPU, one device call (< 8 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_verify.sh
# 1. the sharded model on a 1-device mesh against the unsharded model: 4 training steps each
#    (h200-32k preset at T=4K: 1 dense warm-up step, then sparse steps whose indexer loss runs
#    the Pallas kernels inside shard_map), losses compared step by step;
# 2. the compiled-kernel tests of all three kernels (TestCompiledGPU) and the layer, model and
#    one-device-mesh tests.
. experiments/gpu_runs/gpu_env.sh gpu_verify

stamp "model: 1-device mesh against unsharded" | tee -a "$LOG"
for mesh in none data=1,seq=1; do
  extra=(); [ "$mesh" != none ] && extra=(--mesh "$mesh")
  timeout 75 python3 experiments/train.py --preset h200-32k --seq-len 4096 --steps 4 \
    --indexer-warmup-steps 1 --indexer-warmup-seq-len 1024 --ckpt-every 100 --no-plot \
    --no-progress --out "/tmp/hyscale_model_$mesh" "${extra[@]}" 2>&1 | tail -2 | tee -a "$LOG"
done
python3 - /tmp <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
runs = {m: [json.loads(l) for l in open(f"{sys.argv[1]}/hyscale_model_{m}/metrics.jsonl")]
        for m in ("none", "data=1,seq=1")}
for a, b in zip(*runs.values()):
    print(f"step {a['step']} {a['stage']:6s} ce {a['ce']:.6f} / {b['ce']:.6f}  indexer_loss "
          f"{a['indexer_loss']:.6f} / {b['indexer_loss']:.6f}  step_time {a['step_time_s']:.2f}"
          f" / {b['step_time_s']:.2f} s  (unsharded / 1-device mesh)")
PY

stamp "pytest" | tee -a "$LOG"
timeout 320 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_hytopk_pallas.py tests/test_sparse_attention_pallas.py \
  tests/test_indexer_loss_pallas.py tests/test_layer.py tests/test_nn.py tests/test_parallel.py \
  -k "TestCompiledGPU or test_layer or test_nn or one_device_mesh" 2>&1 | tail -12 | tee -a "$LOG"

stamp "done" | tee -a "$LOG"
