"""Tests of the Flax modules: shapes, attention modes, indexer isolation, selection replay (on
CPU; the kernel-path tests also compile on GPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hyscale_jax as hs
from hyscale_jax.nn import HyScaleAttention, Indexer, LongContextLM, ModelConfig, rope
from tests.helpers import KERNEL_IMPL, all_eqns, count_named_eqns
from tests.test_mla_model import TINY as MLA_TINY

TINY = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    index_heads=2,
    index_dim=16,
    topk=8,
    impl="xla",
)
B, T = 2, 24


def _tokens(seed=0, shape=(B, T)):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size, jnp.int32)


def _split(cfg):
    return nnx.split(LongContextLM(cfg, rngs=nnx.Rngs(0)))


def _losses(graphdef, params, tokens, stage):
    logits, aux = nnx.merge(graphdef, params).forward(tokens, indexer_stage=stage)
    targets = jnp.roll(tokens, -1, axis=1)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    return ce, aux["indexer_loss"]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(attention="sparse"), "attention"),
        (dict(remat="selective"), "remat"),
        (dict(impl="cuda"), "impl"),
        (dict(n_heads=3), "multiple of n_kv_heads"),
        (dict(head_dim=15), "even"),
        (dict(topk=0), "topk"),
        (dict(dtype="int8"), "dtype"),
        (dict(index_dtype="float8_e5m2"), "index_dtype"),
        (dict(index_dtype="float8_e4m3fn", index_dim=24), "power of two"),
        (dict(index_rope_dim=3), "index_rope_dim"),
        (dict(index_rope_dim=18), "index_rope_dim"),
        (dict(index_rope_dim=-2), "index_rope_dim"),
        (dict(index_rope_dim=True), "index_rope_dim"),
        (dict(mlp_chunk=0), "mlp_chunk"),
        (dict(mlp_chunk=True), "mlp_chunk"),
        (dict(mlp_chunk=8.0), "mlp_chunk"),
    ],
)
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **bad)


def test_forward_rejects_bad_tokens_and_stage():
    model = LongContextLM(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((B, T, 1), jnp.int32))
    with pytest.raises(ValueError, match="indexer_stage"):
        model.forward(_tokens(), indexer_stage="warm")


@pytest.fixture(scope="module")
def logits_by_mode():
    """Logits of the same parameters under each attention mode (dense has no indexer)."""
    out = {}
    tokens = _tokens()
    for mode in ("hyscale", "materialized", "dense"):
        model = LongContextLM(dataclasses.replace(TINY, attention=mode), rngs=nnx.Rngs(0))
        out[mode] = (
            model,
            jax.jit(lambda m, t: m.forward(t, indexer_stage="sparse"))(model, tokens),
        )
    return out


@pytest.mark.parametrize("mode", ["hyscale", "materialized", "dense"])
def test_shapes_and_dtypes(logits_by_mode, mode):
    model, (logits, aux) = logits_by_mode[mode]
    assert logits.shape == (B, T, TINY.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    params = nnx.state(model, nnx.Param)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    if mode == "dense":
        assert aux["indices"] == () and float(aux["indexer_loss"]) == 0.0
    else:
        assert len(aux["indices"]) == TINY.n_layers
        for idx in aux["indices"]:
            assert idx.shape == (B, T, TINY.topk) and idx.dtype == jnp.int32
            # causal: query t selects min(t + 1, k) distinct keys <= t, the rest are -1
            idx = np.asarray(idx)
            t = np.arange(T)[None, :, None]
            assert ((idx == -1) | ((idx >= 0) & (idx <= t))).all()
            assert ((idx >= 0).sum(-1) == np.minimum(np.arange(T) + 1, TINY.topk)).all()
        assert float(aux["indexer_loss"]) > 0.0


def test_hyscale_equals_materialized(logits_by_mode):
    """Same parameters, exact selection both ways: same indices, same logits."""
    (_, (lh, ah)), (_, (lm, am)) = logits_by_mode["hyscale"], logits_by_mode["materialized"]
    for ih, im in zip(ah["indices"], am["indices"]):
        np.testing.assert_array_equal(np.asarray(ih), np.asarray(im))
    np.testing.assert_allclose(np.asarray(lh), np.asarray(lm), atol=1e-5)


def test_call_matches_forward(logits_by_mode):
    model, (logits, _) = logits_by_mode["hyscale"]
    called = jax.jit(lambda m, t: m(t))(model, _tokens())
    np.testing.assert_allclose(np.asarray(called), np.asarray(logits), atol=2e-2)  # bf16


def test_dense_warmup_stage():
    """DSA warm-up: dense main attention, dense KL, no selection (shapes only: no compile)."""
    model = LongContextLM(TINY, rngs=nnx.Rngs(0))
    logits, aux = jax.eval_shape(lambda m, t: m.forward(t, indexer_stage="dense"), model, _tokens())
    assert logits.shape == (B, T, TINY.vocab_size)
    assert aux["indices"] == () and aux["indexer_loss"].shape == ()


def test_index_rows_are_rows_of_the_indices(logits_by_mode):
    """forward(index_rows=...) returns each layer's selected keys at those query rows only."""
    model, (_, aux) = logits_by_mode["hyscale"]
    rows = jnp.array([[0, 5, T - 1], [7, 7, 1]], jnp.int32)
    _, aux_rows = jax.jit(lambda m, t, r: m.forward(t, indexer_stage="sparse", index_rows=r))(
        model, _tokens(), rows
    )
    assert len(aux_rows["indices"]) == TINY.n_layers
    for full, part in zip(aux["indices"], aux_rows["indices"]):
        assert part.shape == (B, 3, TINY.topk)
        expected = np.take_along_axis(np.asarray(full), np.asarray(rows)[..., None], axis=1)
        np.testing.assert_array_equal(np.asarray(part), expected)
    with pytest.raises(ValueError, match="index_rows"):
        model.forward(_tokens(), indexer_stage="sparse", index_rows=rows[0])
    with pytest.raises(ValueError, match="index_rows"):
        model.forward(_tokens(), indexer_stage="sparse", index_rows=rows.astype(jnp.float32))


@pytest.mark.parametrize("cfg", [TINY, MLA_TINY], ids=["gqa", "mla"])
@pytest.mark.parametrize("remat, ties", [("none", 0), ("full", 2), ("replay", 2)])
def test_blocks_are_fenced(cfg, remat, ties):
    """Each block's indexer loss and index rows exist before the next block starts (a barrier
    over the block's output, its loss and its rows), and under rematerialization a block's
    input cotangent leaves only with its parameter gradients complete (a barrier over the
    block's parameters and input, and that barrier's transpose)."""
    model = LongContextLM(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    block_leaves = len(jax.tree.leaves(nnx.split(model.blocks[0])[1]))
    rows = jnp.zeros((B, 3), jnp.int32)

    def loss(p):
        logits, aux = nnx.merge(graphdef, p).forward(
            _tokens(), indexer_stage="sparse", index_rows=rows
        )
        return jnp.mean(logits) + aux["indexer_loss"], aux["indices"]

    jaxpr = jax.make_jaxpr(jax.grad(loss, has_aux=True))(params)
    barriers = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"]
    fences = [
        e
        for e in barriers
        if any(v.aval.shape == (B, 3, cfg.topk) and v.aval.dtype == jnp.int32 for v in e.invars)
    ]
    assert len(fences) == cfg.n_layers
    param_ties = [e for e in barriers if len(e.invars) == block_leaves + 1]  # parameters and x
    assert len(param_ties) == ties * cfg.n_layers


@pytest.fixture(scope="module")
def grads_by_remat():
    """(ce, indexer loss, d ce / d params, d indexer loss / d params) for remat none / replay."""
    tokens = _tokens(1)
    out = {}
    for remat in ("none", "replay"):
        # f32 compute: bf16 rounding would differ with each remat's fusion, not its math.
        graphdef, params = _split(dataclasses.replace(TINY, remat=remat, dtype="float32"))

        def both(p, graphdef=graphdef):
            (ce, il), vjp = jax.vjp(lambda q: _losses(graphdef, q, tokens, "sparse"), p)
            one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
            return ce, il, vjp((one, zero))[0], vjp((zero, one))[0]

        # Full f32 matmuls: on GPU, XLA's default f32 dot precision is TF32, whose input
        # rounding amplifies each remat's different fusion into ~1e-3 gradient differences.
        with jax.default_matmul_precision("highest"):
            out[remat] = jax.jit(both)(params)
    return out


def _in_indexer(path) -> bool:
    return any(getattr(k, "key", None) == "indexer" for k in path)


def test_indexer_detached_and_lm_loss_never_reaches_it(grads_by_remat):
    """LM loss -> no gradient in the indexer; indexer KL -> gradient only in the indexer."""
    _, il, g_ce, g_idx = grads_by_remat["none"]
    assert float(il) > 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(g_ce)[0]:
        if _in_indexer(path):
            assert float(jnp.abs(leaf).max()) == 0.0, path
    assert sum(float(jnp.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(g_ce)) > 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(g_idx)[0]:
        assert (float(jnp.abs(leaf).max()) > 0.0) == _in_indexer(path), path


def test_replay_matches_no_remat(grads_by_remat):
    """Replaying the saved indices computes the same losses and gradients as no remat."""
    for a, b in zip(
        jax.tree.leaves(grads_by_remat["none"]), jax.tree.leaves(grads_by_remat["replay"])
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_indexer_shapes():
    idx_mod = Indexer(TINY, rngs=nnx.Rngs(1))
    x = jnp.ones((B, T, TINY.d_model), jnp.bfloat16)
    q_idx, k_idx, w = jax.eval_shape(idx_mod, x, jnp.arange(T))
    assert q_idx.shape == (B, T, TINY.index_heads, TINY.index_dim)
    assert k_idx.shape == (B, T, TINY.index_dim)
    assert w.shape == (B, T, TINY.index_heads)


@pytest.mark.parametrize("rope_dim", [None, 16, 6, 0])
def test_indexer_rope_dim(rope_dim):
    """RoPE rotates the leading index_rope_dim features of q_idx and k_idx; the others are the
    projections themselves, the same at every position."""
    cfg = dataclasses.replace(TINY, index_rope_dim=rope_dim, dtype="float32")
    indexer = Indexer(cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (B, T, cfg.d_model), jnp.float32)
    positions = jnp.arange(T)
    q_idx, k_idx, _ = indexer(x, positions)
    q_raw = indexer.wq(x).reshape(B, T, cfg.index_heads, cfg.index_dim)
    k_raw = indexer.k_norm(indexer.wk(x))[:, :, None, :]
    r = cfg.index_dim if rope_dim is None else rope_dim
    for got, raw in ((q_idx, q_raw), (k_idx[:, :, None, :], k_raw)):
        np.testing.assert_array_equal(got[..., r:], raw[..., r:])
        if r:
            np.testing.assert_array_equal(
                got[..., :r], rope(raw[..., :r], positions, cfg.rope_base)
            )
            assert not np.array_equal(got[..., :r], raw[..., :r])


@pytest.mark.parametrize(
    "attention, remat, expected",
    [
        ("hyscale", "none", 1),
        ("hyscale", "replay", 1),
        ("hyscale", "full", 2),
        ("materialized", "replay", 1),
        ("materialized", "full", 2),
        ("dense", "full", 0),
    ],
)
def test_selection_runs_per_layer(attention, remat, expected):
    """Replay: the selection runs once per layer in forward+backward; full remat: twice."""
    cfg = dataclasses.replace(TINY, attention=attention, remat=remat)
    graphdef, params = _split(cfg)
    tokens = _tokens()
    grad = jax.grad(lambda p: sum(_losses(graphdef, p, tokens, "sparse")))
    jaxpr = jax.make_jaxpr(grad)(params)
    assert count_named_eqns(jaxpr) == expected * cfg.n_layers


@pytest.mark.parametrize("remat, expected", [("replay", 1), ("full", 2)])
def test_selection_runs_per_layer_with_kernels(remat, expected):
    """The same replay count when every op runs on the Pallas kernels."""
    cfg = dataclasses.replace(TINY, impl=KERNEL_IMPL, remat=remat)
    graphdef, params = _split(cfg)
    grad = jax.grad(lambda p: sum(_losses(graphdef, p, _tokens(), "sparse")))
    jaxpr = jax.make_jaxpr(grad)(params)
    assert count_named_eqns(jaxpr) == expected * cfg.n_layers
    assert count_named_eqns(jaxpr, ("hytopk_fused_select",)) == expected * cfg.n_layers


@pytest.mark.run_first
def test_kernels_match_xla_model_losses_bf16():
    """The model on the Pallas kernels under replay computes the xla model's losses with bf16
    activations (a near-tie that f32 summation order flips may change a selected key, which
    moves a mean loss far less than the 2% allowed). Gradients: the f32 tests below."""
    tokens = _tokens(3)

    def losses(impl):
        """The model's (ce, indexer loss), one jitted program: compiled whole, not op by op."""
        graphdef, params = _split(dataclasses.replace(TINY, impl=impl, remat="replay"))
        return jax.jit(lambda p: _losses(graphdef, p, tokens, "sparse"))(params)

    for got, want in zip(losses(KERNEL_IMPL), losses("xla")):
        np.testing.assert_allclose(float(got), float(want), rtol=2e-2)


# Normwise relative error allowed between two f32 computations of the same function that differ
# only in summation order (and in what is recomputed): a few hundred f32 ulps.
F32_TOL = 5e-5


def _f32_forward_and_grads(cfg, tokens, cotangent):
    """cfg's model in f32 (full-precision matmuls) on `tokens`, sparse indexer stage:
    (logits, indexer loss, indices, d<logits, cotangent>/d params, d indexer loss/d params)."""
    graphdef, params = _split(dataclasses.replace(cfg, dtype="float32"))

    def run(p):
        def f(p):
            logits, aux = nnx.merge(graphdef, p).forward(tokens, indexer_stage="sparse")
            return (logits, aux["indexer_loss"]), aux["indices"]

        (logits, il), vjp, indices = jax.vjp(f, p, has_aux=True)
        zero_l, zero_s, one = jnp.zeros_like(logits), jnp.zeros_like(il), jnp.ones_like(il)
        return logits, il, indices, vjp((cotangent, zero_s))[0], vjp((zero_l, one))[0]

    with jax.default_matmul_precision("highest"):
        return jax.jit(run)(params)


def _assert_close_normwise(got, want, tol, what):
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert err <= tol, f"{what} {jax.tree_util.keystr(path)}: normwise error {err:.2e}"


@pytest.fixture(scope="module")
def f32_by_impl():
    """_f32_forward_and_grads of TINY under replay for each impl, same inputs and cotangent."""
    tokens = _tokens(3)
    cotangent = jax.random.normal(jax.random.key(7), (B, T, TINY.vocab_size), jnp.float32)
    return {
        impl: _f32_forward_and_grads(
            dataclasses.replace(TINY, impl=impl, remat="replay"), tokens, cotangent
        )
        for impl in ("reference", "xla", KERNEL_IMPL)
    }


@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_model_matches_reference_impl_f32(f32_by_impl, impl):
    """Logits, indexer loss and both losses' parameter gradients (random output cotangent) of
    the model on `impl` against impl="reference" (materialized selection, dense masked
    attention), in f32: the same selection index for index, then agreement to f32 rounding."""
    logits, il, indices, g_lm, g_il = f32_by_impl[impl]
    r_logits, r_il, r_indices, r_g_lm, r_g_il = f32_by_impl["reference"]
    for got, want in zip(indices, r_indices, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _assert_close_normwise(logits, r_logits, F32_TOL, "logits")
    np.testing.assert_allclose(float(il), float(r_il), rtol=F32_TOL)
    assert float(r_il) > 0
    _assert_close_normwise(g_lm, r_g_lm, F32_TOL, "d<logits, cotangent>/d")
    _assert_close_normwise(g_il, r_g_il, F32_TOL, "d indexer loss/d")


def test_all_keys_selected_equals_dense_attention_f32():
    """With k >= T every query selects every visible key, so the hyscale model is the dense
    model (jax.nn.dot_product_attention) on the same weights: same logits and LM gradients in
    f32. The indexer only chooses keys here, so it gets no LM gradient in either."""
    tokens = _tokens(4)
    cotangent = jax.random.normal(jax.random.key(8), (B, T, TINY.vocab_size), jnp.float32)
    dense_cfg = dataclasses.replace(TINY, attention="dense", remat="replay", dtype="float32")
    sparse_cfg = dataclasses.replace(dense_cfg, attention="hyscale", topk=T)
    dense = LongContextLM(dense_cfg, rngs=nnx.Rngs(0))
    sparse = LongContextLM(sparse_cfg, rngs=nnx.Rngs(1))
    nnx.update(sparse, nnx.state(dense, nnx.Param))  # every non-indexer weight from `dense`

    def lm_grads(model):
        graphdef, params = nnx.split(model)

        def f(p):
            return nnx.merge(graphdef, p).forward(tokens, indexer_stage="none")[0]

        logits, vjp = jax.vjp(f, params)
        return logits, vjp(cotangent)[0]

    with jax.default_matmul_precision("highest"):
        d_logits, d_grads = jax.jit(lm_grads)(dense)
        s_logits, s_grads = jax.jit(lm_grads)(sparse)
    _assert_close_normwise(s_logits, d_logits, F32_TOL, "logits")
    s_flat = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(s_grads)[0]
    }
    d_flat = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(d_grads)[0]
    }
    assert set(d_flat) < set(s_flat)
    _assert_close_normwise(
        [s_flat[k] for k in sorted(d_flat)], [d_flat[k] for k in sorted(d_flat)], F32_TOL, "grad"
    )
    for key in set(s_flat) - set(d_flat):
        assert "indexer" in key and float(jnp.abs(s_flat[key]).max()) == 0.0, key


FP8_TINY = dataclasses.replace(TINY, index_dtype="float8_e4m3fn")


@pytest.mark.parametrize("attention", ["hyscale", "materialized"])
@pytest.mark.parametrize("hadamard", [True, False])
def test_fp8_indexer_selects_quantized_and_trains_unquantized(attention, hadamard):
    """FP8 indexer: the layer selects on `hs.quantize_indexer` of its indexer's outputs, and
    its indexer KL (value and gradients) is the unquantized indexer's KL on that selection.
    f32 compute: with bf16, XLA may keep a fused intermediate in f32 (excess precision) that
    the unfused reference rounds, and one FP8 rounding step flips a near-tie."""
    cfg = dataclasses.replace(
        FP8_TINY, attention=attention, index_hadamard=hadamard, dtype="float32"
    )
    attn = HyScaleAttention(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    x = jax.random.normal(jax.random.key(3), (B, T, cfg.d_model), jnp.float32)
    pos = jnp.arange(T)

    def layer(state):
        _, aux = nnx.merge(graphdef, state)(x, pos, indexer_stage="sparse")
        return aux["indexer_loss"], aux["idx"]

    def unquantized(state, idx):
        m = nnx.merge(graphdef, state)
        q = rope(m.q_proj(x).reshape(B, T, cfg.n_heads, cfg.head_dim), pos, cfg.rope_base)
        k = rope(m.k_proj(x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), pos, cfg.rope_base)
        q_idx, k_idx, w = m.indexer(x, pos)
        return hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, impl="xla") / T, (q_idx, k_idx, w)

    (loss, idx), grads = jax.jit(jax.value_and_grad(layer, has_aux=True))(state)
    (want, outs), want_grads = jax.jit(jax.value_and_grad(unquantized, has_aux=True))(state, idx)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert float(loss) > 0 and any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))

    q8, k8, w8, k_scale = hs.quantize_indexer(*outs, hadamard=hadamard)
    assert q8.dtype == jnp.float8_e4m3fn
    idx = np.asarray(idx)
    want_idx = hs.topk_reference(q8, k8, w8, k=cfg.topk, k_scale=k_scale)
    np.testing.assert_array_equal(idx, np.asarray(want_idx))
    t = np.arange(T)[None, :, None]  # valid and causal: min(t + 1, k) distinct keys <= t
    assert ((idx == -1) | ((idx >= 0) & (idx <= t))).all()
    assert ((idx >= 0).sum(-1) == np.minimum(np.arange(T) + 1, cfg.topk)).all()
    assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in idx.reshape(-1, cfg.topk))


@pytest.mark.parametrize("remat, expected", [("replay", 1), ("full", 2)])
def test_fp8_indexer_selection_replayed(remat, expected):
    cfg = dataclasses.replace(FP8_TINY, remat=remat)
    graphdef, params = _split(cfg)
    grad = jax.grad(lambda p: sum(_losses(graphdef, p, _tokens(), "sparse")))
    assert count_named_eqns(jax.make_jaxpr(grad)(params)) == expected * cfg.n_layers


def test_fp8_indexer_needs_one_device():
    mesh = hs.parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="one device only"):
        LongContextLM(FP8_TINY, rngs=nnx.Rngs(0), mesh=mesh)
    LongContextLM(FP8_TINY, rngs=nnx.Rngs(0))  # the same model on one device builds


def test_fp8_indexer_model_trains():
    """Two training steps of the FP8-indexer model (sparse stage, replay): finite losses, the
    indexer's weights move, and the selection stays valid and causal."""
    from hyscale_jax.data import DataConfig
    from hyscale_jax.train import TrainConfig, create_train_state, make_train_step

    cfg = dataclasses.replace(FP8_TINY, remat="replay", n_layers=1)
    tcfg = TrainConfig(seq_len=T, batch_size=B, steps=2, warmup_steps=0, data=DataConfig("text"))
    graphdef, state, tx = create_train_state(cfg, tcfg)
    step = make_train_step(graphdef, tx, tcfg)
    batch = {
        "tokens": _tokens(2, (B, T + 1)),
        "loss_mask": jnp.ones((B, T), jnp.float32),
        "query_pos": jnp.zeros((B, 0), jnp.int32),
        "needle_pos": jnp.zeros((B, 0), jnp.int32),
    }
    before = jax.tree.map(np.asarray, state.params)  # the step donates its state on GPU
    for _ in range(2):
        state, metrics = step(state, batch, "sparse")
        assert np.isfinite(float(metrics["loss"])) and float(metrics["indexer_loss"]) > 0
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()) > 0, before, state.params)
    flat = jax.tree_util.tree_flatten_with_path(moved)[0]
    assert all(m for path, m in flat if _in_indexer(path))
    forward = jax.jit(lambda m, t: m.forward(t, indexer_stage="none"))
    _, aux = forward(nnx.merge(graphdef, state.params), batch["tokens"][:, :T])
    t = np.arange(T)[None, :, None]
    for idx in aux["indices"]:
        idx = np.asarray(idx)
        assert ((idx == -1) | ((idx >= 0) & (idx <= t))).all()
        assert ((idx >= 0).sum(-1) == np.minimum(np.arange(T) + 1, cfg.topk)).all()


@pytest.mark.parametrize("remat", ["none", "replay"])
def test_mlp_chunk_matches_the_unchunked_model(remat):
    """The SwiGLU in chunks of `mlp_chunk` tokens (T = 24: chunks of 5 with a tail of 4, three
    whole chunks of 8) gives the unchunked model's losses and gradients (f32: only the weight
    gradients' summation order differs); one chunk covering T traces the unchunked program."""
    cfg = dataclasses.replace(TINY, remat=remat, dtype="float32")
    tokens = _tokens()

    def trace(mlp_chunk):
        """The loss, its parameters and the loss's jaxpr."""
        graphdef, params = _split(dataclasses.replace(cfg, mlp_chunk=mlp_chunk))
        loss = lambda p: sum(_losses(graphdef, p, tokens, "sparse"))  # noqa: E731
        return loss, params, jax.make_jaxpr(loss)(params)

    def scans(jaxpr):
        return sum(eqn.primitive.name == "scan" for eqn in all_eqns(jaxpr))

    loss0, params0, jaxpr0 = trace(None)
    # A chunk covering T takes the unchunked path: the same program, equation for equation.
    assert str(trace(T)[2]) == str(jaxpr0)
    loss0, grads0 = jax.jit(jax.value_and_grad(loss0))(params0)
    for chunk in (5, 8):
        loss1, params1, jaxpr1 = trace(chunk)
        # The chunked path (one lax.map per block) runs exactly when a chunk is shorter than T.
        assert scans(jaxpr1) - scans(jaxpr0) == TINY.n_layers, chunk
        loss1, grads1 = jax.jit(jax.value_and_grad(loss1))(params1)
        np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_mlp_chunk_bounds_the_backward_memory():
    """With chunks of 128 tokens at T = 2048 the compiled gradient's temporary memory does not
    grow with the SwiGLU's width: its [B, T, mlp_dim] activations live a chunk at a time.
    Unchunked, it grows by more than one [2048, 1024] f32 activation from 1024 to 2048 wide
    (CPU: 77 -> 137 MiB under jax 0.10.2, 29 -> 48 under 0.11.2; chunked 35 and 24 at both)."""
    tokens = _tokens(shape=(1, 2048))
    growth = {}
    for mlp_chunk in (None, 128):
        temp = []
        for mlp_dim in (1024, 2048):
            cfg = dataclasses.replace(TINY, mlp_dim=mlp_dim, remat="replay", mlp_chunk=mlp_chunk)
            graphdef, params = _split(cfg)
            grad = jax.jit(jax.grad(lambda p, g=graphdef: _losses(g, p, tokens, "sparse")[0]))
            temp.append(grad.lower(params).compile().memory_analysis().temp_size_in_bytes)
        growth[mlp_chunk] = temp[1] - temp[0]
    assert growth[None] > 2048 * 1024 * 4, growth
    assert growth[128] < 0.1 * growth[None], growth


def test_mlp_chunk_needs_one_device():
    mesh = hs.parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    cfg = dataclasses.replace(TINY, mlp_chunk=8)
    with pytest.raises(ValueError, match="mlp_chunk"):
        LongContextLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)
