#!/usr/bin/env bash
# One device call (its steps' limits add to 500 s), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_attn_schedule.sh
# Written in the seventeenth session, first run in the twentieth (experiments/results/
# attn_schedule_run/: no schedule beats the fused one beyond noise), issue 4. Applies
# experiments/patches/bwd_schedule.patch, which adds BlockSizes.bwd_schedule (dV's rows in the
# gradient sweep, as on main; in the delta sweep; or the two sweeps as two kernels, each
# kernel's atomics into one buffer) and replaces the sixteenth session's dV patch. Each
# schedule is checked against the f32 reference and timed at T=32K, H=64 (bench_attention.py
# --tune); the atomics floor into both buffers and into dK's alone (diagnose_bounds.py); then
# the compiled sparse-attention tests and the layer tests that run its kernels, six pytest
# processes at once.
. experiments/gpu_runs/gpu_env.sh gpu_attn_schedule
# The patch landed on main in the twentieth session; on a tree that has it, run as is.
if git apply -R --check experiments/patches/bwd_schedule.patch 2>/dev/null; then
  step "bwd_schedule.patch already in the tree"
else
  apply_patch experiments/patches/bwd_schedule.patch
fi
step "bench_attention --tune"
timed_script 200 experiments/bench_attention.py --tune --seq 32768 --heads 64 \
  --impls pallas --reps 6 --out "$OUT/bench_attention_schedule"
step "diagnose_bounds (attention floors)"
timed_script 100 experiments/diagnose_bounds.py --no-epilogue --T 32768 --reps 5 \
  --out "$OUT/bounds"
parallel_pytest 200 6 tests/test_sparse_attention_pallas.py tests/test_layer.py \
  -k "TestCompiledGPU or kernel_layer"
step "done"
