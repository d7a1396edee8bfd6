"""Lab probe: which orientation of HyTopK's scoring core is faster on the GPU.

HyTopK scores each query block against every visible key (docs/design.md, 'HyTopK kernel'),
one f32-accumulated dot per indexer head:

  per_head   M = 16 queries, N = block_k keys, K = DI, once per head (heads unrolled), then
             relu * w summed over heads in f32. The dots' M = 16 is below the 64 rows Triton
             needs for Hopper's wgmma, so they run on mma.sync.
  key_major  M = block_k keys, N = queries x heads packed (4 x 32 = 128, 8 x 32 = 256), K = DI:
             one dot per key block (wgmma-eligible), then relu * w and each query's head sum
             as a reshape [keys, queries, heads] and an f32 sum over heads.

Both compute the exact score of docs/design.md ('Indexer score'), products summed in f32, relu,
f32 head sum, and reduce each query row to its maximum visible score, so the probe times the
scoring alone (no selection). Inputs are bf16, or float8_e4m3fn loaded as such and converted to
bf16 in the kernel (the bytes saved) or fed to the dot directly (`fp8dot`).

    PYTHONPATH=. python experiments/lab/scoring_core.py [--seq 32768] [--heads 32 64]
        [--cores per_head key_major] [--queries 4 8] [--block-k 64 128]

Checks every core against a plain-jnp row max on T = 1024 first (exactly representable
inputs: equal to the bit); prints a table and writes runs/scoring_core/scoring_core.json
(--out).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768], help="T = S, causal")
    p.add_argument("--heads", type=int, nargs="+", default=[32, 64], help="indexer heads HI")
    p.add_argument("--dim", type=int, default=128, help="indexer dim DI")
    p.add_argument(
        "--cores", nargs="+", default=["per_head", "key_major"], choices=["per_head", "key_major"]
    )
    p.add_argument("--queries", type=int, nargs="+", default=[4, 8], help="key_major queries")
    p.add_argument("--block-k", type=int, nargs="+", default=[64, 128], help="key_major keys")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8", "fp8dot"], help="input forms")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="key_major num_warps")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "scoring_core"))
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reproduce import median_ms  # noqa: E402

_dot = getattr(pltriton, "dot", None) or pl.dot
NEG = -float(np.finfo(np.float32).max)


def _operand(x, form):
    return x.astype(jnp.bfloat16) if form == "fp8" else x


def per_head_kernel(q_ref, w_ref, k_ref, o_ref, *, T, S, bq, bk, form):
    """q_ref [bq, HI, DI], w_ref [HI, bq] f32, k_ref [S, DI], o_ref [bq] f32 row max."""
    HI = q_ref.shape[1]
    qb = pl.program_id(0)
    q_heads = [_operand(q_ref[:, h, :], form) for h in range(HI)]
    w_heads = [w_ref[h, :][:, None] for h in range(HI)]
    t_pos = qb * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    s_off = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    n_kb = (jnp.minimum(qb * bq + bq, T) - 1 + (S - T)) // bk + 1

    def body(j, best):
        kblk = _operand(k_ref[pl.ds(j * bk, bk), :], form)
        acc = jnp.zeros((bq, bk), jnp.float32)
        for h in range(HI):
            logits = lax.dot_general(
                q_heads[h], kblk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc = acc + w_heads[h] * jnp.where(logits < 0.0, 0.0, logits)
        visible = j * bk + s_off <= t_pos + (S - T)
        return jnp.maximum(best, jnp.max(jnp.where(visible, acc, NEG), axis=1))

    o_ref[...] = lax.fori_loop(0, n_kb, body, jnp.full((bq,), NEG, jnp.float32))


def key_major_kernel(q_ref, w_ref, k_ref, o_ref, *, T, S, bq, bk, form):
    """q_ref [bq, HI, DI], w_ref [bq, HI] f32, k_ref [S, DI], o_ref [bq] f32 row max."""
    _, HI, DI = q_ref.shape
    qb = pl.program_id(0)
    # N = queries x heads; transposed once here: a transpose inside the loop sends the
    # loop-invariant operand from registers to shared memory again at every key block.
    q_packed = _operand(q_ref[...], form).reshape(bq * HI, DI).T  # [DI, bq * HI]
    w_packed = w_ref[...].reshape(1, bq * HI)
    s_pos = lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
    t_pos = qb * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
    n_kb = (jnp.minimum(qb * bq + bq, T) - 1 + (S - T)) // bk + 1

    def body(j, best):
        kblk = _operand(k_ref[pl.ds(j * bk, bk), :], form)  # M = keys
        logits = _dot(kblk, q_packed)  # [bk, bq * HI] f32
        weighted = jnp.where(logits < 0.0, 0.0, logits) * w_packed
        scores = jnp.sum(weighted.reshape(bk, bq, HI), axis=2)  # f32 head sum [bk, bq]
        visible = j * bk + s_pos <= t_pos + (S - T)
        return jnp.maximum(best, jnp.max(jnp.where(visible, scores, NEG), axis=0))

    o_ref[...] = lax.fori_loop(0, n_kb, body, jnp.full((bq,), NEG, jnp.float32))


def row_max(core, q, k, w, *, bq, bk, warps, form, interpret):
    """q [T, HI, DI], k [S, DI], w [T, HI] f32 -> [T] f32 max visible score per query."""
    T, HI, DI = q.shape
    S = k.shape[0]
    kernel = per_head_kernel if core == "per_head" else key_major_kernel
    if core == "per_head":
        w_arg, w_spec = w.T, pl.BlockSpec((HI, bq), lambda i: (0, i))
    else:
        w_arg, w_spec = w, pl.BlockSpec((bq, HI), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(kernel, T=T, S=S, bq=bq, bk=bk, form=form),
        grid=(T // bq,),
        in_specs=[
            pl.BlockSpec((bq, HI, DI), lambda i: (i, 0, 0)),
            w_spec,
            pl.BlockSpec((S, DI), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((bq,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((T,), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=2),
        interpret=interpret,
        name=f"hytopk_probe_{core}",
    )(q, w_arg, k)


def reference_row_max(q, k, w):
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    logits = jnp.einsum("thd,sd->ths", qf, kf, precision=lax.Precision.HIGHEST)
    scores = jnp.einsum("th,ths->ts", w, jnp.maximum(logits, 0.0), precision="highest")
    T, S = scores.shape
    visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
    return jnp.max(jnp.where(visible, scores, NEG), axis=1)


def inputs(T, HI, DI, form, exact, seed=0):
    rng = np.random.default_rng(seed)
    if exact:  # small integers and power-of-two weights: every score exact in f32
        q = rng.integers(-3, 4, (T, HI, DI)).astype(np.float32)
        k = rng.integers(-3, 4, (T, DI)).astype(np.float32)
        w = (2.0 ** rng.integers(-3, 2, (T, HI))).astype(np.float32)
    else:
        q = rng.normal(size=(T, HI, DI)).astype(np.float32)
        k = rng.normal(size=(T, DI)).astype(np.float32)
        w = rng.random((T, HI)).astype(np.float32)
    dtype = jnp.bfloat16 if form == "bfloat16" else jnp.float8_e4m3fn
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(w)


def variants(args, HI):
    for form in args.dtypes:
        if "per_head" in args.cores:
            yield dict(core="per_head", bq=16, bk=256, warps=8, form=form)
        if "key_major" in args.cores:
            for bq in args.queries:
                for bk in args.block_k:
                    for warps in args.warps:
                        if bq * HI <= 256:
                            yield dict(core="key_major", bq=bq, bk=bk, warps=warps, form=form)


def main(args):
    interpret = args.interpret or jax.default_backend() != "gpu"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; interpret={interpret}")
    records = []
    for HI in args.heads:
        for v in variants(args, HI):
            check_T = 256 if interpret else 1024
            q, k, w = inputs(
                check_T, HI, args.dim, "bfloat16" if v["form"] == "bfloat16" else "fp8", True
            )
            fn = jax.jit(
                functools.partial(
                    row_max,
                    v["core"],
                    interpret=interpret,
                    **{x: v[x] for x in ("bq", "bk", "warps", "form")},
                )
            )
            rec = dict(HI=HI, DI=args.dim, **v)
            try:
                got = fn(q, k, w)
                exact = bool(
                    np.array_equal(np.asarray(got), np.asarray(reference_row_max(q, k, w)))
                )
            except Exception as e:  # lowering or compile failure: recorded
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"HI={HI} {v}: {rec['error']}")
                records.append(rec)
                continue
            rec["exact"] = exact
            for T in [] if interpret else args.seq:
                q, k, w = inputs(
                    T, HI, args.dim, "bfloat16" if v["form"] == "bfloat16" else "fp8", False
                )
                ms = median_ms(lambda: fn(q, k, w), args.reps)
                pairs = T * (T + 1) / 2
                rec[f"ms_{T}"] = ms
                rec[f"tflops_{T}"] = 2 * HI * args.dim * pairs / ms / 1e9
            print(
                f"HI={HI} {v} exact={exact} "
                + " ".join(
                    f"{key}={val:.2f}"
                    for key, val in rec.items()
                    if key.startswith(("ms_", "tflops_"))
                ),
                flush=True,
            )
            records.append(rec)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "scoring_core.json"), "w") as f:
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
    main(ARGS)
