"""Lab probe: what bounds the MLA sparse-attention forward, by timing it with parts removed.

    PYTHONPATH=. python3 experiments/lab/mla_forward_bounds.py --seq 32768 --heads 64 [--out DIR]

MLA's absorbed shape (D = 576 over one shared key row whose first 512 features are the value,
k = 2048, bf16, causal random indices as in experiments/bench_attention.py). The library's
forward kernel (`library`) beside variants of the same kernel (same grid, tiles, warps, stages
and slot-block loop over the same live blocks), each with one part taken out:

  no_gather   the key tile is rows 0..block_k-1, loaded once before the loop: the matmuls
              and the softmax without the gathers
  no_scores   gathers and the value matmul with a constant probability tile: no score matmul,
              no softmax
  no_value    gathers, score matmul and softmax statistics: no value matmul (the accumulator
              adds the probability rows' sums, to keep it live)

`no_scores` is the gather floor that keeps the gathers' pipeline: a tile that feeds no matmul
is loaded into registers instead (Triton 3.9's sm_90 compile of such a variant asked for 4 KB
of shared memory: no staged tiles), so the probe has no gathers-only variant. Compiled for
sm_90 (Triton 3.9, H = 64): library 185,088 B of shared memory, 74 `wgmma`, 828 B of spills;
no_gather 111,104 B, 74, 1,108; no_scores 99,072 B (no resident q), 2, 288; no_value 185,344 B,
36 (the score matmul no longer feeds a matmul, so the warpgroups split it), none.
If `library` is near the sum of `no_gather` (the matmuls without gathers) and `no_scores` (the
gathers with the small value matmul), the two do not overlap (a latency bound); near the larger
of the two, that part bounds it. The variants' outputs mean nothing; `library` is checked
(output and gradients) against the f32 reference at T = 1024 first. Prints a table and writes
<out>/mla_forward_bounds.json (default runs/mla_forward_bounds/). Needs a GPU (--interpret: a
CPU smoke run, times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attention_parts import DV, TOPK, D, library_forward  # noqa: E402
from bench_attention import check, make_inputs, median_ms, run_meta, save  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402

# (gather, scores, value) of each variant; `library` is the kernel itself.
VARIANTS = {
    "no_gather": (False, True, True),
    "no_scores": (True, False, True),
    "no_value": (True, True, False),
}


def _variant_kernel(idx_ref, q_ref, k_ref, o_ref, lse_ref, *, parts, scale_log2, block_k, lay):
    """`psa._online_softmax` with parts taken out (`parts` = (gather, scores, value)); refs as
    in `psa._forward_kernel` with a shared value (MLA's absorbed form)."""
    gather, scores, value = parts
    num_keys = k_ref.shape[0]
    q_main, q_tail = psa._pieces(q_ref, None, lay)
    if not gather:
        fixed = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        fixed_tiles = psa._masked_pieces(k_ref, fixed, fixed < num_keys, lay)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        if gather:
            k_main, k_tail = psa._masked_pieces(k_ref, rows, valid, lay)
        else:
            k_main, k_tail = fixed_tiles
        if scores:
            s = psa._scores(q_main, q_tail, k_main, k_tail, None) * scale_log2
            s = jnp.where(valid[None, :], s, psa._MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            p = jnp.where(valid[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
            correction = jnp.exp2(m_prev - m_next)
        else:
            p = jnp.broadcast_to(
                jnp.where(valid, 1.0 / block_k, 0.0)[None, :], (lay.block_h, block_k)
            )
            m_next, correction = m_prev, jnp.ones_like(m_prev)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        if value:
            update = psa._dot(p.astype(k_main.dtype), k_main, precision=None)
        else:
            update = jnp.broadcast_to(jnp.sum(p, axis=1)[:, None], acc.shape)
        return acc * correction[:, None] + update, m_next, l_next

    init = (
        jnp.zeros((lay.block_h, lay.dv), jnp.float32),
        jnp.full((lay.block_h,), psa._MASK_VALUE, jnp.float32),
        jnp.zeros((lay.block_h,), jnp.float32),
    )
    acc, m, total = lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys), body, init)
    o_ref[...] = (acc / jnp.maximum(total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + total


def variant_forward(parts, lay, block_k, sizes: psa.BlockSizes, scale: float, interpret: bool):
    """A jitted fn of the library forward's padded operands (qg, kp, idxp) -> (o, lse), with
    `_forward_call`'s grid, specs and compiler parameters."""
    assert lay.shared, "the probe serves MLA's shared-value layout"

    def call(qg, kp, idxp):
        B, T, G = qg.shape[:3]
        S, Kp = kp.shape[1], idxp.shape[-1]
        kernel = functools.partial(
            _variant_kernel, parts=parts, scale_log2=scale * psa._LOG2E, block_k=block_k, lay=lay
        )
        tile_bytes = psa._tile_bytes(lay, block_k, qg.dtype)
        return pl.pallas_call(
            kernel,
            grid=(T * lay.head_blocks, B, G),
            in_specs=psa._input_specs(lay, S, Kp),
            out_specs=[
                pl.BlockSpec((None, None, None, lay.block_h, lay.dv), psa._query_map(lay, 0)),
                pl.BlockSpec((None, None, None, lay.block_h), psa._query_map(lay)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((B, T, G, lay.heads, lay.dv), qg.dtype),
                jax.ShapeDtypeStruct((B, T, G, lay.heads), jnp.float32),
            ],
            compiler_params=pltriton.CompilerParams(
                num_warps=sizes.num_warps or (8 if lay.block_h * lay.dv > psa._ACC_ELEMENTS else 4),
                num_stages=psa._stages(
                    sizes.num_stages, 5, tile_bytes, psa._SHARED_STAGE_BUDGET_BYTES
                ),
            ),
            interpret=interpret,
            name="sparse_attn_fwd_probe",
        )(idxp, qg, kp)

    return jax.jit(call)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (times mean nothing)")
    p.add_argument("--out", default=os.path.join("runs", "mla_forward_bounds"))
    args = p.parse_args(argv)
    sizes = psa.BlockSizes()
    records = []
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for H in args.heads:
        T_check = min(1024, max(args.seq))
        impl = "interpret" if args.interpret else "pallas"
        check([impl], T_check, H, D, DV, min(args.topk, T_check), shared=True)
        for T in args.seq:
            q, kv, _, idx, _ = make_inputs(1, T, H, D, DV, args.topk, shared=True)
            fwd, operands, lay, cfg = library_forward(q, kv, idx, sizes, args.interpret)
            block_k = psa._prepare(q, kv, None, idx, cfg, backward=False)[4]
            row = {
                "T": T,
                "H": H,
                "block_k": block_k,
                "library": median_ms(fwd, operands, args.reps),
            }
            for name, parts in VARIANTS.items():
                fn = variant_forward(parts, lay, block_k, sizes, cfg.scale, args.interpret)
                try:
                    row[name] = median_ms(fn, operands, args.reps)
                except Exception as e:  # a variant the compiler refuses
                    row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            records.append(row)
            print(
                f"T={T} H={H} "
                + " ".join(
                    f"{k} {v:8.2f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in row.items()
                    if k not in ("T", "H")
                ),
                flush=True,
            )
    path = save(args.out, run_meta(), records, "mla_forward_bounds")
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing
    main()
