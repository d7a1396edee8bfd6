"""Can Mosaic GPU's bulk reductions add the backward's dK/dV rows faster than atomics? (issue 4)

    PYTHONPATH=. python3 experiments/probe_mosaic_reduce.py --lower-only     # CPU
    PYTHONPATH=. python3 experiments/probe_mosaic_reduce.py [--modes M,..] [--stages N,..]
                                                           # H200 (see --help)

Why: the Triton backward is bound by its dK/dV accumulation. Every valid (query, slot) pair
adds a 128-float row into dK and one into dV, 1.66e10 f32 adds at T=32K, H=64, k=2048; with
Hopper's vector reductions (`red.global.add.v4.f32`, four floats per request) those alone take
17.8 ms (`diagnose_bounds.py`'s masked atomics floor, eighth session), against the ~32 ms that
the 10x bar leaves for forward and backward together. A Hopper-native backward (the direction
`probe_mosaic_gather.py` tests for the forward) would add each row differently: its wgmma
leaves dK's block tile ([64 keys, 128] f32) in registers; the tile goes to shared memory, and
one thread issues a bulk tensor reduction per row, `cp.reduce.async.bulk.tensor...add` (f32)
(512 bytes per request instead of 16), into the selected key's row of dK. Whether the L2 adds
whole rows faster than vector requests is a property of the chip that only the H200 can show;
this script measures it at the benchmark's shape, in three modes:

  reduce_only  the bulk row reductions alone: each CTA computes its two tiles once, then
               reduces them into the rows its query selected, block by block (the traffic of
               the backward's dK/dV accumulation, nothing else);
  store        per block, the two wgmmas that make the tiles (dS^T Q and P^T dO stand-ins:
               [64 keys, 64 heads] x [64 heads, 128]) and their stores into shared memory,
               no reduction (what a backward pays before its reductions);
  reduce       both: per block the wgmmas, the stores, then the row reductions, with
               `stages` tile buffers so that a block's stores overlap the previous blocks'
               reductions (a buffer is rewritten only once its reductions have read it).

beside the Triton floor `diagnose_bounds.atomics_only` (masked, as the backward) on the same
indices, in the same process. Before timing, each configuration's `reduce` output is checked
against a jnp scatter-add on a small problem (the sums' order differs: f32 rounding only).

Reading the result: one thread per CTA issues every reduction (Pallas issues a copy from one
thread of the warpgroup), 2 x 64 per block, and the probe takes 105 KiB of shared memory
at one buffer (two CTAs per SM) and 169 KiB at two (one CTA per SM). So a slow `reduce_only`
may be the issuing threads' rate rather than the L2's; it is an upper bound on what this form
costs, and only a fast one settles the question.

Facts this design rests on, read in jax 0.10.2's Mosaic GPU sources and lowered on CPU
(`--lower-only`): Mosaic emits reductions only as tensor TMA (the plain bulk copy's path
excludes them), whose shared-memory side must be 128-byte aligned, which 512-byte f32 rows
are; storing a wgmma accumulator into plain (unswizzled) f32 smem lowers (whether without
bank conflicts, only the device's time can say); `plgpu.kernel` has no input-output aliases
(only the deprecated `pl.pallas_call` route to Mosaic GPU has), so the compiled probe reduces
into `jax.new_ref` zeros passed to `pl.kernel` (`plgpu.kernel`'s batching wrapper refuses
refs). The interpreter
(jax 0.10.2) has no TMA reduction: under `interpret=True` each row reduction is a
read-modify-write of the output row, which checks the rows and values, not the instruction.

Measured (twentieth session, H200, `experiments/results/mosaic_gather/gpu_mosaic_backward/`):
`reduce_only` 17.95 ms against the Triton floor's 17.84 ms: whole-row reductions add at the
same ~3.7 TB/s as vector atomics. (Its `store` times, ~0.1 ms, are impossibly short for the
wgmmas they stand for and are not a measurement.)

Writes DIR/probe_mosaic_reduce{TAG}.json (DIR defaults to experiments/results/mosaic_gather),
after every configuration.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention  # noqa: E402
import probe_mosaic_gather as gather  # noqa: E402

MODES = ("reduce_only", "store", "reduce")
BLOCK_K = 64          # selected keys per step: the wgmma tile's rows
log = bench_attention.log


def smem_bytes(stages, kk=2048, H=64, D=128):
  """The shared memory the compiled probe allocates at the benchmark's shape: the index row,
  q, the coefficients and `stages` dK and dV f32 tiles (each already a multiple of the 1024
  bytes Pallas rounds buffers to), plus 1024 for the barriers."""
  return (kk * 4 + H * D * 2 + 2 * BLOCK_K * H * 2 + 2 * stages * BLOCK_K * D * 4 + 1024)


def reduce_tile_rows(idx_smem, first, k_tile, v_tile, dk_ref, dv_ref, b, num_keys,
                     interpret):
  """Adds row j of the f32 tiles k_tile, v_tile [BLOCK_K, D] (smem) into rows
  s = idx_smem[first + j] of dk_ref, dv_ref [B, num_keys, D] (gmem), for the j whose s lies in
  [0, num_keys): one bulk tensor reduction per row, issued by one thread, all committed as
  one group (the caller waits on it before rewriting the tiles). The tiles' stores must be
  fenced (`commit_smem`) before. interpret=True: a read-modify-write per row instead (the
  interpreter has no TMA reduction)."""
  @pl.loop(0, BLOCK_K)
  def _row(j):
    row = idx_smem[first + j]
    valid = (row >= 0) & (row < num_keys)
    row = jnp.where(valid, row, 0)
    for tile, out_ref in ((k_tile, dk_ref), (v_tile, dv_ref)):
      src, dst = tile.at[pl.ds(j, 1)], out_ref.at[b, pl.ds(row, 1)]
      if interpret:
        @pl.when(valid)
        def _():
          dst[...] = dst[...] + src[...]
      else:
        plgpu.copy_smem_to_gmem(src, dst, predicate=valid, commit_group=False,
                                reduction_op="add")
  plgpu.commit_smem_to_gmem_group()


def reduce_probe(q, coeffs, idx, num_keys, *, mode: str, stages: int = 2,
                 interpret: bool = False):
  """The probe kernel: (dk, dv), f32 [B, num_keys, D] each.

  q [B, T, H, D] bf16 (H = 64: the wgmmas' contraction), coeffs [2, BLOCK_K, H] bf16 (the
  stand-ins for a block's dS^T and P^T: the same for every block and query), idx int32
  [B, T, kk], kk a multiple of 256. For every valid entry idx[b, t, i] = s (0 <= s < num_keys),
  "reduce" adds f * (coeffs[0] @ q[b, t])[i % BLOCK_K] into dk[b, s] and
  f * (coeffs[1] @ q[b, t])[i % BLOCK_K] into dv[b, s], f = i // BLOCK_K + 1 (a factor per
  block, so that a buffer rewritten before its reductions have read it gives wrong sums);
  other entries add nothing. "reduce_only" adds the same with f = 1 (its tiles are made
  once); "store" adds nothing (dk = dv = 0). One CTA (one warpgroup) per query.
  """
  B, T, H, D = q.shape
  kk = idx.shape[-1]
  if H != 64 or kk % gather.IDX_CHUNK or coeffs.shape != (2, BLOCK_K, H) or D % 64:
    raise ValueError(f"probe shapes: {H=} must be 64, {kk=} a multiple of {gather.IDX_CHUNK}, "
                     f"coeffs {coeffs.shape} must be {(2, BLOCK_K, H)}, {D=} a multiple of 64")
  if mode not in MODES:
    raise ValueError(f"mode: choose from {MODES}, got {mode!r}")
  nblocks = kk // BLOCK_K
  slots = 1 if mode == "reduce_only" else stages

  def body(q_ref, coeffs_ref, idx_ref, dk_ref, dv_ref):
    b, t = lax.axis_index("b"), lax.axis_index("t")

    def scoped(idx_smem, q_smem, coeffs_smem, k_tiles, v_tiles, idx_ready, ready):
      for chunk in range(kk // gather.IDX_CHUNK):
        part = pl.ds(chunk * gather.IDX_CHUNK, gather.IDX_CHUNK)
        plgpu.copy_gmem_to_smem(idx_ref.at[b, t, part], idx_smem.at[part], idx_ready)
      plgpu.copy_gmem_to_smem(q_ref.at[b, t], q_smem, ready.at[0])
      plgpu.copy_gmem_to_smem(coeffs_ref, coeffs_smem, ready.at[1])
      plgpu.barrier_wait(idx_ready)
      for i in range(2):
        plgpu.barrier_wait(ready.at[i])

      def make_tiles(slot, factor):
        for c, tiles in enumerate((k_tiles, v_tiles)):
          def product(acc_ref):
            plgpu.wgmma(acc_ref, coeffs_smem.at[c], q_smem)
            return acc_ref[...]
          tiles.at[slot][...] = factor * pl.run_scoped(product,
                                                       plgpu.ACC((BLOCK_K, D), jnp.float32))
        plgpu.commit_smem()      # generic stores -> visible to the TMA (and a barrier)

      def reduce_rows(blk, slot):
        reduce_tile_rows(idx_smem, blk * BLOCK_K, k_tiles.at[slot], v_tiles.at[slot], dk_ref,
                         dv_ref, b, num_keys, interpret)

      if mode == "reduce_only":
        make_tiles(0, 1.0)

      @pl.loop(0, nblocks)
      def _block(blk):
        slot = lax.rem(blk, slots)
        if mode != "reduce_only":
          # The group committed `slots` blocks ago read this buffer: let it finish reading.
          plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
          make_tiles(slot, (blk + 1).astype(jnp.float32))
        if mode != "store":
          reduce_rows(blk, slot)

      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((kk,), jnp.int32),
        gather._swizzled((H, D)),
        gather._swizzled((2, BLOCK_K, H)),
        plgpu.SMEM((slots, BLOCK_K, D), jnp.float32),   # 512-byte rows: the TMA's alignment
        plgpu.SMEM((slots, BLOCK_K, D), jnp.float32),
        plgpu.Barrier(num_arrivals=kk // gather.IDX_CHUNK),   # one arrival per index copy
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )

  out = jax.ShapeDtypeStruct((B, num_keys, D), jnp.float32)
  mesh = plgpu.Mesh(grid=(T, B), grid_names=("t", "b"))
  if interpret:   # the interpreter zero-fills fresh outputs
    return pl.kernel(body, out_type=(out, out), mesh=mesh, name="probe_mosaic_reduce",
                     interpret=gather._interpret_params(uninitialized_memory="zero"))(
                         q, coeffs, idx)
  dk = jax.new_ref(jnp.zeros(out.shape, out.dtype))
  dv = jax.new_ref(jnp.zeros(out.shape, out.dtype))
  pl.kernel(body, mesh=mesh, name="probe_mosaic_reduce",
            compiler_params=plgpu.CompilerParams())(q, coeffs, idx, dk, dv)
  return jax.freeze(dk), jax.freeze(dv)


def reduce_reference(q, coeffs, idx, num_keys, mode="reduce"):
  """What `mode` ("reduce" or "reduce_only") computes, by a jnp scatter-add: f32 (dk, dv)
  [B, num_keys, D]."""
  B, T, H, D = q.shape
  kk = idx.shape[-1]
  tiles = jnp.einsum("cjh,bthd->cbtjd", coeffs.astype(jnp.float32), q.astype(jnp.float32))
  rows = jnp.tile(tiles, (1, 1, 1, kk // BLOCK_K, 1))              # [2, B, T, kk, D]
  if mode == "reduce":
    rows = rows * (jnp.arange(kk) // BLOCK_K + 1.0)[:, None]
  valid = (idx >= 0) & (idx < num_keys)
  target = jnp.where(valid, idx, num_keys)                         # invalid: dropped
  def scatter(rows_b, target_b):
    return jnp.zeros((num_keys, D), jnp.float32).at[target_b.reshape(-1)].add(
        rows_b.reshape(-1, D), mode="drop")
  dk = jax.vmap(scatter)(rows[0], target)
  dv = jax.vmap(scatter)(rows[1], target)
  return dk, dv


def make_coeffs(H=64, seed=1):
  """bf16 [2, BLOCK_K, H] stand-ins for dS^T and P^T, of order 0.1 like softmax gradients."""
  return 0.1 * jax.random.normal(jax.random.key(seed), (2, BLOCK_K, H), jnp.bfloat16)


def lowering_survey() -> dict[str, str]:
  """Lower each mode for CUDA (no GPU needed)."""
  B, T, H, D, S, kk = 1, 4, 64, 128, 300, 512
  keys = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  idx = jax.random.randint(keys[1], (B, T, kk), -1, S)
  return {f"mode={mode}, stages={stages}": gather._lowers(
      functools.partial(reduce_probe, num_keys=S, mode=mode, stages=stages), q, make_coeffs(),
      idx) for mode in MODES for stages in ((1,) if mode == "reduce_only" else (1, 2))}


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  gather.add_run_arguments(ap, "the modes", no_survey=False)
  ap.add_argument("--stages", default="1,2",
                  help="comma-separated tile-buffer counts for store/reduce (default 1,2; "
                       "3 exceeds the shared memory of a CTA)")
  ap.add_argument("--modes", default=",".join(MODES),
                  help=f"comma-separated subset of {MODES} to time (default all)")
  args = ap.parse_args()
  modes = gather.parse_modes(ap, args.modes, MODES)
  stage_counts = gather.parse_stages(ap, args.stages, smem_bytes)
  gather.record_probe(os.path.join(args.out, f"probe_mosaic_reduce{args.tag}.json"),
                      lowering_survey, None if args.lower_only else functools.partial(
                          time_on_gpu, T=args.T, reps=args.reps, modes=modes,
                          stage_counts=stage_counts))


def time_on_gpu(rec, save, *, T, reps, modes, stage_counts):
  """Adds the check and the timings to `rec`, calling `save()` after each configuration."""
  import diagnose_bounds  # noqa: E402 -- GPU-only import (its Triton helpers)
  from pallas_kernels import sparse_attention as psa

  H, D, kk = 64, 128, 2048
  q, _, _, idx, _ = bench_attention.make_inputs(1, T, H, D, D, kk)
  coeffs = make_coeffs(H)
  valid = float(jnp.sum(idx >= 0))
  rec.update(T=T, H=H, D=D, k=kk, valid_pairs=valid, f32_adds=valid * 2 * D,
             reduce_bytes=valid * 2 * D * 4)
  floor = jax.jit(functools.partial(diagnose_bounds.atomics_only, S=T, D=D, Dv=D,
                                    sizes=psa.BlockSizes(), masked=True))
  rec["triton_atomics_masked_ms"] = bench_attention.median_ms(floor, (idx[0],), reps)
  log(f"triton atomics_only, masked: {rec['triton_atomics_masked_ms']:.2f} ms "
      f"({rec['f32_adds'] / rec['triton_atomics_masked_ms'] / 1e6:.0f} G f32 adds/s)")

  # The check's problem: 64 queries over 300 keys, every fourth slot invalid, a negative
  # entry, one past the keys, and a query with no valid entry.
  cq = q[:, :64]
  cidx = jax.random.randint(jax.random.key(2), (1, 64, 512), 0, 300)
  cidx = cidx.at[:, :, ::4].set(-1).at[0, 0, 1].set(-7).at[0, 1, 2].set(300).at[0, 2].set(-1)
  want = reduce_reference(cq, coeffs, cidx, 300)

  def run_one(stages, cfg):
    probe = jax.jit(functools.partial(reduce_probe, mode="reduce", stages=stages),
                    static_argnums=3)
    got = probe(cq, coeffs, cidx, 300)
    cfg["reduce_rel_err"] = max(bench_attention.rel_err(g, w) for g, w in zip(got, want))
    log(f"mode=reduce vs jnp scatter-add: rel. err. {cfg['reduce_rel_err']:.2e}")
    if not cfg["reduce_rel_err"] < 1e-5:    # f32 sums in another order: ~1e-7
      cfg["error"] = "failed its check"
      log("WRONG: this configuration is not timed")
      return
    for mode in modes:
      if mode == "reduce_only" and stages != stage_counts[0]:
        continue          # one tile buffer whatever `stages` is: timed once
      fn = jax.jit(functools.partial(reduce_probe, num_keys=T, mode=mode, stages=stages))
      ms = cfg[f"{mode}_ms"] = bench_attention.median_ms(fn, (q, coeffs, idx), reps)
      log(f"mosaic {mode:11s} {ms:8.2f} ms"
          + ("" if mode == "store" else
             f"  ({rec['f32_adds'] / ms / 1e6:.0f} G f32 adds/s, "
             f"{rec['reduce_bytes'] / ms / 1e9:.2f} TB/s reduced)"))

  gather.run_configs(rec, save, [(f"stages{stages}", f"stages={stages}",
                                  functools.partial(run_one, stages))
                                 for stages in stage_counts])


if __name__ == "__main__":
  main()
