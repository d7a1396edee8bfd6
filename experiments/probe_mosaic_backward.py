"""Can a Mosaic GPU backward reach the 10x forward+backward bar? (issue 4)

    PYTHONPATH=. python3 experiments/probe_mosaic_backward.py --lower-only     # CPU
    PYTHONPATH=. python3 experiments/probe_mosaic_backward.py [--stages N,..]   # H200

Why: forward+backward must take <= 32.3 ms at T=32K, H=64, k=2048 for 10x over `xla`; with
the Triton forward's 9.0 ms that leaves ~23 ms for the backward, whose Triton kernel takes
~39 ms (bound by its f32 atomics: 17.8 ms alone) (`attention_notes.md`). The two probes beside
this one test the Hopper-native pieces separately: `probe_mosaic_gather.py` the per-row
copies that feed wgmma, `probe_mosaic_reduce.py` bulk row reductions in place of atomics.
This script puts them together into the backward itself and times it against the Triton
backward on the same inputs, in the same process:

  delta  the first sweep: per block of 64 selected keys, S^T = K Q^T and dP^T = V dO^T, and
         delta[h] = sum_j P[h, j] dP[h, j] (= dO . O, the softmax correction; the output is not
         a residual, SPEC section 3);
  grad   the second sweep: P^T, dS^T = P^T * (dP^T - delta), then dV_rows = P^T dO and
         dK_rows = scale * dS^T Q (wgmma, into f32 tiles in shared memory, added into dK/dV
         by one bulk tensor reduction per row, `cp.reduce.async.bulk.tensor` add), and
         dQ += dS K in registers (dS from shared memory through a transposed operand).

Both are one CTA per query: a producer warpgroup copies each selected K and V row with its own
bulk copy into padded staging rows (`probe_mosaic_gather.copy_selected_rows`), the consumer
warpgroup re-lays the block out into swizzled smem and runs the wgmmas with keys as the
matmul's rows (S^T, not S), so P^T and dS^T are already the register operands that dV and dK
need. "backward" below is delta + grad + the f32 -> bf16 casts: what a custom_vjp backward
built on them would run, against the Triton backward (`_sparse_attention_bwd`, atomics).

Before timing, both kernels are checked at T = S = 1024, k = 256 (the benchmark's check):
delta against sum(dO * O), and dQ/dK/dV against the f32 reference's gradients.

Limits of the probe: G = 1, H = 64 (the wgmmas' M or K), D = Dv = 128, k a multiple of 256.
`stages` is the number of staging buffers; the dK/dV f32 tiles have one buffer (two would
exceed the 227 KiB of shared memory), so the next block's tile stores wait until this block's
reductions have read the tiles. Measured (twentieth session, H200, jax 0.11.2, `gpu_runs/gpu_mosaic_unpadded.sh`, with
ROW_PAD = 0: jax 0.11.2 refuses 8, which 0.10.2 needs): correct (rel. err. <= 2.4e-3 against
the f32 reference, <= 1.7e-4 against Triton at 32K) and 0.35x Triton's speed: delta 44.55 ms,
backward 112.58 ms against 39.34 ms, bound by the per-row copies (see probe_mosaic_gather).

Writes DIR/probe_mosaic_backward{TAG}.json (DIR defaults to
experiments/results/mosaic_gather), after every configuration.
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
import probe_mosaic_reduce as reduce_probe  # noqa: E402

MODES = ("delta", "grad")
BLOCK_K = 64          # selected keys per step: the rows of every key-major wgmma
ROW_PAD = 8           # bf16 elements after each staging row (see probe_mosaic_gather)
log = bench_attention.log


def smem_bytes(stages, kk=2048, H=64, D=128):
  """The shared memory the compiled "grad" kernel allocates at the benchmark's shape (each
  buffer rounded up to 1024 bytes, as Pallas does, plus 1024 per barrier group)."""
  def buf(nbytes):
    return -(-nbytes // 1024) * 1024
  return (buf(kk * 4) + 2 * buf(H * D * 2) + 2 * buf(H * 4)
          + 2 * buf(stages * BLOCK_K * (D + ROW_PAD) * 2) + 2 * buf(BLOCK_K * D * 2)
          + buf(BLOCK_K * H * 2) + 2 * buf(BLOCK_K * D * 4) + 4 * 1024)


def backward_probe(q, k, v, do, lse, delta, idx, *, mode: str, stages: int = 2,
                   interpret: bool = False):
  """mode="delta": f32 [B, T, H] delta; mode="grad": (dq bf16 [B, T, H, D], dk f32
  [B, S, D], dv f32 [B, S, Dv]).

  q [B, T, H, D], k [B, S, D], v [B, S, Dv], do [B, T, H, Dv] bf16 (G = 1, squeezed);
  lse f32 [B, T, H]: the forward's base-2 log-sum-exp of the base-2 logits (the Triton
  forward's residual; -inf for a row without valid entry); delta f32 [B, T, H] ("grad" only:
  "delta"'s output; None for "delta"); idx int32 [B, T, kk]. Entries of idx outside [0, S) add nothing (their slots copy
  row 0, whose K and V rows are zeroed in registers and whose reductions are predicated off).

  interpret=True runs it in Mosaic GPU's interpret mode (jax 0.10.2), which lacks
  `layout_cast`, transposed wgmma operands, register operands, `run_state` and TMA
  reductions: layouts are dropped, Q^T, dO^T, P^T and dS go to wgmma through their own smem
  buffers written from registers, dQ's products land in fresh accumulators that are added,
  and each row reduction is a read-modify-write of zero-filled outputs.
  """
  B, T, H, D = q.shape
  S, Dv = k.shape[1], v.shape[-1]
  kk = idx.shape[-1]
  if H != 64 or kk % gather.IDX_CHUNK or D != 128 or Dv != D:
    raise ValueError(f"probe shapes: {H=} must be 64, {kk=} a multiple of "
                     f"{gather.IDX_CHUNK}, {D=} and {Dv=} 128")
  if mode not in MODES:
    raise ValueError(f"mode: choose from {MODES}, got {mode!r}")
  nblocks = kk // BLOCK_K
  scale = D ** -0.5
  scale_log2 = scale * 1.4426950408889634
  key_layout = plgpu.Layout.WGMMA.reduce(1)     # one value per matmul row: a selected key
  head_layout = plgpu.Layout.WGMMA.reduce(0)    # one value per matmul column: a head
  cast = (lambda x, _layout: x) if interpret else plgpu.layout_cast

  def acc_products(*products):
    """f32 a @ b for each (shape, a, b): all wgmmas issued, then one wait for them all."""
    def run(*acc_refs):
      for acc_ref, (_, a, b) in zip(acc_refs, products):
        plgpu.wgmma(acc_ref, a, b)
      return tuple(acc_ref[...] for acc_ref in acc_refs)
    return pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for shape, _, _ in products))

  def body(idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
           delta_out_ref, idx_smem, q_smem, do_smem, lse_smem, delta_smem, k_stage, v_stage,
           k_tiled, v_tiled, ds_smem, dk_tile, dv_tile, q_t, do_t, p_t_smem, ds_n, idx_ready,
           operands_ready, loaded, consumed):
    b, t, wg = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
      for chunk in range(kk // gather.IDX_CHUNK):
        part = pl.ds(chunk * gather.IDX_CHUNK, gather.IDX_CHUNK)
        plgpu.copy_gmem_to_smem(idx_ref.at[b, t, part], idx_smem.at[part], idx_ready)
      plgpu.barrier_wait(idx_ready)

      @pl.loop(0, nblocks)
      def _block(blk):
        slot = lax.rem(blk, stages)

        @pl.when(blk >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[slot])

        gather.copy_selected_rows(idx_smem, blk * BLOCK_K, BLOCK_K, k_ref, v_ref, b,
                                  k_stage.at[slot], v_stage.at[slot], loaded.at[slot])

      for last in range(max(nblocks - stages, 0), nblocks):   # observe every release
        plgpu.barrier_wait(consumed.at[last % stages])

    @pl.when(wg == 0)
    def _consumer():
      operands = [(q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem)]
      if mode == "grad":
        operands.append((delta_ref, delta_smem))
      for i, (src, dst) in enumerate(operands):
        plgpu.copy_gmem_to_smem(src.at[b, t], dst, operands_ready.at[i])
      for i in range(len(operands)):
        plgpu.barrier_wait(operands_ready.at[i])
      plgpu.barrier_wait(idx_ready)
      if interpret:   # B operands of S^T and dP^T, transposed once
        q_t[...] = q_smem[...].T
        do_t[...] = do_smem[...].T
        plgpu.commit_smem()
      # Per-head vectors; broadcast to [keys, heads] inside the loop (as f32 [64, 64] tiles
      # they would hold ~64 registers per thread across it).
      lse = cast(lse_smem[...], head_layout)
      delta = cast(delta_smem[...], head_layout) if mode == "grad" else None

      def per_head(x):
        return lax.broadcast_in_dim(x, (BLOCK_K, H), [1])

      def step(blk, carry):
        slot = lax.rem(blk, stages)
        plgpu.barrier_wait(loaded.at[slot])
        k_rows = cast(k_stage[slot, :, pl.ds(0, D)], plgpu.Layout.WGMMA)
        v_rows = cast(v_stage[slot, :, pl.ds(0, Dv)], plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(consumed.at[slot])       # the rows are in registers now
        keys = cast(idx_smem[pl.ds(blk * BLOCK_K, BLOCK_K)], key_layout)
        valid_key = (keys >= 0) & (keys < S)
        # Invalid slots hold row 0: zero it, so a NaN there cannot reach dQ (0 * NaN).
        valid_rows = lax.broadcast_in_dim(valid_key, (BLOCK_K, D), [0])
        k_tiled[...] = jnp.where(valid_rows, k_rows, jnp.zeros_like(k_rows))
        v_tiled[...] = jnp.where(valid_rows, v_rows, jnp.zeros_like(v_rows))
        plgpu.commit_smem()                           # generic stores -> visible to wgmma

        s_t, dp_t = acc_products(
            ((BLOCK_K, H), k_tiled, q_t if interpret else plgpu.transpose_ref(q_smem, (1, 0))),
            ((BLOCK_K, H), v_tiled, do_t if interpret
             else plgpu.transpose_ref(do_smem, (1, 0))))
        valid = lax.broadcast_in_dim(valid_key, (BLOCK_K, H), [0])
        p_t = jnp.where(valid, jnp.exp2(s_t * scale_log2 - per_head(lse)), 0.0)  # [keys, heads]
        if mode == "delta":
          return carry + (p_t * dp_t).sum(axis=0)
        ds_t = (p_t * (dp_t - per_head(delta))).astype(jnp.bfloat16)
        p_t = p_t.astype(jnp.bfloat16)

        # The tiles are rewritten only after the previous block's reductions have read them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if interpret:
          p_t_smem[...] = p_t
          ds_smem[...] = ds_t
          ds_n[...] = ds_t.T
          plgpu.commit_smem()
          dv_tile[...] = acc_products(((BLOCK_K, Dv), p_t_smem, do_smem))[0]
          dk_tile[...] = acc_products(((BLOCK_K, D), ds_smem, q_smem))[0] * scale
          dq = carry + acc_products(((H, D), ds_n, k_tiled))[0]
          plgpu.commit_smem()                         # tile stores -> visible to the TMA
        else:
          # dV's and dK's tiles one after the other: each is a 64-register accumulator
          # beside dQ's.
          dv_tile[...] = acc_products(((BLOCK_K, Dv), p_t, do_smem))[0]
          dk_tile[...] = acc_products(((BLOCK_K, D), ds_t, q_smem))[0] * scale
          ds_smem[...] = ds_t
          plgpu.commit_smem()                         # tiles -> TMA, dS -> wgmma

          def accumulate(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(ds_smem, (1, 0)), k_tiled)
          dq = pl.run_state(accumulate)(plgpu.ACC.init(carry))

        reduce_probe.reduce_tile_rows(idx_smem, blk * BLOCK_K, dk_tile, dv_tile, dk_ref,
                                      dv_ref, b, S, interpret)
        return dq

      if mode == "delta":
        total = lax.fori_loop(0, nblocks, step, cast(jnp.zeros((H,), jnp.float32), head_layout))
        delta_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(delta_smem, delta_out_ref.at[b, t])
      else:
        dq = lax.fori_loop(0, nblocks, step, cast(jnp.zeros((H, D), jnp.float32),
                                                  plgpu.Layout.WGMMA))
        q_smem[...] = (dq * scale).astype(jnp.bfloat16)   # every wgmma reading q is done
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, t])
      plgpu.wait_smem_to_gmem(0)

  def entry(*refs):
    tiles = plgpu.SMEM((BLOCK_K, D), jnp.float32) if mode == "grad" else None
    pl.run_scoped(
        lambda *scratch: body(*refs, *scratch),
        plgpu.SMEM((kk,), jnp.int32),
        gather._swizzled((H, D)),
        gather._swizzled((H, Dv)),
        plgpu.SMEM((H,), jnp.float32),
        plgpu.SMEM((H,), jnp.float32),
        plgpu.SMEM((stages, BLOCK_K, D + ROW_PAD), jnp.bfloat16),
        plgpu.SMEM((stages, BLOCK_K, Dv + ROW_PAD), jnp.bfloat16),
        gather._swizzled((BLOCK_K, D)),
        gather._swizzled((BLOCK_K, Dv)),
        gather._swizzled((BLOCK_K, H)) if mode == "grad" else None,
        tiles,                                        # 512-byte rows: the TMA's alignment
        tiles,
        gather._swizzled((D, H)) if interpret else None,
        gather._swizzled((Dv, H)) if interpret else None,
        gather._swizzled((BLOCK_K, H)) if interpret else None,
        gather._swizzled((H, BLOCK_K)) if interpret else None,
        plgpu.Barrier(num_arrivals=kk // gather.IDX_CHUNK),   # one arrival per index copy
        plgpu.Barrier(num_arrivals=1, num_barriers=4),
        plgpu.Barrier(num_arrivals=2 * BLOCK_K, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )

  # Refs: the inputs, delta, then dq, dk, dv, delta_out; those a mode lacks are None.
  args = (idx, q, k, v, do, lse)
  name = f"probe_mosaic_backward_{mode}"
  mesh = plgpu.Mesh(grid=(T, B), grid_names=("t", "b"), num_threads=2, thread_name="wg")
  if mode == "delta":
    delta_out = pl.kernel(
        lambda *refs: entry(*refs[:-1], None, None, None, None, refs[-1]),
        out_type=jax.ShapeDtypeStruct((B, T, H), jnp.float32), mesh=mesh, name=name,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=gather._interpret_params() if interpret else None)(*args)
    return delta_out
  dq_type = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
  if interpret:     # the interpreter zero-fills fresh outputs: dK/dV start at zero
    rows = jax.ShapeDtypeStruct((B, S, D), jnp.float32)
    return pl.kernel(lambda *refs: entry(*refs, None), out_type=(dq_type, rows, rows),
                     mesh=mesh, name=name,
                     interpret=gather._interpret_params(uninitialized_memory="zero"))(
                         *args, delta)
  # Compiled: dK/dV are zeroed refs that the reductions add into (plgpu.kernel has no
  # input-output aliasing; see probe_mosaic_reduce).
  dk = jax.new_ref(jnp.zeros((B, S, D), jnp.float32))
  dv = jax.new_ref(jnp.zeros((B, S, Dv), jnp.float32))

  def with_refs(*refs):   # inputs..., dk, dv, dq
    *ins, dk_ref, dv_ref, dq_ref = refs
    entry(*ins, dq_ref, dk_ref, dv_ref, None)
  dq = pl.kernel(with_refs, out_type=dq_type, mesh=mesh, name=name,
                 compiler_params=plgpu.CompilerParams(approx_math=True))(*args, delta, dk, dv)
  return dq, jax.freeze(dk), jax.freeze(dv)


def mosaic_backward(q, k, v, idx, lse, do, *, stages: int = 2, interpret: bool = False):
  """The backward a custom_vjp would run on these kernels: (dq, dk, dv) in the inputs' dtype.
  Shapes as `backward_probe` (G = 1 squeezed)."""
  delta = backward_probe(q, k, v, do, lse, None, idx, mode="delta", stages=stages,
                         interpret=interpret)
  dq, dk, dv = backward_probe(q, k, v, do, lse, delta, idx, mode="grad", stages=stages,
                              interpret=interpret)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def reference_backward(q, k, v, idx, do):
  """f32 gradients (dq, dk, dv) of `hs.sparse_attention_reference` (G = 1 squeezed), and the
  f32 output."""
  import hyscale_jax as hs
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  out, vjp = jax.vjp(
      lambda q, k, v: hs.sparse_attention_reference(q, k[:, :, None], v[:, :, None], idx), *f32)
  return vjp(do.astype(jnp.float32)), out


def lowering_survey() -> dict[str, str]:
  """Lower both kernels for CUDA at a small shape; no GPU needed."""
  B, T, H, D, S, kk = 1, 4, 64, 128, 256, 512
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  kv = jax.random.normal(keys[1], (B, S, D), jnp.bfloat16)
  idx = jax.random.randint(keys[2], (B, T, kk), 0, S)
  lse = jnp.zeros((B, T, H), jnp.float32)
  return {f"{mode}, stages={stages}": gather._lowers(
              functools.partial(backward_probe, mode=mode, stages=stages),
              q, kv, kv, q, lse, None if mode == "delta" else lse, idx)
          for mode in MODES for stages in (1, 2)}


# ------------------------------------------------------------------------ GPU: timing


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  gather.add_run_arguments(ap, "the kernels")
  ap.add_argument("--stages", default="2,1",
                  help="comma-separated staging-buffer counts to time (default 2,1)")
  args = ap.parse_args()
  stage_counts = gather.parse_stages(ap, args.stages, smem_bytes)
  gather.record_probe(os.path.join(args.out, f"probe_mosaic_backward{args.tag}.json"),
                      None if args.no_survey else lowering_survey,
                      None if args.lower_only else functools.partial(
                          time_on_gpu, T=args.T, reps=args.reps, stage_counts=stage_counts))


def time_on_gpu(rec, save, *, T, reps, stage_counts):
  """Adds the timings to `rec`, calling `save()` after each configuration."""
  from pallas_kernels import sparse_attention as psa

  H, D, kk = 64, 128, 2048
  cfg = psa._Config(scale=D ** -0.5, interpret=False, deterministic=False,
                    sizes=psa.BlockSizes())
  triton_fwd = jax.jit(lambda q, k, v, idx: psa._sparse_attention_fwd(q, k, v, idx, cfg))
  triton_bwd = jax.jit(lambda res, do: psa._sparse_attention_bwd(cfg, res, do)[:3])

  def squeeze(res):   # Triton's residuals (q, k, v, idx, lse), G = 1 squeezed
    q, k4, v4, idx, lse = res
    return q, k4[:, :, 0], v4[:, :, 0], idx, lse

  # The check: the benchmark's (T = S = 1024, k = 256), against the f32 reference.
  q, k4, v4, idx, do = bench_attention.make_inputs(1, 1024, H, D, D, 256, seed=1)
  _, res = triton_fwd(q, k4, v4, idx)
  (want_dq, want_dk, want_dv), want_out = reference_backward(q, k4[:, :, 0], v4[:, :, 0], idx,
                                                             do)
  small = (squeeze(res), do, (want_dq, want_dk, want_dv),
           jnp.sum(do.astype(jnp.float32) * want_out, axis=-1))

  q, k4, v4, idx, do = bench_attention.make_inputs(1, T, H, D, D, kk)
  out, res = triton_fwd(q, k4, v4, idx)
  flops = bench_attention.sparse_flops(T, H, D, D, kk)
  rec.update(T=T, H=H, D=D, k=kk, forward_flops=flops, backward_flops=2.5 * flops)
  rec["triton_forward_ms"] = bench_attention.median_ms(triton_fwd, (q, k4, v4, idx), reps)
  rec["triton_backward_ms"] = bench_attention.median_ms(triton_bwd, (res, do), reps)
  xla_fwd_bwd = bench_attention.programs("xla")[1]
  rec["xla_forward_backward_ms"] = bench_attention.median_ms(xla_fwd_bwd, (q, k4, v4, idx, do),
                                                             reps)
  triton_grads = triton_bwd(res, do)
  log(f"triton forward {rec['triton_forward_ms']:.2f} ms, backward "
      f"{rec['triton_backward_ms']:.2f} ms ({2.5 * flops / rec['triton_backward_ms'] / 1e9:.0f}"
      f" TFLOP/s); xla forward+backward {rec['xla_forward_backward_ms']:.1f} ms")
  gather.run_configs(rec, save, [
      (f"stages{stages}", f"stages={stages}",
       lambda cfg, stages=stages: _check_and_time(cfg, stages, small, squeeze(res), do,
                                                  triton_grads, reps, rec))
      for stages in stage_counts])


def _check_and_time(cfg, stages, small, res, do, triton_grads, reps, rec):
  """One configuration: its checks (small problem vs the f32 reference; full problem vs the
  Triton backward), then, if they pass, its timings, into `cfg`."""
  rel_err = bench_attention.rel_err
  (q, k, v, idx, lse), small_do, want, want_delta = small
  delta = backward_probe(q, k, v, small_do, lse, None, idx, mode="delta", stages=stages)
  cfg["check_delta_max_abs_err"] = float(jnp.max(jnp.abs(delta - want_delta)))
  grads = mosaic_backward(q, k, v, idx, lse, small_do, stages=stages)
  cfg["check_rel_err_dq_dk_dv"] = [rel_err(a.astype(jnp.float32), b)
                                   for a, b in zip(grads, want)]
  q, k, v, idx, lse = res
  grads = mosaic_backward(q, k, v, idx, lse, do, stages=stages)
  cfg["vs_triton_rel_err_dq_dk_dv"] = [
      rel_err(a.astype(jnp.float32), b.reshape(a.shape).astype(jnp.float32))
      for a, b in zip(grads, triton_grads)]
  log(f"check vs f32 reference (T=1024, k=256): delta max abs err "
      f"{cfg['check_delta_max_abs_err']:.1e}, rel err dq/dk/dv "
      + " ".join(f"{e:.1e}" for e in cfg["check_rel_err_dq_dk_dv"])
      + "; at full size vs Triton: " + " ".join(f"{e:.1e}" for e in cfg["vs_triton_rel_err_dq_dk_dv"]))
  # The benchmark's tolerance (bench_attention.check); delta's scale is ~|dO||O| ~ 10.
  ok = (cfg["check_delta_max_abs_err"] < 1e-2 and max(cfg["check_rel_err_dq_dk_dv"]) < 3e-2
        and max(cfg["vs_triton_rel_err_dq_dk_dv"]) < 3e-2)
  if not ok:
    log("WRONG: this configuration is not timed")
    cfg["error"] = "failed its check"
    return
  args = (q, k, v, idx, lse, do)
  for what, fn in (("delta", lambda q, k, v, idx, lse, do: backward_probe(
                        q, k, v, do, lse, None, idx, mode="delta", stages=stages)),
                   ("backward", functools.partial(mosaic_backward, stages=stages))):
    cfg[f"{what}_ms"] = bench_attention.median_ms(jax.jit(fn), args, reps)
  cfg["grad_ms"] = cfg["backward_ms"] - cfg["delta_ms"]
  composed = rec["triton_forward_ms"] + cfg["backward_ms"]
  cfg["composed_forward_backward_ms"] = composed
  cfg["composed_speedup_vs_xla"] = rec["xla_forward_backward_ms"] / composed
  log(f"mosaic delta {cfg['delta_ms']:.2f} ms, grad ~{cfg['grad_ms']:.2f} ms (the difference), "
      f"backward {cfg['backward_ms']:.2f} ms "
      f"({rec['backward_flops'] / cfg['backward_ms'] / 1e9:.0f} TFLOP/s, "
      f"{rec['triton_backward_ms'] / cfg['backward_ms']:.2f}x Triton's); Triton forward + this "
      f"backward: {composed:.2f} ms, {cfg['composed_speedup_vs_xla']:.2f}x xla's forward+backward")


if __name__ == "__main__":
  main()
