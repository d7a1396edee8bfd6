"""Replay fidelity: the backward pass attends to the forward's keys under replay, and plain
checkpointing's recomputed selection can differ from the forward's in bf16 (here: where the
model's blocks are not fenced)."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import hyscale_jax as hs
from hyscale_jax import nn as hs_nn
from hyscale_jax.data import DataConfig, Dataset
from hyscale_jax.nn import ModelConfig
from hyscale_jax.replay_check import observe_selections, selection_drift
from hyscale_jax.train import TrainConfig, create_train_state
from tests.helpers import TINY_TRAIN_MODEL
from tests.test_layer import REMAT, TOPK, layer_inputs, layer_loss

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("remat,expected", [("none", 1), ("full", 2), ("replay", 1)])
def test_observed_selection_fires_once_per_run_and_passes_indices_through(remat, expected):
    """The callback fires once per execution of the selection: twice in one gradient under
    plain checkpointing (the forward and the backward's recomputation), once under replay. It
    sees the selection's result and changes nothing: the gradient is the unobserved one, bit
    for bit."""
    inputs = layer_inputs(1)
    loss = REMAT[remat](layer_loss)
    # value_and_grad: with grad alone the forward's output is unused and jit drops it.
    want = jax.jit(jax.value_and_grad(loss))(inputs)[1]
    with observe_selections() as log:
        grads = jax.jit(jax.value_and_grad(loss))(inputs)[1]
        jax.block_until_ready(grads)
    assert log.traced == 1
    assert len(log.runs[0]) == expected
    _, idx = hs.hyscale_attention(**inputs, topk=TOPK, impl="xla")
    for seen in log.runs[0]:
        np.testing.assert_array_equal(seen, idx)  # f32: the recomputation is the same selection
    for name in inputs:
        np.testing.assert_array_equal(grads[name], want[name])


def test_observation_ends_with_its_block():
    """A function traced inside the block runs without the callback after it."""
    inputs = layer_inputs(1)
    grad = jax.jit(jax.value_and_grad(REMAT["full"](layer_loss)))
    with observe_selections() as log:
        grad(inputs)
    grad(inputs)
    assert log.traced == 1 and len(log.runs[0]) == 2


# Two layers in bf16: where nothing fences the blocks, the second layer's block input is what
# XLA keeps in excess precision in the forward pass, so that is where the recomputation can
# differ (docs/design.md, 'Replay fidelity').
MODEL = ModelConfig(**{**TINY_TRAIN_MODEL, "n_layers": 2}, dtype="bfloat16")


def model_params_and_batch():
    train_cfg = TrainConfig(seq_len=64, batch_size=2, data=DataConfig(n_pairs=2, n_queries=2))
    _, state, _ = create_train_state(MODEL, train_cfg)
    return state.params, Dataset(train_cfg.data).batch(0, 2, 64)


@pytest.fixture(scope="module")
def params_and_batch():
    return model_params_and_batch()


@pytest.fixture(scope="module")
def fenced_drift(params_and_batch):
    """selection_drift of MODEL as it is (blocks fenced) per remat mode, each computed once for
    the tests below that read it: the gradient is a pure function of the model, params and
    batch, and its observed selections compile with host callbacks, which the persistent
    compilation cache does not keep."""
    params, batch = params_and_batch

    @functools.cache
    def drift(remat):
        return selection_drift(dataclasses.replace(MODEL, remat=remat), params, batch)

    return drift


def test_replay_backward_sees_the_forward_indices(fenced_drift):
    drift = fenced_drift("replay")
    assert drift["selection_runs"] == [1, 1]
    assert drift["changed_fraction"] == [0.0, 0.0]


CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="pins XLA CPU's fusion and rounding of bf16"
)


def unfenced(monkeypatch):
    """The model without the barriers that fence its blocks (`LongContextLM.forward`): XLA may
    then fuse across a block boundary."""
    monkeypatch.setattr(hs_nn, "_fence", lambda tree: tree)


@CPU_ONLY
def test_full_remat_in_bf16_recomputes_other_indices_across_an_unfenced_boundary(
    params_and_batch, monkeypatch
):
    """The same model and batch under plain checkpointing, its blocks unfenced: the selection
    runs again in the backward pass and picks other keys for some queries. XLA on CPU keeps the
    forward's bf16 block output in f32 inside its fusions (`--xla_allow_excess_precision`, on by
    default) while the rematerialized block starts from the saved, rounded bf16 input, so the
    second layer's indexer scores differ; with that flag off the two selections agree."""
    unfenced(monkeypatch)
    params, batch = params_and_batch
    drift = selection_drift(dataclasses.replace(MODEL, remat="full"), params, batch)
    assert drift["selection_runs"] == [2, 2]
    assert drift["changed_fraction"][1] > 0, drift
    assert 0 < drift["rows_changed_fraction"][1] <= 1


@CPU_ONLY
def test_fenced_blocks_recompute_the_same_indices(fenced_drift):
    """The model as it is: the barrier after each block rounds its output to bf16 before the
    next block reads it, in the forward pass as in the rematerialization, and plain
    checkpointing's recomputed selection equals the forward's here."""
    drift = fenced_drift("full")
    assert drift["selection_runs"] == [2, 2]
    assert drift["changed_fraction"] == [0.0, 0.0], drift


@CPU_ONLY
def test_fenced_bf16_gradients_equal_the_unrematerialized_ones(fenced_drift):
    """With the blocks fenced, the rematerialized forward reads the same bf16 values the forward
    did, and on CPU the bf16 gradients under plain checkpointing and under replay equal those
    without rematerialization bit for bit."""
    grads = {remat: fenced_drift(remat)["grads"] for remat in ("none", "full", "replay")}
    for remat in ("full", "replay"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.run_first
@CPU_ONLY
def test_full_remat_recomputes_the_same_indices_without_excess_precision():
    """The control: the unfenced measurement with XLA's excess precision off (a fresh process,
    as XLA reads its flags once) finds the recomputed selection equal to the forward's."""
    code = (
        "import dataclasses, json\n"
        "import hyscale_jax.nn\n"
        "from hyscale_jax.replay_check import selection_drift\n"
        "from tests.test_replay_faithful import MODEL, model_params_and_batch\n"
        "hyscale_jax.nn._fence = lambda tree: tree\n"
        "params, batch = model_params_and_batch()\n"
        "d = selection_drift(dataclasses.replace(MODEL, remat='full'), params, batch)\n"
        "print(json.dumps([d['selection_runs'], d['changed_fraction']]))\n"
    )
    env = dict(
        os.environ,
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"),
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        JAX_PLATFORMS="cpu",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    runs, changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs == [2, 2]
    assert changed == [0.0, 0.0]


def test_selection_drift_rejects_other_attention(params_and_batch):
    params, batch = params_and_batch
    with pytest.raises(ValueError, match="attention is 'dense'"):
        selection_drift(dataclasses.replace(MODEL, attention="dense"), params, batch)
