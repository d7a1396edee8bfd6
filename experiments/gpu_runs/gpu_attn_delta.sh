#!/usr/bin/env bash
# One device call (< 6 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_attn_delta.sh
# Sixteenth session, issue 4: applies experiments/patches/delta_from_output.patch (a probe that
# breaks SPEC section 3's residual contract on purpose: the VJP also saves the output O, so the
# backward takes delta = rowsum(dO * O) and skips its delta sweep) and times, in one run at
# T=32K H=64, forward and forward+backward of the default and of the probe, and the xla path's
# forward+backward, after checking both against the f32 reference.
. experiments/gpu_runs/gpu_env.sh gpu_attn_delta
apply_patch experiments/patches/delta_from_output.patch
step "probe: delta from the saved output"
timed_script 420 experiments/probe_attention_delta.py --seq 32768 --heads 64 --reps 5 \
  --out "$OUT"
step "done"
