#!/usr/bin/env bash
# Written 2026-12-03 (fourth session), run in the fifth (records: results/attn_bk64/,
# results/hytopk_ms8/). One device call, from the repo root
# (< 10 minutes):
#     OUT=/some/dir bash experiments/gpu_runs/gpu_next.sh
# 1. Same-run ratios for the block_k_bwd=64 attention default: pallas, xla and cuDNN at
#    T=32K, H=64 (the tune run that chose it had no xla or cuDNN column).
# 2. Selection probes at T=32K around block_k=256: block_k=512 without the K-block prefetch
#    (num_stages=1; the 2-stage kernel exceeds shared memory), capacity 8192 or min_steps=2
#    (fewer in-stream compactions), and the Pallas epilogue, against the default in the same run.
. experiments/gpu_runs/gpu_env.sh gpu_next

stamp "attention at 32K, H=64: pallas, xla, cudnn" | tee -a "$LOG"
timeout 240 python3 experiments/bench_attention.py --seq 32768 --heads 64 \
  --impls pallas xla cudnn --reps 5 --out "$OUT/bench_attention_32k" 2>&1 | grep -v -i deprecat \
  | tee -a "$LOG" | tail -6

stamp "selection variants at 32K" | tee -a "$LOG"
timeout 280 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,score_only_bk512_ns1,bk512_ns1,bk256_c8k,bk256_ms8,bk256_ms2,bk256_order_pallas \
  2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -10
stamp "done" | tee -a "$LOG"
