#!/usr/bin/env bash
# One device call (< 3 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_attn_ir.sh
# Sixteenth session, issue 4: which matmul instructions (wgmma or mma.sync) the sparse-attention
# forward and backward kernels compile to, beside the atomic forms (probe_atomics.py).
. experiments/gpu_runs/gpu_env.sh gpu_attn_ir
step "probe_atomics: atomic and matmul forms"
timed_script 200 experiments/probe_atomics.py --out "$OUT/probe_atomics"
step "done"
