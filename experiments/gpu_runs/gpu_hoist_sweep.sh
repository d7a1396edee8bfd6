#!/usr/bin/env bash
# One device call (< 8 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_hoist_sweep.sh
# Twelfth session (2026-12-04): the headline sizes at the hoisted-queries default. 8K-32K
# against the reference (every row checked), 64K-256K without one (sampled rows checked).
. experiments/gpu_runs/gpu_env.sh gpu_hoist_sweep
step "8K-32K with the reference"
timed_bench 190 --sizes 8192,16384,32768 --impls reference,pallas --reps 5 --out-dir "$OUT/sweep_8k_32k"
step "64K-256K"
timed_bench 230 --sizes 65536,131072,262144 --impls pallas --reps 3 --out-dir "$OUT/sweep_64k_256k"
step "done"
