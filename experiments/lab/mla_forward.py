"""Lab probe: sparse attention forward at MLA's absorbed shapes, other tilings than the library's.

The library's forward (pallas_kernels/sparse_attention.py) gives each program 64 heads at
D = 576, Dv = 512 (M = 64 rows, wgmma-eligible), 8 warps and 3 stages. This probe times it
against other tilings:

  lib:...   the library's kernel with other BlockSizes, e.g. block_h=16,num_warps=4,num_stages=2
            (16 heads a program: M = 16, mma.sync, each selected row gathered 4 times at 64
            heads), or other key tiles (block_k) and depths (num_stages).
  vsplit    one program per (query, half of the value): all 64 heads (M = 64), the scores over
            the full 576 features (recomputed by both halves: 1.53x the matmul FLOPs), the
            output accumulator [64, 256]; each selected row is gathered twice.

    PYTHONPATH=. python experiments/lab/mla_forward.py              # CPU: interpret check
    PYTHONPATH=. python experiments/lab/mla_forward.py --seq 32768 --heads 64 128   # GPU

Checks every variant against the library's output (and on CPU the f32 reference), then times the
forward; writes runs/mla_forward/mla_forward.json (--out).
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
from jax.experimental.pallas import triton as pltriton

import hyscale_jax as hs
from pallas_kernels import sparse_attention as psa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reproduce import median_ms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _vsplit_kernel(idx_ref, q_ref, k_ref, o_ref, lse_ref, *, scale_log2, block_k, parts, lay):
    """One (query, value part): all heads, scores over every feature, output columns
    [part * dvp, (part + 1) * dvp) of the shared value (the key's leading d_main features).

    idx_ref [Kp] int32, q_ref [heads, width], k_ref [S, width], o_ref [heads, dvp],
    lse_ref [heads] f32 (written identically by every part)."""
    num_keys = k_ref.shape[0]
    dvp = lay.d_main // parts
    col = (pl.program_id(0) % parts) * dvp
    q_main, q_tail = psa._pieces(q_ref, None, lay)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = psa._pieces(k_ref, rows, lay)
        s = psa._scores(q_main, q_tail, k_main, k_tail, None) * scale_log2
        s = jnp.where(valid[None, :], s, psa._MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(valid[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
        correction = jnp.exp2(m_prev - m_next)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        v_blk = jnp.where(valid[:, None], k_ref[rows, pl.ds(col, dvp)], 0)  # [block_k, dvp]
        acc = acc * correction[:, None] + psa._dot(p.astype(v_blk.dtype), v_blk)
        return acc, m_next, l_next

    init = (
        jnp.zeros((lay.heads, dvp), jnp.float32),
        jnp.full((lay.heads,), psa._MASK_VALUE, jnp.float32),
        jnp.zeros((lay.heads,), jnp.float32),
    )
    acc, m, total = lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys), body, init)
    nonempty = total > 0.0
    o_ref[...] = (acc / jnp.where(nonempty, total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, total, 1.0)), -jnp.inf)


def vsplit_forward(q, kv, idx, *, value_dim, parts, block_k, warps, stages, interpret):
    """q [B,T,H,D], kv [B,S,1,D], idx [B,T,K] -> o [B,T,H,value_dim] (shared value)."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    sizes = psa.BlockSizes(block_h=psa._next_pow2(H, 16), block_k=block_k)
    cfg = psa._Config(D**-0.5, interpret, True, sizes, value_dim=value_dim)
    qg, kp, _, idxp, bk, lay = psa._prepare(q, kv, None, idx, cfg, backward=False)
    Kp = idxp.shape[-1]
    dvp = lay.d_main // parts
    kernel = functools.partial(
        _vsplit_kernel, scale_log2=cfg.scale * psa._LOG2E, block_k=bk, parts=parts, lay=lay
    )
    o, _ = pl.pallas_call(
        kernel,
        grid=(T * parts, B, 1),
        in_specs=[
            pl.BlockSpec((None, None, Kp), lambda i, b, g: (b, i // parts, 0)),
            pl.BlockSpec(
                (None, None, None, lay.heads, lay.width), lambda i, b, g: (b, i // parts, g, 0, 0)
            ),
            pl.BlockSpec((None, S, None, lay.width), lambda i, b, g: (b, 0, g, 0)),
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, lay.heads, dvp), lambda i, b, g: (b, i // parts, g, 0, i % parts)
            ),
            pl.BlockSpec((None, None, None, lay.heads), lambda i, b, g: (b, i // parts, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, 1, lay.heads, lay.d_main), q.dtype),
            jax.ShapeDtypeStruct((B, T, 1, lay.heads), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sparse_attn_probe_vsplit",
    )(idxp, qg, kp)
    return o[:, :, 0, :H, :value_dim]


def library_forward(q, kv, idx, *, value_dim, interpret, sizes=None):
    return psa.sparse_attention(
        q,
        kv,
        None,
        idx,
        scale=q.shape[-1] ** -0.5,
        value_dim=value_dim,
        interpret=interpret,
        block_sizes=sizes or psa.BlockSizes(),
    )


def inputs(B, T, S, H, D, K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, S, 1, D)), dtype)
    idx = jnp.asarray(rng.integers(-1, S, (B, T, K)), jnp.int32)
    return q, kv, idx


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def variant_fn(spec, value_dim, interpret):
    """'lib:FIELD=V,...' (the library's kernel with these BlockSizes) or
    'vsplit:PARTS,BLOCK_K,WARPS,STAGES' -> forward fn (q, kv, idx) -> o."""
    name, _, args = spec.partition(":")
    if name == "lib":
        fields = dict(item.split("=") for item in filter(None, args.split(",")))
        sizes = psa.BlockSizes(**{f: int(v) for f, v in fields.items()})
        return lambda q, kv, idx: library_forward(
            q, kv, idx, value_dim=value_dim, interpret=interpret, sizes=sizes
        )
    vals = [int(a) for a in args.split(",")]
    if name == "vsplit":
        parts, block_k, warps, stages = vals
        return lambda q, kv, idx: vsplit_forward(
            q,
            kv,
            idx,
            value_dim=value_dim,
            parts=parts,
            block_k=block_k,
            warps=warps,
            stages=stages,
            interpret=interpret,
        )
    raise SystemExit(f"unknown variant {spec!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768], help="T = S (GPU timing)")
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["lib:block_h=16,num_warps=4,num_stages=2", "vsplit:2,32,4,3"],
        help="lib:FIELD=V,... (BlockSizes) or vsplit:PARTS,BLOCK_K,WARPS,STAGES",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "mla_forward"))
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    flops = lambda T, H, k: 2.0 * T * H * np.mean(np.minimum(np.arange(T) + 1, k)) * 1088  # noqa: E731
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records, broken = [], set()
    # Check: the real widths at T = 1024 on the GPU; a small analogue (72 = 64 + 8) on CPU.
    D, Dv = (576, 512) if on_gpu else (72, 64)
    shape = (1, 1024, 1024, 64, D, 256) if on_gpu else (1, 3, 29, 20, D, 37)
    q, kv, idx = inputs(*shape, jnp.bfloat16 if on_gpu else jnp.float32)
    want = library_forward(q, kv, idx, value_dim=Dv, interpret=not on_gpu)
    if not on_gpu:
        ref = hs.sparse_attention_reference(q, kv, kv[..., :Dv], idx)
        print(f"library vs f32 reference: rel err {rel_err(want, ref):.1e}")
    for spec in args.variants:
        try:
            got = jax.jit(variant_fn(spec, Dv, not on_gpu))(q, kv, idx)
        except Exception as e:  # e.g. shared memory: recorded, not timed
            print(f"check {spec}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            records.append(dict(check=spec, error=f"{type(e).__name__}: {str(e)[:300]}"))
            broken.add(spec)
            continue
        err = rel_err(got, want)
        print(f"check {spec}: rel err against the library {err:.1e}", flush=True)
        records.append(dict(check=spec, rel_err=err))
        if err > (1e-2 if on_gpu else 1e-5):
            raise SystemExit(f"{spec} disagrees with the library's forward")
    for T in args.seq if on_gpu else []:
        for H in args.heads:
            q, kv, idx = inputs(1, T, T, H, 576, 2048, jnp.bfloat16)
            fl = flops(T, H, 2048)
            lib = jax.jit(
                lambda q, kv, idx: library_forward(q, kv, idx, value_dim=512, interpret=False)
            )
            ms = median_ms(lambda: lib(q, kv, idx), args.reps, warmups=2)
            rec = dict(T=T, H=H, library_ms=ms)
            print(f"T={T} H={H} library fwd {ms:.2f} ms {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
            for spec in args.variants:
                if spec in broken:
                    continue
                fn = jax.jit(variant_fn(spec, 512, False))
                try:
                    ms = median_ms(lambda: fn(q, kv, idx), args.reps, warmups=2)
                except Exception as e:  # e.g. shared memory at H = 128: recorded
                    print(f"  {spec}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                rec[spec] = ms
                print(
                    f"  {spec:18s} fwd {ms:.2f} ms {fl / ms / 1e9:.0f} TFLOP/s "
                    f"({rec['library_ms'] / ms:.2f}x)",
                    flush=True,
                )
            records.append(rec)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "mla_forward.json"), "w") as f:
                meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind)
                json.dump(dict(meta, command=" ".join(sys.argv), records=records), f, indent=1)
    return records


if __name__ == "__main__":
    main()
