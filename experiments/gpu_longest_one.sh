#!/usr/bin/env bash
# NOT YET RUN (written 2026-12-03, sixth session, when this session's device time was spent).
# One device call (< 10 minutes) on the one-GPU machine, from the repo root:
#     OUT=/some/dir bash experiments/gpu_longest_one.sh
# The longest trainable T on one H200 for hyscale/replay, from 512K, now that the selection runs
# query chunks of 65536 rows (candidate buffers at most 4 GiB per call instead of 16 GiB at 512K
# with the earlier one-call kernel; 512K trained in 69.9 GiB with it, results/scale/).
. experiments/gpu_env.sh gpu_longest_one
stamp "scale_parallel --only longest, N=1, 512K-1M" | tee -a "$LOG"
timeout 560 python3 experiments/scale_parallel.py --preset h200 --devices 1 --only longest \
  --longest-start 524288 --longest-cap 1048576 --budget-s 520 --out "$OUT" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -20
stamp "done" | tee -a "$LOG"
