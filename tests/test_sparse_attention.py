"""Sparse attention (docs/design.md, "Sparse attention") for every impl this machine can run:
outputs, gradients with random cotangents against f32 references, and the residual contract
(docs/design.md, "Residual contract")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs

# The Pallas kernels (interpret mode on CPU) have their own file, test_sparse_attention_pallas.py.
IMPLS = ["xla", "reference"]


def attention_inputs(rng, B, T, S, H, G, D, Dv, dtype):
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    k = jnp.asarray(rng.normal(size=(B, S, G, D)), dtype)
    v = jnp.asarray(rng.normal(size=(B, S, G, Dv)), dtype)
    return q, k, v


def messy_indices(rng, B, T, S, K):
    """Random indices with -1, out-of-range (both sides), repeats and a fully empty row."""
    idx = rng.integers(0, S, (B, T, K))
    idx[:, ::3, 0] = -1
    idx[:, 1::4, -1] = S + 2
    idx[:, 2::5, 1] = -S
    idx[:, ::2, 2] = idx[:, ::2, 3]  # a repeated key counts twice
    idx[0, T // 2] = -1  # no valid entry: output zeros
    return jnp.asarray(idx, jnp.int32)


def f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def relative_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


# Error budget (flash-attention style): a kernel in dtype X may be at most a few times worse
# than the naive reference run in X, plus a noise floor tied to X.
NOISE_FLOOR = {jnp.float32: 1e-6, jnp.bfloat16: 2e-3}


def check_close(got, want_f32, naive_same_dtype, dtype):
    bound = 2.0 * relative_error(naive_same_dtype, want_f32) + NOISE_FLOOR[dtype]
    err = relative_error(got, want_f32)
    assert err <= bound, (err, bound)


def call(impl, q, k, v, idx, **kw):
    if impl == "xla":
        kw.setdefault("block_q", 8)  # several query blocks, the last one partial
    return hs.sparse_attention(q, k, v, idx, impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("G", [1, 2])
def test_full_causal_index_set_equals_dense_causal_attention(impl, G):
    rng = np.random.default_rng(0)
    B, T, H, D = 2, 21, 4, 16
    q, k, v = attention_inputs(rng, B, T, T, H, G, D, D, jnp.float32)
    # Row t lists all keys 0..t in a shuffled order, padded with -1.
    idx = np.full((B, T, T), -1, np.int32)
    for b in range(B):
        for t in range(T):
            idx[b, t, : t + 1] = rng.permutation(t + 1)
    got = call(impl, q, k, v, jnp.asarray(idx))
    with jax.default_matmul_precision("float32"):  # no TF32 in the comparison on GPU
        want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["xla"])  # "reference" is what the others are compared with
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("G,D,Dv", [(1, 16, 16), (2, 24, 8)])
def test_forward_and_gradients_against_f32_reference(impl, dtype, G, D, Dv):
    rng = np.random.default_rng(1)
    B, T, S, H, K = 2, 19, 37, 4, 11
    q, k, v = attention_inputs(rng, B, T, S, H, G, D, Dv, dtype)
    idx = messy_indices(rng, B, T, S, K)
    d_out = jnp.asarray(rng.normal(size=(B, T, H, Dv)), dtype)

    def ref_f32(q, k, v):
        return hs.sparse_attention_reference(q, k, v, idx)

    out, vjp = jax.vjp(lambda q, k, v: call(impl, q, k, v, idx), q, k, v)
    want, vjp_ref = jax.vjp(ref_f32, *f32(q, k, v))
    naive, vjp_naive = jax.vjp(ref_f32, q, k, v)  # same reference, inputs in dtype
    assert out.dtype == dtype and out.shape == (B, T, H, Dv)
    check_close(out, want, naive, dtype)
    grads, grads_ref, grads_naive = vjp(d_out), vjp_ref(d_out.astype(jnp.float32)), vjp_naive(d_out)
    for g, g_ref, g_naive, x in zip(grads, grads_ref, grads_naive, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        check_close(g, g_ref, g_naive, dtype)
    # The empty row is exactly zero, and so is its query gradient.
    assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_entries_outside_range_are_ignored(impl):
    rng = np.random.default_rng(2)
    q, k, v = attention_inputs(rng, 1, 6, 10, 2, 1, 8, 8, jnp.float32)
    idx = jnp.asarray(rng.integers(0, 10, (1, 6, 4)), jnp.int32)
    junk = idx.at[:, :, 1].set(-1).at[:, :, 3].set(10_000)
    only_valid = idx.at[:, :, 1].set(idx[:, :, 0]).at[:, :, 3].set(idx[:, :, 0])
    # Dropping entries == the softmax over the remaining ones: compare with a direct formula.
    got = np.asarray(call(impl, q, k, v, junk))
    kept = np.asarray(idx)[0][:, [0, 2]]
    logits = np.einsum("thd,tjd->thj", np.asarray(q[0]), np.asarray(k[0, :, 0])[kept]) / np.sqrt(8)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("thj,tjd->thd", p, np.asarray(v[0, :, 0])[kept])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, np.asarray(call(impl, q, k, v, only_valid)))


@pytest.mark.parametrize("impl", ["xla"])
def test_residuals_are_inputs_indices_and_one_statistic(impl):
    rng = np.random.default_rng(3)
    # Dv != D, so a saved output [B, T, H, Dv] could not pass for q [B, T, H, D].
    B, T, S, H, G, D, Dv, K = 1, 16, 24, 4, 1, 8, 12, 12
    q, k, v = attention_inputs(rng, B, T, S, H, G, D, Dv, jnp.bfloat16)
    idx = messy_indices(rng, B, T, S, K)
    res = saved_residuals(lambda q, k, v: call(impl, q, k, v, idx), q, k, v)
    shapes = sorted((tuple(a.shape), str(a.dtype)) for a, _ in res)
    allowed = {(tuple(x.shape), str(x.dtype)) for x in (q, k, v, idx)}
    allowed.add(((B, T, H), "float32"))
    assert set(shapes) <= allowed, shapes
    assert all(int(np.prod(a.shape)) < T * K * H for a, _ in res), shapes


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_indices_past_int32_are_ignored(impl):
    """int64 entries past the int32 range are out of range (ignored), not wrapped onto a key."""
    rng = np.random.default_rng(5)
    q, k, v = attention_inputs(rng, 1, 4, 10, 2, 1, 8, 8, jnp.float32)
    idx = jnp.asarray(rng.integers(0, 10, (1, 4, 3)), jnp.int32)
    with jax.enable_x64(True):
        wide = jnp.asarray(idx, jnp.int64).at[:, :, 1].set(2**32 + 3)
        got = call(impl, q, k, v, wide)
    want = call(impl, q, k, v, idx.at[:, :, 1].set(-1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_auto_is_xla_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks the Pallas kernels on GPU")
    rng = np.random.default_rng(4)
    q, k, v = attention_inputs(rng, 1, 5, 7, 2, 1, 8, 8, jnp.float32)
    idx = messy_indices(rng, 1, 5, 7, 5)
    np.testing.assert_array_equal(
        hs.sparse_attention(q, k, v, idx), hs.sparse_attention(q, k, v, idx, impl="xla")
    )


def lse_oracle(q, k, idx, scale):
    """f64 log-sum-exp of the scaled logits over each row's valid entries (a repeated entry
    counts once per occurrence), -inf on rows without one: [B, T, H]."""
    q, k, idx = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(idx)
    B, T, H, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    out = np.full((B, T, H), -np.inf)
    for b in range(B):
        for t in range(T):
            rows = [int(s) for s in idx[b, t] if 0 <= s < S]
            if rows:
                for h in range(H):
                    logits = scale * k[b, rows, h // (H // G)] @ q[b, t, h]
                    out[b, t, h] = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
    return out


@pytest.mark.parametrize("impl", IMPLS + ["interpret"])
@pytest.mark.parametrize("G, D, Dv, value_dim", [(2, 8, 12, None), (1, 72, 64, 64)])
def test_return_lse_is_the_softmax_log_sum_exp_detached(impl, G, D, Dv, value_dim):
    """return_lse gives the natural log-sum-exp of the scaled logits (f64 oracle, -inf on the
    empty row), the same output as without it, and no gradient through the lse."""
    rng = np.random.default_rng(6)
    B, T, S, H, K = 2, 9, 21, 4, 7
    q, k, v = attention_inputs(rng, B, T, S, H, G, D, Dv, jnp.float32)
    v = None if value_dim else v
    idx = messy_indices(rng, B, T, S, K)
    out, lse = call(impl, q, k, v, idx, return_lse=True, value_dim=value_dim)
    assert lse.shape == (B, T, H) and lse.dtype == jnp.float32
    want = lse_oracle(q, k, idx, D**-0.5)
    assert np.array_equal(np.isinf(want), np.isinf(np.asarray(lse)))
    np.testing.assert_allclose(lse, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out, call(impl, q, k, v, idx, value_dim=value_dim))
    finite = jnp.where(jnp.isfinite(lse), 1.0, 0.0)

    def with_lse(q, k):
        out, lse = call(impl, q, k, v, idx, return_lse=True, value_dim=value_dim)
        return jnp.sum(out) + jnp.sum(jnp.where(finite > 0, lse, 0.0))

    def without(q, k):
        return jnp.sum(call(impl, q, k, v, idx, value_dim=value_dim))

    for got, plain in zip(jax.grad(with_lse, (0, 1))(q, k), jax.grad(without, (0, 1))(q, k)):
        np.testing.assert_array_equal(got, plain)
