"""Can a Mosaic GPU kernel gather the selected K/V rows fast enough on Hopper? (issue 4)

    PYTHONPATH=. python3 experiments/probe_mosaic_gather.py --lower-only      # CPU
    PYTHONPATH=. python3 experiments/probe_mosaic_gather.py [--modes M,..] [--configs BK:ST:C,..]
                                                            # H200 (see --help)

Why: the 10x forward+backward bar needs the sparse-attention matmuls to run ~1.26x faster than
the Triton forward's 236 TFLOP/s, everywhere (`attention_notes.md`, seventeenth session). The
Hopper-native route is Mosaic GPU (wgmma fed from swizzled shared memory by asynchronous
copies), but on sm_90 Mosaic GPU has no copy that gathers rows into that layout:
`--lower-only` shows, by lowering small kernels for CUDA on this machine, which forms
jax's Mosaic GPU accepts:

  per-row copy into tiled, swizzled smem  refused (slices of a tiled ref must be whole tiles)
  per-row copy into plain (untiled) smem  lowers
  wgmma reading a plain smem operand      refused (wgmma's operands must be tiled/swizzled)
  register gather `k_ref[idx_vector, :]`  refused (no array indexers)
  TMA gather (`tile::gather4`)            sm_100 only (PTX ISA); CP_ASYNC gather unimplemented

What is left is a staging design: a producer warpgroup copies each selected row with its own
asynchronous copy into a plain smem buffer, and the consumer re-lays the tile out into
swizzled smem through registers before its wgmma. The staging rows are padded by 16 bytes
(272 B): unpadded 256-byte rows all start on the same bank, so the consumer's loads in the
wgmma register layout (8 rows x 16 bytes per warp instruction) would conflict 8 ways, and
jax's Mosaic GPU refuses to lower that ("Failed to synthesize a transfer pattern that avoids
bank conflicts"). The padded rows are only 16-byte aligned, which tensor TMA does not accept
for its shared-memory address (128 bytes, per the CUDA guide's table); so each row goes by
the plain bulk copy (`cp.async.bulk`, 16-byte alignment), which Mosaic GPU emits for a
contiguous slice when the copy promises to stay in bounds (`OOBFillMode.PROMISE_IN_BOUNDS`).
Invalid slots therefore copy row 0 and are masked. On the H200 this script times the design
at the benchmark's shape (G=1, H=64, D=Dv=128, k=2048, bf16), one or two queries per CTA, in
five modes:

  arrive     no copy: the producer only arrives on the buffer barrier as often as the copies
             would. In Pallas every copy is a warpgroup-wide arrival (each of its 128 threads
             arrives with 1/128 of the bytes, after a warpgroup barrier), where a CUDA producer
             would arrive once per buffer. This mode's arrivals skip that warpgroup barrier,
             so it is a lower bound on the arrivals' share of `tma`;
  tma        the per-row copies alone (the consumer only waits and releases the buffers);
  relayout   plus the register re-layout of K and V into swizzled smem;
  matmul     plus the forward's two matmuls per block, S = Q K^T and acc += bf16(S) V
             (no softmax: that is the matmul pipeline's rate, compared with the forward's);
  forward    the whole forward: masking of invalid slots, online softmax in base 2, output
             and log-sum-exp as the Triton forward writes them, on the benchmark's indices
             with their -1 padding (invalid slots copy row 0; their logits are masked and
             their value rows zeroed in registers, so a NaN there cannot leak).

next to the Triton kernels on the same indices: the forward (impl="pallas") and its gather
floor (diagnose_bounds.gather_only). The indices are bench_attention's causal random ones with
the -1 padding of the first k queries clamped to key 0 for the first four modes, so every
slot is a real copy (the gather floor gets the same), and unchanged for `forward` and the
Triton forward. Before timing, `matmul` is checked against the same arithmetic in jnp and
`forward` against an f32 reference (output and log-sum-exp), on 64 queries including four
padded ones. A probe, not a library kernel: a consumer warpgroup per query, so the re-layout
overlaps the matmuls only across the two queries of a CTA (`--configs ...:2`); G = 1, H = 64,
D = Dv only. Each configuration's failure (a compile refusal, a device fault) is recorded
and the next one tried.

Measured (twentieth session, H200, jax 0.11.2, `experiments/results/mosaic_gather/`): jax
0.11.2 refuses row_pad=8 ("Stride 136 is not divisible by 128") and lowers row_pad 0 and 64;
unpadded, `arrive` 5.35 ms, `tma` 33.05 ms, `relayout` 37.83, `matmul` 43.44 against the
Triton gather floor's 4.13 ms and forward's 9.01 in the same run (`gpu_mosaic_stages/`), and
`forward` 42.69 ms against the Triton forward's 9.13 in another (`gpu_mosaic_unpadded/`): the
per-row copies alone cost more than the whole Triton forward, so this design cannot beat it.

Writes DIR/probe_mosaic_gather{TAG}.json (DIR defaults to experiments/results/mosaic_gather),
after every configuration.
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
MODES = ("arrive", "tma", "relayout", "matmul", "forward")
BLOCK_K = 64          # selected keys per pipeline step
STAGES = 2            # staging buffers in flight
IDX_CHUNK = 256       # a TMA box holds at most 256 elements per dimension


log = bench_attention.log
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on the H200 (opt-in maximum)


def smem_bytes(block_k, stages, consumers, row_pad=8, kk=2048, H=64, D=128):
  """An upper estimate of the shared memory the compiled probe allocates: Pallas rounds every
  buffer up to 1024 bytes and reserves 2048 for the softmax's reductions; 1024 more per
  barrier group."""
  def buf(nbytes):
    return -(-nbytes // 1024) * 1024
  n = consumers
  return (buf(n * kk * 4) + buf(n * H * D * 2) + buf(n * H * 4)
          + 2 * buf(n * stages * block_k * (D + row_pad) * 2) + 2 * buf(n * block_k * D * 2)
          + 2048 + 4 * 1024)


def _swizzled(shape, dtype=jnp.bfloat16):
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def copy_selected_rows(idx_smem, first, block_k, k_ref, v_ref, b, k_dst, v_dst, barrier):
  """The producer's step: one bulk copy per selected key, of K row idx_smem[first + j] into
  k_dst[j, :D] and of its V row into v_dst[j, :Dv], for j < block_k, all arriving on
  `barrier` (which expects 2 * block_k arrivals). k_ref [B, S, D], v_ref [B, S, Dv] in gmem;
  k_dst [block_k, D + pad], v_dst [block_k, Dv + pad] plain smem. Entries outside [0, S) copy
  row 0 instead, so that every copy can promise to stay in bounds (what lets Mosaic GPU use
  the plain bulk copy); the consumer masks them."""
  S, D, Dv = k_ref.shape[1], k_ref.shape[2], v_ref.shape[2]

  @pl.loop(0, block_k)
  def _row(j):
    row = idx_smem[first + j]
    row = jnp.where((row >= 0) & (row < S), row, 0)
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(row, 1)], k_dst.at[pl.ds(j, 1), pl.ds(0, D)],
                            barrier, oob_mode=in_bounds)
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(row, 1)], v_dst.at[pl.ds(j, 1), pl.ds(0, Dv)],
                            barrier, oob_mode=in_bounds)


def gather_probe(q, k, v, idx, *, mode: str, row_pad: int = 8, block_k: int = BLOCK_K,
                 stages: int = STAGES, consumers: int = 1, interpret: bool = False):
  """The probe kernel: (bf16 [B, T, H, Dv], f32 [B, T, H]).

  q [B, T, H, D], k [B, S, D], v [B, S, Dv] (G = 1, squeezed), idx int32 [B, T, kk];
  H = 64 (one warpgroup's wgmma rows), D == Dv, kk a multiple of 256. `row_pad`: bf16 elements
  of padding after each staging row. `consumers`: queries per CTA, one consumer warpgroup
  each (2: one's softmax can run under the other's matmuls, as in FlashAttention-3), served by
  one producer warpgroup; T must be a multiple. Modes (see the module docstring): "arrive",
  "tma" and "relayout" return zeros, "matmul" the sum over blocks of bf16(Q K_blk^T) V_blk
  (both leave the statistic unwritten); "forward" returns the attention output and the
  base-2 log-sum-exp of the base-2 logits, as the Triton forward (rows with no valid entry:
  zeros and -inf).

  Entries of idx outside [0, S) copy row 0 instead (every copy promises to stay in bounds,
  which is what lets Mosaic GPU use the plain bulk copy); "forward" masks their logits and
  zeroes their value rows.

  interpret=True runs it in Mosaic GPU's interpret mode on CPU (jax 0.10.2), which lacks
  `layout_cast`, a transposed wgmma operand, a register operand and `run_state`: layouts are
  dropped (they do not change values), K^T and P go to wgmma through their own smem buffers
  written from registers, and P V lands in a fresh accumulator that is then added.
  Everything else (the copies, barriers, masking, softmax) is the compiled kernel's.
  """
  B, T, H, D = q.shape
  S, Dv = k.shape[1], v.shape[-1]
  kk = idx.shape[-1]
  if H != 64 or kk % IDX_CHUNK or kk % block_k or D != Dv or D % 64 or T % consumers:
    raise ValueError(f"probe shapes: {H=} must be 64, {kk=} a multiple of {IDX_CHUNK} and "
                     f"{block_k=}, {D=} == {Dv=} a multiple of 64, {T=} of {consumers=}")
  nblocks = kk // block_k
  scale_log2 = D ** -0.5 * 1.4426950408889634           # logits in base 2: exp2, log2
  mask_value = -0.7 * float(np.finfo(np.float32).max)   # finite, as the Triton kernel's
  rows_layout = plgpu.Layout.WGMMA.reduce(1)             # one value per head (matmul row)
  cols_layout = plgpu.Layout.WGMMA.reduce(0)             # one value per selected key
  cast = (lambda x, _layout: x) if interpret else plgpu.layout_cast
  # The 40/232 register split of jax's FlashAttention-3 example assumes three warpgroups; with
  # two (one consumer) every thread already has ~256 registers and an "increase" to 232 would
  # be a decrease, so the split is only asked for with two consumers.
  split_registers = consumers == 2 and not interpret

  def body(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, idx_smem, q_smem, lse_smem, k_stage,
           v_stage, k_tiled, v_tiled, k_transposed, p_smem, idx_ready, q_ready, loaded,
           consumed):
    # Warpgroups 0 .. consumers-1 each own one query (t = program * consumers + warpgroup) and
    # its buffers; warpgroup `consumers` copies every consumer's rows. Buffer (c, slot) of a
    # consumer c has barriers loaded/consumed.at[c * stages + slot].
    b, program = lax.axis_index("b"), lax.axis_index("t")
    wg = lax.axis_index("wg")

    @pl.when(wg == consumers)
    def _producer():
      if split_registers:
        plgpu.set_max_registers(40, action="decrease")
      for c in range(consumers):     # each consumer waits on its idx_ready too ("forward")
        for chunk in range(kk // IDX_CHUNK):
          plgpu.copy_gmem_to_smem(
              idx_ref.at[b, program * consumers + c, pl.ds(chunk * IDX_CHUNK, IDX_CHUNK)],
              idx_smem.at[c, pl.ds(chunk * IDX_CHUNK, IDX_CHUNK)], idx_ready.at[c])
      for c in range(consumers):
        plgpu.barrier_wait(idx_ready.at[c])

      @pl.loop(0, nblocks)
      def _block(blk):
        slot = lax.rem(blk, stages)
        for c in range(consumers):
          buf = c * stages + slot

          @pl.when(blk >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[buf])

          if mode == "arrive":   # the copies' barrier arrivals alone, no copy
            @pl.loop(0, 2 * block_k)
            def _arrival(_):
              plgpu.barrier_arrive(loaded.at[buf])
            continue

          copy_selected_rows(idx_smem.at[c], blk * block_k, block_k, k_ref, v_ref, b,
                             k_stage.at[c, slot], v_stage.at[c, slot], loaded.at[buf])

      # Observe the last releases too, so that every phase of `consumed` has been waited on.
      for last in range(max(nblocks - stages, 0), nblocks):
        for c in range(consumers):
          plgpu.barrier_wait(consumed.at[c * stages + last % stages])

    @pl.when(wg < consumers)
    def _consumer():
      if split_registers:
        plgpu.set_max_registers(232, action="increase")
      t = program * consumers + wg
      my_q, my_idx, my_lse = q_smem.at[wg], idx_smem.at[wg], lse_smem.at[wg]
      my_k, my_v = k_tiled.at[wg], v_tiled.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, t], my_q, q_ready.at[wg])
      plgpu.barrier_wait(q_ready.at[wg])
      plgpu.barrier_wait(idx_ready.at[wg])
      acc = cast(jnp.zeros((H, Dv), jnp.float32), plgpu.Layout.WGMMA)
      m = cast(jnp.full((H,), mask_value, jnp.float32), rows_layout)
      l = cast(jnp.zeros((H,), jnp.float32), rows_layout)

      def step(blk, carry):
        acc, m, l = carry
        slot = lax.rem(blk, stages)
        buf = wg * stages + slot
        plgpu.barrier_wait(loaded.at[buf])
        if mode in ("arrive", "tma"):
          plgpu.barrier_arrive(consumed.at[buf])
          return acc, m, l
        k_rows = cast(k_stage[wg, slot, :, pl.ds(0, D)], plgpu.Layout.WGMMA)
        v_rows = cast(v_stage[wg, slot, :, pl.ds(0, Dv)], plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(consumed.at[buf])      # the rows are in registers now
        if mode == "forward":   # invalid slots hold row 0: zero their values (0 * NaN)
          keys = cast(my_idx[pl.ds(blk * block_k, block_k)], rows_layout)
          valid_rows = lax.broadcast_in_dim((keys >= 0) & (keys < S), v_rows.shape, [0])
          v_rows = jnp.where(valid_rows, v_rows, jnp.zeros_like(v_rows))
        if interpret:
          k_transposed.at[wg][...] = k_rows.T
        else:
          my_k[...] = k_rows
        my_v[...] = v_rows
        plgpu.commit_smem()                         # generic stores -> visible to wgmma
        if mode == "relayout":
          return acc, m, l

        def scores(s_ref):
          plgpu.wgmma(s_ref, my_q,
                      k_transposed.at[wg] if interpret else plgpu.transpose_ref(my_k, (1, 0)))
          return s_ref[...]
        s = pl.run_scoped(scores, plgpu.ACC((H, block_k), jnp.float32))
        if mode == "matmul":
          p = s
        else:  # forward: online softmax in base 2 over the valid slots
          keys = cast(my_idx[pl.ds(blk * block_k, block_k)], cols_layout)
          valid = lax.broadcast_in_dim((keys >= 0) & (keys < S), (H, block_k), [1])
          s = jnp.where(valid, s * scale_log2, mask_value)
          m_next = jnp.maximum(m, s.max(axis=1))
          p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
          correction = jnp.exp2(m - m_next)
          l = l * correction + p.sum(axis=1)
          m = m_next
          acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])

        if interpret:   # wgmma's A from smem, and no run_state: a fresh accumulator, added
          p_smem.at[wg][...] = p.astype(jnp.bfloat16)
          plgpu.commit_smem()

          def product(pv_ref):
            plgpu.wgmma(pv_ref, p_smem.at[wg], my_v)
            return pv_ref[...]
          return acc + pl.run_scoped(product, plgpu.ACC((H, Dv), jnp.float32)), m, l

        def accumulate(acc_ref):
          plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), my_v)
        return pl.run_state(accumulate)(plgpu.ACC.init(acc)), m, l

      acc, m, l = lax.fori_loop(0, nblocks, step, (acc, m, l))
      if mode == "forward":
        nonempty = l > 0.0
        l_safe = jnp.where(nonempty, l, 1.0)
        acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        my_lse[...] = jnp.where(nonempty, m + jnp.log2(l_safe), -jnp.inf)
      my_q[...] = acc.astype(jnp.bfloat16)          # D == Dv: reuse the query's tile
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, t])
      if mode == "forward":
        plgpu.copy_smem_to_gmem(my_lse, lse_ref.at[b, t])
      plgpu.wait_smem_to_gmem(0)

  def entry(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    n = consumers
    pl.run_scoped(
        lambda *scratch: body(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch),
        plgpu.SMEM((n, kk), jnp.int32),
        _swizzled((n, H, D)),
        plgpu.SMEM((n, H), jnp.float32),
        plgpu.SMEM((n, stages, block_k, D + row_pad), jnp.bfloat16),
        plgpu.SMEM((n, stages, block_k, Dv + row_pad), jnp.bfloat16),
        _swizzled((n, block_k, D)),
        _swizzled((n, block_k, Dv)),
        _swizzled((n, D, block_k)) if interpret else None,
        _swizzled((n, H, block_k)) if interpret else None,
        plgpu.Barrier(num_arrivals=kk // IDX_CHUNK, num_barriers=n),   # one per copy
        plgpu.Barrier(num_arrivals=1, num_barriers=n),
        plgpu.Barrier(num_arrivals=2 * block_k, num_barriers=n * stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=n * stages),
        collective_axes="wg",
    )

  return plgpu.kernel(
      entry, out_type=(jax.ShapeDtypeStruct((B, T, H, Dv), jnp.bfloat16),
                       jax.ShapeDtypeStruct((B, T, H), jnp.float32)),
      grid=(T // consumers, B), grid_names=("t", "b"), num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret_params() if interpret else None,
  )(idx, q, k, v)


def _interpret_params(**overrides):
  # A private module: imported only when interpreting, so the GPU path does not depend on it.
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams(detect_races=True, **overrides)


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
  add_run_arguments(ap, "the gather forms and the probe")
  ap.add_argument("--configs", default=f"{BLOCK_K}:{STAGES}:1",
                  help="comma-separated BLOCK_K:STAGES:CONSUMERS triples to time (default "
                       f"{BLOCK_K}:{STAGES}:1; BLOCK_K 64 or 128: the register tile needs 64 "
                       "rows; CONSUMERS 1 or 2 queries per CTA)")
  ap.add_argument("--modes", default=",".join(MODES),
                  help=f"comma-separated subset of {MODES} to time (default all)")
  args = ap.parse_args()
  modes = parse_modes(ap, args.modes, MODES)
  try:
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    if not all(len(c) == 3 and c[0] in (64, 128) and c[1] >= 1 and c[2] in (1, 2)
               for c in configs):
      raise ValueError
  except ValueError:
    ap.error("--configs: BLOCK_K:STAGES:CONSUMERS triples, BLOCK_K in (64, 128), CONSUMERS in "
             f"(1, 2), got {args.configs!r}")
  for c in configs:
    if smem_bytes(*c) > SMEM_LIMIT:
      ap.error(f"--configs {':'.join(map(str, c))} needs up to {smem_bytes(*c)} bytes of "
               f"shared memory, over the H200's {SMEM_LIMIT} per CTA")

  record_probe(os.path.join(args.out, f"probe_mosaic_gather{args.tag}.json"),
               None if args.no_survey else lowering_survey,
               None if args.lower_only else functools.partial(
                   time_on_gpu, T=args.T, reps=args.reps, modes=modes, configs=configs))


def add_run_arguments(ap, lowered: str, no_survey: bool = True):
  """The arguments every Mosaic GPU probe takes: --lower-only (help: "only lower `lowered`
  for CUDA"), --no-survey (where `no_survey`), --T, --reps, --out, --tag."""
  ap.add_argument("--lower-only", action="store_true",
                  help=f"only lower {lowered} for CUDA (runs on CPU)")
  if no_survey:
    ap.add_argument("--no-survey", action="store_true", help="skip the lowering survey")
  ap.add_argument("--T", type=int, default=32768, help="T = S (default 32768)")
  ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
  ap.add_argument("--out", default=os.path.join(RESULTS, "mosaic_gather"),
                  help="directory for the JSON record")
  ap.add_argument("--tag", default="", help="suffix of the record's file name")


def parse_stages(ap, text, smem_bytes):
  """--stages: comma-separated buffer counts >= 1 whose `smem_bytes(count)` fits a CTA, or
  the parser's error."""
  try:
    counts = [int(x) for x in text.split(",")]
    if not counts or min(counts) < 1:
      raise ValueError
  except ValueError:
    ap.error(f"--stages: comma-separated counts >= 1, got {text!r}")
  for count in counts:
    if smem_bytes(count) > SMEM_LIMIT:
      ap.error(f"--stages {count} needs {smem_bytes(count)} bytes of shared memory, over the "
               f"H200's {SMEM_LIMIT} per CTA")
  return counts


def parse_modes(ap, text, choices):
  """--modes: a comma-separated, non-empty subset of `choices`, or the parser's error."""
  modes = [m for m in text.split(",") if m]
  if not modes or set(modes) - set(choices):
    ap.error(f"--modes: choose from {choices}, got {text!r}")
  return modes


def record_probe(path, survey, timing):
  """A Mosaic GPU probe's run: the lowering `survey()` (a dict, or None to skip), then
  `timing(rec, save)` on the GPU (None: lowering only), writing the record `rec` to the JSON
  file `path` after every configuration (`save`), so that a time limit keeps what was
  measured."""
  if timing is not None and jax.devices()[0].platform != "gpu":
    sys.exit("timing needs the GPU; on CPU use --lower-only")
  rec = {"jax": jax.__version__, "device": str(jax.devices()[0])}
  log(f"jax {rec['jax']} on {rec['device']}")
  if survey is not None:
    rec["lowering"] = survey()
    for form, result in rec["lowering"].items():
      log(f"  {form:45s} {result}")
  os.makedirs(os.path.dirname(path), exist_ok=True)

  def save():
    with open(path, "w") as f:
      json.dump(rec, f, indent=1)

  if timing is not None:
    timing(rec, save)
  save()
  log(f"wrote {path}")


def run_configs(rec, save, configs):
  """Runs each configuration of a probe on the GPU: `configs` holds (name, description,
  run_one) triples; run_one(cfg) fills the dict rec["configs"][name]. A failure (a compile
  refusal, a device fault) is recorded as cfg["error"] and the next configuration runs;
  `save()` writes the record after each."""
  rec["configs"] = {}
  save()
  for name, description, run_one in configs:
    cfg = rec["configs"][name] = {}
    log(f"--- {description}")
    try:
      run_one(cfg)
    except Exception as e:  # noqa: BLE001 -- record it: a compile refusal or a device fault
      cfg["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      log(f"FAILED: {cfg['error'][:500]}")
    save()


def forward_reference(q, k, v, idx, rows):
  """f32 output [B, R, H, Dv] and base-2 log-sum-exp [B, R, H] of the queries `rows`."""
  q, idx = q[:, rows].astype(jnp.float32), idx[:, rows]
  S, D = k.shape[1], q.shape[-1]
  valid = (idx >= 0) & (idx < S)
  safe = jnp.where(valid, idx, 0)
  kg = jax.vmap(lambda kb, ib: kb[ib])(k, safe).astype(jnp.float32)   # [B, R, kk, D]
  vg = jax.vmap(lambda vb, ib: vb[ib])(v, safe).astype(jnp.float32)
  vg = jnp.where(valid[..., None], vg, 0.0)        # invalid slots contribute nothing
  s = jnp.einsum("brhd,brjd->brhj", q, kg) * (D ** -0.5 * 1.4426950408889634)
  s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp2(s - m)
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("brhj,brje->brhe", p, vg) / jnp.where(l > 0, l, 1.0)[..., None]
  return out, jnp.where(l > 0, m[..., 0] + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def time_on_gpu(rec, save, *, T, reps, modes, configs):
  """Adds the timings to `rec`, calling `save()` after each configuration."""
  import diagnose_bounds  # noqa: E402 -- GPU-only import (its Triton helpers)
  from pallas_kernels import sparse_attention as psa
  import hyscale_jax as hs

  H, D, kk = 64, 128, 2048
  q, k4, v4, idx, _ = bench_attention.make_inputs(1, T, H, D, D, kk)
  k, v = k4[:, :, 0], v4[:, :, 0]
  dense_idx = jnp.maximum(idx, 0)       # tma/relayout/matmul: every slot a real row
  # FLOPs by SPEC section 5: "matmul" runs every slot of dense_idx (k_eff = k), "forward"
  # the valid ones of idx (k_eff averaged), as the Triton forward.
  rec.update(T=T, H=H, D=D, k=kk, row_pad=8,
             matmul_flops=2 * T * H * kk * (D + D),
             forward_flops=bench_attention.sparse_flops(T, H, D, D, kk),
             gather_bytes=T * kk * 2 * D * 2)
  rate = {"matmul": rec["matmul_flops"], "forward": rec["forward_flops"]}

  sizes = psa.BlockSizes()
  gather_floor = jax.jit(functools.partial(diagnose_bounds.gather_only, sizes=sizes))
  rec["triton_gather_only_ms"] = bench_attention.median_ms(
      gather_floor, (k[0], v[0], dense_idx[0]), reps)
  fwd = jax.jit(lambda q, k, v, idx: hs.sparse_attention(q, k, v, idx, impl="pallas"))
  rec["triton_forward_ms"] = bench_attention.median_ms(fwd, (q, k4, v4, idx), reps)
  log(f"triton gather_only {rec['triton_gather_only_ms']:8.2f} ms (all slots valid); triton "
      f"forward {rec['triton_forward_ms']:.2f} ms "
      f"({rate['forward'] / rec['triton_forward_ms'] / 1e9:.0f} TFLOP/s)")

  rows = np.sort(np.concatenate([np.arange(4), np.random.RandomState(0).choice(
      np.arange(4, T), 60, replace=False)]))
  def run_one(block_k, stages, consumers, cfg):
    probe = functools.partial(gather_probe, block_k=block_k, stages=stages,
                              consumers=consumers)
    _check_and_time(cfg, probe, q, k, v, idx, dense_idx, rows, modes, reps, rate,
                    rec["gather_bytes"])

  run_configs(rec, save, [
      (f"bk{block_k}_s{stages}_c{consumers}",
       f"block_k={block_k}, stages={stages}, consumers={consumers}",
       functools.partial(run_one, block_k, stages, consumers))
      for block_k, stages, consumers in configs])


def _check_and_time(cfg, probe, q, k, v, idx, dense_idx, rows, modes, reps, rate,
                    gather_bytes):
  """One configuration: its checks, then (if they pass) its timings, into `cfg`."""
  # Check before timing: "matmul" against the same arithmetic in jnp, "forward" against an
  # f32 gathered reference (rows 0-3 hold -1 padding: the invalid-slot path). Loose bounds
  # (bf16 output; the Triton forward's error is ~2e-3): they catch a wrong gather, mask or
  # pipeline, which err by O(1), not the last bits.
  ok = True
  if "matmul" in modes:
    out, _ = probe(q, k, v, dense_idx, mode="matmul")
    cfg["matmul_rel_err"] = bench_attention.rel_err(
        out[:, rows].astype(jnp.float32), matmul_reference(q, k, v, dense_idx, rows))
    log(f"mode=matmul vs jnp on {len(rows)} queries: rel. err. {cfg['matmul_rel_err']:.2e}")
    ok &= cfg["matmul_rel_err"] < 2e-2
  if "forward" in modes:
    out, lse = probe(q, k, v, idx, mode="forward")
    want_out, want_lse = forward_reference(q, k, v, idx, rows)
    cfg["forward_rel_err"] = bench_attention.rel_err(out[:, rows].astype(jnp.float32),
                                                     want_out)
    cfg["forward_lse_max_abs_err"] = float(jnp.max(jnp.abs(lse[:, rows] - want_lse)))
    log(f"mode=forward vs f32 reference on {len(rows)} queries: output rel. err. "
        f"{cfg['forward_rel_err']:.2e}, lse max abs err {cfg['forward_lse_max_abs_err']:.2e}")
    ok &= cfg["forward_rel_err"] < 2e-2 and cfg["forward_lse_max_abs_err"] < 1e-2
  if not ok:
    log("WRONG: this configuration is not timed")
    cfg["error"] = "failed its check"
    return
  for mode in modes:
    args = (q, k, v, idx if mode == "forward" else dense_idx)
    ms = bench_attention.median_ms(jax.jit(functools.partial(probe, mode=mode)), args, reps)
    cfg[f"{mode}_ms"] = ms
    log(f"mosaic {mode:9s} {ms:8.2f} ms  ({gather_bytes / ms / 1e9:.2f} TB/s gathered"
        + (f", {rate[mode] / ms / 1e9:.0f} TFLOP/s)" if mode in rate else ")"))


if __name__ == "__main__":
  main()
