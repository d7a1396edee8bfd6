"""FP8 indexer inputs (`hs.quantize_indexer`, docs/design.md, 'FP8 indexer'): the Hadamard
rotation against the explicit Sylvester matrix, e4m3 rounding bounds on the dequantized values
and on the scores, and selection on the quantized inputs (xla against reference, index for
index)."""

import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs
from hyscale_jax.quantize import E4M3_MAX, hadamard_transform, quantize_rows
from hyscale_jax.scores import indexer_scores

U = 2.0**-4  # e4m3 (3 mantissa bits): relative rounding error of a normal number
SUB = 2.0**-10  # e4m3 subnormal spacing 2**-9, halved: absolute error below 2**-6
F32_SLACK = 2.0**-20  # f32 arithmetic around the rounding (divide, multiply back, rotation)


def sylvester(D):
    """H_D / sqrt(D) in float64: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]."""
    h = np.ones((1, 1))
    while h.shape[0] < D:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(D)


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def indexer_inputs(seed, B, T, S, HI, DI, dtype=jnp.bfloat16, outlier=None):
    """Gaussian q [B,T,HI,DI], k [B,S,DI], w [B,T,HI] in `dtype`; `outlier` scales feature 0 of
    every key (an outlier channel, as activations often have)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, HI, DI))
    k = rng.normal(size=(B, S, DI))
    if outlier is not None:
        k[..., 0] *= outlier
    w = rng.normal(size=(B, T, HI))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


@pytest.mark.parametrize("D", [1, 2, 4, 32, 128])
def test_hadamard_is_the_orthonormal_sylvester_matrix(D):
    H = sylvester(D)
    M = f64(hadamard_transform(jnp.eye(D, dtype=jnp.float32)))  # row i: e_i @ H
    np.testing.assert_allclose(M, H, rtol=0, atol=1e-6)
    np.testing.assert_allclose(M @ M.T, np.eye(D), rtol=0, atol=1e-5)
    rng = np.random.default_rng(D)
    x = rng.normal(size=(3, 5, D)).astype(np.float32)
    y = f64(hadamard_transform(jnp.asarray(x)))
    np.testing.assert_allclose(y, x @ H, rtol=1e-5, atol=1e-5)
    # Dot products survive; applied twice it is the identity (H symmetric and orthogonal).
    np.testing.assert_allclose(y @ y[0, 0], x.astype(np.float64) @ x[0, 0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(f64(hadamard_transform(jnp.asarray(y))), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_rows_within_e4m3_error(dtype):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 7, 64)) * np.exp(rng.normal(size=(4, 7, 1)) * 3)  # scales vary
    x[0, 0] = 0.0  # a zero row
    x[1, 2, :5] *= 1e-5  # elements deep in e4m3's subnormal range of their row
    x = jnp.asarray(x, dtype)
    x8, scale = quantize_rows(x)
    assert x8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert scale.shape == x.shape[:-1]
    x64, s64, q64 = f64(x), f64(scale), f64(x8)
    assert np.isfinite(s64).all() and (s64 > 0).all() and np.isfinite(q64).all()
    assert s64[0, 0] == 1.0 and (q64[0, 0] == 0).all()
    # Each nonzero row's largest element lands on +-448: the full e4m3 range is used.
    peak = np.abs(q64).max(-1)
    np.testing.assert_array_equal(peak[np.abs(x64).max(-1) > 0], E4M3_MAX)
    np.testing.assert_allclose(s64, np.where(peak > 0, np.abs(x64).max(-1) / E4M3_MAX, 1.0), 1e-6)
    err = np.abs(q64 * s64[..., None] - x64)
    bound = (U + F32_SLACK) * np.abs(x64) + SUB * s64[..., None]
    assert (err <= bound).all(), np.max(err / bound)
    assert (err > 0).any()  # FP8 rounds: the check is not vacuous


def test_quantize_rows_nonfinite_rows():
    x = jnp.asarray([[1.0, np.nan, 2.0], [np.inf, 1.0, 0.5], [3.0, -6.0, 0.0]], jnp.float32)
    x8, scale = quantize_rows(x)
    q = f64(x8)
    assert np.isnan(q[:2]).all()  # a non-finite row is all NaN: never selectable
    np.testing.assert_allclose(f64(scale), [1.0, 1.0, 6.0 / E4M3_MAX], rtol=1e-6)
    np.testing.assert_array_equal(q[2], [224.0, -448.0, 0.0])


@pytest.mark.parametrize("hadamard", [True, False])
def test_quantize_indexer_dequantizes_and_folds_q_scale(hadamard):
    B, T, S, HI, DI = 2, 9, 13, 3, 32
    q, k, w = indexer_inputs(2, B, T, S, HI, DI)
    q = q.at[0, 1, 2].set(0.0)  # a zero query row: scale 1, its head weight unchanged
    q8, k8, w2, k_scale = hs.quantize_indexer(q, k, w, hadamard=hadamard)
    assert (q8.dtype, k8.dtype, w2.dtype, k_scale.dtype) == (
        jnp.float8_e4m3fn,
        jnp.float8_e4m3fn,
        jnp.float32,
        jnp.float32,
    )
    assert q8.shape == q.shape and k8.shape == k.shape
    assert w2.shape == w.shape and k_scale.shape == (B, S)
    R = sylvester(DI) if hadamard else np.eye(DI)
    qr, kr = f64(q) @ R, f64(k) @ R  # the rotated originals, float64
    q_scale = np.abs(qr).max(-1) / E4M3_MAX
    q_scale[0, 1, 2] = 1.0
    np.testing.assert_allclose(f64(k_scale), np.abs(kr).max(-1) / E4M3_MAX, rtol=1e-5)
    np.testing.assert_allclose(f64(w2), f64(w) * q_scale, rtol=1e-5)
    assert f64(w2)[0, 1, 2] == f64(w)[0, 1, 2]
    for x8, scale, ref in ((q8, q_scale, qr), (k8, f64(k_scale), kr)):
        err = np.abs(f64(x8) * scale[..., None] - ref)
        bound = (U + 1e-5) * np.abs(ref) + SUB * scale[..., None]
        assert (err <= bound).all(), np.max(err / bound)


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("outlier", [None, 30.0])
def test_fp8_scores_within_quantization_bound(hadamard, outlier):
    """The FP8 scores (k_scale * head sum, the function selection ranks) are within the bound
    that e4m3 rounding of each element of the rotated q and k implies, around the bf16 scores."""
    B, T, S, HI, DI = 2, 11, 40, 4, 64
    q, k, w = indexer_inputs(3, B, T, S, HI, DI, outlier=outlier)
    q8, k8, w2, k_scale = hs.quantize_indexer(q, k, w, hadamard=hadamard)
    got = f64(indexer_scores(q8, k8, w2, k_scale))  # [B, T, S]
    want = f64(indexer_scores(q, k, w))  # bf16 inputs: exact products, f32 sums
    R = sylvester(DI) if hadamard else np.eye(DI)
    qr, kr = np.abs(f64(q) @ R), np.abs(f64(k) @ R)
    q_scale, k_sc = qr.max(-1) / E4M3_MAX, kr.max(-1) / E4M3_MAX
    eq = (U + 1e-5) * qr + SUB * q_scale[..., None]  # |q8 * q_scale - q_rot| per element
    ek = (U + 1e-5) * kr + SUB * k_sc[..., None]
    per_head = (
        np.einsum("bthd,bsd->bths", eq, kr)
        + np.einsum("bthd,bsd->bths", qr, ek)
        + np.einsum("bthd,bsd->bths", eq, ek)
    )
    absw = np.abs(f64(w))
    bound = np.einsum("bths,bth->bts", per_head, absw)
    slack = 1e-5 * np.einsum("bths,bth->bts", np.einsum("bthd,bsd->bths", qr, kr), absw)
    err = np.abs(got - want)
    assert (err <= bound + slack).all(), np.max(err / (bound + slack))
    assert err.max() > 0
    # The bound is e4m3-sized: about 2 * 2**-4 of the magnitude sum sum_h |w| |q|.|k|.
    mag = np.einsum("bths,bth->bts", np.einsum("bthd,bsd->bths", qr, kr), absw)
    assert np.median(bound / mag) < 0.14


@pytest.mark.parametrize(
    "B, T, S, HI, DI, topk, causal, block",
    [
        (2, 21, 150, 3, 16, 12, True, (5, 16)),
        (1, 19, 133, 2, 32, 30, False, (4, 32)),
        (2, 7, 40, 3, 8, 50, True, (3, 16)),  # k past the visible keys: -1 slots
    ],
)
@pytest.mark.parametrize("hadamard", [True, False])
def test_selection_on_quantized_inputs_xla_matches_reference(
    B, T, S, HI, DI, topk, causal, block, hadamard
):
    q, k, w = indexer_inputs(B + T + S, B, T, S, HI, DI)
    # Repeated key rows quantize identically: exact ties, broken by the smaller index.
    k = k.at[:, 1::7].set(k[:, :1])
    q8, k8, w2, k_scale = hs.quantize_indexer(q, k, w, hadamard=hadamard)
    ref = np.asarray(
        hs.hytopk(q8, k8, w2, k=topk, causal=causal, k_scale=k_scale, impl="reference")
    )
    xla = hs.hytopk(
        q8, k8, w2, k=topk, causal=causal, k_scale=k_scale, impl="xla",
        block_q=block[0], block_k=block[1],
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(xla), ref)
    # The ties are there (some row selects a repeated key beside the original) and break by
    # index: the original (key 0) precedes its copies wherever both are selected.
    pos = {s: np.argmax(ref == s, axis=-1) for s in (0, 1)}
    both = (ref == 0).any(-1) & (ref == 1).any(-1)
    assert both.any() and (pos[0][both] < pos[1][both]).all()
    # FP8 selection approximates the bf16 one: most selected keys are shared.
    bf16 = np.asarray(hs.hytopk(q, k, w, k=topk, causal=causal, impl="reference"))
    shared = [len(set(a[a >= 0]) & set(b[b >= 0])) / max((b >= 0).sum(), 1)
              for a, b in zip(ref.reshape(-1, topk), bf16.reshape(-1, topk))]  # fmt: skip
    assert np.mean(shared) > 0.8, np.mean(shared)


def test_nan_key_never_selected_and_scales_stay_valid():
    q, k, w = indexer_inputs(5, 1, 6, 20, 2, 16)
    k = k.at[0, 3, 2].set(np.nan)
    q8, k8, w2, k_scale = hs.quantize_indexer(q, k, w)
    assert np.isfinite(f64(k_scale)).all() and (f64(k_scale) > 0).all()
    idx = np.asarray(hs.hytopk(q8, k8, w2, k=20, causal=False, k_scale=k_scale, impl="reference"))
    assert not (idx == 3).any() and (idx[..., :19] >= 0).all() and (idx[..., 19] == -1).all()


def test_bad_input():
    q, k, w = indexer_inputs(6, 1, 4, 8, 2, 24)
    with pytest.raises(ValueError, match=r"power of two.*DI=24"):
        hs.quantize_indexer(q, k, w)
    q8, k8, _, _ = hs.quantize_indexer(q, k, w, hadamard=False)  # any DI without rotation
    assert q8.shape == q.shape and k8.shape == k.shape
    with pytest.raises(ValueError, match=r"last axis 12"):
        hadamard_transform(jnp.ones((3, 12)))
    with pytest.raises(ValueError, match=r"k_idx must be \[B=1, S, DI=24\]"):
        hs.quantize_indexer(q, k[..., :16], w, hadamard=False)
    with pytest.raises(ValueError, match=r"w must be \[B, T, HI\]"):
        hs.quantize_indexer(q, k, w[..., :1], hadamard=False)
    with pytest.raises(ValueError, match=r"q_idx must have rank 4"):
        hs.quantize_indexer(q[0], k, w, hadamard=False)
    with pytest.raises(TypeError, match=r"k_idx must be a real floating"):
        hs.quantize_indexer(q, k.astype(jnp.int32), w, hadamard=False)
