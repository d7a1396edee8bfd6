# Issue 4: can Mosaic GPU feed wgmma with gathered K/V rows on the H200?
# experiments/probe_mosaic_gather.py times the copies' barrier arrivals alone (arrive), the
# per-row TMA gathers (tma), plus the register re-layout into swizzled smem (relayout), plus
# the forward's two matmuls (matmul), plus the whole forward (forward, checked against an f32
# reference first), beside the Triton forward and its gather floor on the same indices.
# Separate processes: the padded staging rows may break TMA's shared-memory alignment, and a
# misaligned copy is a sticky CUDA error.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_gather.sh (<= 520 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_gather
step "lowering survey; unpadded staging rows (256 B): the copies' arrivals alone, per-row TMA"
timed_script 160 experiments/probe_mosaic_gather.py --row-pad 0 --modes arrive,tma \
  --out "$OUT/mosaic_gather"
step "staging rows padded by 16 B: all modes, 64 keys per step, 2 stages"
timed_script 200 experiments/probe_mosaic_gather.py --no-survey --row-pad 8 \
  --out "$OUT/mosaic_gather"
step "padded rows, forward only: two queries per CTA (64 keys, 1 stage), 3 stages, 128 keys"
timed_script 160 experiments/probe_mosaic_gather.py --no-survey --row-pad 8 --modes forward \
  --configs 64:1:2,64:3:1,128:2:1 --tag _forward_configs --out "$OUT/mosaic_gather"
step "done"
