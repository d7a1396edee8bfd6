"""Replay that also saves the sparse-stage indexer loss's statistics
(`hs.replay_policy(indexer_statistics=True)`, which the model's replay always uses), and its
target (`indexer_target=True`, with the loss's `save_target=True`)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs
from hyscale_jax import nn
from hyscale_jax.nn import ModelConfig
from tests.helpers import KERNEL_IMPL, TINY_TRAIN_MODEL, count_named_eqns, load_script
from tests.test_layer import TOPK, kernel_inputs

NAMES = ("q", "k", "v", "q_idx", "k_idx", "w")


def layer_loss(x, save_target=False):
    """Sparse attention and its sparse-stage indexer loss (the Pallas kernels), as a block
    trains them."""
    out, idx = hs.hyscale_attention(**x, topk=TOPK, impl=KERNEL_IMPL)
    kl = hs.indexer_kl_loss(
        x["q"],
        x["k"],
        x["q_idx"],
        x["k_idx"],
        x["w"],
        idx,
        impl=KERNEL_IMPL,
        save_target=save_target,
    )
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + kl


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("statistics", [False, True])
def test_policy_saves_the_statistics_only_when_asked(offload, statistics):
    """Computed residuals: the indices, plus the indexer loss's two f32 statistics (all heads'
    log-sum-exps, the row's loss and indexer log-sum-exp) with indexer_statistics=True."""
    inputs = kernel_inputs(0)
    policy = hs.replay_policy(offload=offload, indexer_statistics=statistics)

    def loss(*args):
        return jax.checkpoint(layer_loss, policy=policy)(dict(zip(NAMES, args)))

    res = saved_residuals(loss, *(inputs[n] for n in NAMES))
    # (name or "offloaded", dtype, memory): offloaded indices come back from a device_put
    computed = sorted(
        (
            re.search(r"named '([^']+)'", src)[1] if "named" in src else "offloaded",
            str(a.dtype),
            "host" if "<host>" in str(a) else "device",
        )
        for a, src in res
        if "argument" not in src
    )
    indices = ("offloaded", "int32", "host") if offload else (hs.INDICES_NAME, "int32", "device")
    want = [indices] + [(hs.INDEXER_STATISTICS_NAME, "float32", "device")] * 2 * statistics
    assert computed == sorted(want), res


def test_saved_statistics_drop_the_recomputed_forward_kernel():
    """value_and_grad under both policies: bit for bit the same loss and gradients, and the
    compiled step with the statistics saved does less work (the rematerialized forward no
    longer runs the indexer loss's forward kernel: its outputs go unused and XLA drops it)."""
    inputs = kernel_inputs(1)
    results, flops = {}, {}
    for statistics in (False, True):
        policy = hs.replay_policy(indexer_statistics=statistics)
        step = jax.jit(jax.value_and_grad(jax.checkpoint(layer_loss, policy=policy)))
        compiled = step.lower(inputs).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        flops[statistics] = analysis["flops"]
        results[statistics] = jax.tree.leaves(compiled(inputs))
    for a, b in zip(results[False], results[True]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert flops[True] < flops[False], flops


def test_saved_target_drops_the_main_keys_from_the_backward():
    """save_target=True under replay_policy(indexer_statistics=True, indexer_target=True): the
    loss of the recomputing backward's step bit for bit and its gradients to f32 rounding, and
    a compiled step that does less work (its backward computes no main logits). Without
    indexer_target the rematerialization runs the loss's forward kernel again, for the target:
    more work than with it saved."""
    inputs = kernel_inputs(1)
    results, flops = {}, {}
    for save_target, target in ((False, False), (True, True), (True, False)):
        policy = hs.replay_policy(indexer_statistics=True, indexer_target=target)
        loss = jax.checkpoint(lambda x: layer_loss(x, save_target), policy=policy)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(inputs).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        flops[save_target, target] = analysis["flops"]
        results[save_target, target] = compiled(inputs)
    (want_loss, want_grads) = results[False, False]
    for key in ((True, True), (True, False)):
        got_loss, got_grads = results[key]
        assert got_loss == want_loss
        for name in NAMES:
            np.testing.assert_allclose(
                np.asarray(got_grads[name], np.float32),
                np.asarray(want_grads[name], np.float32),
                rtol=1e-6,
                atol=1e-7,
            )
    assert flops[True, True] < flops[False, False], flops
    assert flops[True, True] < flops[True, False], flops


def test_the_model_runs_the_policy_it_names(monkeypatch):
    """remat_block's replay policy saves the statistics, offloads the indices and saves the
    indexer loss's target as the config asks."""
    calls = []
    real = hs.replay_policy
    monkeypatch.setattr(hs, "replay_policy", lambda **kw: calls.append(kw) or real(**kw))
    for offload, target in ((False, False), (True, False), (False, True)):
        cfg = ModelConfig(
            **TINY_TRAIN_MODEL,
            remat="replay",
            offload_indices=offload,
            save_indexer_target=target,
        )
        nn.remat_block(nn.Block(cfg, rngs=nnx.Rngs(0)), cfg)
    assert calls == [
        {"offload": False, "indexer_statistics": True, "indexer_target": False},
        {"offload": True, "indexer_statistics": True, "indexer_target": False},
        {"offload": False, "indexer_statistics": True, "indexer_target": True},
    ]


def test_configs_saved_with_the_former_option_still_load():
    """Configurations saved while saving the statistics was an option name it; they load."""
    saved = {**ModelConfig(remat="replay").to_dict(), "save_indexer_statistics": False}
    assert ModelConfig.from_dict(saved) == ModelConfig(remat="replay")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_model_wires_the_target_and_the_order(kind):
    """A block with save_indexer_target and selection_order="index" (both attention kinds, the
    Pallas kernels): replay saves the indexer loss's target, the gradient runs the backward that
    reads it, and the selected keys come by ascending index."""
    from tests.test_mla_model import TINY

    base = ModelConfig(**TINY_TRAIN_MODEL) if kind == "gqa" else dataclasses.replace(TINY)
    cfg = dataclasses.replace(
        base,
        n_layers=1,
        remat="replay",
        impl=KERNEL_IMPL,
        save_indexer_target=True,
        selection_order="index",
    )
    run = nn.remat_block(nn.Block(cfg, rngs=nnx.Rngs(0)), cfg)
    x = jax.random.normal(jax.random.key(0), (1, 24, cfg.d_model), jnp.float32)
    positions = jnp.arange(24)

    def loss(x):
        y, aux = run(x, positions, indexer_stage="sparse")
        return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux["indexer_loss"], aux["idx"]

    saved = saved_residuals(lambda x: loss(x)[0], x)
    assert any(hs.INDEXER_TARGET_NAME in src for _, src in saved), saved
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: loss(x)[0]))(x)
    assert count_named_eqns(jaxpr, ("indexer_kl_bwd_given_target",)) >= 1
    idx = np.asarray(loss(x)[1])
    keys = np.where(idx < 0, np.iinfo(np.int32).max, idx)
    assert (np.diff(keys, axis=-1) >= 0).all() and (idx >= 0).any()


def test_train_cli_target_and_order_flags():
    """experiments/train.py's --save-indexer-target and --selection-order set the model's
    fields (off and "score" by default); an unknown order is refused."""
    cli = load_script("train", "train_cli")
    flags = ["--save-indexer-target", "--selection-order", "index"]
    model_cfg, _, _ = cli.build_configs(cli.parse_args(flags))
    assert model_cfg.save_indexer_target and model_cfg.selection_order == "index"
    default = cli.build_configs(cli.parse_args([]))[0]
    assert not default.save_indexer_target and default.selection_order == "score"
    with pytest.raises(SystemExit):
        cli.parse_args(["--selection-order", "random"])
