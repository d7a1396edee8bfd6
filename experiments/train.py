"""Train the HyScale long-context LM: `python experiments/train.py` (CPU default, 2-4 minutes).

A decoder-only byte-level LM whose attention is HyScale (exact HyTopK selection, sparse
attention, selection replayed under `jax.checkpoint`), with its lightning indexer distilled from
the main attention: dense KL over every key during a short warm-up at a short length, then KL
over the selected keys. The task needs no download: key-value needles hidden in the Python
standard library's source, asked for again at the end of each sequence.

Presets (--preset; the flags below override single fields):
  cpu             2-layer model (0.29M params), one needle per sequence: 400 dense steps at
                  T=64 (batch 64), then 400 sparse steps at T=256 (batch 8), k=16 (default)
  h200-32k        4-layer model (20M params), T=32K, k=2048, one H200
  h200-128k       the same model at T=128K
  h200-retrieval  the cpu recipe at 32K: 2-layer H200 model, RoPE on 8 of the indexer's 64
                  features, one needle, 300 dense steps at T=64 (batch 64), then 400 sparse
                  steps at T=32K (batch 4), k=2048

Attention: grouped-query by default; --attention-kind mla runs multi-head latent attention
(GLM-5 / DeepSeek-V3.2; sizes from --q-lora-rank, --kv-lora-rank, --qk-nope-dim, --qk-rope-dim,
--v-head-dim), its sparse attention in the absorbed multi-query form.

Files, in --out (default runs/train/<preset>):
  config.json     the run's model and training configuration, jax version, device, command
  metrics.jsonl   one JSON record per step: LM loss, indexer KL, retrieval accuracy, indexer
                  recall of the needle (per layer and best, with its chance level), time, tokens/s
  metrics.png     those curves
  ckpt/<step>/    Orbax checkpoints (parameters, optimizer state, step), the newest
                  keep_checkpoints kept, every --ckpt-every steps and at the end

A new run in a folder that holds a run replaces it (checkpoints and metrics deleted; a line says
so). To continue a stopped or killed run, repeat its command with --resume: it restores the
newest checkpoint, with the configuration saved in config.json (only --remat, --offload-indices,
--save-indexer-target, --selection-order, --impl, --log-every and --ckpt-every may change),
drops the metrics logged after it, and then computes exactly what the uninterrupted run would
have. A damaged checkpoint (a file cut short or changed since it was saved) is skipped, with
one line saying why, and moved to <out>/ckpt_damaged/; resume then uses the newest one that
restores. Ctrl-C or SIGTERM saves a checkpoint before stopping.

Several devices: `--mesh data=2,seq=4` shards the batch over 2 and the sequence over 4 devices
(8 in all; batch % 2 == 0, T % 8 == 0), with the same results as one device. On CPU, simulate
devices with XLA_FLAGS=--xla_force_host_platform_device_count=8. Several hosts: run the same
command on every host with `--distributed` (calls `jax.distributed.initialize()`; see
hyscale_jax/parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyscale_jax.data import DataConfig
from hyscale_jax.nn import (
    ATTENTION_KINDS,
    ATTENTIONS,
    IMPLS,
    INDEX_DTYPES,
    REMATS,
    REPLAY_OPTIONS,
    ModelConfig,
)
from hyscale_jax.parallel import parse_mesh
from hyscale_jax.reference import TABLE_ENTRIES_LIMIT
from hyscale_jax.train import TrainConfig, read_metrics, train

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
            mlp_dim=128,
            attention="hyscale",
            remat="replay",
        ),
        TrainConfig(
            seq_len=256,
            batch_size=8,
            steps=800,
            lr=3e-3,
            warmup_steps=50,
            indexer_warmup_steps=400,
            indexer_warmup_seq_len=64,
            indexer_warmup_batch_size=64,
            ckpt_every=200,
            data=DataConfig(n_pairs=1, n_queries=1, n_values=16, answer_weight=10.0),
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
        # An indexer with RoPE on 8 of its 64 features: the content match it learns at T=64
        # holds at 32K (H100: needle recall 0.99, retrieval 1.0, LM cross-entropy 0.92 against
        # dense attention's 0.90). With RoPE on all 64 recall stayed at 0.44 (H200); with none
        # it was 1.0, but the LM's cross-entropy stayed at 1.37 (H100).
        dataclasses.replace(_H200_MODEL, n_layers=2, index_rope_dim=8),
        TrainConfig(
            seq_len=32_768,
            batch_size=4,
            steps=700,
            lr=1e-3,
            warmup_steps=100,
            # Retrieval forms in short sequences: this model learns it at T=64 (accuracy 0.996
            # over steps 76-100 on CPU) and stayed at chance through 989 dense steps at T=2048
            # (H100).
            indexer_warmup_steps=300,
            indexer_warmup_seq_len=64,
            indexer_warmup_batch_size=64,
            ckpt_every=100,
            data=DataConfig(n_pairs=1, n_queries=1, n_values=16, answer_weight=10.0),
        ),
    ),
}


# Help for the override flags: (field, type, what it sets). Their defaults come from --preset.
_MODEL_FLAGS = (
    ("d_model", int, "residual stream width"),
    ("n_layers", int, "transformer blocks"),
    ("n_heads", int, "attention query heads H"),
    ("n_kv_heads", int, "key/value heads G (H %% G == 0; gqa only)"),
    ("head_dim", int, "width of each head's q, k, v (even; gqa only)"),
    ("index_heads", int, "lightning-indexer heads HI"),
    ("index_dim", int, "lightning-indexer width DI (even)"),
    ("index_rope_dim", int, "indexer features RoPE rotates (even)"),
    ("topk", int, "keys each query attends to (k)"),
    ("q_lora_rank", int, "MLA query latent width"),
    ("kv_lora_rank", int, "MLA key/value latent width"),
    ("qk_nope_dim", int, "MLA per-head q/k width without position"),
    ("qk_rope_dim", int, "MLA decoupled RoPE width (even)"),
    ("v_head_dim", int, "MLA per-head value width"),
    ("mlp_chunk", int, "tokens per SwiGLU chunk, recomputed one at a time (memory at long T)"),
)
# What a None in the preset means for a model flag.
_MODEL_NONE = {"index_rope_dim": "all", "mlp_chunk": "whole sequence"}
_TRAIN_FLAGS = (
    ("steps", int, "total optimizer steps"),
    ("seq_len", int, "sequence length T after the warm-up"),
    ("batch_size", int, "sequences per step"),
    ("lr", float, "peak learning rate (AdamW, cosine decay)"),
    ("warmup_steps", int, "linear learning-rate warm-up steps"),
    ("seed", int, "parameter initialization seed"),
    ("indexer_warmup_steps", int, "steps of the dense indexer warm-up (dense attention + KL)"),
    ("indexer_warmup_seq_len", int, "sequence length during the indexer warm-up"),
    ("indexer_warmup_batch_size", int, "batch during the indexer warm-up"),
    ("indexer_loss_weight", float, "weight of the indexer KL in the loss"),
    ("ckpt_every", int, "checkpoint every this many steps (and at the end)"),
    ("log_every", int, "write a metrics record every this many steps"),
)
_DATA_FLAGS = (
    ("data_seed", int, "seed", "data seed (with the step, fixes every example)"),
    ("n_pairs", int, "n_pairs", "key-value needles per sequence"),
    ("n_queries", int, "n_queries", "needles asked for at the end of each sequence"),
    ("n_keys", int, "n_keys", "key vocabulary (>= --n-pairs)"),
    ("n_values", int, "n_values", "value vocabulary (retrieval chance 1/N)"),
    ("answer_weight", float, "answer_weight", "LM-loss weight of the retrieved values"),
)


def _preset_values(get, none: str = "as --batch-size") -> str:
    """'cpu: 128; h200-*: 512' - the value each preset gives a field (`none` shows None)."""
    values = {name: get(*cfgs) for name, cfgs in PRESETS.items()}
    shown = {n: (none if v is None else v) for n, v in values.items()}
    if len(set(shown.values())) == 1:
        return f"all presets: {shown['cpu']}"
    h200 = {v for n, v in shown.items() if n.startswith("h200")}
    if len(h200) == 1:
        return f"cpu: {shown['cpu']}; h200-*: {h200.pop()}"
    return "; ".join(f"{n}: {v}" for n, v in shown.items())


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=100)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--preset",
        default="cpu",
        choices=sorted(PRESETS),
        help="model, training and data configuration (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="run folder (default: runs/train/<preset>). Without --resume, a run already "
        "there is replaced: its checkpoints and metrics are deleted",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest checkpoint that restores, with its "
        "saved configuration; with no checkpoint there, say so and start a new run "
        "(default: off)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: off)")
    p.add_argument("--no-plot", action="store_true", help="do not draw metrics.png (default: off)")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="stop with a checkpoint after this step, as if killed there (default: run to "
        "the last step)",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        metavar="data=N,seq=M",
        help="data + sequence parallel over a (data, seq) device mesh, e.g. data=2,seq=4; a "
        "missing axis is inferred from the device count (default: one device)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="several hosts: call jax.distributed.initialize() first; on SLURM, Open MPI, "
        "Kubernetes or Cloud TPU the cluster is detected, elsewhere give the three flags "
        "below (default: off)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="with --distributed: process 0's address (default: JAX_COORDINATOR_ADDRESS or "
        "detected)",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="with --distributed: number of processes (default: detected)",
    )
    p.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="N",
        help="with --distributed: this process's index (default: detected)",
    )
    m = p.add_argument_group("model overrides (default: the preset's value)")
    for name, choices, what in (
        ("attention", ATTENTIONS, "selection + attention"),
        ("attention_kind", ATTENTION_KINDS, "gqa: grouped-query; mla: multi-head latent"),
        ("remat", REMATS, "per-block rematerialization (replay: the selection replayed)"),
        ("impl", IMPLS, "kernels (auto: pallas on GPU, xla elsewhere)"),
    ):
        m.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            choices=choices,
            help=f"{what} ({_preset_values(lambda mc, tc, n=name: getattr(mc, n))})",
        )
    m.add_argument(
        "--index-dtype",
        choices=INDEX_DTYPES,
        help="indexer scores the selection ranks: the compute dtype, or float8_e4m3fn "
        "(DeepSeek-V3.2's FP8 indexer; its KL still trains the unquantized indexer) "
        f"({_preset_values(lambda mc, tc: mc.index_dtype)})",
    )
    m.add_argument(
        "--index-hadamard",
        action=argparse.BooleanOptionalAction,
        help="FP8 indexer: Hadamard-rotate q and k before quantizing (index_dim a power of "
        f"two) ({_preset_values(lambda mc, tc: mc.index_hadamard)})",
    )
    m.add_argument(
        "--offload-indices",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --remat replay: keep the saved indices in pinned host memory until the "
        "backward pass needs them (int32 [B, T, k] per layer, 8 GiB at T=1M, k=2048) "
        "(all presets: off)",
    )
    m.add_argument(
        "--save-indexer-target",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sparse stage: keep the indexer loss's target distribution (f32, about as large "
        "as the indices) so that its Pallas backward gathers no main keys (all presets: off)",
    )
    m.add_argument(
        "--selection-order",
        choices=("score", "index"),
        default=None,
        help="order of each query's selected keys: score, or index (ascending; the Pallas "
        "selection skips its ordering sort) (all presets: score)",
    )
    for name, typ, what in _MODEL_FLAGS:
        m.add_argument(
            "--" + name.replace("_", "-"),
            type=typ,
            dest=name,
            metavar="N",
            help=f"{what} "
            f"({_preset_values(lambda mc, tc, n=name: getattr(mc, n), _MODEL_NONE.get(name))})",
        )
    t = p.add_argument_group("training overrides (default: the preset's value)")
    for name, typ, what in _TRAIN_FLAGS:
        t.add_argument(
            "--" + name.replace("_", "-"),
            type=typ,
            dest=name,
            metavar="X" if typ is float else "N",
            help=f"{what} ({_preset_values(lambda mc, tc, n=name: getattr(tc, n))})",
        )
    d = p.add_argument_group("data overrides (default: the preset's value)")
    d.add_argument(
        "--data",
        choices=("retrieval", "text"),
        dest="data_kind",
        help="retrieval: needles in stdlib text; text: plain stdlib text "
        f"({_preset_values(lambda mc, tc: tc.data.kind)})",
    )
    d.add_argument(
        "--filler",
        choices=("text", "random"),
        help="what the needles hide in: stdlib text or uniform random printable bytes "
        f"({_preset_values(lambda mc, tc: tc.data.filler)})",
    )
    for flag, typ, field, what in _DATA_FLAGS:
        d.add_argument(
            "--" + flag.replace("_", "-"),
            type=typ,
            dest=flag,
            metavar="X" if typ is float else "N",
            help=f"{what} ({_preset_values(lambda mc, tc, f=field: getattr(tc.data, f))})",
        )
    return p.parse_args(argv)


def _overrides(args, names):
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_configs(args) -> tuple[ModelConfig, TrainConfig, Path]:
    out = Path(args.out or os.path.join("runs", "train", args.preset))
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
    overrides = _overrides(args, model_fields)
    if overrides.get("remat", model_cfg.remat) != "replay":
        # Options of replay carried over from the preset or a saved run lapse with it; asked
        # for on this command line, they stop the run below with ModelConfig's message.
        for name in REPLAY_OPTIONS:
            overrides.setdefault(name, False)
    try:
        model_cfg = dataclasses.replace(model_cfg, **overrides)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    data_cfg = dataclasses.replace(
        train_cfg.data,
        **{
            k: v
            for k, v in (
                ("kind", args.data_kind),
                ("seed", args.data_seed),
                ("n_pairs", args.n_pairs),
                ("n_queries", args.n_queries),
                ("n_keys", args.n_keys),
                ("n_values", args.n_values),
                ("filler", args.filler),
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
    import jax

    from hyscale_jax.train import describe

    if args.distributed:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    mesh = None
    if args.mesh is not None:
        from hyscale_jax.parallel import make_mesh

        mesh = make_mesh(**args.mesh)
        print(
            f"mesh: {dict(mesh.shape)} over {mesh.devices.size} devices "
            f"({jax.process_count()} process(es))"
        )
    saved = out / "config.json"
    preset = args.preset
    if args.resume and saved.exists():
        preset = json.loads(saved.read_text()).get("preset", "saved configuration")
    device = jax.devices()[0].device_kind
    if device != jax.default_backend():
        device += f" ({jax.default_backend()})"
    print(f"preset {preset}; jax {jax.__version__} on {device}; out dir {out}")
    print(describe(model_cfg, train_cfg))
    T = train_cfg.seq_len
    if (
        model_cfg.attention == "materialized"
        and jax.default_backend() == "gpu"
        and T * T >= TABLE_ENTRIES_LIMIT
    ):
        raise SystemExit(
            f"--attention materialized at T={T}: its [T, T] score table holds {T * T} entries, "
            f"at or past 2**31, where XLA's GPU kernels fail (illegal memory access); use "
            f"T < 46341 or --attention hyscale"
        )
    if model_cfg.index_dtype != "compute" and model_cfg.attention != "dense":
        rotation = "Hadamard-rotated" if model_cfg.index_hadamard else "unrotated"
        print(f"indexer: selection on {model_cfg.index_dtype} scores ({rotation}, per-row scales)")
    result = train(
        model_cfg,
        train_cfg,
        out,
        resume=args.resume,
        progress=not args.no_progress,
        plot=not args.no_plot,
        stop_after=args.stop_after,
        mesh=mesh,
        run_info={"preset": preset, "command": " ".join([sys.executable, *sys.argv])},
    )
    rows = read_metrics(out / "metrics.jsonl")
    if not rows:
        return
    first, last = rows[0], rows[-1]
    tail = rows[-50:]

    def avg(key):
        vals = [r[key] for r in tail if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    ran = result["step"] - result["start_step"]
    where = "" if result["start_step"] == 0 else f" (from step {result['start_step']})"
    status = (
        "done"
        if result["step"] == train_cfg.steps
        else f"stopped at step {result['step']} of {train_cfg.steps} (continue with --resume)"
    )
    print(f"{status}: {ran} steps{where} in {result['wall_s']:.0f} s (this run)")
    summary = (
        f"LM loss {first['ce']:.3f} (step {first['step']}) -> {avg('ce'):.3f} "
        f"(mean of steps {tail[0]['step']}-{last['step']})"
    )
    if last.get("retrieval_acc") is not None:
        summary += (
            f"; retrieval accuracy {avg('retrieval_acc'):.3f} (chance "
            f"{1 / train_cfg.data.n_values:.3f}"
            + (
                f", key-blind guess {avg('retrieval_blind'):.3f})"
                if avg("retrieval_blind") < 1
                else ")"
            )
        )
    if last.get("needle_recall") is not None:
        summary += (
            f"; needle recall {avg('needle_recall'):.3f} (chance {avg('needle_recall_chance'):.3f})"
        )
    print(summary)
    print(
        f"metrics: {out / 'metrics.jsonl'}"
        + ("" if args.no_plot else f"; plot: {out / 'metrics.png'}")
    )


if __name__ == "__main__":
    main()
