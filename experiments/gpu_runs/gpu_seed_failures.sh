#!/usr/bin/env bash
# One device call (< 6 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_seed_failures.sh
# Sixteenth session, issue 3: how many rows fail their seed, and how many programs re-run, on
# the benchmark's normal and integer inputs at 8K, 32K and 64K (probe_seed_failures.py).
. experiments/gpu_runs/gpu_env.sh gpu_seed_failures
step "probe_seed_failures"
timed_script 400 experiments/probe_seed_failures.py --sizes 8192,32768,65536 --out "$OUT"
step "done"
