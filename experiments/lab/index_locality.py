"""Lab probe: does the pattern of the selected indices change the sparse-stage kernels' time?

    PYTHONPATH=. python3 experiments/lab/index_locality.py [--T 32768] [--reps 5] [--out DIR]

In GLM-5.1's layer at T = 32K the key-gradient kernel took 110.70 ms per step (profiled) where
bench_attention's random indices give ~92 ms alone. This times the same operations, at the
preset's shapes (B = 1, bf16; random q, keys and cotangent), over four index sets:
  random          bench_attention's causal stratified random indices (ascending per row)
  layer           HyTopK over the GLM-5.1 layer's own indexer outputs (its initial weights,
                  random hidden states), score order, as the model selects
  layer_index     the same keys by ascending index (`order="index"`)
  layer_shuffled  the same keys, each row in a random order
  layer_strided   the layer's rows (queries, their keys, cotangents, indexer inputs) permuted so
                  that program i works on query (i * a) mod T, a ~ 0.618 T coprime to T: the
                  kernels' programs running at once then hold queries spread over the sequence
                  instead of neighbours (the same sums, in another order)
Per set: how the keys are shared (selections per key: max, 99th percentile; the share of a
row's keys also in the row before it; distinct keys per 128 consecutive rows), the sparse
attention's forward+backward and the indexer KL loss's forward+backward (given the attention's
log-sum-exps, as the model calls it), median ms, and the kernels' ms from one profiled run of
each. Writes <out>/index_locality.json (default runs/index_locality/). Needs a GPU for timings;
--sharing-only reports how the random and the layer's rows share keys, at the preset's shapes,
on any backend (on a CPU, the `xla` selection).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import reproduce  # noqa: E402
from bench_attention import causal_random_indices  # noqa: E402
from bench_layer_parts import attention_shapes  # noqa: E402
from flax import nnx  # noqa: E402
from layer_profile import kernel_events, summarize  # noqa: E402

import hyscale_jax as hs  # noqa: E402
from hyscale_jax.nn import Block  # noqa: E402


def sharing(idx, window: int = 128) -> dict:
    """How rows of idx [1, T, k] (int32, -1 padded) share keys."""
    rows = idx[0]
    T, k = rows.shape
    valid = rows >= 0
    counts = jnp.zeros(T, jnp.int32).at[jnp.where(valid, rows, T)].add(1, mode="drop")
    srt = jnp.sort(jnp.where(valid, rows, jnp.iinfo(jnp.int32).max), axis=-1)
    prev = srt[:-1]
    pos = jax.vmap(jnp.searchsorted)(prev, srt[1:])
    found = jnp.take_along_axis(prev, jnp.minimum(pos, k - 1), axis=-1) == srt[1:]
    real_next = srt[1:] < jnp.iinfo(jnp.int32).max  # validity in the sorted rows' order
    shared_prev = jnp.sum(found & real_next) / jnp.maximum(jnp.sum(real_next), 1)
    n_win = T // window
    blocks = srt[: n_win * window].reshape(n_win, window * k)
    blocks = jnp.sort(blocks, axis=-1)
    real = blocks < jnp.iinfo(jnp.int32).max
    distinct = jnp.sum(
        real
        & jnp.concatenate([jnp.ones((n_win, 1), bool), blocks[:, 1:] != blocks[:, :-1]], axis=1),
        axis=1,
    ) / jnp.maximum(jnp.sum(real, axis=1), 1)
    return {
        "selections_per_key_max": int(jnp.max(counts)),
        "selections_per_key_p99": float(jnp.percentile(counts, 99)),
        "selections_per_key_mean": float(jnp.mean(counts)),
        "shared_with_previous_row": float(shared_prev),
        f"distinct_share_per_{window}_rows": float(jnp.mean(distinct)),
    }


def record_header(args) -> dict:
    """What every record of this probe starts with."""
    return {
        "jax": jax.__version__,
        "device": reproduce.device_name(),
        "preset": args.preset,
        "T": args.T,
        "command": reproduce.command_line(),
    }


def layer_indexer_outputs(cfg, T: int):
    """(q_idx, k_idx, w) of cfg's layer indexer: initial weights, random hidden states."""
    block = Block(cfg, rngs=nnx.Rngs(0))
    (x, _), _ = reproduce._layer_inputs(cfg, 1, T)
    positions = jnp.arange(T, dtype=jnp.int32)
    indexer = nnx.jit(lambda block, x, pos: block.attn.indexer(block.attn_norm(x), pos))
    return indexer(block, x, positions)


def sharing_only(cfg, args) -> None:
    """How rows share keys: bench_attention's random indices against the layer's own."""
    T, K = args.T, cfg.topk
    q_idx, k_idx, w = layer_indexer_outputs(cfg, T)
    sets = {
        "random": causal_random_indices(jax.random.key(5), B=1, T=T, k=K),
        "layer": hs.hytopk(q_idx, k_idx, w, k=K),
    }
    record = {
        **record_header(args),
        # each set whole, and its second half alone (rows that hold k keys, past the causal ramp)
        "sets": {
            name + part: sharing(idx[:, rows])
            for name, idx in sets.items()
            for part, rows in (("", slice(None)), ("_second_half", slice(T // 2, None)))
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_sharing.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record["sets"], indent=1))
    print(f"wrote {out / 'index_sharing.json'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="glm-5.1", choices=["glm-5.1", "deepseek-v3.2"])
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="runs/index_locality")
    p.add_argument(
        "--sharing-only",
        action="store_true",
        help="only how the random and the layer's own rows share keys (no timing; any backend)",
    )
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    cfg = dataclasses.replace(
        reproduce.PRESETS[args.preset]["layer_model"], attention="hyscale", remat="none"
    )
    if args.sharing_only:
        return sharing_only(cfg, args)
    if not on_gpu:  # a CPU smoke run of the pipeline at small shapes
        cfg = dataclasses.replace(reproduce.PRESETS["cpu"]["layer_model"], attention="hyscale")
    T, K, H = args.T, cfg.topk, cfg.n_heads
    D, Dv, value_dim, scale = attention_shapes(cfg)
    q_idx, k_idx, w = layer_indexer_outputs(cfg, T)
    ks = jax.random.split(jax.random.key(7), 6)
    n = lambda key, s: jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, kv = n(ks[0], (1, T, H, D)), n(ks[1], (1, T, 1, D))
    v = None if value_dim else n(ks[2], (1, T, 1, Dv))
    cot = n(ks[3], (1, T, H, Dv))

    layer = hs.hytopk(q_idx, k_idx, w, k=K)
    perm = jnp.argsort(jax.random.uniform(ks[4], layer.shape), axis=-1)
    index_sets = {
        "random": causal_random_indices(ks[5], B=1, T=T, k=K),
        "layer": layer,
        "layer_index": hs.hytopk(q_idx, k_idx, w, k=K, order="index"),
        "layer_shuffled": jnp.take_along_axis(layer, perm, axis=-1),
    }

    def attn_loss(q, k, v, idx, cot):
        out = hs.sparse_attention(q, k, v, idx, scale=scale, value_dim=value_dim)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    grad_args = (0, 1) if value_dim else (0, 1, 2)
    attn = jax.jit(jax.grad(attn_loss, argnums=grad_args))
    lse_fn = jax.jit(
        lambda q, k, v, idx: hs.sparse_attention(
            q, k, v, idx, scale=scale, value_dim=value_dim, return_lse=True
        )[1]
    )
    kl = jax.jit(
        jax.value_and_grad(
            lambda a, b, c, q, k, idx, lse: hs.indexer_kl_loss(
                q, k, a, b, c, idx, scale=scale, attention_lse=lse
            ),
            argnums=(0, 1, 2),
        )
    )
    # A stride permutation of the query axis: neighbouring programs get distant queries.
    a = int(T * 0.6180339887) | 1
    while math.gcd(a, T) != 1:
        a += 2
    order = (jnp.arange(T, dtype=jnp.int32) * a) % T
    # Per set: its per-query operands (q, cot, q_idx, w), its indices, and the indices whose
    # sharing is reported (the strided set's are the layer's own, in program order).
    plain = (q, cot, q_idx, w)
    cases = {name: (plain, idx, idx) for name, idx in index_sets.items()}
    cases["layer_strided"] = (tuple(x[:, order] for x in plain), layer[:, order], layer)
    record = {
        **record_header(args),
        "sets": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, ((q_, cot_, q_idx_, w_), idx, unpermuted) in cases.items():
        row = sharing(unpermuted)
        lse = lse_fn(q_, kv, v, idx)
        row["attention_fwd_bwd_ms"] = reproduce.median_ms(
            lambda: attn(q_, kv, v, idx, cot_), args.reps
        )
        kl_args = (q_idx_, k_idx, w_, q_, kv, idx, lse)
        row["indexer_kl_fwd_bwd_ms"] = reproduce.median_ms(lambda: kl(*kl_args), args.reps)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready(attn(q_, kv, v, idx, cot_))
                jax.block_until_ready(kl(*kl_args))
            events, _ = kernel_events(trace_dir)
        kernels = summarize(events, 1)["top_kernels"]
        row["kernels_ms"] = {k["name"][:60]: round(k["ms_per_step"], 3) for k in kernels[:12]}
        record["sets"][name] = row
        (out / "index_locality.json").write_text(json.dumps(record, indent=1))
        print(
            f"\n{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "kernels_ms")
        )
        for kname, ms in row["kernels_ms"].items():
            print(f"    {ms:9.3f} ms  {kname}")
    print(f"\nwrote {out / 'index_locality.json'}")


if __name__ == "__main__":
    main()
