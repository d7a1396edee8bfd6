#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:  OUT=/some/dir bash experiments/gpu_runs/gpu_refresh.sh
# 2026-12-04 (eleventh session), at the tenth session's default (bulk first run):
# 1. the headline sweep at 8K-64K (reference, xla, pallas, the kernel alone), to merge with
#    the tenth session's 128K/256K run into results/bench_selection.json;
# 2. the compiled sort-width tests that gpu_bulk_next.sh's time limit left out (the two that
#    passed there are deselected).
. experiments/gpu_runs/gpu_env.sh gpu_refresh
step "headline sweep 8K-64K"
timed_bench 250 --sizes 8192,16384,32768,65536 --reps 5 --out-dir "$OUT/sweep_8k_64k"
step "pytest compiled sort-width tests"
C=tests/test_hytopk_pallas.py::TestCompiledGPU
T=$C::test_order_and_sort_width_exact_vs_reference
timed_pytest 290 "$T" --deselect "$T[2048-2048-2048-True-xla_stable-k]" \
  --deselect "$T[2048-2048-2048-True-xla_stable-9k/8]"
step "done"
