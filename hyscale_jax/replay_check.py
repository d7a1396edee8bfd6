"""Replay fidelity: the keys the backward pass attends to, against the forward pass's.

Under plain `jax.checkpoint` the backward pass recomputes each layer's selection. XLA compiles
that recomputation separately (fused and rounded differently), so in bf16 its indexer scores
need not equal the forward's bit for bit, and near-ties can then select other keys: the gradient
belongs to an attention the forward never computed. Replay (`hs.replay_policy()`) saves the
forward's indices and the backward reuses them (docs/design.md, 'Replay fidelity').

`observe_selections()` makes every `hs.hyscale_attention` traced while it is active pass its
selection result through a `jax.pure_callback` identity placed before the `INDICES_NAME` tag.
The callback sits where the selection is computed in the compiled program, so it fires each time
the selection runs and sees the indices that run produced: once in the forward pass, and once
more in the backward pass wherever rematerialization recomputes the selection. Where the tagged
indices are replayed, nothing in the backward pass needs the callback's result, so it is not
recomputed and does not fire. It returns its input unchanged.

`selection_drift` runs one gradient of the training loss under that observation and reports,
per layer, how often the selection ran and which share of the indices the backward pass's
recomputation changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from hyscale_jax import layer
from hyscale_jax.nn import LongContextLM, ModelConfig
from hyscale_jax.train import loss_and_metrics


@dataclasses.dataclass
class SelectionLog:
    """What `observe_selections` saw. traced: selections traced (in call order, so layer l of a
    model traced once is number l); runs[i]: the int32 [B, T, topk] results of selection i, one
    per execution, in execution order."""

    traced: int = 0
    runs: dict[int, list[np.ndarray]] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def observe_selections():
    """Context manager yielding a `SelectionLog` that records every execution of every
    selection traced while it is active (module docstring).

    jax's trace and compilation caches are cleared on entry and on exit (`jax.clear_caches`),
    so everything called inside the block is traced with the callbacks, even a function traced
    before it (`jax.jit` and `jax.checkpoint` reuse traces per function), and nothing called
    after it runs them."""
    log = SelectionLog()

    def tap(idx):
        number = log.traced
        log.traced += 1

        def record(x):
            x = np.asarray(x)
            log.runs.setdefault(number, []).append(x.copy())
            return x

        return jax.pure_callback(record, jax.ShapeDtypeStruct(idx.shape, idx.dtype), idx)

    previous = layer._selection_tap
    jax.clear_caches()
    layer._selection_tap = tap
    try:
        yield log
    finally:
        layer._selection_tap = previous
        jax.clear_caches()


def selection_drift(
    model_cfg: ModelConfig,
    params,
    batch: dict[str, Any],
    *,
    stage: str = "sparse",
    indexer_loss_weight: float = 1.0,
) -> dict[str, Any]:
    """One jitted gradient of the training loss (`hyscale_jax.train.loss_and_metrics`) with every
    selection observed.

    Args:
      model_cfg: the model (attention "hyscale", no mesh); its `remat` decides what the
        backward pass does: "none" keeps the indices, "full" recomputes the selection, "replay"
        replays the forward's indices.
      params: the model's parameters (`nnx.State`, e.g. `TrainState.params`).
      batch: a training batch (`hyscale_jax.data.Dataset.batch`), tokens [B, T + 1].
      stage: the indexer stage of the step ("sparse": main attention over the selection).
    Returns a dict:
      selection_runs: per layer, how many times the compiled gradient ran the selection;
      changed_fraction: per layer, the share of index entries [B, T, topk] in which the
        backward pass's selection differs from the forward's (0.0 where it ran once);
      rows_changed_fraction: per layer, the share of query rows [B, T] with a changed entry;
      loss: the loss; grads: the parameter gradients (an `nnx.State` like `params`).
    """
    if model_cfg.attention != "hyscale":
        raise ValueError(
            f"selection_drift observes hs.hyscale_attention; model_cfg.attention is "
            f"{model_cfg.attention!r}, expected 'hyscale'"
        )
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: LongContextLM(model_cfg, rngs=nnx.Rngs(0))))

    def loss(p):
        return loss_and_metrics(
            graphdef, p, batch, stage=stage, indexer_loss_weight=indexer_loss_weight
        )[0]

    with observe_selections() as log:
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        jax.block_until_ready(grads)
    if log.traced != model_cfg.n_layers:
        raise RuntimeError(
            f"traced {log.traced} selections for a {model_cfg.n_layers}-layer model; expected "
            f"one per layer"
        )
    runs = [log.runs.get(i, []) for i in range(log.traced)]
    changed, rows = [], []
    for layer_runs in runs:
        if not 1 <= len(layer_runs) <= 2:
            raise RuntimeError(f"a selection ran {len(layer_runs)} times in one gradient")
        forward, backward = layer_runs[0], layer_runs[-1]
        diff = forward != backward
        changed.append(float(diff.mean()))
        rows.append(float(diff.any(axis=-1).mean()))
    return {
        "selection_runs": [len(r) for r in runs],
        "changed_fraction": changed,
        "rows_changed_fraction": rows,
        "loss": float(value),
        "grads": grads,
    }
