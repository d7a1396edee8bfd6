#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_km128.sh
# Written 2026-12-04 (fourteenth session). Two cheap questions for issue 3:
# 1. Key-major scoring (experiments/patches/key_major.patch, applied to the device's copy only)
#    asked for 262656 B of shared memory at block_k=256 (232448 available). Its dot keeps the
#    key block as the wgmma rows, so block_k=128 halves the double-buffered key tiles (128 KB
#    -> 64 KB): does it fit, does it take wgmma, and how fast are scoring and the selection?
# 2. The epilogue's sort moves an int32 payload: probe_sort.py times int16-payload forms
#    (two_keys16 compares (key, position) as two keys: the SPEC order without the expander).
. experiments/gpu_runs/gpu_env.sh gpu_km128
step "sort forms"
timeout 120 python3 experiments/probe_sort.py --shapes 32768x2048,8192x2048 \
  --forms stable_iota,unstable_iota,stable_iota16,unstable_iota16,two_keys16,keys_only 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG"
apply_patch experiments/patches/key_major.patch
probe_scoring 150 default=block_k:256,km128=key_major:1/block_k:128,km128_nh=key_major:1/block_k:128/hoist_queries:0
step "key-major block_k=128 at 32K"
SO=diagnostic:score_only
timed_bench 330 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"so_default=$SO,so_km128=$SO/key_major:1/block_k:128,so_km128_nh=$SO/key_major:1/block_k:128/hoist_queries:0,so_km128_w4=$SO/key_major:1/block_k:128/num_warps:4,default,km128=key_major:1/block_k:128,km128_nh=key_major:1/block_k:128/hoist_queries:0"
step "done"
