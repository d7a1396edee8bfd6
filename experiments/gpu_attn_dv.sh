#!/usr/bin/env bash
# One device call (< 4 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_attn_dv.sh
# Written in the sixteenth session, NOT RUN (the session's device time ran out), issue 4.
# Applies experiments/patches/dv_in_delta_sweep.patch: dV's rows formed in the backward's first
# (delta) sweep, the patch's default (BlockSizes.dv_in_delta_sweep), so each sweep carries half
# of the dK/dV atomics; timed against the second sweep (the order on main), T=32K, H=64
# (bench_attention.py --tune, checked against the reference first); then the compiled
# sparse-attention tests and the layer tests that run its kernels, six pytest processes at a time.
. experiments/gpu_env.sh gpu_attn_dv
apply_patch experiments/patches/dv_in_delta_sweep.patch
step "bench_attention --tune"
timed_script 100 experiments/bench_attention.py --tune --seq 32768 --heads 64 \
  --impls pallas --reps 6 --out "$OUT/bench_attention_dv"
parallel_pytest 100 6 tests/test_sparse_attention_pallas.py tests/test_layer.py \
  -k "TestCompiledGPU or kernel_layer"
step "done"
