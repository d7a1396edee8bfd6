"""Lab probe: MLA's sparse-attention forward as a warp-specialized Pallas Mosaic GPU kernel.

    PYTHONPATH=. python3 experiments/lab/mla_forward_mosaic.py [--seq 32768] [--heads 64 128]
        [--block-k 32] [--out DIR]
    PYTHONPATH=. python3 experiments/lab/mla_forward_mosaic.py --lower-only   # CPU: lower only

The question: does overlapping the gathers with the matmuls lift the forward past the
Pallas-Triton kernel's ~187 TFLOP/s (H100), which waits on its gathers (docs/performance.md,
"MLA's absorbed form")? Pallas-Triton cannot split a program into a producer and consumers;
Mosaic GPU can, but has no indexed copy into shared memory on sm_90, so the producer here issues
per-thread 16-byte `cp.async` copies of the selected rows to addresses it swizzles itself.

One program = 64 heads of one query (D = 576 over one shared key row whose first 512 features
are the value, G = 1), three warpgroups:
  producer (warpgroup 2): for each slot block of `block_k` keys, every thread copies 16-byte
    chunks of the gathered rows into the stage's [block_k, 576] tile, laid out as `wgmma` reads
    it (8-row tiles, 64-byte swizzle at 32 keys a block, 128 at 64); invalid slots (index
    outside [0, S)) are zero-filled by the copy itself. After its copies land: a proxy fence,
    then the stage's ready barrier.
  consumers (warpgroups 0 and 1): each computes the whole score tile S = q K^T [64, block_k]
    (the duplicate costs 53% more tensor work; both then hold the same softmax statistics) and
    its own half of the output, acc[:, 256 w : 256 (w + 1)] += P V_w, with V the key tile's
    first 512 features; then frees the stage.
The output tile [64, 512] reuses the key stages' shared memory once both consumers are done;
resident: q (73,728 bytes), the stages (36,864 bytes each at 32 keys), the program's indices.
Outputs as the library's forward: o [B, T, H, 512] in q's dtype and the base-2 log-sum-exp
lse [B, T, H] f32 (-inf, output 0, on rows with no valid entry).

Not yet: live-block skipping of -1 tails (the library stops at the last valid block), other
D / value widths, G > 1. Prints a table and writes <out>/mla_forward_mosaic.json (default
runs/mla_forward_mosaic/).
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
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

D, DV, HEADS = 576, 512, 64  # feature width, value width, heads a program
HALF = DV // 2  # each consumer warpgroup's output columns
CHUNK = 8  # bf16 elements of one 16-byte cp.async
_LOG2E = 1.4426950408889634
_MASK_VALUE = -1e30  # finite: masked logits never make inf - inf


def _swizzle_for(block_k: int) -> int:
    """The tiles' swizzle in bytes: `wgmma`'s value matmul needs its K (block_k) a multiple of
    swizzle / 2, and A and B share one swizzle."""
    return 128 if block_k % 64 == 0 else 64


def _gather_rows(keys, ids, dst, *, num_keys: int, block_k: int):
    """Every producer thread's share of one slot block: 16-byte cp.async copies of the rows
    `ids` [block_k] of `keys` [S, 576] (GMEM) into `dst` [block_k, 576] (SMEM, 8-row tiles of
    `swizzle` bytes a row), zero-filled where the index is outside [0, S); one commit group.

    Thread `tid` of the warpgroup copies rows 16 r + tid // 8 (r < block_k / 16) and, of each,
    the 16-byte chunks c = tid % 8 + 8 i (i < 9): eight threads read 128 contiguous bytes."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    swz = _swizzle_for(block_k)
    tiling = plgpu.TilingTransform((8, swz // 2))
    swizzle = plgpu.SwizzleTransform(swz)
    chunks_per_tile_row = swz // 16
    tiles = D * 2 // swz  # column tiles of one key row
    tile_bytes = 8 * swz

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType((tiling, swizzle))),
    )
    def issue(ctx, keys_ref, ids_ref, dst_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        bf16 = ir.BF16Type.get()
        index = ir.IndexType.get()

        def c32(v):
            return arith.constant(i32, v)

        tid = arith.remui(mu.thread_idx(), c32(128))
        lane = arith.remui(tid, c32(8))
        group = arith.divui(tid, c32(8))  # rows advance by 16, so row % 8 = group % 8
        row_in_tile = arith.remui(group, c32(8))
        # The swizzle XORs a 16-byte chunk's index within its tile row with the index of the
        # 128-byte group that holds that row, modulo the chunks a tile row has (Mosaic GPU's
        # `transfer_tiled`; 128 bytes: row % 8, 64 bytes: (row // 2) % 4).
        xor = arith.remui(
            arith.divui(arith.muli(row_in_tile, c32(chunks_per_tile_row)), c32(8)),
            c32(chunks_per_tile_row),
        )
        chunk_in_row = arith.remui(lane, c32(chunks_per_tile_row))
        tile_of_lane = arith.divui(lane, c32(chunks_per_tile_row))
        lane_bytes = arith.addi(
            arith.addi(
                arith.muli(row_in_tile, c32(swz)),
                arith.muli(arith.xori(chunk_in_row, xor), c32(16)),
            ),
            arith.muli(tile_of_lane, c32(tile_bytes)),
        )
        dst_base = mu.memref_ptr(dst_ref)  # shared::cta
        src_base = llvm.addrspacecast(
            llvm.PointerType.get(address_space=1), mu.memref_ptr(keys_ref)
        )
        tiles_per_step = 8 // chunks_per_tile_row  # tiles eight chunks span
        for r in range(block_k // 16):
            row = arith.addi(c32(16 * r), group)
            key = memref.load(ids_ref, [arith.index_cast(index, row)])
            valid = arith.andi(
                arith.cmpi(arith.CmpIPredicate.sge, key, c32(0)),
                arith.cmpi(arith.CmpIPredicate.slt, key, c32(num_keys)),
            )
            safe = arith.select(valid, key, c32(0))
            src_size = arith.select(valid, c32(16), c32(0))
            src_row = arith.addi(
                arith.muli(arith.extui(i64, safe), arith.constant(i64, D)),
                arith.extui(i64, arith.muli(lane, c32(CHUNK))),
            )
            row_bytes = arith.addi(
                arith.muli(arith.divui(row, c32(8)), c32(tiles * tile_bytes)), lane_bytes
            )
            for i in range(D // (8 * CHUNK)):
                src = mu.getelementptr(
                    src_base, [arith.addi(src_row, arith.constant(i64, i * 8 * CHUNK))], bf16
                )
                dst = mu.getelementptr(
                    dst_base, [arith.addi(row_bytes, c32(i * tiles_per_step * tile_bytes))], i8
                )
                nvvm.cp_async_shared_global(
                    dst, src, 16, nvvm.LoadCacheModifierKind.CG, cp_size=src_size
                )
        nvvm.cp_async_commit_group()

    issue(keys, ids, dst)


def _wait_copies(pending: int):
    """Wait until at most `pending` of this thread's cp.async groups are in flight."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)

    wait()


def gather_only(keys, idx, *, block_k: int):
    """Diagnostic: keys [S, 576], idx [P, block_k] int32 -> [P, block_k, 576], each program's
    rows gathered by `_gather_rows` into the swizzled tile and copied back out by TMA (which
    undoes the swizzle): equal to keys[idx] (zeros for indices outside [0, S)) iff the gather's
    addresses are the layout `wgmma` and TMA expect."""
    P, S = idx.shape[0], keys.shape[0]
    swz = _swizzle_for(block_k)
    transforms = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))

    def kernel(k_ref, ids_ref, out_ref):
        def body(tile, ids_smem, bar):
            prog = lax.axis_index("p")
            plgpu.copy_gmem_to_smem(ids_ref.at[prog], ids_smem, bar)
            plgpu.barrier_wait(bar)
            _gather_rows(k_ref, ids_smem, tile, num_keys=S, block_k=block_k)
            _wait_copies(0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, out_ref.at[prog])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((block_k, D), k_ref.dtype, transforms=transforms),
            plgpu.SMEM((block_k,), jnp.int32),
            plgpu.Barrier(num_arrivals=1),
        )

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((P, block_k, D), keys.dtype),
        grid=(P,),
        grid_names=("p",),
    )(keys, idx.astype(jnp.int32))


def mla_forward(q, keys, idx, *, scale: float, block_k: int = 32, stages: int = 2):
    """q [B, T, H, 576], keys [B, S, 576] (the value is keys[..., :512]), idx [B, T, K] int32
    (K a multiple of block_k; entries outside [0, S) ignored) -> (o [B, T, H, 512] in q's
    dtype, lse [B, T, H] f32, base 2)."""
    B, T, H, width = q.shape
    S, K = keys.shape[1], idx.shape[-1]
    if width != D or H % HEADS or K % block_k or block_k % 16:
        raise ValueError(f"unsupported shape: q {q.shape}, K {K}, block_k {block_k}")
    head_blocks = H // HEADS
    blocks = K // block_k
    programs = B * T * head_blocks
    q2 = q.reshape(programs, HEADS, D)
    k2 = keys.reshape(B * S, D).astype(q.dtype)
    ids2 = idx.astype(jnp.int32).reshape(B * T, blocks, block_k)
    scale_log2 = scale * _LOG2E
    swz = _swizzle_for(block_k)
    tiling = plgpu.TilingTransform((8, swz // 2))
    swizzle = plgpu.SwizzleTransform(swz)
    out_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(q_ref, k_ref, ids_ref, o_ref, lse_ref):
        def body(q_smem, tiles, ids_smem, lse_smem, q_bar, ids_bar, ready, free, done):
            k_smem, o_smem = tiles  # the key stages, then (after every step) the output
            prog = lax.axis_index("p")
            wg = lax.axis_index("wg")
            bt = prog // head_blocks
            batch_keys = k_ref.at[pl.ds((bt // T) * S, S)]

            @pl.when(wg == 0)
            def _load_inputs():
                plgpu.copy_gmem_to_smem(q_ref.at[prog], q_smem, q_bar)
                plgpu.copy_gmem_to_smem(ids_ref.at[bt], ids_smem, ids_bar)

            def consumer(half: int):
                plgpu.set_max_registers(232, action="increase")
                plgpu.barrier_wait(q_bar)
                plgpu.barrier_wait(ids_bar)
                acc = plgpu.layout_cast(jnp.zeros((HEADS, HALF), jnp.float32), plgpu.Layout.WGMMA)
                row = plgpu.Layout.WGMMA.reduce(1)
                m = plgpu.layout_cast(jnp.full((HEADS,), _MASK_VALUE, jnp.float32), row)
                total = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), row)

                def step(j, carry):
                    acc, m, total = carry
                    slot = lax.rem(j, stages)
                    plgpu.barrier_wait(ready.at[slot])

                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                        return acc_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((HEADS, block_k), jnp.float32))
                    key = plgpu.load(ids_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0))
                    valid = lax.broadcast_in_dim((key >= 0) & (key < S), s.shape, [1])
                    s = jnp.where(valid, s * scale_log2, _MASK_VALUE)
                    m_next = jnp.maximum(m, s.max(axis=1))
                    p = jnp.where(
                        valid, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0
                    )
                    correction = jnp.exp2(m - m_next)
                    total = total * correction + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])

                    def values(acc_ref):
                        plgpu.wgmma(
                            acc_ref,
                            p.astype(q_ref.dtype),
                            k_smem.at[slot, :, pl.ds(half * HALF, HALF)],
                        )

                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(free.at[slot])
                    return acc, m_next, total

                acc, m, total = lax.fori_loop(0, blocks, step, (acc, m, total))
                # o_smem reuses the key stages' memory: both consumers' last matmuls first.
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
                nonempty = total > 0.0
                denom = jnp.where(nonempty, total, 1.0)
                o_smem.at[half][...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(
                    o_smem.dtype
                )
                if half == 0:
                    lse_smem[...] = jnp.where(nonempty, m + jnp.log2(denom), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[half], o_ref.at[prog, :, pl.ds(half * HALF, HALF)]
                )
                if half == 0:
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[prog])
                plgpu.wait_smem_to_gmem(0)

            pl.when(wg == 0)(lambda: consumer(0))
            pl.when(wg == 1)(lambda: consumer(1))

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                plgpu.barrier_wait(ids_bar)

                def step(j, carry):
                    slot = lax.rem(j, stages)

                    @pl.when(j < blocks)
                    def _issue():
                        @pl.when(j >= stages)
                        def _():
                            plgpu.barrier_wait(free.at[slot])

                        _gather_rows(
                            batch_keys, ids_smem.at[j], k_smem.at[slot], num_keys=S, block_k=block_k
                        )

                    @pl.when(j >= 1)
                    def _publish():  # slot block j - 1 has landed: make it visible to wgmma
                        pl.when(j < blocks)(lambda: _wait_copies(1))
                        pl.when(j == blocks)(lambda: _wait_copies(0))
                        plgpu.commit_smem()  # proxy fence + warpgroup barrier
                        plgpu.barrier_arrive(ready.at[lax.rem(j - 1, stages)])

                    return carry

                lax.fori_loop(0, blocks + 1, step, None)

        pl.run_scoped(
            body,
            plgpu.SMEM((HEADS, D), q_ref.dtype, transforms=(tiling, swizzle)),
            plgpu.RefUnion(
                plgpu.SMEM((stages, block_k, D), q_ref.dtype, transforms=(tiling, swizzle)),
                plgpu.SMEM((2, HEADS, HALF), q_ref.dtype, transforms=out_transforms),
            ),
            plgpu.SMEM((blocks, block_k), jnp.int32),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    o, lse = plgpu.kernel(
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
    )(q2, k2, ids2)
    return o.reshape(B, T, H, DV), lse.reshape(B, T, H)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--block-k", type=int, default=32)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--lower-only", action="store_true", help="lower for CUDA on any host, then stop"
    )
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def lower_only(args):
    """Lower the kernel for CUDA (no GPU needed): catches tracing and Mosaic GPU lowering errors."""
    T, H, K = 256, args.heads[0], 128
    q = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, T, K), jnp.int32)
    fn = jax.jit(
        lambda q, k, i: mla_forward(
            q, k, i, scale=D**-0.5, block_k=args.block_k, stages=args.stages
        )
    )
    text = fn.trace(q, kv, idx).lower(lowering_platforms=("cuda",)).as_text()
    print(f"lowered for cuda: {len(text)} characters of StableHLO (mosaic_gpu custom call)")
    gather = jax.jit(lambda k, i: gather_only(k, i, block_k=args.block_k))
    ids = jax.ShapeDtypeStruct((T, args.block_k), jnp.int32)
    text = (
        gather.trace(jax.ShapeDtypeStruct((T, D), jnp.bfloat16), ids)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    print(f"gather_only lowered for cuda: {len(text)} characters")


def main(argv=None):
    args = parse_args(argv)
    if args.lower_only:
        return lower_only(args)
    from bench_attention import make_inputs, median_ms, run_meta, sparse_flops

    import hyscale_jax as hs
    from pallas_kernels import sparse_attention as psa

    out = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "runs",
        "mla_forward_mosaic",
    )
    os.makedirs(out, exist_ok=True)
    scale = D**-0.5
    mosaic = jax.jit(
        lambda q, k, i: mla_forward(
            q, k[:, :, 0], i, scale=scale, block_k=args.block_k, stages=args.stages
        )
    )

    def library(q, k, i):
        cfg = psa._Config(scale, False, False, psa.BlockSizes(), value_dim=DV)
        return psa._forward(q, k, None, i, cfg)

    library = jax.jit(library)
    records = []
    # The gather alone: every row where the layout expects it (the forward's check cannot
    # tell a swizzle error from a softmax error).
    keys = jax.random.normal(jax.random.key(1), (4096, D), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (512, args.block_k), -8, 4096 + 8, jnp.int32)
    rows = jax.jit(lambda k, i: gather_only(k, i, block_k=args.block_k))(keys, ids)
    want = jnp.where(((ids >= 0) & (ids < 4096))[..., None], keys[jnp.clip(ids, 0, 4095)], 0)
    wrong_rows = int(jnp.sum(jnp.any(rows != want, axis=-1)))
    rec = dict(check="gather", programs=512, block_k=args.block_k, wrong_rows=wrong_rows)
    if wrong_rows:  # which positions went where: the first wrong row's first columns
        bad = jnp.argwhere(jnp.any(rows != want, axis=-1))[0]
        rec["first_wrong"] = [int(x) for x in bad]
        import numpy as np  # the first program's tile and its expectation, for a layout diagnosis

        np.savez(
            os.path.join(out, "gather_wrong.npz"),
            rows=np.asarray(rows[0], np.float32),
            want=np.asarray(want[0], np.float32),
            ids=np.asarray(ids[0]),
        )
    print(rec, flush=True)
    records.append(rec)
    if wrong_rows:
        print("GATHER WRONG: not timed", flush=True)
        json.dump(
            dict(meta=run_meta(), records=records),
            open(os.path.join(out, "mla_forward_mosaic.json"), "w"),
            indent=1,
        )
        return 1
    # Exactness first: against the library's forward and the f32 reference, small T.
    for H in args.heads:
        q, kv, _, idx, _ = make_inputs(1, 1024, H, D, DV, 256, shared=True)
        o, lse = mosaic(q, kv, idx)
        o_lib, lse_lib = library(q, kv, idx)
        kv32 = kv.astype(jnp.float32)
        ref = hs.sparse_attention_reference(
            q.astype(jnp.float32), kv32, kv32[..., :DV], idx, scale=scale
        )
        err = float(jnp.linalg.norm(o.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        err_lib = float(jnp.linalg.norm(o_lib.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        lse_diff = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(lse_lib), lse - lse_lib, 0.0))))
        lse_inf_same = bool(jnp.all(jnp.isfinite(lse) == jnp.isfinite(lse_lib)))
        rec = dict(
            check=True,
            T=1024,
            H=H,
            k=256,
            rel_err=err,
            rel_err_library=err_lib,
            lse_max_abs_diff=lse_diff,
            lse_empty_rows_equal=lse_inf_same,
        )
        print(rec, flush=True)
        records.append(rec)
        if not (err < 2 * err_lib + 1e-3 and lse_diff < 1e-3 and lse_inf_same):
            print("MOSAIC FORWARD WRONG: not timed", flush=True)
            json.dump(
                dict(meta=run_meta(), records=records),
                open(os.path.join(out, "mla_forward_mosaic.json"), "w"),
                indent=1,
            )
            return 1
    for H in args.heads:
        q, kv, _, idx, _ = make_inputs(1, args.seq, H, D, DV, args.topk, shared=True)
        k_eff = float(jnp.mean(jnp.sum(idx >= 0, axis=-1)))
        flops = sparse_flops(args.seq, H, D, DV, k_eff)
        t_mosaic = median_ms(mosaic, (q, kv, idx), args.reps)
        t_lib = median_ms(library, (q, kv, idx), args.reps)
        rec = dict(
            T=args.seq,
            H=H,
            k=args.topk,
            block_k=args.block_k,
            stages=args.stages,
            mosaic_ms=t_mosaic,
            library_ms=t_lib,
            mosaic_tflops=flops / t_mosaic / 1e9,
            library_tflops=flops / t_lib / 1e9,
        )
        print(rec, flush=True)
        records.append(rec)
        json.dump(
            dict(meta=run_meta(), records=records),
            open(os.path.join(out, "mla_forward_mosaic.json"), "w"),
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
