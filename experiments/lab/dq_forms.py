"""Lab probe: forms of the MLA split backward's dQ kernel, timed alone on the same operands.

    PYTHONPATH=. python3 experiments/lab/dq_forms.py --seq 32768 --heads 64 [--out DIR]
    PYTHONPATH=. python3 experiments/lab/dq_forms.py --seq 256 --heads 16 --interpret  # CPU check

MLA's absorbed shape (D = 576 over one shared key row whose first 512 features are the value,
k = 2048, bf16, causal random indices as in experiments/bench_attention.py). Forms:
  default        the library's dQ kernel: 16 heads a program, head-major (`mma.sync`)
  head64-wW-sS   head-major at 64 heads a program on W warps and S stages (one gather per query)
  key64-kK-wW    key-major at 64 heads a program: per slot block of K keys, S^T = K Q^T and
                 dP^T = K dO^T ([K, heads], `wgmma` from 64 keys, q and dO as right operands in
                 shared memory), then dQ^T += K^T dS^T ([576, heads] accumulator)
Each form's dQ is checked against the default's before timing (relative error printed).
Writes <out>/dq_forms.json (default runs/dq_forms/). Times need a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import make_inputs, median_ms, run_meta, save  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402

D, DV, TOPK = 576, 512, 2048  # MLA's absorbed shape
_dot = psa._dot


def _dq_key_major_kernel(
    idx_ref, q_ref, k_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, scale_log2, block_k, lay
):
    """One query's dQ over its block_h heads, key-major (shared value only).

    idx_ref [Kp] int32; q_ref [block_h, width]; k_ref [S, width]; do_ref [block_h, dv];
    lse_ref, delta_ref [block_h] f32; dq_ref [block_h, width] (out).
    """
    num_keys = k_ref.shape[0]
    precision = psa._precision(q_ref.dtype)
    # Right operands transposed once, before the loop: a transpose inside it puts the
    # loop-invariant operand through registers into shared memory again at every step.
    q_main, q_tail = (x.T for x in psa._pieces(q_ref, None, lay))  # [piece, heads]
    do = do_ref[...].T  # [dv, heads]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def body(j, acc):
        dqt_main, dqt_tail = acc
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main = psa._masked_rows(k_ref, rows, valid, 0, lay.d_main)  # [block_k, d_main]
        k_tail = psa._masked_rows(k_ref, rows, valid, lay.d_main, lay.d_tail)
        s_t = _dot(k_main, q_main, precision=precision)  # [block_k, heads]
        s_t = s_t + _dot(k_tail, q_tail, precision=precision)
        dp_t = _dot(k_main, do, precision=precision)
        p_t = jnp.where(valid[:, None], jnp.exp2(s_t * scale_log2 - lse[None, :]), 0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).astype(k_main.dtype)
        dqt_main = dqt_main + _dot(k_main, ds_t, trans_a=True, precision=precision)
        dqt_tail = dqt_tail + _dot(k_tail, ds_t, trans_a=True, precision=precision)
        return dqt_main, dqt_tail

    init = (
        jnp.zeros((lay.d_main, lay.block_h), jnp.float32),
        jnp.zeros((lay.d_tail, lay.block_h), jnp.float32),
    )
    dqt_main, dqt_tail = lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys), body, init)
    dq_ref[:, pl.ds(0, lay.d_main)] = (dqt_main.T * scale).astype(dq_ref.dtype)
    dq_ref[:, pl.ds(lay.d_main, lay.d_tail)] = (dqt_tail.T * scale).astype(dq_ref.dtype)


def dq_key_major(q, k, idx, lse, do, delta, *, scale, block_k, lay, warps, stages, interpret):
    """Operands as `psa._dq_call`'s (shared value)."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    kernel = lambda *refs: _dq_key_major_kernel(  # noqa: E731
        *refs, scale=scale, scale_log2=scale * psa._LOG2E, block_k=block_k, lay=lay
    )
    return pl.pallas_call(
        kernel,
        grid=(T * lay.head_blocks, B, G),
        in_specs=psa._input_specs(lay, S, Kp)
        + [
            psa._per_head(lay, lay.block_h, lay.dv),
            psa._per_head(lay, lay.block_h),
            psa._per_head(lay, lay.block_h),
        ],
        out_specs=psa._per_head(lay, lay.block_h, lay.width),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sparse_attn_bwd_dq_key_major",
    )(idx, q, k, do, lse, delta)


def forms(heads: int):
    """name -> (kind, block_h, block_k, warps, stages)."""
    out = {"default": ("head", None, None, None, None)}
    h = min(64, heads)
    for warps, stages in ((8, 1), (8, 3)):
        out[f"head{h}-w{warps}-s{stages}"] = ("head", h, 32, warps, stages)
    for block_h, block_k, warps, stages in (
        (64, 64, 8, 1),
        (32, 64, 8, 2),
        (32, 64, 8, 4),
        (16, 64, 4, 4),
        (16, 64, 8, 4),
    ):
        block_h = min(block_h, heads)
        out[f"key{block_h}-k{block_k}-w{warps}-s{stages}"] = (
            "key",
            block_h,
            block_k,
            warps,
            stages,
        )
    return out


def run(T, H, reps, interpret, only=None, topk=TOPK):
    q, kv, _, idx, do = make_inputs(1, T, H, D, DV, topk, shared=True)
    scale = D**-0.5
    sizes = psa.BlockSizes()
    cfg = psa._Config(scale, interpret, False, sizes, value_dim=DV)
    _, lse = psa._forward(q, kv, None, idx, cfg)
    qb, kb, _, idxb, block_kb, lay = psa._prepare(q, kv, None, idx, cfg, backward=True)
    dog = psa._pad_axis(do.reshape(1, T, 1, H, DV), 3, lay.heads)
    lseg = psa._pad_axis(lse.reshape(1, T, 1, H), 3, lay.heads)
    delta = psa._pad_axis(psa._forward(q, kv, None, idx, cfg, do), 3, lay.heads)
    args = (qb, kb, None, idxb, lseg, dog, delta)
    records, want = [], None
    for name, (kind, block_h, block_k, warps, stages) in forms(H).items():
        if only and name not in only and name != "default":
            continue
        try:
            if kind == "head" and block_h is None:
                fn = jax.jit(
                    lambda *a: psa._dq_call(
                        *a, scale=scale, block_k=block_kb, lay=lay, sizes=sizes, interpret=interpret
                    )
                )
                call_args = args
            elif kind == "head":
                lay_v = dataclasses.replace(lay, block_h=block_h, block_h_dkv=max(block_h, 64))
                sizes_v = dataclasses.replace(sizes, num_warps_bwd=warps, num_stages_bwd=stages)
                fn = jax.jit(
                    lambda *a, lay_v=lay_v, sizes_v=sizes_v, block_k=block_k: psa._dq_call(
                        *a,
                        scale=scale,
                        block_k=block_k,
                        lay=lay_v,
                        sizes=sizes_v,
                        interpret=interpret,
                    )
                )
                call_args = args
            else:
                lay_v = dataclasses.replace(lay, block_h=block_h, block_h_dkv=max(block_h, 64))
                fn = jax.jit(
                    functools.partial(
                        dq_key_major,
                        scale=scale,
                        block_k=block_k,
                        lay=lay_v,
                        warps=warps,
                        stages=stages,
                        interpret=interpret,
                    )
                )
                call_args = (qb, kb, idxb, lseg, dog, delta)
            got = fn(*call_args).astype(jnp.float32)
            if want is None:
                want = got
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            ms = median_ms(fn, call_args, reps) if not interpret else float("nan")
            rec = {"T": T, "H": H, "form": name, "ms": ms, "rel_err_vs_default": err}
        except Exception as e:  # e.g. beyond shared memory
            rec = {"T": T, "H": H, "form": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        records.append(rec)
        print(rec, flush=True)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--only", nargs="*", default=None, help="forms to run besides the default")
    p.add_argument("--interpret", action="store_true", help="CPU check (times mean nothing)")
    p.add_argument("--out", default=os.path.join("runs", "dq_forms"))
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records = []
    for H in args.heads:
        records += run(args.seq, H, args.reps, args.interpret, args.only, args.topk)
    path = save(args.out, run_meta(), records, "dq_forms")
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())
    main()
