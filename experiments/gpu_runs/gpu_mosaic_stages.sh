# Issue 4, twentieth session, third call: where the Mosaic GPU probes' time goes. With
# unpadded staging rows the forward probe took 42.7 ms and the backward's delta sweep 44.6 ms
# (gpu_mosaic_unpadded.sh), against the Triton forward's 9.1 ms. The gather probe's pipeline
# modes split it: the copies' arrivals alone, the per-row copies, plus the re-layout, plus the
# matmuls (row_pad=0, 64 keys x 2 stages, 1 query per CTA); then the forward with 64-element
# padding (stride 192 elements: lowers on 0.11.2), which moves rows off each other's banks.
# Run from the repo root: OUT=$OUT bash experiments/gpu_runs/gpu_mosaic_stages.sh (<= 330 s).
. experiments/gpu_runs/gpu_env.sh gpu_mosaic_stages
for pad in 0 64; do
  if [ "$pad" = 0 ]; then modes=arrive,tma,relayout,matmul; else modes=relayout,forward; fi
  step "gather probe, row_pad=$pad: $modes"
  timed_script 165 -c "
import functools, sys; sys.path.insert(0, 'experiments'); sys.argv[0] = 'probe_mosaic_gather.py'
import probe_mosaic_gather as g
g.gather_probe = functools.partial(g.gather_probe, row_pad=$pad); g.main()" \
    --no-survey --modes "$modes" --configs 64:2:1 --tag "_stages_row_pad$pad" \
    --out "$OUT/mosaic_gather"
done
step "done"
