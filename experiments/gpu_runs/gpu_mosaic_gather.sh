# Issue 4: can Mosaic GPU feed wgmma with gathered K/V rows on the H200?
# experiments/probe_mosaic_gather.py times the copies' barrier arrivals alone (arrive), the
# per-row bulk copies (tma), plus the register re-layout into swizzled smem (relayout), plus
# the forward's two matmuls (matmul), plus the whole forward (forward, checked against an f32
# reference first), beside the Triton forward and its gather floor on the same indices.
# Three processes, each writing its record after every configuration: a device fault is
# sticky and ends its process, not the later ones.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_gather.sh (<= 520 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_gather
step "lowering survey; the copies' arrivals alone, then the per-row copies (64 keys, 2 stages)"
timed_script 160 experiments/probe_mosaic_gather.py --modes arrive,tma --tag _copies \
  --out "$OUT/mosaic_gather"
step "re-layout, matmuls, whole forward (64 keys, 2 stages, one query per CTA)"
timed_script 200 experiments/probe_mosaic_gather.py --no-survey --modes relayout,matmul,forward \
  --tag _stages --out "$OUT/mosaic_gather"
step "forward only: two queries per CTA (64 keys, 1 stage), 3 stages, 128 keys x 1 stage"
timed_script 160 experiments/probe_mosaic_gather.py --no-survey --modes forward \
  --configs 64:1:2,64:3:1,128:1:1 --tag _forward_configs --out "$OUT/mosaic_gather"
step "done"
