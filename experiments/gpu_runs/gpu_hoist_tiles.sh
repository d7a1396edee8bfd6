#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_hoist_tiles.sh
# Thirteenth session: the compaction and tile settings tuned at earlier defaults (chunk,
# pivots, sample, interpolate, num_warps, block_q), re-tried at the hoisted-queries default,
# whose runs hold the queries in registers for the whole program; the default is timed first
# and last to show the run's noise. Every full row is checked against the reference.
. experiments/gpu_runs/gpu_env.sh gpu_hoist_tiles
step "32K: compaction and tile settings at the hoisted default"
timed_bench 540 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,ch512=chunk:512,ch128=chunk:128,pv3=pivots:3,s64=sample:64,s16=sample:16,\
i12=interpolate:12,i5=interpolate:5,nw16=num_warps:16,bq32=block_q:32,ms12=min_steps:12,\
default_again="
step "done"
