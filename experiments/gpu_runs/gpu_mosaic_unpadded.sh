# Issue 4, twentieth session, second call: jax 0.11.2 refuses the probes' padded staging rows
# (row_pad=8: "Stride 136 is not divisible by 128", gpu_mosaic_backward.sh's record) but
# lowers unpadded ones (row_pad=0, refused by 0.10.2 for bank conflicts). So: the backward
# and forward probes again with unpadded staging rows (the module constant / default
# overridden in the driver below), without their lowering surveys.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_unpadded.sh (<= 430 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_unpadded
step "Mosaic GPU backward, row_pad=0, stages 2 and 1"
timed_script 270 -c '
import sys; sys.path.insert(0, "experiments"); sys.argv[0] = "probe_mosaic_backward.py"
import probe_mosaic_backward as pb; pb.ROW_PAD = 0; pb.main()' \
  --no-survey --stages 2,1 --tag _row_pad0 --out "$OUT/mosaic_gather"
step "Mosaic GPU forward, row_pad=0 (64 keys x 2 stages, 1 query per CTA; 64 x 1, 2 per CTA)"
timed_script 150 -c '
import functools, sys; sys.path.insert(0, "experiments"); sys.argv[0] = "probe_mosaic_gather.py"
import probe_mosaic_gather as g
g.gather_probe = functools.partial(g.gather_probe, row_pad=0); g.main()' \
  --no-survey --modes forward --configs 64:2:1,64:1:2 --tag _forward_row_pad0 \
  --out "$OUT/mosaic_gather"
step "done"
