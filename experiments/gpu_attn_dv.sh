#!/usr/bin/env bash
# One device call (< 4 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_attn_dv.sh
# Sixteenth session, issue 4: dV's rows formed in the backward's first (delta) sweep, the new
# default (BlockSizes.dv_in_delta_sweep), against the second sweep, T=32K, H=64
# (bench_attention.py --tune, checked against the reference first); then the compiled
# sparse-attention tests and the layer tests that run its kernels, six pytest processes at a time.
. experiments/gpu_env.sh gpu_attn_dv
step "bench_attention --tune"
timeout 100 python3 experiments/bench_attention.py --tune --seq 32768 --heads 64 \
  --impls pallas --reps 6 --out "$OUT/bench_attention_dv" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | grep -E "tune|check|pallas "
parallel_pytest 100 6 tests/test_sparse_attention_pallas.py tests/test_layer.py \
  -k "TestCompiledGPU or kernel_layer"
step "done"
