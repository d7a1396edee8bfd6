"""Replay fidelity: does the backward pass attend to the keys the forward pass selected?

    PYTHONPATH=. python experiments/train.py                                   # a trained model
    PYTHONPATH=. python experiments/replay_fidelity.py --run runs/train/cpu    # ~2 minutes (CPU)

For each dtype and rematerialization (remat "none", "full", "replay"), one gradient of the
training loss (sparse indexer stage) per batch, with every selection observed where the
compiled program runs it (`hyscale_jax.replay_check`, docs/design.md 'Replay fidelity'):
per layer, how many times the selection ran and the share of the forward's index entries
(rows) that the backward pass's recomputation changed. Beside it, the largest relative
difference ||g - g_none|| / ||g_none|| over the parameter-gradient leaves against remat "none".

--run loads the newest checkpoint of an experiments/train.py run folder (its model and data);
without it the model is the cpu preset's at its random initialization. Batches are drawn past the
run's last training step. Output: <out>/replay_fidelity.{json,png}, by default under
runs/replay_fidelity/.
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
import numpy as np  # noqa: E402

from hyscale_jax.data import Dataset  # noqa: E402
from hyscale_jax.nn import ModelConfig  # noqa: E402
from hyscale_jax.replay_check import selection_drift  # noqa: E402
from hyscale_jax.train import Checkpointer, TrainConfig, create_train_state  # noqa: E402

REMATS = ("none", "full", "replay")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, except None (those helps say what happens)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def load(run: str | None):
    """(model config, train config, params, step): a train.py run's newest checkpoint, or the
    cpu preset's model at its initialization."""
    if run is None:
        sys.path.insert(0, str(ROOT / "experiments"))
        from train import PRESETS

        model_cfg, train_cfg = PRESETS["cpu"]
        _, state, _ = create_train_state(model_cfg, train_cfg)
        return model_cfg, train_cfg, state.params, 0
    meta = json.loads((Path(run) / "config.json").read_text())
    model_cfg = ModelConfig.from_dict(meta["model"])
    train_cfg = TrainConfig.from_dict(meta["train"])
    _, like, _ = create_train_state(model_cfg, train_cfg)
    state, _ = Checkpointer(Path(run) / "ckpt").restore(like)
    return model_cfg, train_cfg, state.params, int(state.step)


def max_rel_diff(grads, reference) -> float:
    """Largest ||g - r|| / ||r|| over the leaves whose reference is nonzero."""
    worst = 0.0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        if np.linalg.norm(r) > 0:
            worst = max(worst, float(np.linalg.norm(g - r) / np.linalg.norm(r)))
    return worst


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if r["remat"] != "none"]
    n_layers = len(rows[0]["changed_fraction"])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = np.arange(n_layers) + (i - (len(rows) - 1) / 2) * width
        bars = ax.bar(xs, 100 * np.asarray(r["changed_fraction"]), width, label=r["mode"])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(n_layers), [f"layer {i}" for i in range(n_layers)])
    ax.set_ylabel("index entries changed in backward (%)")
    ax.set_title("selection recomputed in the backward pass vs the forward's", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"{record['device']}, jax {record['jax']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--run",
        default=None,
        help="experiments/train.py run folder to load (default: the cpu preset's model at init)",
    )
    p.add_argument("--dtypes", default="bfloat16,float32", help="activation dtypes to measure")
    p.add_argument("--batches", type=int, default=2, help="batches measured (averaged)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="sequences per batch (default: the run's)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="length T (default: the run's)")
    p.add_argument("--impl", default="auto", help="kernels (auto|pallas|interpret|xla|reference)")
    p.add_argument(
        "--out",
        default=None,
        help="folder for the JSON and PNG (default: runs/replay_fidelity/ in the repository)",
    )
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else ROOT / "runs" / "replay_fidelity"
    out.mkdir(parents=True, exist_ok=True)

    model_cfg, train_cfg, params, step = load(args.run)
    B = args.batch_size or train_cfg.batch_size
    T = args.seq_len or train_cfg.seq_len
    dataset = Dataset(train_cfg.data)
    batches = [dataset.batch(step + i, B, T) for i in range(args.batches)]
    device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
    print(
        f"jax {jax.__version__} on {device}; {'run ' + args.run if args.run else 'init'} at "
        f"step {step}; {model_cfg.n_layers} layers, k={model_cfg.topk}, B={B}, T={T}"
    )
    record = {
        "jax": jax.__version__,
        "device": device,
        "run": args.run,
        "train_step": step,
        "model": model_cfg.to_dict(),
        "B": B,
        "T": T,
        "batches": args.batches,
        "impl": args.impl,
        "command": shlex.join([Path(sys.executable).name] + sys.argv),
        "results": [],
    }
    t0 = time.perf_counter()
    for dtype in args.dtypes.split(","):
        reference = []  # remat "none"'s gradients, per batch
        for remat in REMATS:
            cfg = dataclasses.replace(model_cfg, dtype=dtype, remat=remat, impl=args.impl)
            runs, changed, rows, grad_diff = [], [], [], []
            for i, batch in enumerate(batches):
                r = selection_drift(cfg, params, batch)
                runs.append(r["selection_runs"])
                changed.append(r["changed_fraction"])
                rows.append(r["rows_changed_fraction"])
                if remat == "none":
                    reference.append(r["grads"])
                else:
                    grad_diff.append(max_rel_diff(r["grads"], reference[i]))
            result = {
                "mode": f"{dtype}/{remat}",
                "dtype": dtype,
                "remat": remat,
                "selection_runs": runs[0],
                "changed_fraction": np.mean(changed, axis=0).tolist(),
                "rows_changed_fraction": np.mean(rows, axis=0).tolist(),
                "changed_fraction_per_batch": changed,
                "max_rel_grad_diff_vs_none": max(grad_diff) if grad_diff else 0.0,
            }
            record["results"].append(result)
            print(
                f"[{time.perf_counter() - t0:6.1f} s] {dtype}/{remat}: selection runs per layer "
                f"{runs[0]}; entries changed "
                + ", ".join(
                    f"L{i} {100 * f:.2f}%" for i, f in enumerate(result["changed_fraction"])
                )
                + "; rows changed "
                + ", ".join(
                    f"L{i} {100 * f:.1f}%" for i, f in enumerate(result["rows_changed_fraction"])
                )
                + f"; max grad diff vs none {100 * result['max_rel_grad_diff_vs_none']:.2f}%",
                flush=True,
            )
    record["wall_s"] = time.perf_counter() - t0
    path = out / "replay_fidelity.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    plot(record, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
