#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_probe_ir.sh
# Written 2026-12-04 (eleventh session); ran in the twelfth at 6a9e4c0, the only commit the
# patch applies to (check it out to rerun). Record: results/hytopk_head_group/.
# Does the per-head scoring core reload the key block's MMA fragments from shared memory for
# every head, and does a dot per group of heads help? The head-group option is not on main
# (it never ran on the GPU): experiments/patches/head_group.patch adds BlockSizes.head_group
# and its tests, and is applied to the device's copy of the tree first.
# 1. probe_scoring_ir.py: ldmatrix / mma / shared-memory instruction counts of the score_only
#    kernel at head_group 1, 2, 4;
# 2. scoring alone and the full selection at 32K for head_group 1 (the default), 2 and 4, in
#    the same run, every full row checked against the reference;
# 3. the compiled head_group tests.
. experiments/gpu_runs/gpu_env.sh gpu_probe_ir
apply_patch experiments/patches/head_group.patch
probe_scoring 120 g1=head_group:1,g2=head_group:2,g4=head_group:4
step "head groups at 32K"
SO=diagnostic:score_only
timed_bench 280 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"so_g1=$SO,so_g2=$SO/head_group:2,so_g4=$SO/head_group:4,default,hg2=head_group:2,hg4=head_group:4"
step "pytest compiled head_group tests"
timed_pytest 150 tests/test_hytopk_pallas.py::TestCompiledGPU::test_head_groups_exact_vs_reference
step "done"
