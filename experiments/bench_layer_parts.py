"""Where one HyScale layer's time goes: the parts of reproduce.py's layer, each timed alone.

    PYTHONPATH=. python experiments/bench_layer_parts.py                 # GPU: h200, T = 8K, 32K
    PYTHONPATH=. python experiments/bench_layer_parts.py --preset cpu --T 256
    PYTHONPATH=. python experiments/bench_layer_parts.py --preset glm-5.1      # GPU: 8K, 32K

Shapes: reproduce.py's layer model of the preset (h200: H=16, G=1, D=128, HI=32, DI=64, k=2048;
glm-5.1 / deepseek-v3.2: MLA's absorbed form, 64 / 128 heads of D = 576 over one shared latent
row, value its first 512 features, HI = 32 / 64, DI = 128), batch 1, bf16, causal. Parts, each
jitted alone:
  hytopk              the selection (impl auto: Pallas on GPU)
  attention fwd+bwd   hs.sparse_attention, grads in q, k, v under a random cotangent
  indexer KL fwd      hs.indexer_kl_loss on the selected set (the sparse stage; impl auto:
                      Pallas on GPU)
  indexer KL fwd+bwd  the same with grads in q_idx, k_idx, w (as in training)
  ... given lse       both with the attention's log-sum-exps passed in (`attention_lse`, as the
                      model does): the Pallas forward sweeps the selected keys once
  indexer KL xla      fwd and fwd+bwd of the portable impl="xla", for comparison
  block fwd+bwd       the whole block (attention + indexer + MLP), hyscale/replay, from
                      reproduce.py: the total the parts add up to
Before timing, the indexer KL loss and gradients of impl auto, with and without the attention's
log-sum-exps, are compared with impl="xla" (their relative errors are recorded). Timing: one
warm-up call, then the median of --reps calls, each synchronized with block_until_ready. Ratios
in the record: each part's share of the block time and the indexer KL speedup over xla, all
from the same run.

Output: <out>/bench_layer_parts.{json,png}, by default under runs/bench_layer_parts/; the JSON
is rewritten after every T. What bounds each part: docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reproduce

import hyscale_jax as hs

# The indexer loss's variants, by record-key suffix: (impl, given the attention's lse): the
# default (Pallas on GPU), the same given the log-sum-exps, the portable version.
KL_VARIANTS = {"": ("auto", False), "_given_lse": ("auto", True), "_xla": ("xla", False)}
DEFAULT_T = {"cpu": [256], "h200": [8192, 32768], "glm-5.1": [8192, 32768], "deepseek-v3.2": [8192]}
# Parts whose shares of the block time the record reports (they run once per block fwd+bwd).
SHARES = ("hytopk", "attention_fwd_bwd", "indexer_kl_fwd_bwd")


def attention_shapes(cfg) -> tuple[int, int, int | None, float | None]:
    """(D, Dv, value_dim, scale) of the layer's sparse attention: GQA heads of head_dim with a
    separate value (value_dim None, the default scale), or MLA's absorbed form, D = kv_lora_rank
    + qk_rope_dim over one shared latent row whose first kv_lora_rank features are the value,
    scaled as the model scales it ((qk_nope_dim + qk_rope_dim) ** -0.5)."""
    if cfg.attention_kind != "mla":
        return cfg.head_dim, cfg.head_dim, None, None
    C, R = cfg.kv_lora_rank, cfg.qk_rope_dim
    return C + R, C, C, (cfg.qk_nope_dim + R) ** -0.5


def parts(T, reps, cfg, progress: reproduce.Progress):
    B, H, HI, DI, K = 1, cfg.n_heads, cfg.index_heads, cfg.index_dim, cfg.topk
    D, Dv, value_dim, scale = attention_shapes(cfg)
    ks = jax.random.split(jax.random.key(T), 8)
    n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, k = n(ks[0], (B, T, H, D)), n(ks[1], (B, T, 1, D))
    v = None if value_dim else n(ks[2], (B, T, 1, Dv))
    q_idx, k_idx = n(ks[3], (B, T, HI, DI)), n(ks[4], (B, T, DI))
    w = jax.random.uniform(ks[5], (B, T, HI), jnp.float32).astype(jnp.bfloat16)
    cot = n(ks[6], (B, T, H, Dv))
    select = jax.jit(lambda a, b, c: hs.hytopk(a, b, c, k=K))
    idx = jax.block_until_ready(select(q_idx, k_idx, w))

    # Every array is an argument of the jitted functions: an array a function closes over is
    # compiled in as a constant (gigabytes at 32K: slow compiles and a second copy in memory).
    def attn_loss(q, k, v, idx, cot):
        out = hs.sparse_attention(q, k, v, idx, scale=scale, value_dim=value_dim)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    def kl(q_idx, k_idx, w, q, k, idx, lse, impl="auto"):
        return hs.indexer_kl_loss(
            q, k, q_idx, k_idx, w, idx, scale=scale, impl=impl, attention_lse=lse
        )

    attn = jax.jit(jax.grad(attn_loss, argnums=(0, 1) if value_dim else (0, 1, 2)))
    kl_fwd, kl_grad = {}, {}
    for suffix, (impl, _) in KL_VARIANTS.items():
        kl_fwd[suffix] = jax.jit(functools.partial(kl, impl=impl))
        kl_grad[suffix] = jax.jit(
            jax.value_and_grad(functools.partial(kl, impl=impl), argnums=(0, 1, 2))
        )
    lse = jax.jit(
        lambda q, k, v, idx: hs.sparse_attention(
            q, k, v, idx, scale=scale, value_dim=value_dim, return_lse=True
        )[1]
    )(q, k, v, idx)
    kl_args = {
        suffix: (q_idx, k_idx, w, q, k, idx, lse if given else None)
        for suffix, (_, given) in KL_VARIANTS.items()
    }
    row = {"T": T}
    # The kernel's loss and gradients against the portable version, before any timing.
    progress.start(f"T={T} check indexer KL (auto, auto given lse, against xla)")
    want, want_g = kl_grad["_xla"](*kl_args["_xla"])
    for suffix in ("", "_given_lse"):
        got, got_g = kl_grad[suffix](*kl_args[suffix])
        row[f"indexer_kl_loss{suffix}"] = float(got)
        row[f"indexer_kl_loss{suffix}_rel_err_vs_xla"] = abs(float(got - want)) / abs(float(want))
        row[f"indexer_kl_grad{suffix}_rel_err_vs_xla"] = max(
            float(
                jnp.linalg.norm((a - b).astype(jnp.float32))
                / jnp.linalg.norm(b.astype(jnp.float32))
            )
            for a, b in zip(got_g, want_g)
        )
    progress.done(
        ", ".join(
            f"{name} loss rel err {row[f'indexer_kl_loss{s}_rel_err_vs_xla']:.2g}, "
            f"grad rel err {row[f'indexer_kl_grad{s}_rel_err_vs_xla']:.2g}"
            for s, name in (("", "auto"), ("_given_lse", "given lse"))
        )
    )

    def timed(key, fn):
        progress.start(f"T={T} {key}")
        row[f"{key}_ms"] = reproduce.median_ms(fn, reps)
        progress.done(f"{row[f'{key}_ms']:.3f} ms")

    timed("hytopk", lambda: select(q_idx, k_idx, w))
    timed("attention_fwd_bwd", lambda: attn(q, k, v, idx, cot))
    for s in KL_VARIANTS:
        timed(f"indexer_kl_fwd{s}", lambda s=s: kl_fwd[s](*kl_args[s]))
        timed(f"indexer_kl_fwd_bwd{s}", lambda s=s: kl_grad[s](*kl_args[s]))
    block_cfg = dataclasses.replace(cfg, attention="hyscale", remat="replay")
    state, fn = reproduce._layer_fn(block_cfg, T)
    xs, r = reproduce._layer_inputs(block_cfg, B, T)
    timed("block_fwd_bwd", lambda: fn(state, xs[0], r))
    row["share_of_block"] = {key: row[f"{key}_ms"] / row["block_fwd_bwd_ms"] for key in SHARES}
    row["indexer_kl_speedup_vs_xla"] = {
        phase: row[f"indexer_kl_{phase}_xla_ms"] / row[f"indexer_kl_{phase}_ms"]
        for phase in ("fwd", "fwd_bwd")
    }
    return row


def plot(record: dict, path: Path) -> None:
    """Left: per T, the block's time stacked by part (the rest is projections, MLP and norms).
    Right: the indexer KL loss, impl auto (with and without the lse given) against impl xla."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    xs = list(range(len(rows)))
    labels = [f"T = {row['T']}" for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(4 + 3 * len(rows), 4))
    bottom = [0.0] * len(rows)
    for i, key in enumerate(SHARES):
        ms = [row[f"{key}_ms"] for row in rows]
        left.bar(xs, ms, 0.6, bottom=bottom, label=key, color=f"C{i}")
        bottom = [b + m for b, m in zip(bottom, ms)]
    rest = [max(row["block_fwd_bwd_ms"] - b, 0.0) for row, b in zip(rows, bottom)]
    left.bar(xs, rest, 0.6, bottom=bottom, label="rest of the block", color="0.8")
    for x, row in zip(xs, rows):
        left.annotate(
            f"{row['block_fwd_bwd_ms']:.1f} ms",
            (x, max(row["block_fwd_bwd_ms"], bottom[x])),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    left.set_xticks(xs, labels)
    left.set_ylabel("ms")
    left.set_title("block fwd+bwd (hyscale/replay), by part")
    left.legend(fontsize=8)
    names = {"": "auto", "_given_lse": "auto, lse given", "_xla": "xla"}
    bars = [(suffix, phase) for phase in ("fwd", "fwd_bwd") for suffix in KL_VARIANTS]
    width = 0.8 / len(bars)
    for i, (suffix, phase) in enumerate(bars):
        right.bar(
            [x + (i - (len(bars) - 1) / 2) * width for x in xs],
            [row[f"indexer_kl_{phase}{suffix}_ms"] for row in rows],
            width,
            label=f"{phase.replace('_', '+')} {names[suffix]}",
            color=f"C{3 + i}",
        )
    right.set_xticks(xs, labels)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("indexer KL loss: impl auto (lse given or not) against xla")
    right.legend(fontsize=8)
    fig.suptitle(f"{record['device']}, jax {record['jax']}, preset {record['preset']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=reproduce.HelpFormatter)
    ap.add_argument(
        "--T",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths T = S (default: h200 8192 32768; cpu 256)",
    )
    ap.add_argument("--reps", type=int, default=5, help="timed calls per part, median reported")
    ap.add_argument(
        "--preset",
        default=None,
        choices=sorted(reproduce.PRESETS),
        help="reproduce.py's layer model to take the shapes from (default: h200 on a GPU, cpu "
        "elsewhere)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="folder for the JSON and PNG (default: runs/bench_layer_parts/ in the repository)",
    )
    args = ap.parse_args(argv)
    preset = args.preset or ("h200" if jax.default_backend() == "gpu" else "cpu")
    lengths = args.T or DEFAULT_T[preset]
    cfg = reproduce.PRESETS[preset]["layer_model"]
    out = Path(args.out) if args.out else reproduce.RUNS / "bench_layer_parts"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_layer_parts.json"
    progress = reproduce.Progress()
    record = dict(
        jax=jax.__version__,
        device=reproduce.device_name(),
        preset=preset,
        model=cfg.to_dict(),
        B=1,
        dtype="bfloat16",
        reps=args.reps,
        command=reproduce.command_line(),
        rows=[],
    )
    print(f"jax {jax.__version__} on {record['device']}; preset {preset}; writing to {out}")
    for T in lengths:
        record["rows"].append(parts(T, args.reps, cfg, progress))
        record["wall_s"] = progress.elapsed()
        path.write_text(json.dumps(record, indent=1) + "\n")  # a stopped run keeps every T done
    plot(record, path.with_suffix(".png"))
    print(f"\n{'T':>8} | " + " | ".join(f"{key} share" for key in SHARES) + " | KL speedup vs xla")
    for row in record["rows"]:
        shares = " | ".join(f"{row['share_of_block'][key]:>{len(key) + 6}.2f}" for key in SHARES)
        speedup = row["indexer_kl_speedup_vs_xla"]
        speedup = f"fwd {speedup['fwd']:.2f}x, fwd+bwd {speedup['fwd_bwd']:.2f}x"
        print(f"{row['T']:>8} | {shares} | {speedup}")
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
