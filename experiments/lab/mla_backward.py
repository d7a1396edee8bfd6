"""Lab probe: a sparse attention backward for MLA's absorbed shapes with a quarter of the atomics.

The library's backward (pallas_kernels/sparse_attention.py) runs one program per (query, head
block) and each program adds its own dK rows: at MLA's D = 576 with 16 heads a program, 64 heads
make 4 programs a query and 4 x 2048 x 576 f32 atomic adds a query (docs/performance.md, "MLA's
absorbed form"). This probe splits the backward in two kernels:

  dq     one program per (query, head block), as the library's: the delta sweep, then dQ, and
         delta [B, T, G, heads] written out instead of dK rows. No atomics.
  dkv    one program per (query, group of dkv_heads heads; 64: M = 64 rows, wgmma-eligible
         dots, and q plus dO of 64 heads fill 136 KiB of shared memory): each gathered key
         block gets the rows scale * dS^T Q + P^T dO summed over the group's heads, added once
         with masked relaxed atomics.

Two more matmul sweeps (the dkv kernel recomputes S and dP) for a quarter of the adds. The value
is the key's leading `value_dim` features (v=None), as in MLA.

    PYTHONPATH=. python experiments/lab/mla_backward.py               # CPU: interpret check
    PYTHONPATH=. python experiments/lab/mla_backward.py --seq 32768 --heads 64 128   # GPU

Checks against the library's backward (and the f32 reference on CPU), then times forward +
backward of both on the GPU; writes runs/mla_backward/mla_backward.json (--out).
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

from pallas_kernels import relaxed_atomics
from pallas_kernels import sparse_attention as psa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reproduce import median_ms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_dot = psa._dot


def _dq_kernel(
    idx_ref, q_ref, k_ref, do_ref, lse_ref, dq_ref, delta_ref, *, scale, block_k, lay, precision
):
    """One (query, head block): delta and dQ. Refs as the library's backward, no value ref."""
    num_keys = k_ref.shape[0]
    q_main, q_tail = psa._pieces(q_ref, None, lay)
    do, lse = do_ref[...], lse_ref[...]
    num_blocks = psa._live_blocks(idx_ref, block_k, num_keys)
    scale_log2 = scale * psa._LOG2E

    def recompute(j):
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = psa._pieces(k_ref, rows, lay)
        k_main = jnp.where(valid[:, None], k_main, 0)
        k_tail = None if k_tail is None else jnp.where(valid[:, None], k_tail, 0)
        s = psa._scores(q_main, q_tail, k_main, k_tail, precision) * scale_log2
        p = jnp.where(valid[None, :], jnp.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, k_main, trans_b=True, precision=precision)
        return k_main, k_tail, p, dp

    def delta_body(j, delta):
        *_, p, dp = recompute(j)
        return delta + jnp.sum(p * dp, axis=1)

    delta = lax.fori_loop(0, num_blocks, delta_body, jnp.zeros((lay.block_h,), jnp.float32))

    def grad_body(j, dq):
        dq_main, dq_tail = dq
        k_main, k_tail, p, dp = recompute(j)
        ds = p * (dp - delta[:, None])
        dq_main = dq_main + _dot(ds.astype(k_main.dtype), k_main, precision=precision)
        if lay.d_tail:
            dq_tail = dq_tail + _dot(ds.astype(k_tail.dtype), k_tail, precision=precision)
        return dq_main, dq_tail

    init = (
        jnp.zeros((lay.block_h, lay.d_main), jnp.float32),
        jnp.zeros((lay.block_h, lay.d_tail), jnp.float32) if lay.d_tail else None,
    )
    dq_main, dq_tail = lax.fori_loop(0, num_blocks, grad_body, init)
    delta_ref[...] = delta
    if not lay.d_tail:
        dq_ref[...] = (dq_main * scale).astype(dq_ref.dtype)
    else:
        dq_ref[:, pl.ds(0, lay.d_main)] = (dq_main * scale).astype(dq_ref.dtype)
        dq_ref[:, pl.ds(lay.d_main, lay.d_tail)] = (dq_tail * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    idx_ref,
    q_ref,
    k_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_main_ref,
    *dk_tail_refs,
    scale,
    block_k,
    lay,
    precision,
):
    """One query, all heads: each key block's dK rows summed over the heads, added once.

    q_ref [heads, width], k_ref [S, width], do_ref [heads, dv], lse_ref / delta_ref [heads] f32,
    dk_main_ref [S, d_main] and (if d_tail) dk_tail_ref [S, d_tail] f32 shared buffers.
    """
    num_keys = k_ref.shape[0]
    q_main, q_tail = psa._pieces(q_ref, None, lay)
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]
    scale_log2 = scale * psa._LOG2E

    def body(j, carry):
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = psa._pieces(k_ref, rows, lay)
        k_main = jnp.where(valid[:, None], k_main, 0)
        k_tail = None if k_tail is None else jnp.where(valid[:, None], k_tail, 0)
        s = psa._scores(q_main, q_tail, k_main, k_tail, precision) * scale_log2
        p = jnp.where(valid[None, :], jnp.exp2(s - lse[:, None]), 0.0)  # [heads, block_k]
        dp = _dot(do, k_main, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        dk_main = _dot(ds.astype(q_main.dtype), q_main, trans_a=True, precision=precision) * scale
        dk_main = dk_main + _dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        mask = jnp.broadcast_to(valid[:, None], dk_main.shape)
        relaxed_atomics.atomic_add(dk_main_ref, (rows, slice(None)), dk_main, mask=mask)
        if lay.d_tail:
            dk_tail = _dot(ds.astype(q_tail.dtype), q_tail, trans_a=True, precision=precision)
            mask = jnp.broadcast_to(valid[:, None], dk_tail.shape)
            relaxed_atomics.atomic_add(
                dk_tail_refs[0], (rows, slice(None)), dk_tail * scale, mask=mask
            )
        return carry

    lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys), body, 0)


def mla_backward(
    q,
    kv,
    idx,
    lse,
    d_out,
    *,
    scale,
    value_dim,
    block_h,
    block_k,
    warps,
    stages,
    dkv_heads,
    interpret,
):
    """q [B,T,H,D], kv [B,S,1,D], idx [B,T,K], lse [B,T,H] f32 (base 2, from the library's
    forward), d_out [B,T,H,Dv] -> dq [B,T,H,D], dkv [B,S,1,D]."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    sizes = psa.BlockSizes(block_h=block_h, block_k_bwd=block_k)
    cfg = psa._Config(scale, interpret, False, sizes, value_dim=value_dim)
    qg, kp, _, idxp, bk, lay = psa._prepare(q, kv, None, idx, cfg, backward=True)
    Kp = idxp.shape[-1]
    dog = psa._pad_axis(d_out.astype(qg.dtype).reshape(B, T, 1, H, value_dim), 3, lay.heads)
    lseg = psa._pad_axis(lse.reshape(B, T, 1, H), 3, lay.heads)
    precision = psa._precision(q.dtype)
    params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    qmap = psa._query_map(lay, 0)
    dq, delta = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk, lay=lay, precision=precision),
        grid=(T * lay.head_blocks, B, 1),
        in_specs=psa._input_specs(lay, S, Kp)
        + [
            pl.BlockSpec((None, None, None, lay.block_h, lay.dv), qmap),
            pl.BlockSpec((None, None, None, lay.block_h), psa._query_map(lay)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, lay.block_h, lay.width), qmap),
            pl.BlockSpec((None, None, None, lay.block_h), psa._query_map(lay)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(qg.shape, qg.dtype),
            jax.ShapeDtypeStruct(lseg.shape, jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="sparse_attn_probe_dq",
    )(idxp, qg, kp, dog, lseg)
    widths = (lay.d_main,) + ((lay.d_tail,) if lay.d_tail else ())
    groups = lay.heads // min(dkv_heads, lay.heads)  # dkv programs per query
    gh = lay.heads // groups
    whole = lambda *tail: lambda i, b, g: (b, i // groups, g, i % groups, *tail)  # noqa: E731
    buffers = [jnp.zeros((B, S, 1, w), jnp.float32) for w in widths]
    n_in = 6

    def body(*refs):
        _dkv_kernel(
            *refs[:n_in],
            *refs[n_in + len(widths) :],
            scale=scale,
            block_k=bk,
            lay=lay,
            precision=precision,
        )

    buf_specs = [pl.BlockSpec((None, S, None, w), lambda t, b, g: (b, 0, g, 0)) for w in widths]
    rows = pl.pallas_call(
        body,
        grid=(T * groups, B, 1),
        in_specs=[
            pl.BlockSpec((None, None, Kp), lambda i, b, g: (b, i // groups, 0)),
            pl.BlockSpec((None, None, None, gh, lay.width), whole(0)),
            pl.BlockSpec((None, S, None, lay.width), lambda t, b, g: (b, 0, g, 0)),
            pl.BlockSpec((None, None, None, gh, lay.dv), whole(0)),
            pl.BlockSpec((None, None, None, gh), whole()),
            pl.BlockSpec((None, None, None, gh), whole()),
        ]
        + buf_specs,
        out_specs=buf_specs,
        out_shape=[jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in buffers],
        input_output_aliases={n_in + i: i for i in range(len(widths))},
        compiler_params=params,
        interpret=interpret,
        name="sparse_attn_probe_dkv",
    )(idxp, qg, kp, dog, lseg, delta, *buffers)
    dkv = jnp.concatenate(rows, axis=-1)[..., :D] if lay.d_tail else rows[0][..., :D]
    dq = dq[:, :, :, :H, :D].reshape(B, T, H, D)
    return dq.astype(q.dtype), dkv.astype(kv.dtype)


def probe_grads(q, kv, idx, d_out, *, value_dim, interpret, **kw):
    scale = q.shape[-1] ** -0.5
    cfg = psa._Config(scale, interpret, True, psa.BlockSizes(), value_dim)
    _, lse = psa._forward(q, kv, None, idx, cfg)
    return mla_backward(
        q, kv, idx, lse, d_out, scale=scale, value_dim=value_dim, interpret=interpret, **kw
    )


def library_grads(q, kv, idx, d_out, *, value_dim, interpret, sizes=None):
    f = lambda q, kv: psa.sparse_attention(  # noqa: E731
        q,
        kv,
        None,
        idx,
        scale=q.shape[-1] ** -0.5,
        value_dim=value_dim,
        interpret=interpret,
        block_sizes=sizes or psa.BlockSizes(),
    )
    return jax.vjp(f, q, kv)[1](d_out)


def inputs(B, T, S, H, D, Dv, K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, S, 1, D)), dtype)
    idx = jnp.asarray(rng.integers(-1, S, (B, T, K)), jnp.int32)
    d_out = jnp.asarray(rng.normal(size=(B, T, H, Dv)), dtype)
    return q, kv, idx, d_out


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768], help="T = S (GPU timing)")
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["16,16,4,1,64", "16,16,8,1,64", "16,32,8,1,64", "16,64,8,1,64", "16,16,8,1,32"],
        help="block_h,block_k,warps,stages,dkv_heads of the probe, or lib:FIELD=V,... (the "
        "library's backward with these BlockSizes)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "mla_backward"))
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"

    def parse(v):  # 'lib:FIELD=V,...': the library's backward with these BlockSizes
        if v.startswith("lib:"):
            fields = dict(item.split("=") for item in filter(None, v[4:].split(",")))
            return dict(sizes=psa.BlockSizes(**{f: int(x) for f, x in fields.items()}))
        names = ("block_h", "block_k", "warps", "stages", "dkv_heads")
        return dict(zip(names, map(int, v.split(","))))

    variants = {spec: parse(spec) for spec in args.variants}
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records = []
    # Check: small analogue on CPU (interpret), the real shape on GPU at T = 1024.
    shape = (1, 1024, 1024, 64, 576, 512, 256) if on_gpu else (1, 3, 29, 32, 72, 64, 37)
    q, kv, idx, d_out = inputs(*shape, jnp.bfloat16 if on_gpu else jnp.float32)
    want = library_grads(q, kv, idx, d_out, value_dim=shape[5], interpret=not on_gpu)
    for spec in list(variants) if on_gpu else list(variants)[:1]:
        v = variants[spec]
        try:
            grads = library_grads if "sizes" in v else probe_grads
            got = grads(q, kv, idx, d_out, value_dim=shape[5], interpret=not on_gpu, **v)
        except Exception as e:  # e.g. shared memory: recorded, the variant is not timed
            print(f"check {spec}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            records.append(dict(check=spec, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        errs = [rel_err(a, b) for a, b in zip(got, want)]
        print(f"check {spec}: rel err dq {errs[0]:.1e} dkv {errs[1]:.1e}", flush=True)
        records.append(dict(check=spec, rel_err_dq_dkv=errs))
        if max(errs) > (2e-2 if on_gpu else 1e-5):
            raise SystemExit(f"probe {spec} disagrees with the library's backward")
    for T in args.seq if on_gpu else []:
        for H in args.heads:
            q, kv, idx, d_out = inputs(1, T, T, H, 576, 512, 2048, jnp.bfloat16)
            lib = jax.jit(
                lambda q, kv, idx, d: library_grads(q, kv, idx, d, value_dim=512, interpret=False)
            )
            rec = dict(
                T=T, H=H, library_ms=median_ms(lambda: lib(q, kv, idx, d_out), args.reps, warmups=2)
            )
            print(f"T={T} H={H} library fwd+bwd {rec['library_ms']:.1f} ms", flush=True)
            for spec, v in variants.items():
                if any(r.get("check") == spec and "error" in r for r in records):
                    continue
                grads = library_grads if "sizes" in v else probe_grads
                fn = jax.jit(
                    lambda q, kv, idx, d, v=v, grads=grads: grads(
                        q, kv, idx, d, value_dim=512, interpret=False, **v
                    )
                )
                try:
                    ms = median_ms(lambda: fn(q, kv, idx, d_out), args.reps, warmups=2)
                except Exception as e:  # e.g. shared memory: recorded
                    print(f"  {spec}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                rec[spec] = ms
                print(f"  {spec} fwd+bwd {ms:.1f} ms ({rec['library_ms'] / ms:.2f}x)", flush=True)
            records.append(rec)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "mla_backward.json"), "w") as f:
                json.dump(
                    dict(
                        jax=jax.__version__,
                        device=jax.devices()[0].device_kind,
                        command=" ".join(sys.argv),
                        records=records,
                    ),
                    f,
                    indent=1,
                )
    return records


if __name__ == "__main__":
    main()
