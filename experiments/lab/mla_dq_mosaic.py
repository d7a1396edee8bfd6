"""Lab probe: the MLA backward's dQ kernel as a warp-specialized Pallas Mosaic GPU kernel.

    PYTHONPATH=. python3 experiments/lab/mla_dq_mosaic.py [--seq 32768] [--heads 64 128]
        [--out DIR]
    PYTHONPATH=. python3 experiments/lab/mla_dq_mosaic.py --lower-only   # any host: lower only

The question: does the forward's structure (pallas_kernels/sparse_attention_mosaic.py: a
producer warpgroup gathering each 32-key slot block with per-thread `cp.async`, two consumer
warpgroups) also beat the split backward's Triton dQ kernel (key-major, 16 heads a program,
78.68 ms alone at T = 32K, H = 64 on an H100, docs/performance.md)?

One program = 64 heads of one query. Per slot block each consumer computes the whole S = q K^T
and dP = dO V^T ([64, 32], V the tile's first 512 columns), P = exp2(S scale log2(e) - lse) and
dS = P (dP - delta) (lse and delta from the forward and the delta kernel), then its half of
dQ += dS K: columns [288 w, 288 w + 288) as a 256-wide and a 32-wide `wgmma` ([64, 288] f32, 144
registers a thread). The duplicated S and dP make the executed tensor work 1.66x the counted.
Shared memory: q (73,728 bytes), dO (65,536), two 32-key stages (73,728, reused for the output
tile), the indices (8,192 at k = 2048).

Checked against the library's dQ kernel (`psa._dq_call`) on the same operands at T = 1024 before
timing both alone at --seq. Writes <out>/mla_dq_mosaic.json (default runs/mla_dq_mosaic/).
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
COLS = D // 2  # dQ columns a consumer owns: a 256-wide and a 32-wide matmul
BLOCK_K = psm._BLOCK_K
STAGES = 2


def mla_dq(q, keys, idx, lse, delta, d_out, *, scale: float):
    """q [P, 64, 576], keys [S, 576] (the value is keys[:, :512]), idx [P, K] int32 (K a
    multiple of 32), lse and delta [P, 64] f32 (base-2 log-sum-exp, delta = sum P dP),
    d_out [P, 64, 512] -> dQ [P, 64, 576] in q's dtype (scale included). One batch, G = 1;
    P = T * heads / 64 programs, program p reading query p // (heads / 64)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    programs, _, width = q.shape
    S, K = keys.shape[0], idx.shape[-1]
    head_blocks = programs // idx.shape[0]
    blocks = K // BLOCK_K
    ids = idx.astype(jnp.int32).reshape(idx.shape[0], blocks, BLOCK_K)
    scale_log2 = scale * psa._LOG2E
    tiles = psm._tile_transforms()
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, ids_ref, lse_ref, delta_ref, do_ref, dq_ref):
        def body(q_smem, do_smem, stage_or_out, ids_smem, stats_smem, in_bar, ready, free, done):
            k_smem, out_smem = stage_or_out
            prog = lax.axis_index("p")
            wg = lax.axis_index("wg")
            query = prog // head_blocks

            @pl.when(wg == 0)
            def _load_inputs():
                plgpu.copy_gmem_to_smem(q_ref.at[prog], q_smem, in_bar)
                plgpu.copy_gmem_to_smem(do_ref.at[prog], do_smem, in_bar)
                plgpu.copy_gmem_to_smem(ids_ref.at[query], ids_smem, in_bar)
                plgpu.copy_gmem_to_smem(lse_ref.at[prog], stats_smem.at[0], in_bar)
                plgpu.copy_gmem_to_smem(delta_ref.at[prog], stats_smem.at[1], in_bar)

            def consumer(half: int):
                plgpu.set_max_registers(232, action="increase")
                plgpu.barrier_wait(in_bar)
                lse = psm._load(stats_smem.at[0], row_layout)
                delta = psm._load(stats_smem.at[1], row_layout)
                acc_main = plgpu.layout_cast(
                    jnp.zeros((HEADS, 256), jnp.float32), plgpu.Layout.WGMMA
                )
                acc_tail = plgpu.layout_cast(
                    jnp.zeros((HEADS, COLS - 256), jnp.float32), plgpu.Layout.WGMMA
                )
                col0 = half * COLS

                def step(j, carry):
                    acc_main, acc_tail = carry
                    slot = lax.rem(j, STAGES)
                    plgpu.barrier_wait(ready.at[slot])

                    def scores(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
                        plgpu.wgmma(dp_ref, do_smem, k_smem.at[slot, :, pl.ds(0, DV)].T)
                        return s_ref[...], dp_ref[...]

                    acc_type = plgpu.ACC((HEADS, BLOCK_K), jnp.float32)
                    s, dp = pl.run_scoped(scores, acc_type, acc_type)
                    key = psm._load(ids_smem.at[j], plgpu.Layout.WGMMA.reduce(0))
                    valid = lax.broadcast_in_dim((key >= 0) & (key < S), s.shape, [1])
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(lse, s.shape, [0]))
                    p = jnp.where(valid, p, 0.0)
                    ds = (p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))).astype(q_ref.dtype)

                    def grads(refs):
                        main_ref, tail_ref = refs
                        plgpu.wgmma(main_ref, ds, k_smem.at[slot, :, pl.ds(col0, 256)])
                        plgpu.wgmma(tail_ref, ds, k_smem.at[slot, :, pl.ds(col0 + 256, COLS - 256)])

                    acc_main, acc_tail = pl.run_state(grads)(
                        (plgpu.ACC.init(acc_main), plgpu.ACC.init(acc_tail))
                    )
                    plgpu.barrier_arrive(free.at[slot])
                    return acc_main, acc_tail

                acc_main, acc_tail = lax.fori_loop(0, blocks, step, (acc_main, acc_tail))
                plgpu.barrier_arrive(done)  # the output tile reuses the stages' memory
                plgpu.barrier_wait(done)
                out_smem.at[half, :, pl.ds(0, 256)][...] = (acc_main * scale).astype(q_ref.dtype)
                out_smem.at[half, :, pl.ds(256, COLS - 256)][...] = (acc_tail * scale).astype(
                    q_ref.dtype
                )
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[half], dq_ref.at[prog, :, pl.ds(col0, COLS)])
                plgpu.wait_smem_to_gmem(0)

            pl.when(wg == 0)(lambda: consumer(0))
            pl.when(wg == 1)(lambda: consumer(1))

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")
                plgpu.barrier_wait(in_bar)
                psm.produce(k_ref, ids_smem, k_smem, ready, free, stages=STAGES)

        pl.run_scoped(
            body,
            plgpu.SMEM((HEADS, width), q_ref.dtype, transforms=tiles),
            plgpu.SMEM((HEADS, DV), q_ref.dtype, transforms=tiles),
            plgpu.RefUnion(
                plgpu.SMEM((STAGES, BLOCK_K, width), q_ref.dtype, transforms=tiles),
                plgpu.SMEM((2, HEADS, COLS), q_ref.dtype, transforms=tiles),
            ),
            plgpu.SMEM((blocks, BLOCK_K), jnp.int32),
            plgpu.SMEM((2, HEADS), jnp.float32),
            plgpu.Barrier(num_arrivals=5),
            plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((programs, HEADS, width), q.dtype),
        grid=(programs,),
        grid_names=("p",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, keys.astype(q.dtype), ids, lse, delta, d_out)


def _operands(T, H, K, seed=0):
    """The library's padded backward operands for one batch at MLA's shape, and the pieces the
    probe takes: (library args, probe args, scale)."""
    from bench_attention import make_inputs

    q, kv, _, idx, do = make_inputs(1, T, H, D, DV, K, shared=True, seed=seed)
    scale = D**-0.5
    cfg = psa._Config(scale, False, False, psa.BlockSizes(), value_dim=DV)
    lse = psa._forward(q, kv, None, idx, cfg)[1]
    qb, kb, _, idxb, _, lay = psa._prepare(q, kv, None, idx, cfg, backward=True)
    dog = psa._pad_axis(do.reshape(1, T, 1, H, DV), 3, lay.heads)
    lseg = psa._pad_axis(lse.reshape(1, T, 1, H), 3, lay.heads)
    delta = psa._pad_axis(psa._forward(q, kv, None, idx, cfg, do, lseg), 3, lay.heads)
    library = (qb, kb, None, idxb, lseg, dog, delta)
    programs = T * H // HEADS
    probe = (
        q.reshape(programs, HEADS, D),
        kv.reshape(T, D),
        idx[0],
        lse.reshape(programs, HEADS),
        delta[:, :, 0, :H].reshape(programs, HEADS),
        do.reshape(programs, HEADS, DV),
    )
    return library, probe, lay, scale


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lower-only", action="store_true")
    p.add_argument("--out", default=os.path.join("runs", "mla_dq_mosaic"))
    args = p.parse_args(argv)
    if args.lower_only:
        P, T, K = 256, 256, 128
        shapes = (
            jax.ShapeDtypeStruct((P, HEADS, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, K), jnp.int32),
            jax.ShapeDtypeStruct((P, HEADS), jnp.float32),
            jax.ShapeDtypeStruct((P, HEADS), jnp.float32),
            jax.ShapeDtypeStruct((P, HEADS, DV), jnp.bfloat16),
        )
        fn = jax.jit(lambda *a: mla_dq(*a, scale=D**-0.5))
        text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lowered for cuda: {len(text)} characters (mosaic_gpu: {'mosaic_gpu' in text})")
        return 0
    from bench_attention import median_ms, run_meta

    from tests.helpers import rel_err

    os.makedirs(args.out, exist_ok=True)
    records = []

    def save():
        with open(os.path.join(args.out, "mla_dq_mosaic.json"), "w") as f:
            json.dump(dict(meta=run_meta(), records=records), f, indent=1)

    for T, timed in ((1024, False), (args.seq, True)):
        for H in args.heads:
            K = 256 if not timed else args.topk
            library_args, probe_args, lay, scale = _operands(T, H, K)
            common = dict(scale=scale, lay=lay, sizes=psa.BlockSizes(), interpret=False)
            library = jax.jit(lambda *a: psa._dq_call(*a, **common))
            probe = jax.jit(lambda *a: mla_dq(*a, scale=scale))
            dq_lib = library(*library_args)[0, :, 0, :H].reshape(T * H // HEADS, HEADS, D)
            dq = probe(*probe_args)
            rec = dict(T=T, H=H, k=K, rel_diff_vs_library=float(rel_err(dq, dq_lib)))
            if timed:
                rec["mosaic_ms"] = median_ms(probe, probe_args, args.reps)
                rec["library_ms"] = median_ms(library, library_args, args.reps)
            print(rec, flush=True)
            records.append(rec)
            save()
            if rec["rel_diff_vs_library"] > 1e-2:
                print("MOSAIC dQ DIFFERS FROM THE LIBRARY'S: stopping", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
