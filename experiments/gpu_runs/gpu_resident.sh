#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_resident.sh
# Written 2026-12-04 (fourteenth session); run in the fifteenth: results/hytopk_resident/. Compactions with the candidate
# buffers in registers (experiments/patches/resident_compaction.patch, applied to the
# device's copy only: BlockSizes.final_rows / stream_rows, `_compact_resident`). At the
# default the final compaction is 4.2 ms of the kernel's cycles at 32K (count passes 3.0,
# rewrite 1.2), the mid-stream ones 4.5 ms; each count pass re-reads the buffers from memory
# one [16, 256] load after another. Loading n rows' buffers once and counting on the loaded
# values should cut that, if the registers hold them. The patch keeps the default kernel's
# jaxpr byte-identical (checked on CPU); its interpret tests and Triton lowering pass on CPU.
# 1. the full selection at 32K: the default first and last, final_rows 1/2/4, stream_rows too,
#    and the clocks of one, every row checked against the reference;
# 2. the compiled tests of the new options;
# 3. probe_epilogue.py (main's code: the patch leaves the epilogue alone): in the fourteenth
#    session the position epilogue alone took ~3.85 ms, its sort in probe_sort.py's 2-D form
#    3.18-3.44; is the [1, rows, k] shape part of the difference?
. experiments/gpu_runs/gpu_env.sh gpu_resident
apply_patch experiments/patches/resident_compaction.patch
step "resident compactions at 32K"
timed_bench 270 --sizes 32768 --reps 5 --out-dir "$OUT/variants" --variants \
"default,f1=final_rows:1,f2=final_rows:2,f4=final_rows:4,s1f1=stream_rows:1/final_rows:1,s2f2=stream_rows:2/final_rows:2,clocks_f2=final_rows:2/diagnostic:clocks,default_2="
step "pytest compiled resident-compaction tests"
compiled_tests 200 "test_resident_compaction_exact_vs_reference" \
  "test_resident_compaction_all_equal_and_nan"
step "probe_epilogue stages"
timeout 60 python3 experiments/probe_epilogue.py --out "$OUT/probe_epilogue" 2>&1 \
  | grep -v -i deprecat | tee -a "$LOG"
step "done"
