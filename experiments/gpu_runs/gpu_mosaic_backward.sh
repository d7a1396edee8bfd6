# Issue 4: can Mosaic GPU kernels bring forward+backward under the 10x bar's 32.3 ms at T=32K,
# H=64, k=2048? One call for the three answers, each script in its own process (a device
# fault is sticky and ends only its process) and writing its record as it goes:
#  1. experiments/probe_mosaic_backward.py: the Mosaic GPU backward (delta and grad kernels:
#     per-row copies feeding wgmma, bulk tensor row reductions for dK/dV), checked against
#     the f32 reference (T=1024) and the Triton backward (full size), timed beside the Triton
#     forward and backward and xla's forward+backward;
#  2. experiments/probe_mosaic_gather.py, mode forward only: the Mosaic GPU forward, one and
#     two queries per CTA, beside the Triton forward;
#  3. experiments/probe_mosaic_reduce.py: the row reductions alone and with their wgmmas.
# Written in the twentieth session.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_backward.sh (<= 560 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_backward
step "Mosaic GPU backward: lowering, checks, then timings at 2 and 1 staging buffers"
timed_script 270 experiments/probe_mosaic_backward.py --stages 2,1 --out "$OUT/mosaic_gather"
step "Mosaic GPU forward (64 keys x 2 stages, 1 query per CTA; 64 x 1, 2 queries per CTA)"
timed_script 140 experiments/probe_mosaic_gather.py --no-survey --modes forward \
  --configs 64:2:1,64:1:2 --tag _forward --out "$OUT/mosaic_gather"
step "row reductions: lowering, check, then reduce_only / store / reduce at 1 and 2 buffers"
timed_script 140 experiments/probe_mosaic_reduce.py --stages 1,2 --out "$OUT/mosaic_gather"
step "done"
