"""Replay with the saved indices offloaded to host memory (`hs.replay_policy(offload=True)`,
`ModelConfig.offload_indices`)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax._src.core import MemorySpace

import hyscale_jax as hs
from hyscale_jax.data import DataConfig, Dataset
from hyscale_jax.nn import ModelConfig
from hyscale_jax.train import TrainConfig, create_train_state, loss_and_metrics
from tests.helpers import TINY_TRAIN_MODEL, all_eqns, count_named_eqns, load_script
from tests.test_layer import TOPK, B, T, layer_inputs, layer_loss

NAMES = ("q", "k", "v", "q_idx", "k_idx", "w")


def index_transfers(jaxpr, shape):
    """(to host, to device): device_put equations that move an int32 array of `shape`."""
    moves = {MemorySpace.Host: 0, MemorySpace.Device: 0}
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name != "device_put":
            continue
        for var, dst in zip(eqn.outvars, eqn.params["devices"]):
            if var.aval.shape == shape and var.aval.dtype == np.int32 and dst in moves:
                moves[dst] += 1
    return moves[MemorySpace.Host], moves[MemorySpace.Device]


def layer_residuals(policy):
    inputs = layer_inputs()

    def loss(*args):
        return jax.checkpoint(layer_loss, policy=policy)(dict(zip(NAMES, args)))

    res = saved_residuals(loss, *(inputs[n] for n in NAMES))
    return [(a, src) for a, src in res if "argument" not in src]


@pytest.mark.parametrize("offload", [False, True])
def test_replay_policy_saves_only_the_indices_in_the_memory_it_names(offload):
    """Both policies save one computed residual, the int32 [B, T, topk] indices: in device
    memory by default, in host memory with offload=True."""
    computed = layer_residuals(hs.replay_policy(offload=offload))
    assert [(tuple(a.shape), str(a.dtype)) for a, _ in computed] == [((B, T, TOPK), "int32")]
    space = computed[0][0].memory_space
    assert space == (MemorySpace.Host if offload else MemorySpace.Device), computed


@pytest.mark.parametrize("offload", [False, True])
def test_offloaded_indices_go_to_host_and_back_once(offload):
    """The gradient's jaxpr moves the indices to host memory once (end of the forward) and back
    once (the backward's replay); the selection runs once either way."""
    loss = jax.checkpoint(layer_loss, policy=hs.replay_policy(offload=offload))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(layer_inputs())
    assert index_transfers(jaxpr, (B, T, TOPK)) == ((1, 1) if offload else (0, 0))
    assert count_named_eqns(jaxpr) == 1


MODEL = ModelConfig(**{**TINY_TRAIN_MODEL, "n_layers": 2}, remat="replay")


@pytest.mark.run_first
def test_model_offload_gives_the_replay_gradients_exactly():
    """The 2-layer bf16 model, sparse indexer stage, its SwiGLU in chunks as the long runs use
    it (48 tokens: two chunks of 20 and a tail of 8): offloading changes where the indices
    wait, not what the step computes. The indices move to host and back once per layer, and the
    selection runs once per layer."""
    train_cfg = TrainConfig(seq_len=48, batch_size=2, data=DataConfig(n_pairs=2, n_queries=2))
    _, state, _ = create_train_state(MODEL, train_cfg)
    batch = Dataset(train_cfg.data).batch(0, 2, 48)
    results = {}
    for offload in (False, True):
        cfg = dataclasses.replace(MODEL, offload_indices=offload, mlp_chunk=20)
        graphdef = create_train_state(cfg, train_cfg)[0]

        def loss(p, graphdef=graphdef):
            return loss_and_metrics(graphdef, p, batch, stage="sparse", indexer_loss_weight=1.0)[0]

        grad = jax.value_and_grad(loss)
        jaxpr = jax.make_jaxpr(grad)(state.params)
        assert count_named_eqns(jaxpr) == MODEL.n_layers
        moves = index_transfers(jaxpr, (2, 48, MODEL.topk))
        assert moves == ((2, 2) if offload else (0, 0))
        results[offload] = jax.jit(grad)(state.params)
    (value, grads), (value_off, grads_off) = results[False], results[True]
    assert float(value_off) == float(value)
    for g, g_off in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_off)):
        np.testing.assert_array_equal(g_off, g)
    assert any(np.asarray(g).any() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_offload_needs_replay(remat):
    with pytest.raises(ValueError, match=f"offload_indices=True .* got remat='{remat}'"):
        ModelConfig(remat=remat, offload_indices=True)
    with pytest.raises(ValueError, match="offload_indices must be a bool"):
        ModelConfig(remat="replay", offload_indices="yes")


def test_train_cli_offload_flag():
    cli = load_script("train", "train_cli")
    model_cfg, _, _ = cli.build_configs(cli.parse_args(["--offload-indices"]))
    assert model_cfg.offload_indices and model_cfg.remat == "replay"
    assert not cli.build_configs(cli.parse_args([]))[0].offload_indices
    with pytest.raises(SystemExit, match="offload_indices"):
        cli.build_configs(cli.parse_args(["--offload-indices", "--remat", "full"]))


def test_replay_options_lapse_with_replay_on_resume(tmp_path):
    """A run saved with replay's option resumes under --remat full without it (the option only
    changes where replay keeps the indices); --no-offload-indices clears it explicitly. A config
    saved while replay's saving of the indexer loss's statistics was an option resumes too."""
    cli = load_script("train", "train_cli")
    saved = {
        **ModelConfig(remat="replay", offload_indices=True).to_dict(),
        "save_indexer_statistics": True,
    }
    train_cfg = cli.PRESETS["cpu"][1]
    (tmp_path / "config.json").write_text(
        json.dumps({"model": saved, "train": train_cfg.to_dict()})
    )
    resume = ["--resume", "--out", str(tmp_path)]
    model_cfg, _, _ = cli.build_configs(cli.parse_args(resume))
    assert model_cfg.offload_indices and model_cfg.remat == "replay"
    model_cfg, _, _ = cli.build_configs(cli.parse_args(resume + ["--remat", "full"]))
    assert model_cfg.remat == "full" and not model_cfg.offload_indices
    model_cfg, _, _ = cli.build_configs(cli.parse_args(resume + ["--no-offload-indices"]))
    assert model_cfg.remat == "replay" and not model_cfg.offload_indices
