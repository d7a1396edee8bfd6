#!/usr/bin/env bash
# Where the HyTopK kernel's time goes, one device call (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_clocks.sh
# 1. Compiled tests of the "clocks" diagnostic and of lazy_reduce count passes.
# 2. bench_selection variants at T=32K: per-phase SM cycles (clocks presets) of the default,
#    plain bisection, lazy_reduce and capacity 8192, each also timed without the clock reads.
# 3. bench_attention at the current defaults with the xla and cuDNN columns (same-run ratios).
# 4. Which NVIDIA profiling tools the image has.
. experiments/gpu_env.sh gpu_clocks

stamp "compiled tests: clocks, lazy_reduce" | tee -a "$LOG"
timeout 150 python3 -m pytest -q tests/test_hytopk_pallas.py -k "TestCompiledGPU and (lazy or clocks)" \
  2>&1 | tail -5 | tee -a "$LOG"

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 260 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,clocks,clocks_no_sample,no_sample,lazy,lazy_clocks,c8k,c8k_clocks \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -3

stamp "attention, all columns" | tee -a "$LOG"
timeout 150 python3 experiments/bench_attention.py --quick --heads 64 16 --impls pallas cudnn xla \
  --reps 5 --out "$OUT/bench_attention" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -3

stamp "profilers" | tee -a "$LOG"
(which ncu nsys ptxas cuobjdump nvdisasm; ls /usr/local/cuda*/bin 2>/dev/null | head -30;
 python3 -c "import nvidia, os; print(nvidia.__path__)") 2>&1 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
