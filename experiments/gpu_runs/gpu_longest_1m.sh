#!/usr/bin/env bash
# One device call (~6 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_longest_1m.sh
# Thirteenth session: does one training step of the h200 end-to-end model (hyscale/replay) run
# at T = 1M tokens on one H200? The sixth session's run (results/scale/) trained 512K in
# 69.9 GiB (22.5 s per step) and stopped at 1M on its time budget (32 s left), before the
# selection ran in query chunks of 65536 rows (candidate buffers at most 4 GiB per call).
. experiments/gpu_runs/gpu_env.sh gpu_longest_1m
step "scale_parallel --only longest, N=1, T=1M"
timeout 320 python3 experiments/scale_parallel.py --preset h200 --devices 1 --only longest \
  --longest-start 1048576 --longest-cap 1048576 --budget-s 300 --out "$OUT" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -20
step "done"
