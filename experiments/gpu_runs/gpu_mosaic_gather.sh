# Issue 4: can Mosaic GPU feed wgmma with gathered K/V rows on the H200?
# experiments/probe_mosaic_gather.py times per-row TMA gathers (tma), plus the register
# re-layout into swizzled smem (relayout), plus the forward's two matmuls (matmul), beside the
# Triton forward and its gather floor on the same indices. Two processes: the padded staging
# rows may break TMA's shared-memory alignment, and a misaligned copy is a sticky CUDA error.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_gather.sh (~6 min max).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_gather
step "probe, unpadded staging rows (256 B): per-row TMA alone"
timed_script 200 experiments/probe_mosaic_gather.py --row-pad 0 --modes tma --out "$OUT/mosaic_gather"
step "probe, staging rows padded by 16 B: tma, relayout, matmul"
timed_script 250 experiments/probe_mosaic_gather.py --row-pad 8 --out "$OUT/mosaic_gather"
step "done"
