#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_position.sh
# Written 2026-12-04 (fourteenth session). BlockSizes.order="xla_position" sorts (key, int16
# buffer position) as two keys: alone 3.44 ms against 3.94 for the stable one-key form
# (results/hytopk_km128/gpu_km128.log). Does the gain survive end to end?
# 1. its compiled tests: the sort-width cases (widths k and 9k/8, three shapes) and the
#    all-equal/NaN rows at 4096;
# 2. the full selection at 32K and 8K, default and xla_position alternated twice, every row
#    checked against the reference of the same run.
. experiments/gpu_runs/gpu_env.sh gpu_position
epilogue_tests 200 "pytest compiled xla_position tests" xla_position
step "xla_position end to end"
timed_bench 300 --sizes 32768,8192 --reps 7 --out-dir "$OUT/variants" --variants \
"default,pos=order:xla_position,default_2=,pos_2=order:xla_position"
step "done"
