#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_stacked.sh
# 2026-12-04 (eleventh session), RAN AT 7f6bd5a (the option lost and was removed after the run;
# check out 7f6bd5a to rerun): the stacked scoring core (BlockSizes.scoring). Per key block,
# one [HI * block_q, DI] x [DI, block_k] dot with head-major rows instead of HI dots of
# M = block_q, so the key block's operand is read once from shared memory, not once per head.
# 1. scoring alone (diagnostic score_only) at 32K: per-head (today's core) against stacked
#    tiles, in the same run (no reference: score_only returns no selection);
# 2. the full selection with the stacked core at 32K against the default, every row checked
#    against the reference (min_steps keeps the 2048-slot room of block_k=256 x 8).
. experiments/gpu_runs/gpu_env.sh gpu_stacked
SO=diagnostic:score_only
step "scoring alone at 32K"
timed_bench 230 --sizes 32768 --reps 5 --ref-max 0 --out-dir "$OUT/score_only" --variants \
"so_per_head=$SO,so_st32=$SO/scoring:stacked/block_k:32,so_st64=$SO/scoring:stacked/block_k:64,\
so_st64h=$SO/scoring:stacked_hoisted/block_k:64,so_st32h=$SO/scoring:stacked_hoisted/block_k:32,\
so_st64w4=$SO/scoring:stacked/block_k:64/num_warps:4,so_st64w16=$SO/scoring:stacked/block_k:64/num_warps:16,\
so_st128w16=$SO/scoring:stacked/block_k:128/num_warps:16"
step "full selection at 32K"
timed_bench 300 --sizes 32768 --reps 5 --out-dir "$OUT/full" --variants \
"default,st64=scoring:stacked/block_k:64/min_steps:32,st32=scoring:stacked/block_k:32/min_steps:64,\
st64h=scoring:stacked_hoisted/block_k:64/min_steps:32,st128w16=scoring:stacked/block_k:128/min_steps:16/num_warps:16"
step "done"
