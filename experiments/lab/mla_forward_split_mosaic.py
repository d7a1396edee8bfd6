"""Lab probe: the Mosaic GPU MLA forward without its duplicated score matmul.

    PYTHONPATH=. python3 experiments/lab/mla_forward_split_mosaic.py [--seq 32768]
        [--heads 64 128] [--out DIR]
    PYTHONPATH=. python3 experiments/lab/mla_forward_split_mosaic.py --lower-only   # any host

The library's Mosaic GPU forward (pallas_kernels/sparse_attention_mosaic.py) has both consumer
warpgroups compute the whole score tile of each 32-key slot block: 1.53x the counted tensor
work, 451 TFLOP/s executed where it counts 295 (H100, 64c3572). Here consumer w scores only the
block's keys [16 w, 16 w + 16) (`wgmma` N = 16) and the two exchange through shared memory, per
block:
  1. each writes its half's row maxima; after a barrier both take max(m, max_0, max_1);
  2. each writes its probabilities P_w (bf16 [64, 16]) and their row sums; after a second
     barrier both add the two sums in the same order (identical softmax statistics), and each
     accumulates its 256 output columns as P_own V_own + P_other V_other (two K = 16 matmuls).
K = 16 matmuls need 32-byte swizzled tiles (A and B share one swizzle), so q and the key
stages use 32 instead of the library's 64. Counted and executed tensor work are equal.

Checked against the library's Mosaic forward and the f32 reference at T = 1024, then timed
beside both library forwards at --seq. Writes <out>/mla_forward_split_mosaic.json (default
runs/mla_forward_split_mosaic/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402
from pallas_kernels import sparse_attention_mosaic as psm  # noqa: E402

HEADS, D, DV = psm.HEADS, 576, psm.VALUE_DIM
HALF = DV // 2
BLOCK_K = 32
PART = BLOCK_K // 2  # keys a consumer scores
SWIZZLE = 32
STAGES = 3


def split_forward(q, keys, idx, *, scale: float):
    """q [P, 64, 576], keys [S, 576] (the value is keys[:, :512]), idx [T, K] int32 (K a
    multiple of 32), P = T * heads / 64 -> (o [P, 64, 512], lse [P, 64] f32, base 2). One
    batch, G = 1."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    programs, _, width = q.shape
    S, K = keys.shape[0], idx.shape[-1]
    head_blocks = programs // idx.shape[0]
    blocks = K // BLOCK_K
    ids = idx.astype(jnp.int32).reshape(idx.shape[0], blocks, BLOCK_K)
    scale_log2 = scale * psa._LOG2E
    tiles = psm._tile_transforms(SWIZZLE)
    out_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, ids_ref, o_ref, lse_ref):
        def body(
            q_smem,
            stage_or_out,
            ids_smem,
            p_smem,
            stats_smem,
            lse_smem,
            in_bar,
            ready,
            free,
            maxed,
            summed,
            done,
        ):
            k_smem, o_smem = stage_or_out
            prog = lax.axis_index("p")
            wg = lax.axis_index("wg")
            query = prog // head_blocks

            @pl.when(wg == 0)
            def _load_inputs():
                plgpu.copy_gmem_to_smem(q_ref.at[prog], q_smem, in_bar)
                plgpu.copy_gmem_to_smem(ids_ref.at[query], ids_smem, in_bar)

            def consumer(me: int):
                other = 1 - me
                plgpu.set_max_registers(232, action="increase")
                plgpu.barrier_wait(in_bar)
                acc = plgpu.layout_cast(jnp.zeros((HEADS, HALF), jnp.float32), plgpu.Layout.WGMMA)
                m = plgpu.layout_cast(jnp.full((HEADS,), psa._MASK_VALUE, jnp.float32), row_layout)
                total = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), row_layout)

                def step(j, carry):
                    acc, m, total = carry
                    slot = lax.rem(j, STAGES)
                    plgpu.barrier_wait(ready.at[slot])

                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot, pl.ds(me * PART, PART)].T)
                        return acc_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((HEADS, PART), jnp.float32))
                    key = psm._load(
                        ids_smem.at[j, pl.ds(me * PART, PART)], plgpu.Layout.WGMMA.reduce(0)
                    )
                    valid = lax.broadcast_in_dim((key >= 0) & (key < S), s.shape, [1])
                    s = jnp.where(valid, s * scale_log2, psa._MASK_VALUE)
                    # 1. the block's row maxima, from both halves
                    stats_smem.at[0, me][...] = s.max(axis=1)
                    plgpu.barrier_arrive(maxed)
                    plgpu.barrier_wait(maxed)
                    block_max = jnp.maximum(
                        psm._load(stats_smem.at[0, 0], row_layout),
                        psm._load(stats_smem.at[0, 1], row_layout),
                    )
                    m_next = jnp.maximum(m, block_max)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
                    p = jnp.where(valid, p, 0.0)
                    p16 = p.astype(q_ref.dtype)
                    # 2. the probabilities and their row sums, from both halves
                    p_smem.at[me][...] = p16
                    stats_smem.at[1, me][...] = p.sum(axis=1)
                    plgpu.commit_smem()  # the other consumer's wgmma reads p_smem
                    plgpu.barrier_arrive(summed)
                    plgpu.barrier_wait(summed)
                    block_sum = psm._load(stats_smem.at[1, 0], row_layout) + psm._load(
                        stats_smem.at[1, 1], row_layout
                    )
                    correction = jnp.exp2(m - m_next)
                    total = total * correction + block_sum
                    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])

                    def values(acc_ref):
                        cols = pl.ds(me * HALF, HALF)
                        plgpu.wgmma(acc_ref, p16, k_smem.at[slot, pl.ds(me * PART, PART), cols])
                        plgpu.wgmma(
                            acc_ref,
                            p_smem.at[other],
                            k_smem.at[slot, pl.ds(other * PART, PART), cols],
                        )

                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(free.at[slot])
                    return acc, m_next, total

                acc, m, total = lax.fori_loop(0, blocks, step, (acc, m, total))
                psm.store_output(acc, m, total, me, o_smem, lse_smem, o_ref, lse_ref, prog, done)

            pl.when(wg == 0)(lambda: consumer(0))
            pl.when(wg == 1)(lambda: consumer(1))

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                plgpu.barrier_wait(in_bar)
                psm.produce(k_ref, ids_smem, k_smem, ready, free, stages=STAGES, swizzle=SWIZZLE)

        pl.run_scoped(
            body,
            plgpu.SMEM((HEADS, width), q_ref.dtype, transforms=tiles),
            plgpu.RefUnion(
                plgpu.SMEM((STAGES, BLOCK_K, width), q_ref.dtype, transforms=tiles),
                plgpu.SMEM((2, HEADS, HALF), q_ref.dtype, transforms=out_tiles),
            ),
            plgpu.SMEM((blocks, BLOCK_K), jnp.int32),
            plgpu.SMEM((2, HEADS, PART), q_ref.dtype, transforms=tiles),
            plgpu.SMEM((2, 2, HEADS), jnp.float32),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((programs, HEADS, DV), q.dtype),
            jax.ShapeDtypeStruct((programs, HEADS), jnp.float32),
        ),
        grid=(programs,),
        grid_names=("p",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, keys.astype(q.dtype), ids)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lower-only", action="store_true")
    p.add_argument("--out", default=os.path.join("runs", "mla_forward_split_mosaic"))
    args = p.parse_args(argv)
    if args.lower_only:
        T, K = 256, 128
        shapes = (
            jax.ShapeDtypeStruct((T, HEADS, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, K), jnp.int32),
        )
        fn = jax.jit(lambda *a: split_forward(*a, scale=D**-0.5))
        text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lowered for cuda: {len(text)} characters (mosaic_gpu: {'mosaic_gpu' in text})")
        return 0
    from bench_attention import make_inputs, median_ms, run_meta, sparse_flops

    import hyscale_jax as hs
    from tests.helpers import rel_err

    os.makedirs(args.out, exist_ok=True)
    scale = D**-0.5
    records = []

    def save():
        with open(os.path.join(args.out, "mla_forward_split_mosaic.json"), "w") as f:
            json.dump(dict(meta=run_meta(), records=records), f, indent=1)

    def library(kernel):
        cfg = psa._Config(scale, False, False, psa.BlockSizes(forward_kernel=kernel), value_dim=DV)
        return jax.jit(lambda q, kv, idx: psa._forward(q, kv, None, idx, cfg))

    def split(q, kv, idx):
        B, T, H, _ = q.shape
        o, lse = split_forward(
            q.reshape(T * H // HEADS, HEADS, D), kv.reshape(T, D), idx[0], scale=scale
        )
        return o.reshape(B, T, H, DV), lse.reshape(B, T, H)

    split = jax.jit(split)
    mosaic, triton = library("mosaic"), library("triton")
    for T, timed in ((1024, False), (args.seq, True)):
        for H in args.heads:
            K = args.topk if timed else 256
            q, kv, _, idx, _ = make_inputs(1, T, H, D, DV, K, shared=True)
            o, lse = split(q, kv, idx)
            o_m, lse_m = mosaic(q, kv, idx)
            rec = dict(T=T, H=H, k=K)
            if not timed:
                kv32 = kv.astype(jnp.float32)
                ref = hs.sparse_attention_reference(
                    q.astype(jnp.float32), kv32, kv32[..., :DV], idx, scale=scale
                )
                rec |= dict(rel_err=float(rel_err(o, ref)), rel_err_mosaic=float(rel_err(o_m, ref)))
            finite = jnp.isfinite(lse_m)
            rec["lse_max_abs_diff"] = float(jnp.max(jnp.where(finite, jnp.abs(lse - lse_m), 0.0)))
            rec["lse_empty_rows_equal"] = bool(jnp.all(jnp.isfinite(lse) == finite))
            ok = rec["lse_max_abs_diff"] < 1e-3 and rec["lse_empty_rows_equal"]
            if not timed:
                ok = ok and rec["rel_err"] <= 2 * rec["rel_err_mosaic"] + 1e-3
            if ok and timed:
                flops = sparse_flops(T, H, D, DV, K)
                for name, fn in (("split", split), ("mosaic", mosaic), ("triton", triton)):
                    ms = median_ms(fn, (q, kv, idx), args.reps)
                    rec[f"{name}_ms"], rec[f"{name}_tflops"] = ms, flops / ms / 1e9
            print(rec, flush=True)
            records.append(rec)
            save()
            if not ok:
                print("SPLIT FORWARD WRONG: stopping", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
