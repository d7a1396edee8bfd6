#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_key_major.sh
# Written 2026-12-04 (twelfth session); ran in the thirteenth at 3122500: the key-major
# variants exceed shared memory at two stages (results/hytopk_key_major/).
# The scoring core runs on mma.sync: Triton takes the warpgroup MMA (wgmma) only for dots whose
# rows are a multiple of 64, and a head's dot [16, DI] x [DI, 256] has 16. With the key block
# as the rows, [256, DI] x [DI, 16] per head, the dot qualifies; the head sum is transposed
# once per key block. experiments/patches/key_major.patch adds BlockSizes.key_major (default
# False; the default kernel's jaxpr unchanged, checked on CPU) and its tests; it is applied to
# the device's copy first and is not on main until it has run here.
# 1. probe_scoring_ir.py: wgmma / mma.sync / ldmatrix counts of score_only, per-head and
#    key-major (with and without the hoisted queries);
# 2. scoring alone and the full selection at 32K, every full row checked against the reference;
# 3. the compiled key_major tests.
. experiments/gpu_runs/gpu_env.sh gpu_key_major
apply_patch experiments/patches/key_major.patch
probe_scoring 150 default=block_k:256,km=key_major:1,km_nohoist=key_major:1/hoist_queries:0
step "key-major scoring at 32K"
SO=diagnostic:score_only
timed_bench 300 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"so_default=$SO,so_km=$SO/key_major:1,so_km_nohoist=$SO/key_major:1/hoist_queries:0,default,km=key_major:1,km_ns1=key_major:1/num_stages:1"
step "pytest compiled key_major tests"
timed_pytest 120 tests/test_hytopk_pallas.py::TestCompiledGPU::test_key_major_exact_vs_reference
step "done"
