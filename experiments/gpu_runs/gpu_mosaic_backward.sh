# Issue 4: can a Mosaic GPU backward (per-row copies feeding wgmma, bulk tensor row reductions
# for dK/dV) bring forward+backward under the 10x bar's 32.3 ms at T=32K, H=64, k=2048?
# experiments/probe_mosaic_backward.py checks its delta and grad kernels against the f32
# reference (T=1024) and the Triton backward (full size), then times them beside the Triton
# forward and backward and xla's forward+backward, in one process per script; then the row
# reduction probe (its pieces' costs). Written in the twentieth session.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_backward.sh (<= 480 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_backward
step "Mosaic GPU backward: lowering, checks, then timings at 2 and 1 staging buffers"
timed_script 290 experiments/probe_mosaic_backward.py --stages 2,1 --out "$OUT/mosaic_gather"
step "row reductions: lowering, check, then reduce_only / store / reduce at 1 and 2 buffers"
timed_script 180 experiments/probe_mosaic_reduce.py --stages 1,2 --out "$OUT/mosaic_gather"
step "done"
