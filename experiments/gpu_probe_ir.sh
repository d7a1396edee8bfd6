#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_probe_ir.sh
# Written 2026-12-04 (eleventh session), NOT YET RUN (the session's device time was spent):
# 1. probe_scoring_ir.py: does the per-head scoring core reload the key block's MMA fragments
#    from shared memory for every head (hytopk_notes.md, eleventh session)?
# 2. the 64K row of the headline table at the tenth session's default (still the eighth's);
# 3. the 10 compiled Pallas-epilogue tests not yet run at that default.
. experiments/gpu_env.sh gpu_probe_ir
step "scoring core instruction counts"
timeout 120 python3 experiments/probe_scoring_ir.py --out "$OUT/probe_scoring_ir" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG" | tail -20
step "64K"
timed_bench 150 --sizes 65536 --impls pallas,pallas_kernel --reps 5 --out-dir "$OUT/sweep_64k"
step "pytest compiled Pallas-epilogue tests"
timed_pytest 280 tests/test_hytopk_pallas.py::TestCompiledGPU::test_pallas_order_exact_vs_reference
step "done"
