"""Tile sizes of the sparse-stage indexer loss kernels (pallas_kernels/indexer_loss.py), timed
on the GPU at the h200 layer preset's shapes (B=1, H=16, G=1, D=128, HI=32, DI=64, k=2048,
bf16, causal selection by hs.hytopk).

    PYTHONPATH=. python3 experiments/tune_indexer_loss.py --T 32768

Each variant's loss is checked against the default's (relative 1e-6) before it is timed.
Writes experiments/results/tune_indexer_loss.json (or --out): median ms of the forward and of
forward+backward (grads in q_idx, k_idx, w) per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hyscale_jax as hs  # noqa: E402
from bench_layer_parts import median_ms  # noqa: E402
from pallas_kernels import indexer_loss as pil  # noqa: E402

# name -> BlockSizes fields (block_k, num_warps, num_stages; the backward the same or _bwd)
VARIANTS = {
    "default": {},
    "k16": dict(block_k=16),
    "k32": dict(block_k=32),
    "k64": dict(block_k=64),
    "k64_w8": dict(block_k=64, num_warps=8, num_warps_bwd=8),
    "k128_w8": dict(block_k=128, num_warps=8, num_warps_bwd=8),
    "k32_s3": dict(block_k=32, num_stages=3, num_stages_bwd=3),
    "k32_w2": dict(block_k=32, num_warps=2, num_warps_bwd=2),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated names from: " + ",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    T, H, D, HI, DI, K = args.T, 16, 128, 32, 64, 2048
    ks = jax.random.split(jax.random.key(T), 6)
    n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, k = n(ks[0], (1, T, H, D)), n(ks[1], (1, T, 1, D))
    q_idx, k_idx = n(ks[2], (1, T, HI, DI)), n(ks[3], (1, T, DI))
    w = jax.random.uniform(ks[4], (1, T, HI), jnp.float32).astype(jnp.bfloat16)
    idx = jax.block_until_ready(jax.jit(lambda a, b, c: hs.hytopk(a, b, c, k=K))(q_idx, k_idx, w))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; T={T} H={H} D={D} "
          f"HI={HI} DI={DI} k={K}", flush=True)
    rows, reference = [], None
    for name in names:
        sizes = pil.BlockSizes(**VARIANTS[name])

        def loss(qi, ki, ww, sizes=sizes):
            return jnp.sum(pil.indexer_kl_rows(q, k, qi, ki, ww, idx, scale=D ** -0.5,
                                               block_sizes=sizes))

        fwd = jax.jit(loss)
        fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        value = float(fwd(q_idx, k_idx, w))
        reference = value if reference is None else reference
        row = dict(variant=name, block_sizes=VARIANTS[name], loss=value,
                   loss_rel_diff=abs(value - reference) / abs(reference))
        if row["loss_rel_diff"] > 1e-6:
            row["status"] = "loss differs from the first variant's"
        else:
            row["fwd_ms"] = median_ms(lambda: fwd(q_idx, k_idx, w), args.reps)
            row["fwd_bwd_ms"] = median_ms(lambda: fwd_bwd(q_idx, k_idx, w), args.reps)
            row["status"] = "ok"
        rows.append(row)
        print(f"{name:>10}: " + (f"fwd {row['fwd_ms']:8.2f} ms  fwd+bwd {row['fwd_bwd_ms']:8.2f} ms"
                                  if row["status"] == "ok" else row["status"]), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_indexer_loss.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, T=T,
                           shape=dict(B=1, H=H, G=1, D=D, HI=HI, DI=DI, k=K, dtype="bfloat16"),
                           reps=args.reps, argv=sys.argv[1:], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
