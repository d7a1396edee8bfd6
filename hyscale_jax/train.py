"""Training: state, optimizer, jitted step, metrics, Orbax checkpoints with exact resume.

Schedule (DSA's two indexer stages, docs/design.md, 'Indexer loss'): the first
`indexer_warmup_steps` steps run at `indexer_warmup_seq_len` with dense main attention and the
dense indexer KL; the rest run at `seq_len` with sparse attention and the KL on the selected
keys. The LM loss and the indexer
loss reach disjoint parameters (the indexer's inputs are detached), so one optimizer trains
both on their sum.

Exact resume: the data is a pure function of (data seed, step) (`hyscale_jax.data`), the step
is in the checkpoint together with the parameters and the optimizer state, and the step
function is deterministic, so a run killed after a checkpoint and resumed from it reproduces
the uninterrupted run. A damaged checkpoint (a file cut short by a full disk or a crash) is
skipped: resume restores the newest one that reads back whole and moves the damaged ones to
`<out>/ckpt_damaged/`. A metrics line cut short at the end of metrics.jsonl is dropped.

Sharding: pass `mesh=hs.parallel.make_mesh(data=..., seq=...)` to `train` (or to
`create_train_state` and `make_train_step`). Parameters and optimizer state are replicated over
the mesh, each batch is split over "data" (`hs.parallel.shard_batch`), activations over
"data" x "seq" inside the model, and `jax.jit`'s SPMD partitioner inserts the gradient
all-reduce. A sharded step computes the unsharded step's result (up to f32 summation order).
Multi-host: call `jax.distributed.initialize()` first in every process (see
`hyscale_jax.parallel`); every process then runs this same loop on the global mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx, struct

from hyscale_jax import parallel
from hyscale_jax.data import DataConfig, Dataset
from hyscale_jax.nn import LongContextLM, ModelConfig

# Fields that may differ on resume: they do not change the math of a step, at most its f32
# rounding (older runs' configs also name save_indexer_statistics, once an option of replay,
# which now always saves them).
_RESUME_FREE = {
    "model": {
        "remat",
        "offload_indices",
        "save_indexer_statistics",
        "save_indexer_target",
        "selection_order",
        "impl",
    },
    "train": {"log_every", "ckpt_every", "keep_checkpoints"},
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512  # sequence length of the sparse stage
    batch_size: int = 8  # sequences per step
    steps: int = 300  # total optimizer steps
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 20  # linear lr warm-up steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1  # AdamW decay on matrices (ndim >= 2) only
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    clip_norm: float = 1.0  # global gradient-norm clip
    seed: int = 0  # parameter init seed
    indexer_warmup_steps: int = 0  # DSA dense warm-up steps (dense attention + dense KL)
    indexer_warmup_seq_len: int = 128  # sequence length during the dense warm-up
    indexer_warmup_batch_size: int | None = None  # batch during the warm-up (None: batch_size)
    indexer_loss_weight: float = 1.0  # weight of the indexer KL (per query) in the loss
    log_every: int = 1  # metrics JSONL cadence (steps)
    ckpt_every: int = 100  # checkpoint cadence (steps); the last step always saves
    keep_checkpoints: int = 2  # checkpoints kept on disk
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # data source

    def __post_init__(self):
        for name in (
            "seq_len",
            "batch_size",
            "steps",
            "indexer_warmup_seq_len",
            "log_every",
            "ckpt_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int; got {value!r}")
        if self.indexer_warmup_batch_size is not None and self.indexer_warmup_batch_size < 1:
            raise ValueError(
                f"TrainConfig.indexer_warmup_batch_size must be a positive int or "
                f"None; got {self.indexer_warmup_batch_size!r}"
            )
        for name in ("warmup_steps", "indexer_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0; got {getattr(self, name)}")
        if isinstance(self.data, dict):
            object.__setattr__(self, "data", DataConfig(**self.data))
        shortest = min(
            self.seq_len, self.indexer_warmup_seq_len if self.indexer_warmup_steps else self.seq_len
        )
        if self.data.kind == "retrieval" and shortest < self.data.min_seq_len():
            raise ValueError(
                f"sequence length {shortest} is too short for {self.data.n_pairs} "
                f"needles and {self.data.n_queries} queries (need >= "
                f"{self.data.min_seq_len()}); raise seq_len / "
                f"indexer_warmup_seq_len or lower n_pairs / n_queries"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        d["data"] = DataConfig(**d.get("data", {}))
        return cls(**d)


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nnx.State of the model's parameters (f32)
    opt_state: Any  # optax state


def stage_for_step(model_cfg: ModelConfig, train_cfg: TrainConfig, step: int) -> tuple[str, int]:
    """(indexer stage, sequence length) of `step`. The length schedule is the same for every
    attention mode so runs compare; dense attention has no indexer ("none")."""
    warm = step < train_cfg.indexer_warmup_steps
    seq_len = train_cfg.indexer_warmup_seq_len if warm else train_cfg.seq_len
    if model_cfg.attention == "dense":
        return "none", seq_len
    return ("dense" if warm else "sparse"), seq_len


def batch_size_for_step(train_cfg: TrainConfig, step: int) -> int:
    if step < train_cfg.indexer_warmup_steps and train_cfg.indexer_warmup_batch_size:
        return train_cfg.indexer_warmup_batch_size
    return train_cfg.batch_size


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up + cosine decay and global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def learning_rate(cfg: TrainConfig, step: int) -> float:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.lr,
        cfg.warmup_steps,
        max(cfg.steps, cfg.warmup_steps + 1),
        cfg.lr * cfg.min_lr_ratio,
    )
    return float(schedule(step))


def create_train_state(model_cfg: ModelConfig, train_cfg: TrainConfig, *, mesh=None):
    """Returns (graphdef, state: TrainState, tx). With a mesh the state is replicated on it."""
    model = LongContextLM(model_cfg, rngs=nnx.Rngs(train_cfg.seed), mesh=mesh)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(train_cfg)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    # Committed to their device like restored arrays, so a resumed run reuses the compiled step.
    if mesh is None:
        state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    else:
        state = jax.device_put(state, parallel.replicated(mesh))
    return graphdef, state, tx


def count_params(model_cfg: ModelConfig) -> int:
    """Parameters of the model `model_cfg` describes (shapes only: nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: LongContextLM(model_cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def describe(model_cfg: ModelConfig, train_cfg: TrainConfig) -> str:
    """A few lines on a run: model size and kind, sequence lengths, batch, steps, data."""
    m, t, d = model_cfg, train_cfg, train_cfg.data
    impl = m.impl
    if impl == "auto":
        impl = f"auto = {'pallas' if jax.default_backend() == 'gpu' else 'xla'} here"
    n = count_params(m)
    size = f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"
    lines = [
        f"model: {size} params, {m.n_layers} layer{'s' if m.n_layers > 1 else ''} x d_model "
        f"{m.d_model}, {m.n_heads} heads "
        + (
            f"(MLA, kv latent {m.kv_lora_rank}, rope {m.qk_rope_dim})"
            if m.attention_kind == "mla"
            else f"({m.n_kv_heads} kv)"
        )
        + f", attention {m.attention}"
        + (
            f" (k={m.topk}, indexer {m.index_heads}x{m.index_dim})"
            if m.attention != "dense"
            else ""
        )
        + f", remat {m.remat}"
        + (" (indices offloaded to host)" if m.offload_indices else "")
        + f", impl {impl}, {m.dtype}",
        f"train: {t.steps} steps, batch {t.batch_size} x T={t.seq_len}"
        + (
            f" after a dense indexer warm-up of {t.indexer_warmup_steps} steps at "
            f"T={t.indexer_warmup_seq_len}"
            + (
                f" (batch {t.indexer_warmup_batch_size})"
                if t.indexer_warmup_batch_size not in (None, t.batch_size)
                else ""
            )
            if t.indexer_warmup_steps and m.attention != "dense"
            else ""
        )
        + f", lr {t.lr:g}",
        "data: "
        + (
            f"{d.n_pairs} key-value needle{'s' if d.n_pairs > 1 else ''} in "
            f"{'stdlib text' if d.filler == 'text' else 'random bytes'} "
            f"({d.n_keys} keys, {d.n_values} values: chance 1/{d.n_values}), "
            f"{d.n_queries} quer{'ies' if d.n_queries > 1 else 'y'} per sequence"
            if d.kind == "retrieval"
            else "stdlib source text"
        ),
    ]
    return "\n".join(lines)


def loss_and_metrics(graphdef, params, batch, *, stage: str, indexer_loss_weight: float):
    """Scalar loss and a dict of f32 metrics (NaN where a metric does not apply)."""
    model = nnx.merge(graphdef, params)
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    query_pos, needle_pos = batch["query_pos"], batch["needle_pos"]  # [B, Q]
    logits, aux = model.forward(inputs, indexer_stage=stage, index_rows=query_pos)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = batch["loss_mask"].astype(jnp.float32)
    ce = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    loss = ce + indexer_loss_weight * aux["indexer_loss"]

    metrics = {"ce": ce, "indexer_loss": aux["indexer_loss"]}
    nan = jnp.full((), jnp.nan, jnp.float32)
    if query_pos.shape[1]:
        pred = jnp.take_along_axis(jnp.argmax(logits, axis=-1), query_pos, axis=1)
        answer = jnp.take_along_axis(targets, query_pos, axis=1)
        metrics["retrieval_acc"] = jnp.mean((pred == answer).astype(jnp.float32))
        metrics["answer_ce"] = jnp.mean(jnp.take_along_axis(nll, query_pos, axis=1))
        metrics["retrieval_blind"] = jnp.mean(batch["blind_acc"])
        # Needle recall: the share of query keys whose selected keys include the needle (its key
        # or value), per layer and for the best layer. Chance: the same for k keys drawn at
        # random from the query's n = t + 1 visible ones, 1 - (n - k)(n - k - 1) / (n (n - 1)).
        recalls = []
        for layer, rows in enumerate(aux["indices"]):  # [B, Q, k]: the query rows
            hit = jnp.any(
                (rows == needle_pos[..., None]) | (rows == needle_pos[..., None] + 1), axis=-1
            )
            recalls.append(jnp.mean(hit.astype(jnp.float32)))
            metrics[f"needle_recall_l{layer}"] = recalls[-1]
        if recalls:
            n = query_pos.astype(jnp.float32) + 1
            k = jnp.minimum(float(aux["indices"][0].shape[-1]), n)
            miss = (n - k) * (n - k - 1) / jnp.maximum(n * (n - 1), 1.0)
            metrics["needle_recall"] = jnp.max(jnp.stack(recalls))
            metrics["needle_recall_chance"] = jnp.mean(1 - miss)
        else:
            metrics["needle_recall"] = metrics["needle_recall_chance"] = nan
    else:
        metrics["retrieval_acc"] = metrics["answer_ce"] = metrics["retrieval_blind"] = nan
        metrics["needle_recall"] = metrics["needle_recall_chance"] = nan
    return loss, metrics


def _global_norm(tree):
    tree_ns = getattr(optax, "tree", None)
    return tree_ns.norm(tree) if hasattr(tree_ns, "norm") else optax.global_norm(tree)


def make_train_step(
    graphdef,
    tx: optax.GradientTransformation,
    train_cfg: TrainConfig,
    *,
    donate: bool | None = None,
    mesh=None,
) -> Callable:
    """`step(state, batch, stage) -> (state, metrics)`, jitted; `stage` is static.

    mesh: the ("data", "seq") mesh the model was built with: the batch is constrained to be
    split over "data" and the new state to stay replicated.
    """
    if donate is None:
        donate = jax.default_backend() != "cpu"

    def step(state: TrainState, batch, stage: str):
        if mesh is not None:
            batch = {
                name: jax.lax.with_sharding_constraint(
                    x,
                    jax.sharding.NamedSharding(
                        mesh, jax.sharding.PartitionSpec(parallel.DATA, *([None] * (x.ndim - 1)))
                    ),
                )
                for name, x in batch.items()
            }
        grad_fn = jax.value_and_grad(
            lambda p: loss_and_metrics(
                graphdef, p, batch, stage=stage, indexer_loss_weight=train_cfg.indexer_loss_weight
            ),
            has_aux=True,
        )
        (loss, metrics), grads = grad_fn(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=_global_norm(grads))
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        if mesh is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, parallel.replicated(mesh))
        return new_state, metrics

    return jax.jit(step, static_argnames=("stage",), donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=8)
def _cached_train_step(graphdef, train_cfg: TrainConfig, mesh=None) -> Callable:
    """One jitted step per (model structure, training config, mesh): a resumed run in the same
    process reuses the compiled step."""
    return make_train_step(graphdef, make_optimizer(train_cfg), train_cfg, mesh=mesh)


# ----------------------------------------------------------------------------- checkpoints


class Checkpointer:
    """Orbax checkpoints of the whole TrainState plus JSON metadata (configs, data fingerprint).

    Each saved step folder also gets a manifest (`MANIFEST`: every file's size and SHA-256),
    so a file that was cut short or changed afterwards is found before Orbax reads it. A
    checkpoint without one (a crash between the save and the manifest) is checked by
    restoring it.
    """

    MANIFEST = "hyscale_manifest.json"

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        step = int(state.step)
        if step in self.manager.all_steps():
            return
        tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
        )
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
            folder = self.directory / str(step)
            files = {
                str(f.relative_to(folder)): [f.stat().st_size, _sha256(f)]
                for f in sorted(folder.rglob("*"))
                if f.is_file()
            }
            tmp = folder / (self.MANIFEST + ".tmp")
            lines = [f"{json.dumps(name)}: {json.dumps(entry)}" for name, entry in files.items()]
            tmp.write_text("{\n" + ",\n".join(lines) + "\n}\n")
            tmp.replace(folder / self.MANIFEST)

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step`'s files match its manifest (or it has none), else what
        differs: the first missing, resized or changed file."""
        folder = self.directory / str(step)
        manifest = folder / self.MANIFEST
        if not manifest.exists():
            return None
        try:
            files = json.loads(manifest.read_text())
        except (OSError, ValueError) as err:
            return f"{self.MANIFEST} unreadable ({type(err).__name__})"
        for name, (size, digest) in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} when saved"
            if _sha256(path) != digest:
                return f"{name} differs from when it was saved (SHA-256)"
        return None

    def restore(self, like: TrainState, step: int | None = None):
        """Restores into the structure (and shardings) of `like`. Returns (state, meta)."""
        step = self.latest_step() if step is None else step
        return self._restore_state(like, step), self._restore_meta(step)

    def _restore_meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return out["meta"]

    def _restore_state(self, like: TrainState, step: int) -> TrainState:
        tree = {"step": like.step, "params": like.params, "opt_state": like.opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
        t = out["state"]
        return TrainState(step=t["step"], params=t["params"], opt_state=t["opt_state"])

    def restore_newest_intact(
        self, like: TrainState, check_meta: Callable[[dict[str, Any]], None] | None = None
    ) -> tuple[TrainState, dict[str, Any], list[tuple[int, str]]]:
        """Restores the newest checkpoint that reads back whole.

        check_meta(meta) runs on each checkpoint's metadata before its arrays are read; what it
        raises (a changed configuration) propagates: a checkpoint of another configuration is
        not damaged. Returns (state, meta, skipped): skipped lists (step, reason) of the newer
        checkpoints that failed to restore, reason being the exception's type and first line.
        Raises RuntimeError naming every checkpoint and its reason when none restores.
        """
        skipped = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            damage = self.verify(step)
            if damage is not None:
                skipped.append((step, damage))
                continue
            try:
                with _quiet_failed_reads():
                    meta = self._restore_meta(step)
            except Exception as err:
                skipped.append((step, self._reason(err)))
                continue
            if check_meta is not None:
                check_meta(meta)
            try:
                with _quiet_failed_reads():
                    return self._restore_state(like, step), meta, skipped
            except Exception as err:
                skipped.append((step, self._reason(err)))
        raise RuntimeError(
            f"cannot resume: no checkpoint in {self.directory} restores: "
            + "; ".join(f"step {step} ({reason})" for step, reason in skipped)
            + ". They are left in place; start over without --resume, or restore a copy."
        )

    def _reason(self, err: BaseException, limit: int = 240) -> str:
        """`Type: first line` of the exception's root cause (Orbax wraps TensorStore's error
        in a generic one), paths shortened to the checkpoint folder."""
        while True:
            inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
            if inner is None:
                break
            err = inner
        lines = str(err).strip().splitlines()
        text = (lines[0] if lines else "").replace(f"{self.directory}{os.sep}", "")
        if len(text) > limit:
            text = text[: limit - 3] + "..."
        return f"{type(err).__name__}: {text}" if text else type(err).__name__

    def move_aside(self, step: int, destination: str | os.PathLike) -> Path:
        """Moves checkpoint `step` out of the managed folder to destination/<step> (with a
        suffix if that exists) and returns its new path. With several processes, process 0
        moves it and the others wait for that before they look at the folder again."""
        source = self.directory / str(step)
        destination = Path(destination).absolute()
        target = destination / str(step)
        if jax.process_index() == 0:
            destination.mkdir(parents=True, exist_ok=True)
            n = 1
            while target.exists():
                target = destination / f"{step}.{n}"
                n += 1
            shutil.move(str(source), str(target))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"hyscale checkpoint {step} moved aside")
        self.manager.reload()
        return target

    def close(self) -> None:
        self.manager.close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _quiet_failed_reads():
    """When an Orbax restore fails, its other array reads are abandoned: their coroutines and
    TensorStore callbacks (which find asyncio's loop closed) then report to
    sys.unraisablehook / sys.excepthook, pages of tracebacks after the one-line reason. Inside
    this context those reports are dropped; if the body raised or any was dropped, it waits
    until the abandoned reads have settled (no new report for 0.5 s, 5 s at most). Other
    reports reach the previous hooks."""
    prev_unraisable, prev_except = sys.unraisablehook, sys.excepthook
    dropped = [0]

    def abandoned(value, obj=None) -> bool:
        return inspect.iscoroutine(obj) or (
            isinstance(value, RuntimeError) and "Event loop is closed" in str(value)
        )

    def unraisable(info):
        if abandoned(info.exc_value, info.object):
            dropped[0] += 1
        else:
            prev_unraisable(info)

    def excepthook(kind, value, tb):
        if abandoned(value):
            dropped[0] += 1
        else:
            prev_except(kind, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        gc.collect()
        if failed or dropped[0]:
            deadline, seen, quiet_since = time.monotonic() + 5.0, -1, time.monotonic()
            while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.5:
                time.sleep(0.05)
                gc.collect()
                if dropped[0] != seen:
                    seen, quiet_since = dropped[0], time.monotonic()
        sys.unraisablehook, sys.excepthook = prev_unraisable, prev_except


def _config_diff(saved: dict, current: dict, free: set[str]) -> list[str]:
    return [
        f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if k not in free and saved.get(k) != current.get(k)
    ]


def _resume_problems(saved: dict, meta: dict) -> list[str]:
    """What differs between a checkpoint's saved configuration and this run's. A model field
    added since the run was saved takes its default, so an older run resumes as long as it ran
    with what that default means."""
    saved_model = {**ModelConfig().to_dict(), **saved["model"]}
    return _config_diff(saved_model, meta["model"], _RESUME_FREE["model"]) + _config_diff(
        saved["train"], meta["train"], _RESUME_FREE["train"]
    )


# ----------------------------------------------------------------------------- training loop


def _to_float(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _parse_jsonl(path: Path, *, warn: bool = True) -> list[dict[str, Any]]:
    """Records of a metrics JSONL file. A last line that is not valid JSON is a record cut
    short (power loss, full disk): it is dropped, with a warning if `warn`. An invalid line
    before the last is an error."""
    lines = path.read_text().splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(numbered):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i + 1 < len(numbered):
                raise ValueError(
                    f"{path} line {n} is not valid JSON ({err.msg}): {line[:80]!r}"
                ) from None
            if warn:
                print(
                    f"warning: {path} line {n} is cut short ({err.msg}); dropped it: {line[:60]!r}"
                )
    return records


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drops records of steps after `last_step` (a resumed run recomputes them) and a last
    line cut short."""
    if not path.exists():
        return
    keep = [r for r in _parse_jsonl(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def _previous_run_step(ckpt_dir: Path, metrics_path: Path) -> int | None:
    """The last step a run in this folder logged or saved, or None if there is no run."""
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.is_dir() and p.name.isdigit()]
    if metrics_path.exists():
        steps += [r["step"] for r in _parse_jsonl(metrics_path, warn=False) if "step" in r]
    return max(steps, default=None)


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    plot: bool = True,
    stop_after: int | None = None,
    dataset: Dataset | None = None,
    mesh=None,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains and writes out_dir/{config.json, metrics.jsonl, ckpt/, metrics.png}.

    resume: continue from the newest checkpoint in out_dir that restores (configs must match,
      except remat/impl/logging); newer damaged checkpoints are moved to out_dir/ckpt_damaged/
      and named in one line each. Without resume, a run already in out_dir is replaced (its
      checkpoints and metrics are deleted), and a line says so.
    stop_after: stop (with a checkpoint) once this step is reached, as if killed there.
    mesh: optional ("data", "seq") mesh (`hs.parallel.make_mesh`): data + sequence parallel
      training (module docstring); batch sizes must divide by its data size and sequence
      lengths by 2 * its seq size. Not part of the run's configuration: a run may resume on
      another mesh.
    run_info: extra fields for config.json (e.g. the preset and command line), not compared
      on resume.
    Returns a summary: start and final step, wall time of this call's training loop,
    first/last metrics, the TrainState.
    """
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "ckpt"
    metrics_path = out_dir / "metrics.jsonl"
    if not resume and out_dir.exists():
        previous = _previous_run_step(ckpt_dir, metrics_path)
        if previous is not None:
            print(
                f"out dir {out_dir} holds a run at step {previous}; starting over, its checkpoints "
                "and metrics are deleted (use --resume to continue it)"
            )
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    dataset = dataset or Dataset(train_cfg.data)
    graphdef, state, tx = create_train_state(model_cfg, train_cfg, mesh=mesh)
    meta = {
        "model": model_cfg.to_dict(),
        "train": train_cfg.to_dict(),
        "corpus_fingerprint": dataset.fingerprint,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        **(run_info or {}),
    }
    if mesh is not None:
        meta["mesh"] = dict(mesh.shape)
    checkpointer = Checkpointer(ckpt_dir, keep=train_cfg.keep_checkpoints)
    if resume and checkpointer.latest_step() is None:
        print(f"resume: no checkpoint in {ckpt_dir}: starting a new run")
    if resume and checkpointer.latest_step() is not None:

        def check_config(saved):
            problems = _resume_problems(saved, meta)
            if problems:
                raise ValueError(
                    "cannot resume: the run's configuration changed:\n  " + "\n  ".join(problems)
                )

        state, saved, skipped = checkpointer.restore_newest_intact(state, check_config)
        for step, reason in skipped:
            moved = checkpointer.move_aside(step, out_dir / "ckpt_damaged")
            print(
                f"resume: checkpoint step {step} is damaged ({reason}); moved it to {moved}; "
                f"resuming from step {int(state.step)}"
            )
        if saved.get("corpus_fingerprint") != dataset.fingerprint:
            print(
                "warning: the stdlib text corpus differs from the checkpoint's (another "
                "Python version?): the data order will not match the original run"
            )
        _truncate_jsonl(metrics_path, int(state.step))
    else:
        _truncate_jsonl(metrics_path, 0)
    # Written only once a resume has been accepted, so a refused one leaves the run as it was.
    (out_dir / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    step_fn = _cached_train_step(graphdef, train_cfg, mesh)

    chance = {}
    if train_cfg.data.kind == "retrieval":
        chance["retrieval_chance"] = 1 / train_cfg.data.n_values
    start = int(state.step)
    end = train_cfg.steps if stop_after is None else min(train_cfg.steps, stop_after)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train_cfg.steps, initial=start, unit="step", dynamic_ncols=True)
    first = last = None
    t_start = time.perf_counter()
    interrupted = []
    prev_handler = None
    if hasattr(signal, "SIGTERM"):
        try:
            prev_handler = signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))
        except ValueError:  # not the main thread
            prev_handler = None
    try:
        with metrics_path.open("a") as log:
            for step in range(start, end):
                stage, seq_len = stage_for_step(model_cfg, train_cfg, step)
                batch_size = batch_size_for_step(train_cfg, step)
                batch = dataset.batch(step, batch_size, seq_len)
                if mesh is not None:
                    batch = parallel.shard_batch(batch, mesh)
                t0 = time.perf_counter()
                state, metrics = step_fn(state, batch, stage)
                metrics = jax.device_get(metrics)
                dt = time.perf_counter() - t0
                tokens = batch_size * seq_len
                record = {
                    "step": step + 1,
                    "stage": stage,
                    "seq_len": seq_len,
                    "batch_size": batch_size,
                    "lr": learning_rate(train_cfg, step),
                    **{k: _to_float(v) for k, v in sorted(metrics.items())},
                    **chance,
                    "step_time_s": dt,
                    "tokens_per_s": tokens / dt,
                    "elapsed_s": time.perf_counter() - t_start,
                }
                first = first or record
                last = record
                if (step + 1) % train_cfg.log_every == 0 or step + 1 == end:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if bar is not None:
                    post = {"loss": f"{record['ce']:.3f}", "tok/s": f"{tokens / dt:,.0f}"}
                    if record["retrieval_acc"] is not None:
                        post["acc"] = f"{record['retrieval_acc']:.2f}"
                    if record["needle_recall"] is not None:
                        post["recall"] = f"{record['needle_recall']:.2f}"
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
                if (step + 1) % train_cfg.ckpt_every == 0 or step + 1 == end or interrupted:
                    checkpointer.save(state, meta)
                if interrupted:
                    print(f"\nSIGTERM: saved step {step + 1}; continue with --resume")
                    break
    except KeyboardInterrupt:
        try:
            checkpointer.save(state, meta)
            print(f"\ninterrupted: saved step {int(state.step)}; continue with --resume")
        except Exception as err:
            print(
                f"\ninterrupted: could not save ({err}); --resume restarts from step "
                f"{checkpointer.latest_step()}"
            )
        raise
    finally:
        if bar is not None:
            bar.close()
        checkpointer.close()
        if prev_handler is not None:
            signal.signal(signal.SIGTERM, prev_handler)
    wall = time.perf_counter() - t_start
    if plot and metrics_path.exists():
        plot_metrics(metrics_path, out_dir / "metrics.png")
    return {
        "step": int(state.step),
        "start_step": start,
        "wall_s": wall,
        "first": first,
        "last": last,
        "state": state,
        "graphdef": graphdef,
        "out_dir": str(out_dir),
    }


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a last line cut short is dropped, with a warning)."""
    return _parse_jsonl(Path(path))


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(jsonl: str | os.PathLike, png: str | os.PathLike) -> None:
    """Loss (LM and indexer), retrieval accuracy and indexer needle recall against step.

    Accuracy and recall are per-batch shares (a few queries each), so they are drawn as a
    trailing mean over about 1/40 of the run, with the raw values faint behind.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    if not rows:
        return
    window = max(1, len(rows) // 40)

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return ([p[0] for p in pts], [p[1] for p in pts])

    def smoothed(ax, key, label, **kw):
        steps, values = series(key)
        if not steps:
            return
        line = ax.plot(steps, values, lw=0.6, alpha=0.25, color=kw.get("color"))[0]
        kw.setdefault("color", line.get_color())
        suffix = f" (mean of {window} steps)" if window > 1 else ""
        ax.plot(steps, trailing_mean(values, window), label=label + suffix, **kw)

    warm = [r for r in rows if r.get("stage") == "dense"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax in axes:
        ax.set_xlabel("step")
        if warm:
            ax.axvspan(
                0,
                warm[-1]["step"],
                color="grey",
                alpha=0.15,
                label=f"dense warm-up (T={warm[-1]['seq_len']})",
            )
    axes[0].plot(*series("ce"), label="LM cross-entropy (nats/byte)")
    axes[0].plot(*series("indexer_loss"), label="indexer KL per query")
    axes[0].set_title("loss")
    axes[0].legend()

    smoothed(axes[1], "retrieval_acc", "retrieval accuracy", lw=1.6)
    steps, chance = series("retrieval_chance")
    if steps:
        axes[1].axhline(chance[-1], color="k", ls=":", label=f"chance = 1/{round(1 / chance[-1])}")
    steps, blind = series("retrieval_blind")
    if steps and min(blind) < 1:
        axes[1].plot(
            steps,
            trailing_mean(blind, window),
            color="k",
            ls="--",
            lw=1,
            label="guess among the needles' values, blind to the key",
        )
    axes[1].set_title("retrieval accuracy (value predicted at the query)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].legend(loc="center right", fontsize="small")

    layers = sorted(
        (k for k in {k for r in rows for k in r} if k.startswith("needle_recall_l")),
        key=lambda k: int(k.removeprefix("needle_recall_l")),
    )
    for key in layers:
        smoothed(axes[2], key, "layer " + key.removeprefix("needle_recall_l"), lw=1, alpha=0.6)
    smoothed(axes[2], "needle_recall", "best layer", color="k", lw=1.6, zorder=5)
    steps, chance = series("needle_recall_chance")
    if steps:
        axes[2].plot(
            steps,
            chance,
            color="k",
            ls=":",
            zorder=4,
            label=f"chance = random k keys (~{sum(chance) / len(chance):.2f})",
        )
    axes[2].set_title("indexer recall of the needle (selected keys include it)")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].legend(loc="center left", fontsize="small")
    fig.text(
        0.5,
        0.01,
        "Grey band: dense attention (nothing selected yet); the indexer learns it by KL over "
        "every key. After it: each query attends only to the k keys its indexer selects (KL over "
        "those), so the answer can be right only if the needle is among them.",
        ha="center",
        fontsize="small",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)
