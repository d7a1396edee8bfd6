#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_packed.sh
# Thirteenth session. The epilogue orders 32768 x 2048 survivors in ~4.1 ms with a stable
# one-key sort (the key and its position, compared both) plus a gather; a keys-only sort took
# 2.68 ms (seventh session). BlockSizes(order="xla_packed") sorts one uint64 word per entry,
# key high and index low: one operand, one comparison, no gather. It ran (thirteenth session)
# with experiments/patches/packed_epilogue.patch applied in the tree; it gained nothing in the
# full selection, so the patch stays off main and this script applies it.
# 1. 8K and 32K: the default against xla_packed (width k and 4096), each epilogue timed alone,
#    every full row checked against the reference;
# 2. the compiled tests of the packed epilogue.
. experiments/gpu_runs/gpu_env.sh gpu_packed
apply_patch experiments/patches/packed_epilogue.patch
step "8K and 32K: stable against packed epilogue"
timed_bench 300 --sizes 8192,32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,packed=order:xla_packed,packed_w4k=order:xla_packed/sort_width:4096"
epilogue_tests 240 "pytest compiled packed-epilogue tests" "xla_packed or sort_width_all_equal"
step "done"
