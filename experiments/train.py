"""Train the HyScale long-context LM: `python experiments/train.py` (CPU default, ~2-3 min).

Writes <out>/config.json, metrics.jsonl (one record per step), metrics.png (loss, retrieval
accuracy, indexer recall of the needle) and Orbax checkpoints under <out>/ckpt. A killed run
continues exactly where it stopped with the same command plus --resume.

Presets (--preset):
  cpu          2-layer byte LM, T=256, hyscale + replay, needles in stdlib text (default)
  h200-32k     4-layer model, T=32K, k=2048, one H200
  h200-128k    same model at T=128K
  h200-retrieval  the retrieval task at T=16K for long training (solving it is a GPU job)
The flags below override the preset's main model, training and data fields (--help lists
them).

Data + sequence parallel: `--mesh data=2,seq=4` shards the batch over 2 and the sequence over 4
devices (8 in all; batch % 2 == 0, seq_len % 8 == 0). On CPU, simulate devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Multi-host: run the same command on every
host with `--distributed` (calls `jax.distributed.initialize()`; see hyscale_jax/parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyscale_jax.data import DataConfig  # noqa: E402
from hyscale_jax.nn import ATTENTIONS, IMPLS, REMATS, ModelConfig  # noqa: E402
from hyscale_jax.parallel import parse_mesh  # noqa: E402
from hyscale_jax.train import TrainConfig, read_metrics, train  # noqa: E402

_H200_MODEL = ModelConfig(
    d_model=512,
    n_layers=4,
    n_heads=8,
    n_kv_heads=1,
    head_dim=128,
    index_heads=16,
    index_dim=64,
    topk=2048,
    attention="hyscale",
    remat="replay",
    rope_base=1_000_000.0,
)

PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    "cpu": (
        ModelConfig(
            d_model=128,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            head_dim=32,
            index_heads=4,
            index_dim=32,
            topk=16,
            attention="hyscale",
            remat="replay",
        ),
        TrainConfig(
            seq_len=256,
            batch_size=8,
            steps=300,
            lr=3e-3,
            warmup_steps=20,
            indexer_warmup_steps=40,
            indexer_warmup_seq_len=64,
            ckpt_every=50,
        ),
    ),
    "h200-32k": (
        _H200_MODEL,
        TrainConfig(
            seq_len=32_768,
            batch_size=1,
            steps=2000,
            lr=1e-3,
            warmup_steps=100,
            indexer_warmup_steps=200,
            indexer_warmup_seq_len=2048,
            ckpt_every=200,
            data=DataConfig(n_pairs=16, n_queries=16),
        ),
    ),
    "h200-128k": (
        _H200_MODEL,
        TrainConfig(
            seq_len=131_072,
            batch_size=1,
            steps=1000,
            lr=1e-3,
            warmup_steps=100,
            indexer_warmup_steps=200,
            indexer_warmup_seq_len=2048,
            ckpt_every=100,
            data=DataConfig(n_pairs=16, n_queries=16),
        ),
    ),
    "h200-retrieval": (
        dataclasses.replace(_H200_MODEL, n_layers=2, topk=512),
        TrainConfig(
            seq_len=16_384,
            batch_size=4,
            steps=4000,
            lr=1e-3,
            warmup_steps=200,
            indexer_warmup_steps=1500,
            indexer_warmup_seq_len=1024,
            ckpt_every=250,
            data=DataConfig(n_pairs=16, n_queries=16),
        ),
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument(
        "--out",
        default=None,
        help="run directory (default checkpoints/<preset>); without --resume, a "
        "run already there is replaced",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint (its saved "
        "config is used; flags may change only remat/impl/logging); with no "
        "checkpoint there, say so and start a new run",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip metrics.png")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop with a checkpoint after this step (simulates a killed run)",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        metavar="data=N,seq=M",
        help="data + sequence parallel over a (data, seq) device mesh, e.g. "
        "data=2,seq=4; a missing axis is inferred from the device count",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize() first; on SLURM, "
        "Open MPI, Kubernetes or Cloud TPU the cluster is auto-detected, "
        "elsewhere give the three flags below",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="with --distributed: process 0's address (or JAX_COORDINATOR_ADDRESS)",
    )
    p.add_argument("--num-processes", type=int, default=None, help="with --distributed")
    p.add_argument("--process-id", type=int, default=None, help="with --distributed")
    m = p.add_argument_group("model overrides")
    m.add_argument("--attention", choices=ATTENTIONS)
    m.add_argument("--remat", choices=REMATS)
    m.add_argument("--impl", choices=IMPLS)
    for name in (
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "index_heads",
        "index_dim",
        "topk",
    ):
        m.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    t = p.add_argument_group("training overrides")
    for name, typ in (
        ("steps", int),
        ("seq_len", int),
        ("batch_size", int),
        ("lr", float),
        ("warmup_steps", int),
        ("seed", int),
        ("indexer_warmup_steps", int),
        ("indexer_warmup_seq_len", int),
        ("indexer_warmup_batch_size", int),
        ("indexer_loss_weight", float),
        ("ckpt_every", int),
        ("log_every", int),
    ):
        t.add_argument("--" + name.replace("_", "-"), type=typ, dest=name)
    d = p.add_argument_group("data overrides")
    d.add_argument("--data", choices=("retrieval", "text"), dest="data_kind")
    d.add_argument("--data-seed", type=int)
    d.add_argument("--n-pairs", type=int)
    d.add_argument("--n-queries", type=int)
    d.add_argument("--answer-weight", type=float, help="LM-loss weight of retrieved values")
    return p.parse_args(argv)


def _overrides(args, names):
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_configs(args) -> tuple[ModelConfig, TrainConfig, Path]:
    out = Path(args.out or os.path.join("checkpoints", args.preset))
    saved = out / "config.json"
    if args.resume and saved.exists():
        meta = json.loads(saved.read_text())
        model_cfg = ModelConfig.from_dict(meta["model"])
        train_cfg = TrainConfig.from_dict(meta["train"])
        print(f"resuming {out} with its saved configuration")
    else:
        model_cfg, train_cfg = PRESETS[args.preset]
    model_fields = [f.name for f in dataclasses.fields(ModelConfig)]
    train_fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "data"]
    model_cfg = dataclasses.replace(model_cfg, **_overrides(args, model_fields))
    data_cfg = dataclasses.replace(
        train_cfg.data,
        **{
            k: v
            for k, v in (
                ("kind", args.data_kind),
                ("seed", args.data_seed),
                ("n_pairs", args.n_pairs),
                ("n_queries", args.n_queries),
                ("answer_weight", args.answer_weight),
            )
            if v is not None
        },
    )
    train_cfg = dataclasses.replace(train_cfg, data=data_cfg, **_overrides(args, train_fields))
    return model_cfg, train_cfg, out


def main(argv=None):
    args = parse_args(argv)
    model_cfg, train_cfg, out = build_configs(args)
    import jax  # noqa: PLC0415

    if args.distributed:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    mesh = None
    if args.mesh is not None:
        from hyscale_jax.parallel import make_mesh  # noqa: PLC0415

        mesh = make_mesh(**args.mesh)
        print(
            f"mesh: {dict(mesh.shape)} over {mesh.devices.size} devices "
            f"({jax.process_count()} process(es))"
        )
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
        f"run dir {out}"
    )
    print(f"model: {model_cfg}")
    print(f"train: {train_cfg}")
    result = train(
        model_cfg,
        train_cfg,
        out,
        resume=args.resume,
        progress=not args.no_progress,
        plot=not args.no_plot,
        stop_after=args.stop_after,
        mesh=mesh,
    )
    rows = read_metrics(out / "metrics.jsonl")
    if rows:
        first, last = rows[0], rows[-1]
        tail = rows[-10:]

        def avg(key):
            vals = [r[key] for r in tail if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        print(
            f"step {last['step']}/{train_cfg.steps} in {result['wall_s']:.0f}s this session; "
            f"LM loss {first['ce']:.3f} (step {first['step']}) -> {avg('ce'):.3f} "
            f"(mean of last {len(tail)}); retrieval acc {avg('retrieval_acc'):.3f}; "
            f"indexer needle recall {avg('needle_recall'):.3f}"
        )
        print(
            f"metrics: {out / 'metrics.jsonl'}"
            + ("" if args.no_plot else f"; plot: {out / 'metrics.png'}")
        )


if __name__ == "__main__":
    main()
