"""An empty batch (B = 0) gives the same empty result, with empty gradients, from every impl
(docs/design.md, "Values jit cannot check"): the library returns it before any kernel runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs

ON_GPU = jax.default_backend() == "gpu"
PALLAS = pytest.param(
    "pallas", marks=pytest.mark.skipif(not ON_GPU, reason="compiled Pallas kernels need a GPU")
)
IMPLS = ["xla", "reference", "interpret", PALLAS]
T, S, H, G, D, Dv, K, HI, DI = 5, 7, 4, 2, 8, 6, 3, 2, 4


def empty_inputs(dtype):
    zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return dict(
        q=zeros(0, T, H, D),
        k=zeros(0, S, G, D),
        v=zeros(0, S, G, Dv),
        q_idx=zeros(0, T, HI, DI),
        k_idx=zeros(0, S, DI),
        w=zeros(0, T, HI),
        idx=jnp.zeros((0, T, K), jnp.int32),
    )


def assert_empty_like(got, shape, dtype):
    assert got.shape == shape and got.dtype == dtype, (got.shape, got.dtype, shape, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_attention(impl, dtype):
    x = empty_inputs(dtype)
    args = (x["q"], x["k"], x["v"])
    out, vjp = jax.vjp(lambda q, k, v: hs.sparse_attention(q, k, v, x["idx"], impl=impl), *args)
    assert_empty_like(out, (0, T, H, Dv), dtype)
    for grad, arg in zip(vjp(out), args):
        assert_empty_like(grad, arg.shape, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_hytopk_and_layer(impl):
    x = empty_inputs(jnp.float32)
    sel = (x["q_idx"], x["k_idx"], x["w"])
    assert_empty_like(hs.hytopk(*sel, k=K, impl=impl), (0, T, K), jnp.int32)
    assert_empty_like(hs.hytopk(*sel, k=S + 2, impl=impl), (0, T, S + 2), jnp.int32)

    def layer(q, k, v):
        return hs.hyscale_attention(q, k, v, *sel, topk=K, impl=impl)

    (out, idx), vjp = jax.vjp(layer, x["q"], x["k"], x["v"])
    assert_empty_like(out, (0, T, H, Dv), jnp.float32)
    assert_empty_like(idx, (0, T, K), jnp.int32)
    for grad, name in zip(vjp((out, np.zeros(idx.shape, jax.dtypes.float0))), "qkv"):
        assert_empty_like(grad, x[name].shape, jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "interpret", PALLAS])
@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_is_zero(impl, stage):
    """KL summed over no rows: 0, not the 0 / 0 of an average over no batch elements."""
    x = empty_inputs(jnp.float32)
    idx = x["idx"] if stage == "sparse" else None

    def loss(q_idx, k_idx, w):
        return hs.indexer_kl_loss(x["q"], x["k"], q_idx, k_idx, w, idx, impl=impl)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(x["q_idx"], x["k_idx"], x["w"])
    assert value.dtype == jnp.float32 and float(value) == 0.0
    for grad, name in zip(grads, ("q_idx", "k_idx", "w")):
        assert_empty_like(grad, x[name].shape, jnp.float32)


def test_sharded_ops_on_a_one_device_mesh():
    x = empty_inputs(jnp.float32)
    mesh = hs.parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    idx = x.pop("idx")
    out, got_idx = hs.parallel.hyscale_attention(**x, topk=K, mesh=mesh, impl="xla")
    assert_empty_like(out, (0, T, H, Dv), jnp.float32)
    assert_empty_like(got_idx, (0, T, K), jnp.int32)
    args = (x["q"], x["k"], x["q_idx"], x["k_idx"], x["w"], idx)
    loss = hs.parallel.indexer_kl_loss(*args, mesh=mesh, impl="xla")
    assert loss.dtype == jnp.float32 and float(loss) == 0.0
