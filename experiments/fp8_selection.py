"""What the FP8 indexer changes in the selection of a trained model.

    PYTHONPATH=. python experiments/fp8_selection.py        # CPU: trains train.py's default
                                                             # model first if needed (~2 min)
    PYTHONPATH=. python experiments/fp8_selection.py --run DIR --batches 16 --out DIR

Takes a run of experiments/train.py (its newest checkpoint; with none in --run, first trains
train.py's cpu preset there) and, on held-out batches of its data (examples after the ones it
trained on), runs the model layer by layer. At each layer the indexer's outputs go through four
selections of the same k keys per query (hs.hytopk):
  bf16          the indexer as trained (compute dtype): the model's own selection
  fp8_hadamard  hs.quantize_indexer(hadamard=True): DeepSeek-V3.2's FP8 indexer (Hadamard
                rotation, float8_e4m3fn, per-row scales)
  fp8           hs.quantize_indexer(hadamard=False): the same without rotation
  f32           the same indexer weights computed in f32 from the same layer input: how much
                bf16's own rounding moves the selection, for scale
Figures, per layer, over the queries that see more than k keys (t >= k; earlier queries select
every visible key whatever the scores):
  overlap       |S_a & S_b| / k averaged over queries, for each pair of selections
  identical     the share of queries whose two selected sets are equal
  mass          the main attention probability (summed over heads, normalized: the indexer
                KL's target) that falls on the selected keys; "best" is the mass of the k most
                attended keys, "chance" that of k keys drawn at random, k / (t + 1)
The residual stream runs through the model's own (bf16) selection, so every layer sees the
inputs it was trained on. The attention probability is materialized ([B, T, T] per layer): for
short sequences. Writes fp8_selection.json and fp8_selection.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import hyscale_jax as hs  # noqa: E402
from hyscale_jax.data import Dataset  # noqa: E402
from hyscale_jax.nn import Indexer, ModelConfig, rope  # noqa: E402
from hyscale_jax.train import (  # noqa: E402
    Checkpointer,
    TrainConfig,
    create_train_state,
    train,
)

SELECTIONS = ("bf16", "fp8_hadamard", "fp8", "f32")
PAIRS = (
    ("fp8_hadamard", "bf16"),
    ("fp8", "bf16"),
    ("f32", "bf16"),
    ("fp8_hadamard", "f32"),
    ("fp8", "f32"),
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--run",
        default="runs/train/cpu",
        metavar="DIR",
        help="experiments/train.py run folder to evaluate; without a checkpoint there, train.py's "
        "cpu preset is trained into it first",
    )
    p.add_argument("--batches", type=int, default=8, metavar="N", help="held-out batches")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="sequences per batch (default: the run's)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="sequence length T (default: the run's)",
    )
    p.add_argument("--out", default="runs/fp8_selection", metavar="DIR", help="output folder")
    p.add_argument("--no-plot", action="store_true", help="do not draw fp8_selection.png")
    return p.parse_args(argv)


def load_run(run: Path):
    """(model, model_cfg, train_cfg, checkpoint step) of the newest intact checkpoint in `run`,
    training experiments/train.py's cpu preset into `run` first if it holds none."""
    ckpt = run / "ckpt"
    if not (run / "config.json").exists() or Checkpointer(ckpt).latest_step() is None:
        from experiments.train import PRESETS

        model_cfg, train_cfg = PRESETS["cpu"]
        print(f"no checkpoint in {run}: training experiments/train.py's cpu preset there")
        train(model_cfg, train_cfg, run, plot=False, run_info={"preset": "cpu"})
    meta = json.loads((run / "config.json").read_text())
    model_cfg = ModelConfig.from_dict(meta["model"])
    train_cfg = TrainConfig.from_dict(meta["train"])
    graphdef, like, _ = create_train_state(model_cfg, train_cfg)
    checkpointer = Checkpointer(ckpt)
    state, _, skipped = checkpointer.restore_newest_intact(like)
    checkpointer.close()
    for step, reason in skipped:
        print(f"skipped damaged checkpoint {step}: {reason}")
    return nnx.merge(graphdef, state.params), model_cfg, train_cfg, int(state.step)


def f32_indexers(model):
    """Each block's indexer with the same weights, computing in f32."""
    cfg = dataclasses.replace(model.config, dtype="float32")
    out = []
    for block in model.blocks:
        indexer = Indexer(cfg, rngs=nnx.Rngs(0))
        nnx.update(indexer, nnx.state(block.attn.indexer))
        out.append(indexer)
    return out


@nnx.jit
def evaluate(model, indexers32, tokens):
    """Per layer: ({selection: idx int32 [B, T, k]}, main attention probability p [B, T, T])."""
    cfg = model.config
    B, T = tokens.shape
    pos = jnp.arange(T, dtype=jnp.int32)
    sel = lambda q, k, w, s=None: hs.hytopk(q, k, w, k=cfg.topk, k_scale=s)  # noqa: E731
    x = model.embed(tokens)
    layers = []
    for block, indexer32 in zip(model.blocks, indexers32):
        h = block.attn_norm(x)
        q_idx, k_idx, w = block.attn.indexer(h, pos)
        sels = {"bf16": sel(q_idx, k_idx, w), "f32": sel(*indexer32(h.astype(jnp.float32), pos))}
        for name, hadamard in (("fp8_hadamard", True), ("fp8", False)):
            sels[name] = sel(*hs.quantize_indexer(q_idx, k_idx, w, hadamard=hadamard))
        attn = block.attn
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = rope(attn.q_proj(h).reshape(B, T, H, D), pos, cfg.rope_base)
        k = rope(attn.k_proj(h).reshape(B, T, G, D), pos, cfg.rope_base)
        q = q.reshape(B, T, G, H // G, D).astype(jnp.float32)
        logits = jnp.einsum("btgjd,bsgd->bgjts", q, k.astype(jnp.float32)) * D**-0.5
        logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1).mean(axis=(1, 2))  # [B, T, S]
        layers.append((sels, p))
        x, _ = block(x, pos, indexer_stage="none")
    return layers


def overlap(a, b):
    """|a_row & b_row| per row of int [N, k] selections without repeats (-1 entries ignored)."""
    hit = (a[:, :, None] == b[:, None, :]) & (a[:, :, None] >= 0)
    return hit.any(-1).sum(-1)


def mass(p, idx):
    """The probability p [B, T, S] on the selected keys idx [B, T, k] -> [B, T]."""
    taken = np.take_along_axis(p, np.maximum(idx, 0), axis=-1)
    return np.where(idx >= 0, taken, 0.0).sum(-1)


def plot(record, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = record["layers"]
    n = len(layers)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(PAIRS)
    for i, (a, b) in enumerate(PAIRS):
        key = f"{a}|{b}"
        ax1.bar(
            np.arange(n) + i * width,
            [layer["overlap"][key] for layer in layers],
            width,
            label=f"{a} vs {b}",
        )
    ax1.set_xticks(np.arange(n) + 0.4 - width / 2, [f"layer {i}" for i in range(n)])
    lowest = min(v for layer in layers for v in layer["overlap"].values())
    ax1.set_ylim(max(0.0, np.floor(lowest * 20 - 0.5) / 20), 1.0)
    ax1.set_ylabel("|S_a & S_b| / k")
    ax1.set_title("selected-set overlap (queries with t >= k)")
    ax1.legend(fontsize=8, loc="lower right")
    names = (*SELECTIONS, "best", "chance")
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax2.bar(
            np.arange(n) + i * width, [layer["mass"][name] for layer in layers], width, label=name
        )
    ax2.set_xticks(np.arange(n) + 0.4 - width / 2, [f"layer {i}" for i in range(n)])
    ax2.set_ylabel("main attention mass on the selection")
    ax2.set_title("attention mass captured")
    ax2.legend(fontsize=8, loc="upper left")
    ev = record["eval"]
    fig.suptitle(
        f"FP8 indexer selection, {ev['batches']} x {ev['batch_size']} x T={ev['seq_len']}, "
        f"k={ev['topk']} ({record['device']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    run, out = Path(args.run), Path(args.out)
    model, model_cfg, train_cfg, step = load_run(run)
    B = args.batch_size or train_cfg.batch_size
    T = args.seq_len or train_cfg.seq_len
    k = model_cfg.topk
    if T <= k:
        raise ValueError(f"--seq-len must exceed the model's topk={k} to leave a choice; got {T}")
    device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
    print(
        f"jax {jax.__version__} on {device}; run {run} at step {step}; {args.batches} held-out "
        f"batches of {B} x T={T}, k={k}, {model_cfg.n_layers} layers"
    )
    data = Dataset(train_cfg.data)
    # Example i of data step s is number s * batch + i: start past every trained example.
    first = -(-train_cfg.steps * train_cfg.batch_size // B)
    indexers32 = f32_indexers(model)
    rows = slice(k, None)  # queries t >= k see more than k keys
    per_batch = [
        {"overlap": {}, "identical": {}, "mass": {}} for _ in range(model_cfg.n_layers)
    ]  # lists of per-batch means
    for i in range(args.batches):
        tokens = jnp.asarray(data.batch(first + i, B, T)["tokens"][:, :T])
        layers = jax.device_get(evaluate(model, indexers32, tokens))
        line = []
        for li, (sels, p) in enumerate(layers):
            sels = {n: np.asarray(s)[:, rows].reshape(-1, k) for n, s in sels.items()}
            p = np.asarray(p, np.float64)[:, rows]
            acc = per_batch[li]
            for a, b in PAIRS:
                ov = overlap(sels[a], sels[b])
                acc["overlap"].setdefault(f"{a}|{b}", []).append(float(ov.mean() / k))
                acc["identical"].setdefault(f"{a}|{b}", []).append(float((ov == k).mean()))
            for name in SELECTIONS:
                m = mass(p, sels[name].reshape(B, -1, k))
                acc["mass"].setdefault(name, []).append(float(m.mean()))
            best = -np.sort(-p, axis=-1)[..., :k].sum(-1)
            acc["mass"].setdefault("best", []).append(float(best.mean()))
            t = np.arange(k, T)
            acc["mass"].setdefault("chance", []).append(float(np.mean(k / (t + 1))))
            line.append(
                f"L{li} fp8_hadamard {acc['overlap']['fp8_hadamard|bf16'][-1]:.4f} "
                f"fp8 {acc['overlap']['fp8|bf16'][-1]:.4f} f32 {acc['overlap']['f32|bf16'][-1]:.4f}"
            )
        print(
            f"[{time.perf_counter() - t0:7.1f} s] batch {i + 1}/{args.batches}: overlap with bf16: "
            + "; ".join(line),
            flush=True,
        )
    layer_records = []
    for li, acc in enumerate(per_batch):
        layer_records.append(
            {
                "layer": li,
                **{
                    what: {key: float(np.mean(v)) for key, v in acc[what].items()}
                    for what in ("overlap", "identical", "mass")
                },
                "overlap_per_batch": acc["overlap"],
            }
        )
    record = {
        "script": "fp8_selection",
        "command": shlex.join([Path(sys.executable).name] + sys.argv),
        "jax": jax.__version__,
        "device": device,
        "run": str(run),
        "checkpoint_step": step,
        "model": model_cfg.to_dict(),
        "eval": {
            "batches": args.batches,
            "batch_size": B,
            "seq_len": T,
            "topk": k,
            "first_data_step": first,
            "data": dataclasses.asdict(train_cfg.data),
            "queries_per_layer": args.batches * B * (T - k),
        },
        "layers": layer_records,
        "mean_over_layers": {
            what: {
                key: float(np.mean([lr[what][key] for lr in layer_records]))
                for key in layer_records[0][what]
            }
            for what in ("overlap", "identical", "mass")
        },
        "wall_s": time.perf_counter() - t0,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_selection.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'layer':>5} " + " ".join(f"{a + ' vs ' + b:>22}" for a, b in PAIRS))
    for lr in layer_records:
        print(
            f"{lr['layer']:>5} "
            + " ".join(
                f"{lr['overlap'][f'{a}|{b}']:>10.4f} ({lr['identical'][f'{a}|{b}']:.3f} eq)"
                for a, b in PAIRS
            )
        )
    print(
        "attention mass on the selection: "
        + "; ".join(
            f"L{lr['layer']} "
            + " ".join(f"{n} {lr['mass'][n]:.4f}" for n in (*SELECTIONS, "best", "chance"))
            for lr in layer_records
        )
    )
    print(f"record: {out / 'fp8_selection.json'}", end="")
    if not args.no_plot:
        plot(record, out / "fp8_selection.png")
        print(f"; plot: {out / 'fp8_selection.png'}", end="")
    print()


if __name__ == "__main__":
    main()
