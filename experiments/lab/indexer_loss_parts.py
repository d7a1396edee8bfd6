"""Lab probe: the sparse-stage indexer loss kernels alone at the paper's MLA shapes.

    PYTHONPATH=. python3 experiments/lab/indexer_loss_parts.py --seq 32768 --heads 64 \\
        [--index-heads 32] [--dim 576] [--index-dim 128] [--sizes num_stages=1 ...] [--out DIR]

Main attention MLA-absorbed (D = 576 by default, G = 1), indexer HI x DI (default 32 x 128),
k = 2048, bf16, causal random indices (experiments/bench_attention.py). For the default
`BlockSizes` and each --sizes variant: `indexer_kl_rows` forward and forward+backward
(gradients in q_idx, k_idx, w under a random cotangent), median of --reps after two warm-up
calls; before timing, the summed loss and its gradients at T = 1024 against impl="xla"
(`hs.indexer_kl_loss`'s portable path), relative errors printed.
Writes <out>/indexer_loss_parts.json (default runs/indexer_loss_parts/). Times need a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import (  # noqa: E402
    block_sizes,
    causal_random_indices,
    median_ms,
    rel_err,
    run_meta,
    save,
)

from hyscale_jax import indexer_loss as hil  # noqa: E402
from pallas_kernels import indexer_loss as pil  # noqa: E402

TOPK = 2048


def inputs(T, H, HI, topk, seed=0, D=576, DI=128):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (1, T, H, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, T, 1, D), jnp.bfloat16)
    qi = jax.random.normal(keys[2], (1, T, HI, DI), jnp.bfloat16)
    ki = jax.random.normal(keys[3], (1, T, DI), jnp.bfloat16)
    w = jax.random.normal(keys[4], (1, T, HI), jnp.float32)
    idx = causal_random_indices(keys[5], B=1, T=T, k=topk)
    return q, k, qi, ki, w, idx


def functions(sizes, interpret=False):
    def rows(q, k, qi, ki, w, idx):
        scale = q.shape[-1] ** -0.5
        return pil.indexer_kl_rows(
            q, k, qi, ki, w, idx, scale=scale, interpret=interpret, block_sizes=sizes
        )

    def fwd_bwd(q, k, qi, ki, w, idx, g):
        out, vjp = jax.vjp(lambda qi, ki, w: rows(q, k, qi, ki, w, idx), qi, ki, w)
        return out, vjp(g)

    return jax.jit(rows), jax.jit(fwd_bwd)


def check(sizes, H, HI, D, DI, interpret):
    """Relative errors (loss, dq_idx, dk_idx, dw) of the summed loss against impl="xla"."""
    T = 256 if interpret else 1024
    q, k, qi, ki, w, idx = inputs(T, H, HI, min(TOPK, T), seed=1, D=D, DI=DI)
    rows, _ = functions(sizes, interpret)

    def pallas(qi, ki, w):
        return jnp.sum(rows(q, k, qi, ki, w, idx))

    def xla(qi, ki, w):
        return hil.indexer_kl_loss(q, k, qi, ki, w, idx, scale=D**-0.5, impl="xla")

    got = jax.value_and_grad(pallas, argnums=(0, 1, 2))(qi, ki, w)
    want = jax.value_and_grad(xla, argnums=(0, 1, 2))(qi, ki, w)
    return [rel_err(a, b) for a, b in zip((got[0], *got[1]), (want[0], *want[1]))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--index-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=576, help="main q/k width D (MLA absorbed: 576)")
    p.add_argument("--index-dim", type=int, default=128, help="indexer width DI")
    p.add_argument("--sizes", nargs="*", default=[], help="BlockSizes variants, FIELD=V,...")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="CPU check only (no timing)")
    p.add_argument("--out", default=os.path.join("runs", "indexer_loss_parts"))
    args = p.parse_args(argv)
    variants = {"default": pil.BlockSizes()} | {
        s: block_sizes(pil.BlockSizes, s) for s in args.sizes
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records = []
    for H in args.heads:
        shape = dict(D=args.dim, DI=args.index_dim)
        ops = None if args.interpret else inputs(args.seq, H, args.index_heads, TOPK, **shape)
        for name, sizes in variants.items():
            rec = {"T": args.seq, "H": H, "HI": args.index_heads, **shape, "sizes": name}
            try:
                rec["rel_err_vs_xla"] = check(
                    sizes, H, args.index_heads, **shape, interpret=args.interpret
                )
                if ops is not None:
                    fwd, fb = functions(sizes)
                    g = jnp.ones((1, args.seq), jnp.float32)
                    rec["forward_ms"] = median_ms(fwd, ops, args.reps)
                    rec["forward_backward_ms"] = median_ms(fb, (*ops, g), args.reps)
            except Exception as e:  # e.g. beyond shared memory
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            records.append(rec)
            print(rec, flush=True)
    path = save(args.out, run_meta(), records, "indexer_loss_parts")
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing
    main()
