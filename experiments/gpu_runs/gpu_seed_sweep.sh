#!/usr/bin/env bash
# One device call (< 5 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_seed_sweep.sh
# Sixteenth session: the 8K-32K rows of bench_selection.json at the seeded default (they were
# the unseeded kernel's), reference and pallas in the same run, every row verified first.
. experiments/gpu_runs/gpu_env.sh gpu_seed_sweep
step "bench_selection 8K-32K"
timed_bench 400 --sizes 8192,16384,32768 --impls reference,pallas --reps 5 \
  --out-dir "$OUT/sweep_8k_32k"
step "done"
