#!/usr/bin/env bash
# One device call (< 6 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_attn_tune.sh
# Sixteenth session, issue 4: the backward's pipeline depth at its 64-key tile (1, 2 = the
# default, 3, 4 stages) and a 128-key tile, T=32K, H=64, the default first and last
# (bench_attention.py --tune; outputs and gradients checked against the reference first).
. experiments/gpu_runs/gpu_env.sh gpu_attn_tune
step "bench_attention --tune"
timed_script 420 experiments/bench_attention.py --tune --seq 32768 --heads 64 \
  --impls pallas --reps 6 --out "$OUT/bench_attention_tune"
step "done"
