"""Compare training runs of experiments/train.py step by step: curves on one plot, and how far
each run's losses move from the first run's.

    PYTHONPATH=. python experiments/compare_runs.py runs/train/h200-retrieval \\
        runs/train/h200-retrieval-materialized runs/train/h200-retrieval-dense

Runs with the same data, seed and model that differ only in how attention selects
(hyscale/replay against materialized/full) compute the same function: with equal selections
their curves agree up to floating-point noise, so the largest divergence of their LM loss
measures that noise (and any selection that differs). Dense attention is the quality reference.
For every run after the first, over the steps both logged: the largest absolute difference of
the LM cross-entropy and of the total loss from the first run's, where it occurs, the first
step at which they differ at all, and the configuration fields in which the two runs differ
(comparable: only in how attention selects and runs, and bookkeeping). Per run: steps, mean
retrieval accuracy, needle recall and step time over its last 50 steps. Writes
compare_runs.json and compare_runs.png into --out (default runs/compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyscale_jax.nn import ModelConfig  # noqa: E402
from hyscale_jax.train import TrainConfig, read_metrics, trailing_mean  # noqa: E402

TAIL = 50  # steps averaged for each run's summary
# Fields that may differ between comparable runs: how attention selects and runs, and
# bookkeeping. Any other difference (data, seed, shapes, schedule) makes the curves differ.
FREE_FIELDS = (
    "model.attention",
    "model.remat",
    "model.impl",
    "model.offload_indices",
    "model.save_indexer_statistics",  # an option of older runs (replay always saves them now)
    "train.ckpt_every",
    "train.log_every",
    "train.keep_checkpoints",
)


def run_files(run: Path) -> tuple[Path, Path]:
    """(config, metrics) paths of a run folder (`config.json`, `metrics.jsonl`), or of a record
    saved under experiments/results/train/ as `<run>_config.json` and `<run>_metrics.jsonl`."""
    if run.is_dir():
        return run / "config.json", run / "metrics.jsonl"
    return Path(f"{run}_config.json"), Path(f"{run}_metrics.jsonl")


def load_run(run: Path) -> tuple[dict, list[dict]]:
    """(config.json, metrics records) of a run folder or record prefix (`run_files`); a missing
    file stops the script. A field added to the model or training configuration since the run
    was saved takes its default."""
    config, metrics = run_files(run)
    for path in (config, metrics):
        if not path.is_file():
            raise SystemExit(
                f"{run}: no {path} (neither an experiments/train.py run folder nor a record prefix)"
            )
    saved = json.loads(config.read_text())
    saved["model"] = {**ModelConfig().to_dict(), **saved.get("model", {})}
    train_defaults = TrainConfig().to_dict()
    saved["train"] = {**train_defaults, **saved.get("train", {})}
    saved["train"]["data"] = {**train_defaults["data"], **saved["train"].get("data", {})}
    return saved, read_metrics(metrics)


def config_differences(a: dict, b: dict) -> list[str]:
    """'section.field: a -> b' for every model, train or data field that differs, and the
    text corpus's fingerprint (the same data needs the same corpus)."""
    out = []
    if a.get("corpus_fingerprint") != b.get("corpus_fingerprint"):
        out.append(
            f"corpus_fingerprint: {a.get('corpus_fingerprint')} -> {b.get('corpus_fingerprint')}"
        )
    for section in ("model", "train"):
        fa, fb = a.get(section, {}), b.get(section, {})
        for name in sorted(set(fa) | set(fb)):
            if name == "data":
                for d in sorted(set(fa.get("data", {})) | set(fb.get("data", {}))):
                    va, vb = fa.get("data", {}).get(d), fb.get("data", {}).get(d)
                    if va != vb:
                        out.append(f"data.{d}: {va} -> {vb}")
            elif fa.get(name) != fb.get(name):
                out.append(f"{section}.{name}: {fa.get(name)} -> {fb.get(name)}")
    return out


def comparable(differences: list[str]) -> bool:
    """True when two runs differ only in FREE_FIELDS: same data, seed, model and schedule, so
    equal selections give equal curves."""
    return all(d.split(":")[0] in FREE_FIELDS for d in differences)


def divergence(base: list[dict], other: list[dict]) -> dict:
    """How far `other`'s losses move from `base`'s over the steps both logged."""
    by_step = {r["step"]: r for r in base}
    common = [(by_step[r["step"]], r) for r in other if r["step"] in by_step]
    out = {"common_steps": len(common)}
    for key in ("ce", "loss"):
        pairs = [
            (a["step"], a[key], b[key])
            for a, b in common
            if is_number(a.get(key)) and is_number(b.get(key))
        ]
        if not pairs:
            continue
        step, x, y = max(pairs, key=lambda p: abs(p[1] - p[2]))
        first = next((s for s, u, v in pairs if u != v), None)
        out[key] = {
            "max_abs_diff": abs(x - y),
            "max_rel_diff": abs(x - y) / max(abs(x), 1e-30),
            "at_step": step,
            "first_differing_step": first,
        }
    return out


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and x == x


def summary(rows: list[dict]) -> dict:
    tail = rows[-TAIL:]

    def mean(key):
        values = [r[key] for r in tail if is_number(r.get(key))]
        return statistics.fmean(values) if values else None

    return {
        "steps": rows[-1]["step"] if rows else 0,
        "retrieval_acc": mean("retrieval_acc"),
        "needle_recall": mean("needle_recall"),
        "step_time_s": mean("step_time_s"),
        "ce": mean("ce"),
    }


def default_labels(configs: list[dict]) -> list[str]:
    """attention/remat (+offload) per run, numbered where two runs would share one."""
    labels = []
    for c in configs:
        m = c["model"]
        label = f"{m['attention']}/{m['remat']}"
        label += "+offload" if m.get("offload_indices") else ""
        labels.append(label)
    return [
        f"{label} #{i + 1}" if labels.count(label) > 1 else label for i, label in enumerate(labels)
    ]


def plot(runs: list[tuple[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("ce", "LM cross-entropy (nats/byte)", False),
        ("retrieval_acc", "retrieval accuracy", True),
        ("needle_recall", "indexer recall of the needle", True),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.8))
    # One smoothing window for every run of a panel (the longest run's), so the title holds for
    # all of them; one legend entry per run, in the runs' colors, below the panels.
    window = max(1, max(len(rows) for _, rows in runs) // 40)
    handles = {}
    for ax, (key, title, smooth) in zip(axes, panels):
        for i, (_, rows) in enumerate(runs):
            pts = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
            if not pts:
                continue
            steps, values = zip(*pts)
            values = trailing_mean(list(values), window if smooth else 1)
            (handles[i],) = ax.plot(steps, values, lw=1.2, color=f"C{i}")  # a run's color
        ax.set_title(title + (f" (mean of {window} steps)" if smooth and window > 1 else ""))
        ax.set_xlabel("step")
        if smooth:
            ax.set_ylim(-0.02, 1.02)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", transform=ax.transAxes)
    fig.legend(
        list(handles.values()),
        [runs[i][0] for i in handles],
        loc="lower center",
        ncol=min(len(handles), 4),
        fontsize="small",
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "runs",
        nargs="+",
        type=Path,
        help="run folders of experiments/train.py, or record prefixes (PREFIX_config.json and "
        "PREFIX_metrics.jsonl, as under experiments/results/train/)",
    )
    p.add_argument("--labels", nargs="*", help="one per run (default: attention/remat)")
    p.add_argument("--out", type=Path, default=Path("runs/compare"), help="output folder")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        raise SystemExit(f"--labels: {len(args.labels)} given for {len(args.runs)} runs")
    loaded = [load_run(folder) for folder in args.runs]
    labels = args.labels or default_labels([config for config, _ in loaded])
    base_config, base_rows = loaded[0]
    record = {"runs": []}
    for i, (folder, label, (config, rows)) in enumerate(zip(args.runs, labels, loaded)):
        entry = {"run": str(folder), "label": label, **summary(rows)}
        if i:
            entry["vs_first"] = divergence(base_rows, rows)
            differs = config_differences(base_config, config)
            entry["config_differences"] = differs
            entry["comparable"] = comparable(differs) and entry["vs_first"]["common_steps"] > 0
        record["runs"].append(entry)
        line = f"{label:<24} {entry['steps']:>6} steps"
        for key in ("retrieval_acc", "needle_recall", "step_time_s"):
            if entry[key] is not None:
                line += f"  {key} {entry[key]:.3f}"
        print(line + f"  (last {TAIL} steps; {folder})")
        if i:
            for key in ("ce", "loss"):
                d = entry["vs_first"].get(key)
                if d:
                    print(
                        f"    {key} vs {labels[0]}: largest |diff| {d['max_abs_diff']:.4g} "
                        f"({100 * d['max_rel_diff']:.2f}%) at step {d['at_step']}; first "
                        f"differing step {d['first_differing_step']} of "
                        f"{entry['vs_first']['common_steps']} common"
                    )
            if not entry["vs_first"]["common_steps"]:
                print(f"    no step in common with {labels[0]}")
            if differs and not comparable(differs):
                print("    not comparable, differs in: " + "; ".join(differs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_runs.json").write_text(json.dumps(record, indent=1))
    plot(list(zip(labels, (rows for _, rows in loaded))), args.out / "compare_runs.png")
    print(f"wrote {args.out / 'compare_runs.json'} and {args.out / 'compare_runs.png'}")


if __name__ == "__main__":
    main()
