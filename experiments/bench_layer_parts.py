"""Where one HyScale layer's time goes (issue 5): the parts of `reproduce.py`'s layer, timed
alone at the h200 preset's shapes (H=16, G=1, D=128, HI=32, DI=64, k=2048, bf16, causal).

    PYTHONPATH=. python3 experiments/bench_layer_parts.py --T 8192 32768

Parts (each jitted alone, median of --reps after a warm-up):
  hytopk            the selection (impl auto: Pallas on GPU)
  attention fwd+bwd hs.sparse_attention, grads in q, k, v under a random cotangent
  indexer KL fwd    hs.indexer_kl_loss on the selected set (the sparse stage; impl auto:
                    Pallas on GPU), checked against impl="xla" (loss and gradients) first
  indexer KL fwd+bwd  the same with grads in q_idx, k_idx, w (as in training)
  indexer KL xla    fwd and fwd+bwd of the portable impl="xla", for comparison
  block fwd+bwd     the whole block (attention + indexer + MLP), hyscale/replay, from
                    reproduce.py, for the total the parts add up to
Writes experiments/results/bench_layer_parts.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reproduce  # noqa: E402

import hyscale_jax as hs  # noqa: E402

IMPLS = ("auto", "xla")  # the indexer loss: the default (Pallas on GPU), the portable version


def median_ms(fn, reps):
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parts(T, reps, cfg):
    B, H, D, HI, DI, K = 1, cfg.n_heads, cfg.head_dim, cfg.index_heads, cfg.index_dim, cfg.topk
    ks = jax.random.split(jax.random.key(T), 8)
    n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, k, v = n(ks[0], (B, T, H, D)), n(ks[1], (B, T, 1, D)), n(ks[2], (B, T, 1, D))
    q_idx, k_idx = n(ks[3], (B, T, HI, DI)), n(ks[4], (B, T, DI))
    w = jax.random.uniform(ks[5], (B, T, HI), jnp.float32).astype(jnp.bfloat16)
    cot = n(ks[6], (B, T, H, D))
    select = jax.jit(lambda a, b, c: hs.hytopk(a, b, c, k=K))
    idx = jax.block_until_ready(select(q_idx, k_idx, w))

    def attn_loss(q, k, v):
        out = hs.sparse_attention(q, k, v, idx)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    def kl(q_idx, k_idx, w, impl="auto"):
        return hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, impl=impl)

    attn = jax.jit(jax.grad(attn_loss, argnums=(0, 1, 2)))
    kl_fwd = {impl: jax.jit(lambda a, b, c, impl=impl: kl(a, b, c, impl)) for impl in IMPLS}
    kl_grad = {
        impl: jax.jit(
            jax.value_and_grad(lambda a, b, c, impl=impl: kl(a, b, c, impl), argnums=(0, 1, 2))
        )
        for impl in IMPLS
    }
    row = {"T": T}
    # The kernel's loss and gradients against the portable version, before any timing.
    (got, got_g), (want, want_g) = (kl_grad[impl](q_idx, k_idx, w) for impl in IMPLS)
    row["indexer_kl_loss"] = float(got)
    row["indexer_kl_loss_rel_err_vs_xla"] = abs(float(got) - float(want)) / abs(float(want))
    row["indexer_kl_grad_rel_err_vs_xla"] = max(
        float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        for a, b in zip(got_g, want_g)
    )
    row["hytopk_ms"] = median_ms(lambda: select(q_idx, k_idx, w), reps)
    row["attention_fwd_bwd_ms"] = median_ms(lambda: attn(q, k, v), reps)
    for impl, suffix in zip(IMPLS, ("", "_xla")):
        row[f"indexer_kl_fwd{suffix}_ms"] = median_ms(lambda: kl_fwd[impl](q_idx, k_idx, w), reps)
        row[f"indexer_kl_fwd_bwd{suffix}_ms"] = median_ms(
            lambda: kl_grad[impl](q_idx, k_idx, w), reps
        )
    block_cfg = dataclasses.replace(cfg, attention="hyscale", remat="replay")
    state, fn = reproduce._layer_fn(block_cfg, T)
    xs, r = reproduce._layer_inputs(block_cfg, B, T)
    row["block_fwd_bwd_ms"] = median_ms(lambda: fn(state, xs[0], r), reps)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--preset", default="h200", choices=sorted(reproduce.PRESETS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    cfg = reproduce.PRESETS[args.preset]["layer_model"]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_layer_parts.json")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; preset {args.preset}")
    for T in args.T:
        rows.append(parts(T, args.reps, cfg))
        print(
            "  ".join(
                f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                for key, val in rows[-1].items()
            ),
            flush=True,
        )
        with open(path, "w") as f:  # after every T: a timeout keeps what was measured
            json.dump(
                dict(
                    jax=jax.__version__,
                    device=jax.devices()[0].device_kind,
                    model=cfg.to_dict(),
                    argv=sys.argv[1:],
                    rows=rows,
                ),
                f,
                indent=1,
            )
    print("wrote", path)


if __name__ == "__main__":
    main()
