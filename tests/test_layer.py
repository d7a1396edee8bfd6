"""The layer op, selection replay under jax.checkpoint, and the indexer loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs
from tests.helpers import (
    KERNEL_IMPL,
    count_named_eqns,
    kl_rows_oracle,
    kl_rows_oracle_grads,
    rel_err,
)

B, T, S, H, G, D, HI, DI, TOPK = 2, 24, 24, 4, 1, 16, 3, 8, 7


def layer_inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = dict(
        q=(B, T, H, D),
        k=(B, S, G, D),
        v=(B, S, G, D),
        q_idx=(B, T, HI, DI),
        k_idx=(B, S, DI),
        w=(B, T, HI),
    )
    return {n: jnp.asarray(rng.normal(size=s), dtype) for n, s in shapes.items()}


def layer_loss(inputs, impl="xla"):
    out, _ = hs.hyscale_attention(**inputs, topk=TOPK, impl=impl)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))


REMAT = {
    "none": lambda f: f,
    "full": jax.checkpoint,
    "replay": functools.partial(jax.checkpoint, policy=hs.replay_policy()),
}


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("remat,expected", [("none", 1), ("full", 2), ("replay", 1)])
def test_selection_runs_once_under_replay_and_twice_under_full_remat(impl, remat, expected):
    loss = REMAT[remat](functools.partial(layer_loss, impl=impl))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(layer_inputs())
    assert count_named_eqns(jaxpr) == expected


def test_replay_saves_only_the_indices():
    inputs = layer_inputs()
    names = ("q", "k", "v", "q_idx", "k_idx", "w")

    def loss(*args):
        return REMAT["replay"](layer_loss)(dict(zip(names, args)))

    res = saved_residuals(loss, *(inputs[n] for n in names))
    computed = [(tuple(a.shape), str(a.dtype)) for a, src in res if "argument" not in src]
    assert computed == [((B, T, TOPK), "int32")], res


def test_gradients_agree_across_remat_modes():
    inputs = layer_inputs(1)
    grads = {m: jax.grad(REMAT[m](layer_loss))(inputs) for m in REMAT}
    # Same indices, same math; recomputation may fuse differently, so f32 rounding may differ.
    for m in ("full", "replay"):
        for name in inputs:
            np.testing.assert_allclose(grads[m][name], grads["none"][name], rtol=1e-5, atol=1e-6)
    # The indexer gets no gradient through the attention output.
    for name in ("q_idx", "k_idx", "w"):
        assert not np.asarray(grads["none"][name]).any()


def kernel_inputs(seed):
    """bf16 attention inputs and small-integer indexer inputs: the indexer scores are exact, so
    every selection implementation agrees index for index (ties included)."""
    rng = np.random.default_rng(seed)
    x = layer_inputs(seed, jnp.bfloat16)
    for name, shape in (("q_idx", (B, T, HI, DI)), ("k_idx", (B, S, DI)), ("w", (B, T, HI))):
        x[name] = jnp.asarray(rng.integers(-2, 3, shape), jnp.bfloat16)
    return x


@pytest.mark.parametrize("remat,expected", [("none", 1), ("full", 2), ("replay", 1)])
def test_kernel_layer_runs_selection_once_under_replay(remat, expected):
    """Replay with the Pallas kernels: the selection kernel runs once per layer under
    replay_policy, twice under plain checkpointing; the attention kernels run either way."""
    loss = REMAT[remat](functools.partial(layer_loss, impl=KERNEL_IMPL))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(kernel_inputs(0))
    assert count_named_eqns(jaxpr) == expected
    assert count_named_eqns(jaxpr, ("hytopk_fused_select",)) == expected
    assert count_named_eqns(jaxpr, ("sparse_attn_fwd",)) >= 1


@pytest.mark.run_first
def test_kernel_layer_matches_xla_and_reference_under_replay():
    """The layer on the Pallas kernels, under replay_policy, against the xla path (the same
    indices, bit for bit) and the f32 reference composition: outputs and gradients within
    twice the xla path's own bf16 error plus a bf16 noise floor."""
    x = kernel_inputs(6)
    # The layer's output, indices and layer_loss's gradients from one pass under replay_policy
    # (the interpreted selection kernel compiles once): the output's cotangent is that of
    # sum(sin(out)) in f32, cos(out) rounded back to the output's dtype; the indices get none.
    layer = REMAT["replay"](lambda x: hs.hyscale_attention(**x, topk=TOPK, impl=KERNEL_IMPL))
    (out, idx), vjp = jax.vjp(layer, x)
    ct = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)
    (grads,) = vjp((ct, np.zeros(idx.shape, jax.dtypes.float0)))
    out_xla, idx_xla = hs.hyscale_attention(**x, topk=TOPK, impl="xla")
    np.testing.assert_array_equal(idx, idx_xla)
    np.testing.assert_array_equal(idx, hs.topk_reference(x["q_idx"], x["k_idx"], x["w"], k=TOPK))
    f32 = {n: v.astype(jnp.float32) for n, v in x.items()}

    def reference_loss(q, k, v):
        out = hs.sparse_attention_reference(q, k, v, idx)
        return jnp.sum(jnp.sin(out))

    want = hs.sparse_attention_reference(f32["q"], f32["k"], f32["v"], idx)
    assert rel_err(out, want) <= 2 * rel_err(out_xla, want) + 2e-3
    want_grads = jax.grad(reference_loss, argnums=(0, 1, 2))(f32["q"], f32["k"], f32["v"])
    grads_xla = jax.grad(REMAT["replay"](layer_loss))(x)
    for name, g_want in zip(("q", "k", "v"), want_grads):
        assert rel_err(grads[name], g_want) <= 2 * rel_err(grads_xla[name], g_want) + 2e-3, name
    for name in ("q_idx", "k_idx", "w"):  # no gradient reaches the indexer through the output
        assert not np.asarray(grads[name], np.float32).any()


@pytest.mark.parametrize("impl", ["xla", KERNEL_IMPL])
def test_index_order_selects_the_same_keys(impl):
    """order="index": the score order's keys by ascending index (-1 slots last), and the same
    output and gradients up to f32 summation order; an unknown order is refused."""
    x = layer_inputs(3)

    def run(order):
        def loss(x):
            out, idx = hs.hyscale_attention(**x, topk=TOPK, impl=impl, order=order)
            return jnp.sum(jnp.sin(out)), (out, idx)

        return jax.grad(loss, has_aux=True)(x)

    grads, (out, idx) = run("index")
    want_grads, (want_out, want_idx) = run("score")
    keys = np.where(np.asarray(idx) < 0, S, np.asarray(idx))
    assert (np.diff(keys, axis=-1) >= 0).all()
    np.testing.assert_array_equal(keys, np.sort(np.where(want_idx < 0, S, want_idx), axis=-1))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="order"):
        hs.hyscale_attention(**x, topk=TOPK, impl=impl, order="random")


def test_layer_equals_reference_composition():
    inputs = layer_inputs(2)
    out, idx = hs.hyscale_attention(**inputs, topk=TOPK, impl="xla")
    ref_idx = hs.topk_reference(inputs["q_idx"], inputs["k_idx"], inputs["w"], k=TOPK)
    np.testing.assert_array_equal(idx, ref_idx)
    want = hs.sparse_attention_reference(inputs["q"], inputs["k"], inputs["v"], ref_idx)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def kl_oracle(*args, **kw):
    """KL summed over t, mean over b (the public loss), from the per-row numpy oracle."""
    return kl_rows_oracle(*args, **kw).sum() / args[0].shape[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_indexer_loss_dense_and_sparse_match_oracle(dtype):
    """The oracle runs in f64 on the same (rounded) inputs: products of 16-bit floats are exact
    in f32, so a bf16 loss may differ from it only by f32 summation order."""
    inputs = layer_inputs(3, dtype)
    args = [inputs[n] for n in ("q", "k", "q_idx", "k_idx", "w")]
    dense = hs.indexer_kl_loss(*args)
    np.testing.assert_allclose(dense, kl_oracle(*args), rtol=1e-5)
    idx = hs.topk_reference(inputs["q_idx"], inputs["k_idx"], inputs["w"], k=TOPK)
    sparse = hs.indexer_kl_loss(*args, idx, block_q=5)
    np.testing.assert_allclose(sparse, kl_oracle(*args, idx=idx), rtol=1e-5)
    # When idx lists every visible key, the sparse stage is the dense loss.
    everything = hs.topk_reference(inputs["q_idx"], inputs["k_idx"], inputs["w"], k=S)
    np.testing.assert_allclose(hs.indexer_kl_loss(*args, everything), dense, rtol=1e-5)
    assert dense >= 0 and sparse >= 0


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_trains_only_the_indexer(sparse):
    inputs = layer_inputs(4)
    names = ("q", "k", "q_idx", "k_idx", "w")
    idx = (
        hs.topk_reference(inputs["q_idx"], inputs["k_idx"], inputs["w"], k=TOPK) if sparse else None
    )
    grads = jax.grad(lambda *a: hs.indexer_kl_loss(*a, idx), argnums=tuple(range(5)))(
        *(inputs[n] for n in names)
    )
    for name, g in zip(names, grads):
        assert np.isfinite(np.asarray(g)).all()
        assert np.asarray(g).any() == (name in ("q_idx", "k_idx", "w")), name


def test_indexer_loss_bf16_key_gradient_accumulates_in_f32():
    """Many queries select the same key; k_idx's gradient sums all of them. Rounding that sum
    to bf16 after every addition (a 16-bit scatter-add) doubled its error here (4.4e-3); with
    f32 accumulation only the bf16 inputs and the final rounding remain (2.0e-3)."""
    T, heads, D, HI, DI, K = 256, 2, 16, 4, 16, 64
    rng = np.random.default_rng(5)
    q, k, q_idx, k_idx, w = (
        jnp.asarray(rng.normal(size=s), jnp.bfloat16)
        for s in ((1, T, heads, D), (1, T, 1, D), (1, T, HI, DI), (1, T, DI), (1, T, HI))
    )
    idx = hs.topk_reference(q_idx, k_idx, w, k=K)
    grads = jax.grad(
        lambda a, b, c: hs.indexer_kl_loss(q, k, a, b, c, idx, impl="xla", block_q=32),
        argnums=(0, 1, 2),
    )(q_idx, k_idx, w)
    wants = kl_rows_oracle_grads(q, k, q_idx, k_idx, w, idx, np.ones((1, T)))
    for got, want in zip(grads, wants):
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert err <= 2.0**-8, err  # one bf16 ulp, relative
