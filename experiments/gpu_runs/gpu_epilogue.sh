#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_epilogue.sh
# Written 2026-12-04 (fourteenth session). The (key, int16 position) sort took 3.44 ms alone
# against 3.94 for the stable form (probe_sort.py), but 5.13 against 4.11 as the epilogue
# (results/hytopk_position/). Which stage differs? probe_epilogue.py times the sort on ready
# keys, with the key masking, and the full epilogue, and writes XLA's optimized HLO of each;
# probe_sort.py's 2-D forms are timed again in the same call.
. experiments/gpu_runs/gpu_env.sh gpu_epilogue
step "probe_sort 2-D forms"
timeout 100 python3 experiments/probe_sort.py --shapes 32768x2048 \
  --forms stable_iota,two_keys16,keys_only 2>&1 | grep -v -i deprecat | tee -a "$LOG"
step "probe_epilogue stages"
timeout 200 python3 experiments/probe_epilogue.py --out "$OUT/probe_epilogue" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG"
step "done"
