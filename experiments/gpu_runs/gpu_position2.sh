#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_position2.sh
# Written 2026-12-04 (fourteenth session), after gpu_epilogue.sh: the xla_position epilogue
# first ran with lax.sort's default is_stable=True, and XLA's stable-sort expander then added
# an int32 iota as a third operand (4.82 ms against 3.18 ms for the same sort unflagged). Both
# two-key epilogues (xla_position, xla) now sort unflagged; their keys are distinct per row.
# 1. the full selection at 32K and 8K: default, xla_position (twice each, alternated) and the
#    (key, index) "xla" sort, every row checked against the reference of the same run;
# 2. the compiled tests of both two-key epilogues.
. experiments/gpu_runs/gpu_env.sh gpu_position2
step "two-key epilogues end to end"
timed_bench 300 --sizes 32768,8192 --reps 7 --out-dir "$OUT/variants" --variants \
"default,pos=order:xla_position,default_2=,pos_2=order:xla_position,pairs=order:xla"
epilogue_tests 220 "pytest compiled two-key epilogue tests" "xla_position or xla-2k"
step "done"
