# Issue 4: can Mosaic GPU's bulk tensor reductions add the backward's dK/dV rows faster than
# the Triton backward's vector atomics (17.8 ms masked floor at T=32K, H=64, eighth session)?
# experiments/probe_mosaic_reduce.py lowers its modes, checks `reduce` against a jnp
# scatter-add, then times the reductions alone (reduce_only), the wgmmas and tile stores alone
# (store) and both (reduce), with 1 and 2 tile buffers, beside the Triton atomics floor on the
# same indices. Written in the nineteenth session; first run as step 3 of gpu_mosaic_backward.sh
# (twentieth session).
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_reduce.sh (<= 180 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_reduce
step "row reductions: lowering, check, then reduce_only / store / reduce at 1 and 2 buffers"
timed_script 180 experiments/probe_mosaic_reduce.py --stages 1,2 --out "$OUT/mosaic_gather"
step "done"
