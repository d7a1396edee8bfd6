"""Tests of the MLA attention option of the Flax model (hyscale_jax/nn.py, `MLAAttention`).

The sparse paths run MLA in DSA's absorbed multi-query form (one latent key per position, the
value its leading kv_lora_rank features), the dense paths in the per-head form: the two must be
the same attention, with the same scale, and the indexer's KL target the same distribution.
Sizes are small and awkward (v_head_dim 12 != qk_nope_dim + qk_rope_dim 16, T = 20).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hyscale_jax as hs
from hyscale_jax.nn import MLA_LAYER_PRESETS, LongContextLM, MLAAttention, ModelConfig
from hyscale_jax.train import TrainConfig, read_metrics, train
from tests.helpers import KERNEL_IMPL, count_named_eqns, load_script

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = jax.default_backend() == "gpu"

TINY = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    index_heads=2,
    index_dim=16,
    topk=8,
    impl="xla",
    attention_kind="mla",
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_dim=8,
    qk_rope_dim=8,
    v_head_dim=12,
)
B, T = 2, 20
# Normwise relative error allowed between two f32 computations of the same function that differ
# in summation order (absorbed vs per-head products, fused vs not): a few hundred f32 ulps.
F32_TOL = 5e-5


def _f32(cfg, **kw):
    return dataclasses.replace(cfg, dtype="float32", **kw)


def _tokens(seed=0, shape=(B, T)):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size, jnp.int32)


def _assert_close_normwise(got, want, tol, what):
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (what, path, a.shape, b.shape)
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert err <= tol, f"{what} {jax.tree_util.keystr(path)}: normwise error {err:.2e}"


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(attention_kind="mha"), "attention_kind"),
        (dict(q_lora_rank=0), "q_lora_rank"),
        (dict(kv_lora_rank=-4), "kv_lora_rank"),
        (dict(qk_nope_dim=2.0), "qk_nope_dim"),
        (dict(v_head_dim=True), "v_head_dim"),
        (dict(qk_rope_dim=7), "qk_rope_dim must be even"),
        (dict(save_indexer_target=1), "save_indexer_target must be a bool"),
        (dict(selection_order="random"), "selection_order"),
    ],
)
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **bad)


def test_gqa_is_the_default_and_mla_has_no_gqa_projections():
    assert ModelConfig().attention_kind == "gqa"
    gqa = nnx.eval_shape(
        lambda: LongContextLM(dataclasses.replace(TINY, attention_kind="gqa"), rngs=nnx.Rngs(0))
    )
    mla = nnx.eval_shape(lambda: LongContextLM(TINY, rngs=nnx.Rngs(0)))
    assert type(gqa.blocks[0].attn).__name__ == "HyScaleAttention"
    assert isinstance(mla.blocks[0].attn, MLAAttention)
    assert not hasattr(mla.blocks[0].attn, "q_proj")


def _mla_dims(cfg):
    """(H, C, R, N, V): heads, kv latent, rope, no-position and value widths."""
    return cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.qk_nope_dim, cfg.v_head_dim


def _attention_param_count(cfg):
    H, C, R, N, V = _mla_dims(cfg)
    main = (
        cfg.d_model * cfg.q_lora_rank
        + cfg.q_lora_rank  # q_norm
        + cfg.q_lora_rank * H * (N + R)
        + cfg.d_model * (C + R)
        + C  # kv_norm
        + C * H * (N + V)
        + H * V * cfg.d_model
    )
    HI, DI = cfg.index_heads, cfg.index_dim
    indexer = cfg.d_model * HI * DI + cfg.d_model * DI + 2 * DI + cfg.d_model * HI
    return main + indexer


@pytest.mark.parametrize("name", sorted(MLA_LAYER_PRESETS))
def test_paper_layer_presets_construct(name):
    """The GLM-5.1 / DeepSeek-V3.2 attention layers, shapes only (nothing is allocated): the
    parameter count of the formula, and the absorbed sparse form's shapes (G = 1, 576 = 512 +
    64 features, output d_model wide) traced at a short length."""
    cfg = MLA_LAYER_PRESETS[name]
    expected = {
        "glm-5.1": (6144, 64, 2048, 192, 256, 32, 64),
        "deepseek-v3.2": (7168, 128, 1536, 128, 128, 64, 64),
    }[name]
    got = (
        cfg.d_model,
        cfg.n_heads,
        cfg.q_lora_rank,
        cfg.qk_nope_dim,
        cfg.v_head_dim,
        cfg.index_heads,
        cfg.qk_rope_dim,
    )
    assert got == expected
    assert (cfg.kv_lora_rank, cfg.index_dim, cfg.topk, cfg.n_layers) == (512, 128, 2048, 1)
    attn = nnx.eval_shape(lambda: MLAAttention(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(attn, nnx.Param)
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == _attention_param_count(
        cfg
    )
    x = jax.ShapeDtypeStruct((1, 64, cfg.d_model), jnp.bfloat16)
    y, aux = jax.eval_shape(
        lambda a, x: a(x, jnp.arange(64), indexer_stage="sparse"),
        attn,
        x,
    )
    assert y.shape == (1, 64, cfg.d_model) and y.dtype == jnp.bfloat16
    assert aux["idx"].shape == (1, 64, 2048) and aux["indexer_loss"].shape == ()
    model = nnx.eval_shape(lambda: LongContextLM(cfg, rngs=nnx.Rngs(0)))
    assert len(model.blocks) == 1


# ------------------------------------------------------------------------------ the math


def _rope_np(x, positions, base):
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) / half)
    ang = positions[:, None] * inv_freq  # [T, half]
    shape = (1, len(positions)) + (1,) * (x.ndim - 3) + (half,)
    sin, cos = np.sin(ang).reshape(shape), np.cos(ang).reshape(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla_reference(attn: MLAAttention, x):
    """The MLA layer's output [B, T, d_model] in float64 numpy, per head, written from the
    formulas (DeepSeek-V2): low-rank q and kv with RMSNorm latents, decoupled RoPE, causal
    softmax at scale (qk_nope_dim + qk_rope_dim) ** -0.5."""
    cfg = attn.cfg
    H, C, R, N, V = _mla_dims(cfg)
    x = np.asarray(x, np.float64)
    Bx, Tx, _ = x.shape
    pos = np.arange(Tx, dtype=np.float64)

    def w(lin):
        return np.asarray(lin.kernel[...], np.float64)

    def rms(h, norm):
        scale = np.asarray(norm.scale[...], np.float64)
        return h / np.sqrt(np.mean(h**2, axis=-1, keepdims=True) + cfg.norm_eps) * scale

    q = (rms(x @ w(attn.wq_a), attn.q_norm) @ w(attn.wq_b)).reshape(Bx, Tx, H, N + R)
    q_nope, q_rope = q[..., :N], _rope_np(q[..., N:], pos, cfg.rope_base)
    kv = x @ w(attn.wkv_a)
    c_kv = rms(kv[..., :C], attn.kv_norm)
    k_rope = _rope_np(kv[..., C:], pos, cfg.rope_base)  # [B, T, R]
    up = (c_kv @ w(attn.wkv_b)).reshape(Bx, Tx, H, N + V)
    k_nope, v = up[..., :N], up[..., N:]
    s = np.einsum("bthn,bshn->bhts", q_nope, k_nope) + np.einsum("bthr,bsr->bhts", q_rope, k_rope)
    s = s * (N + R) ** -0.5
    s = np.where(np.tril(np.ones((Tx, Tx), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", p, v).reshape(Bx, Tx, H * V)
    return o @ w(attn.o_proj)


def _layer_and_input(cfg, seed=0):
    attn = MLAAttention(cfg, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (B, T, cfg.d_model), jnp.float32)
    return attn, x


@pytest.mark.parametrize("attention", ["dense", "hyscale", "materialized"])
def test_layer_matches_numpy_reference_all_keys(attention):
    """Every attention mode against the float64 per-head formula, in f32: dense directly, the
    absorbed sparse paths with topk >= T (every visible key selected, -1 slots included)."""
    attn, x = _layer_and_input(_f32(TINY, attention=attention, topk=T + 3))
    with jax.default_matmul_precision("highest"):
        y, aux = jax.jit(lambda a, x: a(x, jnp.arange(T)))(attn, x)
    _assert_close_normwise(y, mla_reference(attn, x), F32_TOL, "y")
    if attention != "dense":
        idx = np.asarray(aux["idx"])
        assert ((idx >= 0).sum(-1) == np.arange(1, T + 1)).all()


@pytest.mark.parametrize(
    "attention, impl",
    [("hyscale", "xla"), ("materialized", "xla"), ("hyscale", KERNEL_IMPL)],
)
def test_absorbed_equals_per_head_form_all_keys(attention, impl):
    """With topk >= T, the sparse stage (absorbed MQA over the latent, value_dim=kv_lora_rank,
    scale (N + R) ** -0.5) and the dense warm-up stage (per-head form) of one layer are the same
    function: same output, same gradients in x and every main-attention weight (random
    cotangent), and the same indexer KL with the same indexer gradients (sparse-stage KL over
    the selection = dense-stage KL over every visible key). A wrong scale or absorption fails."""
    attn, x = _layer_and_input(_f32(TINY, attention=attention, impl=impl, topk=T + 3))
    graphdef, params = nnx.split(attn)
    cot = jax.random.normal(jax.random.key(9), (B, T, TINY.d_model), jnp.float32)

    def run(stage):
        def f(p, x):
            y, aux = nnx.merge(graphdef, p)(x, jnp.arange(T), indexer_stage=stage)
            return y, aux["indexer_loss"]

        (y, il), vjp = jax.vjp(f, params, x)
        g_y = vjp((cot, jnp.zeros_like(il)))
        g_il = vjp((jnp.zeros_like(y), jnp.ones_like(il)))[0]
        return y, il, g_y, g_il

    with jax.default_matmul_precision("highest"):
        sparse = jax.jit(run, static_argnums=0)("sparse")
        dense = jax.jit(run, static_argnums=0)("dense")
    y_s, il_s, g_s, gi_s = sparse
    y_d, il_d, g_d, gi_d = dense
    _assert_close_normwise(y_s, y_d, F32_TOL, "y")
    _assert_close_normwise(g_s, g_d, F32_TOL, "d<y, cot>/d")
    assert float(il_d) > 0
    np.testing.assert_allclose(float(il_s), float(il_d), rtol=F32_TOL)
    _assert_close_normwise(gi_s, gi_d, F32_TOL, "d indexer loss/d")


# ----------------------------------------------------------------------------- the model


def _split(cfg, seed=0):
    return nnx.split(LongContextLM(cfg, rngs=nnx.Rngs(seed)))


def _forward_and_grads(cfg, tokens, cotangent, seed=0):
    """cfg's model (f32, full-precision matmuls), sparse indexer stage: (logits, indexer loss,
    indices, d<logits, cotangent>/d params, d indexer loss/d params)."""
    graphdef, params = _split(cfg, seed)

    def run(p):
        def f(p):
            logits, aux = nnx.merge(graphdef, p).forward(tokens, indexer_stage="sparse")
            return (logits, aux["indexer_loss"]), aux["indices"]

        (logits, il), vjp, indices = jax.vjp(f, p, has_aux=True)
        zl, zs, one = jnp.zeros_like(logits), jnp.zeros_like(il), jnp.ones_like(il)
        return logits, il, indices, vjp((cotangent, zs))[0], vjp((zl, one))[0]

    with jax.default_matmul_precision("highest"):
        return jax.jit(run)(params)


@pytest.fixture(scope="module")
def model_runs():
    """_forward_and_grads of TINY (f32) per (attention, remat, impl), same weights and data."""
    tokens = _tokens(3)
    cot = jax.random.normal(jax.random.key(7), (B, T, TINY.vocab_size), jnp.float32)
    cache = {}

    def get(attention, remat, impl="xla", order="score"):
        key = (attention, remat, impl, order)
        if key not in cache:
            cfg = _f32(TINY, attention=attention, remat=remat, impl=impl, selection_order=order)
            cache[key] = _forward_and_grads(cfg, tokens, cot)
        return cache[key]

    return get


def test_hyscale_equals_materialized(model_runs):
    """Same weights, exact selection both ways (topk < T): the same indices index for index,
    then the same sparse attention on the same inputs, so identical logits, indexer loss and
    gradients (bit for bit on CPU; on GPU XLA's scatter-adds in the backward may sum in
    another order, so gradients there agree to f32 rounding)."""
    h = model_runs("hyscale", "none")
    m = model_runs("materialized", "none")
    assert len(h[2]) == TINY.n_layers
    for ih, im in zip(h[2], m[2], strict=True):
        np.testing.assert_array_equal(np.asarray(ih), np.asarray(im))
        assert (np.asarray(ih) >= 0).sum(-1).max() == TINY.topk  # a real selection
    assert float(h[1]) > 0
    for a, b in zip(jax.tree.leaves((h[0], h[1])), jax.tree.leaves((m[0], m[1])), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if jax.default_backend() == "cpu":
        for a, b in zip(jax.tree.leaves((h[3], h[4])), jax.tree.leaves((m[3], m[4])), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        _assert_close_normwise((h[3], h[4]), (m[3], m[4]), F32_TOL, "grads")


def test_index_order_selects_the_same_keys_in_the_model(model_runs):
    """selection_order="index": hyscale and materialized select the score order's keys by
    ascending index, index for index alike (so their logits and loss agree bit for bit), and the
    model computes what it does in score order up to f32 summation order."""
    h = model_runs("hyscale", "none", order="index")
    m = model_runs("materialized", "none", order="index")
    s = model_runs("hyscale", "none")
    for ih, im, i_score in zip(h[2], m[2], s[2], strict=True):
        np.testing.assert_array_equal(np.asarray(ih), np.asarray(im))
        keys = np.where(np.asarray(ih) < 0, np.iinfo(np.int32).max, np.asarray(ih))
        assert (np.diff(keys, axis=-1) >= 0).all()
        want = np.sort(np.where(np.asarray(i_score) < 0, np.iinfo(np.int32).max, i_score), -1)
        np.testing.assert_array_equal(keys, want)
    for a, b in zip(jax.tree.leaves((h[0], h[1])), jax.tree.leaves((m[0], m[1])), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_close_normwise((h[0], h[3], h[4]), (s[0], s[3], s[4]), F32_TOL, "index order")
    np.testing.assert_allclose(float(h[1]), float(s[1]), rtol=F32_TOL)


@pytest.mark.parametrize(
    "attention, remat", [("hyscale", "full"), ("hyscale", "replay"), ("materialized", "replay")]
)
def test_remat_gradients_equal_no_remat(model_runs, attention, remat):
    """Rematerializing per block (recomputing the selection, or replaying it) changes nothing
    in f32: same indices, logits, indexer loss and both losses' parameter gradients."""
    got, want = model_runs(attention, remat), model_runs(attention, "none")
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_close_normwise(got[0], want[0], F32_TOL, "logits")
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=F32_TOL)
    _assert_close_normwise(got[3], want[3], F32_TOL, "d<logits, cotangent>/d")
    _assert_close_normwise(got[4], want[4], F32_TOL, "d indexer loss/d")


def test_dense_remat_gradients_equal_no_remat():
    tokens = _tokens(4)
    cot = jax.random.normal(jax.random.key(8), (B, T, TINY.vocab_size), jnp.float32)
    runs = {
        remat: _forward_and_grads(_f32(TINY, attention="dense", remat=remat), tokens, cot)
        for remat in ("none", "full", "replay")
    }
    for remat in ("full", "replay"):
        _assert_close_normwise(runs[remat][0], runs["none"][0], F32_TOL, "logits")
        _assert_close_normwise(runs[remat][3], runs["none"][3], F32_TOL, "grads")


def _losses(graphdef, params, tokens, stage):
    logits, aux = nnx.merge(graphdef, params).forward(tokens, indexer_stage=stage)
    targets = jnp.roll(tokens, -1, axis=1)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    return ce + aux["indexer_loss"]


@pytest.mark.parametrize(
    "attention, remat, impl, expected",
    [
        ("hyscale", "none", "xla", 1),
        ("hyscale", "replay", "xla", 1),
        ("hyscale", "full", "xla", 2),
        ("materialized", "replay", "xla", 1),
        ("materialized", "full", "xla", 2),
        ("dense", "full", "xla", 0),
        ("hyscale", "replay", KERNEL_IMPL, 1),
        ("hyscale", "full", KERNEL_IMPL, 2),
    ],
)
def test_selection_runs_per_layer(attention, remat, impl, expected):
    """Replay: the selection runs once per layer in forward+backward; full remat: twice."""
    cfg = dataclasses.replace(TINY, attention=attention, remat=remat, impl=impl)
    graphdef, params = _split(cfg)
    grad = jax.grad(lambda p: _losses(graphdef, p, _tokens(), "sparse"))
    jaxpr = jax.make_jaxpr(grad)(params)
    assert count_named_eqns(jaxpr) == expected * cfg.n_layers
    if impl == KERNEL_IMPL:  # the attention itself on the kernels too, forward and backward
        assert count_named_eqns(jaxpr, ("hytopk_fused_select",)) == expected * cfg.n_layers
        assert count_named_eqns(jaxpr, ("sparse_attn_fwd",)) >= cfg.n_layers
        assert count_named_eqns(jaxpr, ("sparse_attn_bwd",)) >= cfg.n_layers


@pytest.mark.run_first
@pytest.mark.parametrize("save_target", [False, True], ids=["recomputed_target", "saved_target"])
def test_kernels_match_xla_model_f32(save_target):
    """The model on the Pallas kernels (interpret mode on CPU: value_dim=16, a shared latent
    row of 16 + 8 features) under replay against the xla model: same selection, then agreement
    to f32 rounding in logits, indexer loss and both gradients; also with the indexer loss's
    target saved for its backward (`save_indexer_target`)."""
    tokens = _tokens(3)
    cot = jax.random.normal(jax.random.key(7), (B, T, TINY.vocab_size), jnp.float32)
    # One layer in interpret mode on CPU (the interpreter is slow); the model's two on a GPU.
    cfg = _f32(TINY, attention="hyscale", remat="replay", n_layers=1 if not ON_GPU else 2)
    kernels = dataclasses.replace(cfg, impl=KERNEL_IMPL, save_indexer_target=save_target)
    got = _forward_and_grads(kernels, tokens, cot)
    want = _forward_and_grads(cfg, tokens, cot)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_close_normwise(got[0], want[0], F32_TOL, "logits")
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=F32_TOL)
    _assert_close_normwise(got[3], want[3], F32_TOL, "d<logits, cotangent>/d")
    _assert_close_normwise(got[4], want[4], F32_TOL, "d indexer loss/d")


def test_lm_loss_never_reaches_the_indexer(model_runs):
    _, il, _, g_lm, g_il = model_runs("hyscale", "none")
    assert float(il) > 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(g_lm)[0]:
        in_indexer = any(getattr(k, "key", None) == "indexer" for k in path)
        if in_indexer:
            assert float(jnp.abs(leaf).max()) == 0.0, path
    for path, leaf in jax.tree_util.tree_flatten_with_path(g_il)[0]:
        in_indexer = any(getattr(k, "key", None) == "indexer" for k in path)
        assert (float(jnp.abs(leaf).max()) > 0.0) == in_indexer, path


# ------------------------------------------------------------------------------ training


@pytest.mark.run_first
def test_trains_with_falling_loss(tmp_path):
    """A few steps of the training loop (dense indexer warm-up, then sparse): the LM loss
    falls and the indexer KL is logged."""
    from hyscale_jax.data import DataConfig

    model = dataclasses.replace(
        TINY, n_layers=1, vocab_size=256, remat="replay", topk=8, d_model=32
    )
    cfg = TrainConfig(
        seq_len=48,
        batch_size=8,
        steps=20,
        lr=1e-2,
        warmup_steps=3,
        indexer_warmup_steps=4,
        indexer_warmup_seq_len=32,
        ckpt_every=1000,
        data=DataConfig(n_pairs=4, n_queries=4, corpus_bytes=2**20),
    )
    result = train(model, cfg, tmp_path / "run", progress=False, plot=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert result["step"] == 20 and [r["step"] for r in rows] == list(range(1, 21))
    first = np.mean([r["ce"] for r in rows[:3]])
    last = np.mean([r["ce"] for r in rows[-3:]])
    assert last < first - 1.0, (first, last)
    assert all(r["indexer_loss"] > 0 for r in rows)


def _cli():
    return load_script("train", "train_cli")


def test_cli_builds_an_mla_config():
    cli = _cli()
    args = cli.parse_args(
        [
            "--attention-kind",
            "mla",
            "--q-lora-rank",
            "48",
            "--kv-lora-rank",
            "32",
            "--qk-nope-dim",
            "24",
            "--qk-rope-dim",
            "8",
            "--v-head-dim",
            "20",
        ]
    )
    model_cfg, _, _ = cli.build_configs(args)
    got = (
        model_cfg.attention_kind,
        model_cfg.q_lora_rank,
        model_cfg.kv_lora_rank,
        model_cfg.qk_nope_dim,
        model_cfg.qk_rope_dim,
        model_cfg.v_head_dim,
    )
    assert got == ("mla", 48, 32, 24, 8, 20)
    model_cfg, _, _ = cli.build_configs(cli.parse_args([]))
    assert model_cfg.attention_kind == "gqa"


# ------------------------------------------------------------------------------- sharding


def mesh_check():
    """MLA model on a (data=2, seq=2) mesh of simulated CPU devices against the unsharded
    model, f32: same indices, logits, indexer loss and gradients. Prints 'ok'."""
    from hyscale_jax import parallel

    cfg = _f32(TINY, remat="replay", n_layers=1)
    tokens = _tokens(5, (2, 24))
    cot = jax.random.normal(jax.random.key(6), (2, 24, TINY.vocab_size), jnp.float32)

    def run(mesh):
        graphdef, params = nnx.split(LongContextLM(cfg, rngs=nnx.Rngs(0), mesh=mesh))

        def f(p):
            logits, aux = nnx.merge(graphdef, p).forward(tokens, indexer_stage="sparse")
            return (logits, aux["indexer_loss"]), aux["indices"]

        def go(p):
            (logits, il), vjp, indices = jax.vjp(f, p, has_aux=True)
            zl, zs, one = jnp.zeros_like(logits), jnp.zeros_like(il), jnp.ones_like(il)
            return logits, il, indices, vjp((cot, zs))[0], vjp((zl, one))[0]

        # the sharded model runs the sequence-parallel op (and loss) inside shard_map
        assert ("shard_map" in str(jax.make_jaxpr(go)(params))) == (mesh is not None)
        with jax.default_matmul_precision("highest"):
            return jax.jit(go)(params)

    got = run(parallel.make_mesh(data=2, seq=2, devices=jax.devices()[:4]))
    want = run(None)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _assert_close_normwise(got[0], want[0], F32_TOL, "logits")
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=F32_TOL)
    _assert_close_normwise(got[3], want[3], F32_TOL, "d<logits, cotangent>/d")
    _assert_close_normwise(got[4], want[4], F32_TOL, "d indexer loss/d")
    print("ok")


@pytest.mark.run_first
def test_sharded_model_matches_unsharded():
    """mesh_check in this process where it has 4 CPU devices (tests/conftest.py asks for 8
    simulated CPU devices on a CPU-only machine), else in a fresh interpreter with 4 simulated
    CPU devices (XLA_FLAGS only takes effect before jax initializes)."""
    if jax.default_backend() == "cpu" and jax.device_count() >= 4:
        mesh_check()
        return
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.test_mla_model import mesh_check; mesh_check()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("attention", ["hyscale", "materialized"])
def test_fp8_indexer_selects_on_quantized_scores(attention):
    """MLA with the FP8 indexer: the selection is topk_reference on `hs.quantize_indexer` of
    the layer's own indexer outputs (f32 compute, as in test_nn's FP8 test)."""
    cfg = _f32(TINY, attention=attention, index_dtype="float8_e4m3fn")
    attn, x = _layer_and_input(cfg)
    positions = jnp.arange(T)
    _, aux = jax.jit(lambda a, x: a(x, positions, indexer_stage="sparse"))(attn, x)
    q8, k8, w8, k_scale = hs.quantize_indexer(*jax.jit(attn.indexer)(x, positions))
    want = hs.topk_reference(q8, k8, w8, k=cfg.topk, k_scale=k_scale)
    np.testing.assert_array_equal(np.asarray(aux["idx"]), np.asarray(want))
