#!/usr/bin/env bash
# The Pallas bitonic epilogue and scoring-tile probes on the H200, one device call
# (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_order.sh
# 1. The compiled tests of the Pallas epilogue (BlockSizes.order="pallas") and the dispatch test.
# 2. The epilogue alone at T=32K: XLA sort against the bitonic kernel at several rows/warps.
# 3. bench_selection variants at T=32K: the e14ecb3 default with each epilogue, and tile probes.
. experiments/gpu_runs/gpu_env.sh gpu_order

stamp "compiled epilogue tests" | tee -a "$LOG"
timeout 200 python3 -m pytest -q tests/test_hytopk_pallas.py \
  -k "order or dispatch_name" 2>&1 | tail -4 | tee -a "$LOG"

stamp "epilogue at 32K" | tee -a "$LOG"
timeout 120 python3 experiments/diagnose_bounds.py --no-attention --T 32768 --reps 5 \
  --out "$OUT/epilogue_32k" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -8

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 230 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants xla_order,order_pallas,order_pallas_r2w8,bk256,bq32,ns3,score_only_bk256 \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -12
stamp "done" | tee -a "$LOG"
