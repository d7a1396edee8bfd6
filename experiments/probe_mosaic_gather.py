"""Can a Mosaic GPU kernel gather the selected K/V rows fast enough on Hopper? (issue 4)

    PYTHONPATH=. python3 experiments/probe_mosaic_gather.py --lower-only      # CPU
    PYTHONPATH=. python3 experiments/probe_mosaic_gather.py [--T 32768] [--out DIR]   # H200

Why: the 10x forward+backward bar needs the sparse-attention matmuls to run ~1.26x faster than
the Triton forward's 236 TFLOP/s, everywhere (`attention_notes.md`, seventeenth session). The
Hopper-native route is Mosaic GPU (wgmma fed from swizzled shared memory by asynchronous
copies), but on sm_90 Mosaic GPU has no copy that gathers rows into that layout:
`--lower-only` shows, by lowering small kernels for CUDA on this machine, which forms
jax's Mosaic GPU accepts:

  per-row TMA into tiled, swizzled smem   refused (slices of a tiled ref must be whole tiles)
  per-row TMA into plain (untiled) smem   lowers
  wgmma reading a plain smem operand      refused (wgmma's operands must be tiled/swizzled)
  register gather `k_ref[idx_vector, :]`  refused (no array indexers)
  TMA gather (`tile::gather4`)            sm_100 only (PTX ISA); CP_ASYNC gather unimplemented

What is left is a staging design: a producer warpgroup copies each selected row with its own
TMA into a plain smem buffer, and the consumer re-lays the tile out into swizzled smem through
registers before its wgmma. The staging rows' stride is the open question: unpadded (256 B)
rows start on the same bank, so the consumer's loads in the wgmma register layout (8 rows x
16 bytes per warp instruction) conflict 8 ways; padding each row by 16 bytes (`--row-pad 8`)
spreads them over all 32 banks, but puts odd rows off the 128-byte boundary that (as I read
the CUDA guide) TMA wants for its shared-memory address. jax's Mosaic GPU settles half of it
on CPU: it refuses to lower the unpadded re-layout ("Failed to synthesize a transfer pattern
that avoids bank conflicts") and accepts the padded one. Whether the padded rows' TMA runs is
the device's answer; run it in its own process after `--row-pad 0 --modes tma`: a misaligned
copy is a sticky CUDA error. On the H200 this script times it, one query
per CTA, at the benchmark's shape (G=1, H=64, D=Dv=128, k=2048, bf16), in three stages:

  tma        the per-row copies alone (consumer only waits and releases the buffers);
  relayout   plus the register re-layout of K and V into swizzled smem;
  matmul     plus the forward's two matmuls per block, S = Q K^T and acc += bf16(S) V
             (no softmax: that is the matmul pipeline's rate, compared with the forward's).

next to the Triton kernels on the same indices: the forward (impl="pallas") and its gather
floor (diagnose_bounds.gather_only). The indices are bench_attention's causal random ones with
the -1 padding of the first k queries clamped to key 0, so every slot is a real copy and
k_eff = k for both. `matmul`'s output is checked against the same computation in jnp on a
sample of queries before timing. A probe, not a kernel: one query per CTA, no softmax, no
masking, no overlap between the re-layout and the matmuls.

Writes DIR/probe_mosaic_gather_pad{0,8}.json, or DIR/probe_mosaic_gather.json with --lower-only
(DIR defaults to experiments/results/mosaic_gather).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("tma", "relayout", "matmul")
BLOCK_K = 64          # selected keys per pipeline step
STAGES = 2            # staging buffers in flight
IDX_CHUNK = 256       # a TMA box holds at most 256 elements per dimension


def log(*args):
  print(*args, flush=True)


def _swizzled(shape, dtype=jnp.bfloat16):
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def gather_probe(q, k, v, idx, *, mode: str, row_pad: int = 0):
  """The probe kernel: bf16 [B, T, H, Dv] (zeros unless mode == "matmul").

  q [B, T, H, D], k [B, S, D], v [B, S, Dv] (G = 1, squeezed), idx int32 [B, T, kk], every
  entry in [0, S); H = 64 (one warpgroup's wgmma rows), kk a multiple of 256. `row_pad`: bf16
  elements of padding after each staging row.
  """
  B, T, H, D = q.shape
  Dv = v.shape[-1]
  kk = idx.shape[-1]
  if H != 64 or kk % IDX_CHUNK or D % 64 or Dv % 64:
    raise ValueError(f"probe shapes: {H=} must be 64, {kk=} a multiple of {IDX_CHUNK}, "
                     f"{D=} and {Dv=} multiples of 64")
  nblocks = kk // BLOCK_K

  def body(idx_ref, q_ref, k_ref, v_ref, o_ref, idx_smem, q_smem, k_stage, v_stage, k_tiled,
           v_tiled, idx_ready, q_ready, loaded, consumed):
    b, t = lax.axis_index("b"), lax.axis_index("t")
    wg = lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      for c in range(kk // IDX_CHUNK):
        plgpu.copy_gmem_to_smem(idx_ref.at[b, t, pl.ds(c * IDX_CHUNK, IDX_CHUNK)],
                                idx_smem.at[pl.ds(c * IDX_CHUNK, IDX_CHUNK)], idx_ready)
      plgpu.barrier_wait(idx_ready)

      @pl.loop(0, nblocks)
      def _block(blk):
        slot = lax.rem(blk, STAGES)

        @pl.when(blk >= STAGES)
        def _():
          plgpu.barrier_wait(consumed.at[slot])

        # One TMA per selected row; `loaded` expects 2 * BLOCK_K arrivals per step.
        @pl.loop(0, BLOCK_K)
        def _row(j):
          row = idx_smem[blk * BLOCK_K + j]
          plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(row, 1)],
                                  k_stage.at[slot, pl.ds(j, 1), pl.ds(0, D)], loaded.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(row, 1)],
                                  v_stage.at[slot, pl.ds(j, 1), pl.ds(0, Dv)], loaded.at[slot])

    @pl.when(wg == 0)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[b, t], q_smem, q_ready)
      plgpu.barrier_wait(q_ready)
      acc = plgpu.layout_cast(jnp.zeros((H, Dv), jnp.float32), plgpu.Layout.WGMMA)

      def step(blk, acc):
        slot = lax.rem(blk, STAGES)
        plgpu.barrier_wait(loaded.at[slot])
        if mode == "tma":
          plgpu.barrier_arrive(consumed.at[slot])
          return acc
        k_rows = plgpu.layout_cast(k_stage[slot, :, pl.ds(0, D)], plgpu.Layout.WGMMA)
        v_rows = plgpu.layout_cast(v_stage[slot, :, pl.ds(0, Dv)], plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(consumed.at[slot])     # the rows are in registers now
        k_tiled[...] = k_rows
        v_tiled[...] = v_rows
        plgpu.commit_smem()                         # generic stores -> visible to wgmma
        if mode == "relayout":
          return acc

        def scores(s_ref):
          plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_tiled, (1, 0)))
          return s_ref[...]
        s = pl.run_scoped(scores, plgpu.ACC((H, BLOCK_K), jnp.float32))

        def accumulate(acc_ref):
          plgpu.wgmma(acc_ref, s.astype(jnp.bfloat16), v_tiled)
        return pl.run_state(accumulate)(plgpu.ACC.init(acc))

      acc = lax.fori_loop(0, nblocks, step, acc)
      q_smem[...] = acc.astype(jnp.bfloat16)        # Dv == D: reuse the query's tile
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, t])
      plgpu.wait_smem_to_gmem(0)

  def entry(idx_ref, q_ref, k_ref, v_ref, o_ref):
    pl.run_scoped(
        lambda *scratch: body(idx_ref, q_ref, k_ref, v_ref, o_ref, *scratch),
        plgpu.SMEM((kk,), jnp.int32),
        _swizzled((H, D)),
        plgpu.SMEM((STAGES, BLOCK_K, D + row_pad), jnp.bfloat16),
        plgpu.SMEM((STAGES, BLOCK_K, Dv + row_pad), jnp.bfloat16),
        _swizzled((BLOCK_K, D)),
        _swizzled((BLOCK_K, Dv)),
        plgpu.Barrier(num_arrivals=kk // IDX_CHUNK),   # one arrival per copy
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2 * BLOCK_K, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
        collective_axes="wg",
    )

  if D != Dv:
    raise ValueError(f"probe writes its output through the query's tile: {D=} must equal {Dv=}")
  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((B, T, H, Dv), jnp.bfloat16),
      grid=(T, B), grid_names=("t", "b"), num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(idx, q, k, v)


def matmul_reference(q, k, v, idx, rows):
  """What mode="matmul" computes, for the queries `rows`: f32 [B, len(rows), H, Dv]."""
  q, idx = q[:, rows].astype(jnp.float32), idx[:, rows]
  kg = jax.vmap(lambda kb, ib: kb[ib])(k, idx).astype(jnp.float32)   # [B, R, kk, D]
  vg = jax.vmap(lambda vb, ib: vb[ib])(v, idx).astype(jnp.float32)
  B, R, kk, _ = kg.shape
  kg = kg.reshape(B, R, kk // BLOCK_K, BLOCK_K, -1)
  vg = vg.reshape(B, R, kk // BLOCK_K, BLOCK_K, -1)
  s = jnp.einsum("brhd,brnjd->brnhj", q, kg).astype(jnp.bfloat16).astype(jnp.float32)
  return jnp.einsum("brnhj,brnje->brhe", s, vg)


# ------------------------------------------------------------------- CPU: which forms lower


def _lowers(fn, *args) -> str:
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return "lowers"
  except Exception as e:  # noqa: BLE001 -- the error is the finding
    first = (str(e).strip().splitlines() or [""])[0]
    return f"refused: {type(e).__name__}: {first[:160]}"


def lowering_survey() -> dict[str, str]:
  """Lower each gather form (and the probe itself) for CUDA; no GPU needed."""
  S, D, R = 256, 128, 64
  rows = jnp.arange(R, dtype=jnp.int32) * 3
  rows128 = jnp.arange(128, dtype=jnp.int32)
  k = jnp.ones((S, D), jnp.bfloat16)
  out = jax.ShapeDtypeStruct((R, D), jnp.float32)

  def per_row(dst_type):
    def body(idx_ref, k_ref, o_ref, idx_smem, dst, bar):
      plgpu.copy_gmem_to_smem(idx_ref, idx_smem, bar.at[0])
      plgpu.barrier_wait(bar.at[0])
      for j in range(4):
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(idx_smem[j], 1)], dst.at[pl.ds(j, 1)], bar.at[1])
      plgpu.barrier_wait(bar.at[1])
      o_ref[...] = dst[...].astype(jnp.float32)
    return plgpu.kernel(body, out_type=out, scratch_types=[
        plgpu.SMEM((R,), jnp.int32), dst_type, plgpu.Barrier(num_barriers=2)])

  def wgmma_plain():
    def body(k_ref, o_ref, a, b, bar):
      plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(0, R)], a, bar.at[0])
      plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(0, D)], b, bar.at[1])
      plgpu.barrier_wait(bar.at[0])
      plgpu.barrier_wait(bar.at[1])

      def mm(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
      o_ref[...] = pl.run_scoped(mm, plgpu.ACC((R, D), jnp.float32))
    return plgpu.kernel(body, out_type=out, scratch_types=[
        _swizzled((R, D)), plgpu.SMEM((D, D), jnp.bfloat16), plgpu.Barrier(num_barriers=2)])

  def register_gather(idx_ref, k_ref, o_ref):
    o_ref[...] = k_ref[idx_ref[...], :].astype(jnp.float32)

  B, T, H, kk = 1, 4, 64, 512
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  kv = jax.random.normal(keys[1], (B, S, D), jnp.bfloat16)
  idx = jax.random.randint(keys[2], (B, T, kk), 0, S)
  survey = {
      "per-row TMA into tiled, swizzled smem": _lowers(per_row(_swizzled((R, D))), rows, k),
      "per-row TMA into plain smem": _lowers(
          per_row(plgpu.SMEM((R, D), jnp.bfloat16)), rows, k),
      "wgmma with a plain (untiled) smem operand": _lowers(wgmma_plain(), k),
      "register gather k_ref[idx_vector, :]": _lowers(
          plgpu.kernel(register_gather, out_type=jax.ShapeDtypeStruct((128, D), jnp.float32)),
          rows128, k),
  }
  for mode in MODES:
    for row_pad in (0, 8):
      survey[f"probe kernel, mode={mode}, row_pad={row_pad}"] = _lowers(
          functools.partial(gather_probe, mode=mode, row_pad=row_pad), q, kv, kv, idx)
  return survey


# ------------------------------------------------------------------------ GPU: timing


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lower-only", action="store_true",
                  help="only lower the gather forms and the probe for CUDA (runs on CPU)")
  ap.add_argument("--T", type=int, default=32768, help="T = S (default 32768)")
  ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
  ap.add_argument("--row-pad", type=int, default=8, choices=(0, 8),
                  help="bf16 elements of padding per staging row (default 8; with 0, jax's "
                       "Mosaic GPU refuses the re-layout, so only --modes tma runs)")
  ap.add_argument("--modes", default=",".join(MODES),
                  help=f"comma-separated subset of {MODES} to time (default all)")
  ap.add_argument("--out", default=os.path.join(RESULTS, "mosaic_gather"),
                  help="directory for probe_mosaic_gather.json")
  args = ap.parse_args()
  modes = [m for m in args.modes.split(",") if m]
  if not modes or set(modes) - set(MODES):
    ap.error(f"--modes: choose from {MODES}, got {args.modes!r}")
  if args.row_pad == 0 and modes != ["tma"]:
    ap.error("--row-pad 0 runs only with --modes tma (Mosaic GPU refuses its re-layout)")

  rec = {"jax": jax.__version__, "device": str(jax.devices()[0])}
  log(f"jax {rec['jax']} on {rec['device']}")
  rec["lowering"] = lowering_survey()
  for form, result in rec["lowering"].items():
    log(f"  {form:45s} {result}")
  if not args.lower_only:
    if jax.devices()[0].platform != "gpu":
      sys.exit("timing needs the GPU; on CPU use --lower-only")
    rec.update(time_on_gpu(args.T, args.reps, args.row_pad, modes))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "probe_mosaic_gather.json" if args.lower_only
                      else f"probe_mosaic_gather_pad{args.row_pad}.json")
  with open(path, "w") as f:
    json.dump(rec, f, indent=1)
  log(f"wrote {path}")


def time_on_gpu(T, reps, row_pad, modes):
  import diagnose_bounds  # noqa: E402 -- GPU-only import (its Triton helpers)
  from pallas_kernels import sparse_attention as psa
  import hyscale_jax as hs

  H, D, kk = 64, 128, 2048
  q, k4, v4, idx, _ = bench_attention.make_inputs(1, T, H, D, D, kk)
  idx = jnp.maximum(idx, 0)                    # every slot a real row (see the docstring)
  k, v = k4[:, :, 0], v4[:, :, 0]
  flops = bench_attention.sparse_flops(T, H, D, D, kk)
  rec = {"T": T, "H": H, "D": D, "k": kk, "block_k": BLOCK_K, "stages": STAGES, "row_pad": row_pad,
         "forward_flops": flops, "gather_bytes": T * kk * 2 * D * 2}

  if "matmul" in modes:   # the only mode whose output depends on the gathered rows
    rows = np.random.RandomState(0).choice(T, 64, replace=False)
    out = gather_probe(q, k, v, idx, mode="matmul", row_pad=row_pad)
    want = matmul_reference(q, k, v, idx, rows)
    err = bench_attention.rel_err(out[:, rows].astype(jnp.float32), want)
    rec["matmul_rel_err"] = err
    log(f"mode=matmul vs jnp on {len(rows)} queries: rel. err. {err:.2e}")
    if not err < 2e-2:
      log("mode=matmul is WRONG: not timing the probe")
      rec["error"] = "matmul mode failed its check"
      return rec

  for mode in modes:
    fn = jax.jit(functools.partial(gather_probe, mode=mode, row_pad=row_pad))
    ms = bench_attention.median_ms(fn, (q, k, v, idx), reps)
    rec[f"{mode}_ms"] = ms
    log(f"mosaic {mode:9s} {ms:8.2f} ms  ({rec['gather_bytes'] / ms / 1e9:.2f} TB/s gathered"
        + (f", {flops / ms / 1e9:.0f} TFLOP/s)" if mode == "matmul" else ")"))
  sizes = psa.BlockSizes()
  gather_floor = jax.jit(functools.partial(diagnose_bounds.gather_only, sizes=sizes))
  rec["triton_gather_only_ms"] = bench_attention.median_ms(gather_floor, (k[0], v[0], idx[0]),
                                                           reps)
  fwd = jax.jit(lambda q, k, v, idx: hs.sparse_attention(q, k, v, idx, impl="pallas"))
  rec["triton_forward_ms"] = bench_attention.median_ms(fwd, (q, k4, v4, idx), reps)
  log(f"triton gather_only {rec['triton_gather_only_ms']:8.2f} ms; triton forward "
      f"{rec['triton_forward_ms']:.2f} ms ({flops / rec['triton_forward_ms'] / 1e9:.0f} TFLOP/s)")
  return rec


if __name__ == "__main__":
  main()
