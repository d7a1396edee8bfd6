#!/usr/bin/env bash
# Where the kernels' time goes, one device call (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_clocks.sh
# 1. Compiled tests: HyTopK "clocks" diagnostic and lazy_reduce; every sparse-attention test
#    (skip_invalid: loops stop at the last valid block, invalid slots' atomics masked).
# 2. bench_selection variants at T=32K: per-phase SM cycles (clocks presets) of the default,
#    plain bisection, lazy_reduce and capacity 8192, each also timed without the clock reads.
# 3. diagnose_bounds (attention only): the dK/dV atomics floor, unmasked and masked.
# 4. bench_attention --tune (skip_invalid on/off, same run) and the xla / cuDNN columns.
# 5. Which NVIDIA profiling tools the image has.
. experiments/gpu_runs/gpu_env.sh gpu_clocks

stamp "compiled tests" | tee -a "$LOG"
timeout 200 python3 -m pytest -q tests/test_sparse_attention_pallas.py tests/test_hytopk_pallas.py \
  -k "TestCompiledGPU and (lazy or clocks or Attention or trailing or matches_reference or invalid or deterministic or auto)" \
  2>&1 | tail -4 | tee -a "$LOG"

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 230 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,clocks,clocks_no_sample,no_sample,lazy,lazy_clocks,c8k,c8k_clocks \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -3

stamp "attention bounds" | tee -a "$LOG"
timeout 80 python3 experiments/diagnose_bounds.py --no-epilogue --T 32768 --reps 5 --out "$OUT" \
  2>&1 | grep -v -i deprecat | tail -4 | tee -a "$LOG"

stamp "attention: tune + all columns" | tee -a "$LOG"
timeout 200 python3 experiments/bench_attention.py --quick --tune --heads 64 16 \
  --impls pallas cudnn xla --reps 5 --out "$OUT/bench_attention" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -3

stamp "profilers" | tee -a "$LOG"
(which ncu nsys ptxas cuobjdump nvdisasm; ls /usr/local/cuda*/bin 2>/dev/null | head -30
 python3 -c "import nvidia, os; print(nvidia.__path__)") 2>&1 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
