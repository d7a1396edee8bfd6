"""Pallas sparse attention kernels (pallas_kernels/sparse_attention.py).

On CPU the kernels run in Pallas interpret mode (deterministic dK/dV path: interpret-mode
vector atomics mis-add duplicate indices); `TestCompiledGPU` runs the same checks on the
compiled Triton kernels, both the atomic and the deterministic backward, and skips elsewhere.
Every check compares against the dense f32 reference (`hs.sparse_attention_reference`) with a
flash-attention style budget: at most 2x the error of the reference run in the same dtype, plus a
dtype noise floor.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs
from pallas_kernels import sparse_attention as psa
from tests.helpers import count_named_eqns, rel_err

ON_GPU = jax.default_backend() == "gpu"
# Small tiles in interpret mode so the awkward shapes below span several key blocks.
SMALL = psa.BlockSizes(block_k=16, block_k_bwd=16)
NOISE_FLOOR = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2e-3}


def inputs(seed, B, T, S, H, G, D, Dv, K, dtype):
    """q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv], idx [B,T,K] with -1, out-of-range entries on
    both sides, repeated keys and one row with no valid entry; d_out [B,T,H,Dv]."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    k = jnp.asarray(rng.normal(size=(B, S, G, D)), dtype)
    v = jnp.asarray(rng.normal(size=(B, S, G, Dv)), dtype)
    idx = rng.integers(0, S, (B, T, K))
    idx[:, ::3, 0] = -1
    idx[:, 1::4, -1] = S + 2
    idx[:, 2::5, 1] = -S
    idx[:, ::2, 2] = idx[:, ::2, 3]  # a repeated key counts twice
    idx[0, T // 2] = -1  # empty row: output zeros
    d_out = jnp.asarray(rng.normal(size=(B, T, H, Dv)), dtype)
    return q, k, v, jnp.asarray(idx, jnp.int32), d_out


def check_close(got, want_f32, naive_same_dtype, dtype):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    bound = 2.0 * rel_err(naive_same_dtype, want_f32) + NOISE_FLOOR[jnp.dtype(dtype)]
    err = rel_err(got, want_f32)
    assert err <= bound, (err, bound)


def kernel_fn(idx, interpret, **kw):
    def f(q, k, v):
        return psa.sparse_attention(
            q, k, v, idx, scale=q.shape[-1] ** -0.5, interpret=interpret, **kw
        )

    return f


def check_against_reference(q, k, v, idx, d_out, interpret, **kw):
    """Output and all three gradients (random cotangent) against the f32 reference."""
    dtype = q.dtype

    def ref(q, k, v):
        return hs.sparse_attention_reference(q, k, v, idx)

    out, vjp = jax.vjp(kernel_fn(idx, interpret, **kw), q, k, v)
    want, vjp_ref = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    naive, vjp_naive = jax.vjp(ref, q, k, v)
    assert out.dtype == dtype and out.shape == d_out.shape
    check_close(out, want, naive, dtype)
    grads = vjp(d_out)
    for g, g_ref, g_naive, x in zip(
        grads, vjp_ref(d_out.astype(jnp.float32)), vjp_naive(d_out), (q, k, v)
    ):
        assert g.dtype == x.dtype and g.shape == x.shape
        check_close(g, g_ref, g_naive, dtype)
    return out, grads


# (B, T, S, H, G, D, Dv, K): K spans two 16-slot blocks; H // G = 3 and 1 exercise head padding;
# D, Dv not powers of two exercise feature padding; D != Dv.
SHAPES = [(2, 7, 37, 4, 1, 16, 16, 19), (1, 6, 29, 6, 2, 24, 12, 21), (1, 5, 23, 2, 2, 20, 36, 9)]


CASES = [
    (SHAPES[0], jnp.float32),
    (SHAPES[0], jnp.bfloat16),
    (SHAPES[1], jnp.float32),
    (SHAPES[1], jnp.bfloat16),
    (SHAPES[2], jnp.bfloat16),
]


@pytest.mark.parametrize(
    "shape,dtype",
    CASES,
    ids=lambda c: (
        "B{}T{}S{}H{}G{}D{}Dv{}K{}".format(*c) if isinstance(c, tuple) else jnp.dtype(c).name
    ),
)
def test_interpret_matches_reference(shape, dtype):
    q, k, v, idx, d_out = inputs(0, *shape, dtype)
    out, grads = check_against_reference(q, k, v, idx, d_out, True, block_sizes=SMALL)
    T = shape[1]
    assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()


def causal_padded_idx(seed, B, T, S, K):
    """[B, T, K] like hytopk's causal output: row t holds min(t + 1 + S - T, K) distinct
    visible keys, then -1 padding, so early rows end in whole blocks of -1."""
    rng = np.random.default_rng(seed)
    idx = np.full((B, T, K), -1)
    for b in range(B):
        for t in range(T):
            n = min(t + 1 + S - T, K)
            idx[b, t, :n] = rng.permutation(t + 1 + S - T)[:n]
    return jnp.asarray(idx, jnp.int32)


def test_trailing_padding_interpret():
    """Rows ending in whole blocks of -1 (skipped by the forward's loop): same as the reference,
    and bitwise the same forward as running every block (skip_invalid=False)."""
    B, T, S, H, G, D, K = 1, 40, 40, 4, 1, 16, 48
    q, k, v, _, d_out = inputs(4, B, T, S, H, G, D, D, K, jnp.float32)
    idx = causal_padded_idx(5, B, T, S, K)
    check_against_reference(q, k, v, idx, d_out, True, block_sizes=SMALL)
    full = dataclasses.replace(SMALL, skip_invalid=False)
    np.testing.assert_array_equal(
        kernel_fn(idx, True, block_sizes=SMALL)(q, k, v),
        kernel_fn(idx, True, block_sizes=full)(q, k, v),
    )


@pytest.mark.parametrize("schedule", ["dv_first", "split"])
def test_backward_schedules_interpret(schedule):
    """Forming dV's rows in the delta sweep, or splitting the backward into two kernels, gives
    the reference's gradients and, on the deterministic path, the fused schedule's bit for bit
    (the same per-slot rows, summed in the same order)."""
    shape = (1, 6, 29, 6, 2, 24, 12, 37)
    q, k, v, idx, d_out = inputs(14, *shape, jnp.bfloat16)
    sizes = dataclasses.replace(SMALL, bwd_schedule=schedule)
    _, grads = check_against_reference(q, k, v, idx, d_out, True, block_sizes=sizes)
    fused = jax.vjp(kernel_fn(idx, True, block_sizes=SMALL), q, k, v)[1](d_out)
    for g, g_fused in zip(grads, fused):
        np.testing.assert_array_equal(g, g_fused)


def test_backward_schedule_is_checked():
    with pytest.raises(ValueError, match="bwd_schedule"):
        psa.BlockSizes(bwd_schedule="late")


def test_public_api_interpret_dispatch():
    q, k, v, idx, _ = inputs(1, 1, 5, 11, 2, 1, 8, 8, 6, jnp.float32)
    got = hs.sparse_attention(q, k, v, idx, impl="interpret")
    want = hs.sparse_attention_reference(q, k, v, idx)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_invalid_entries_are_never_read():
    # Row 0 (where invalid entries are clamped) and the last row hold NaN; no valid entry picks
    # either, so the output and every gradient must equal those of clean inputs.
    B, T, S, H, G, D, K = 1, 4, 12, 2, 1, 8, 6
    q, k, v, _, d_out = inputs(2, B, T, S, H, G, D, D, K, jnp.float32)
    rng = np.random.default_rng(3)
    idx = rng.integers(1, S - 1, (B, T, K))
    idx[:, :, 0] = -1
    idx[:, :, 1] = S
    idx = jnp.asarray(idx, jnp.int32)
    bad_k = k.at[:, 0].set(jnp.nan).at[:, -1].set(jnp.inf)
    bad_v = v.at[:, 0].set(jnp.nan).at[:, -1].set(-jnp.inf)
    f = kernel_fn(idx, True, block_sizes=SMALL)
    out, vjp = jax.vjp(f, q, bad_k, bad_v)
    clean, vjp_clean = jax.vjp(f, q, k, v)
    np.testing.assert_array_equal(out, clean)
    for g, g_clean in zip(vjp(d_out), vjp_clean(d_out)):
        np.testing.assert_array_equal(g, g_clean)


def test_deterministic_chunks_agree():
    shape = (1, 7, 19, 4, 2, 16, 16, 12)
    q, k, v, idx, d_out = inputs(4, *shape, jnp.float32)
    chunked = psa.BlockSizes(block_k=16, block_k_bwd=16, block_t_deterministic=2)
    grads = jax.vjp(kernel_fn(idx, True, block_sizes=chunked), q, k, v)[1](d_out)
    whole = jax.vjp(kernel_fn(idx, True, block_sizes=SMALL), q, k, v)[1](d_out)
    for g, g_whole in zip(grads, whole):
        np.testing.assert_allclose(g, g_whole, rtol=1e-5, atol=1e-6)


def test_residuals_are_inputs_indices_and_lse():
    # Dv != D, so a saved output [B, T, H, Dv] could not pass for q [B, T, H, D].
    B, T, S, H, G, D, Dv, K = 1, 6, 24, 4, 1, 16, 20, 24
    q, k, v, idx, _ = inputs(5, B, T, S, H, G, D, Dv, K, jnp.bfloat16)
    res = saved_residuals(kernel_fn(idx, True, block_sizes=SMALL), q, k, v)
    shapes = [(tuple(a.shape), str(a.dtype)) for a, _ in res]
    allowed = {(tuple(x.shape), str(x.dtype)) for x in (q, k, v, idx)} | {((B, T, H), "float32")}
    assert set(shapes) <= allowed, shapes
    assert ((B, T, H), "float32") in shapes, shapes
    assert all(int(np.prod(a.shape)) < T * K * H for a, _ in res), shapes


def test_kernels_are_named_and_replay_policy_works():
    q, k, v, idx, d_out = inputs(6, 1, 5, 13, 2, 1, 8, 8, 5, jnp.float32)
    f = kernel_fn(idx, True)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v) * d_out)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert count_named_eqns(jaxpr, ("sparse_attn",)) >= 3  # fwd, per-slot bwd rows, key sum
    assert count_named_eqns(jaxpr, ("sparse_attn_fwd",)) == 1
    remat = jax.checkpoint(loss, policy=hs.replay_policy())
    plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    replayed = jax.grad(remat, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(plain, replayed):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", ["fused", "dv_first", "split"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_lowers_to_triton(deterministic, schedule):
    """The GPU lowering (Pallas -> Triton IR) runs on CPU too: catches ops Triton lacks, in the
    forward and in the backward kernels (atomic, or per-slot rows and the key-wise sum) of
    every backward schedule."""
    specs = [
        jax.ShapeDtypeStruct(s, jnp.bfloat16)
        for s in ((1, 100, 16, 128), (1, 300, 1, 128), (1, 300, 1, 128))
    ]
    idx = jax.ShapeDtypeStruct((1, 100, 200), jnp.int32)

    def loss(q, k, v, idx):
        return jnp.sum(
            psa.sparse_attention(
                q,
                k,
                v,
                idx,
                scale=0.1,
                deterministic=deterministic,
                block_sizes=psa.BlockSizes(bwd_schedule=schedule),
            ).astype(jnp.float32)
        )

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(*specs, idx)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    suffix = "rows" if deterministic else "atomic"
    bwd = (
        [f"sparse_attn_bwd_dv_{suffix}", f"sparse_attn_bwd_dq_dk_{suffix}"]
        if schedule == "split"
        else [f"sparse_attn_bwd_{suffix}"]
    )
    names = ["sparse_attn_fwd"] + bwd + (["sparse_attn_bwd_keysum"] if deterministic else [])
    assert text.count("xla.gpu.triton") == len(names), text.count("xla.gpu.triton")
    for name in names:
        assert name in text, name


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas-Triton kernels need a GPU")
class TestCompiledGPU:
    """The compiled Triton kernels on realistic tiles (default BlockSizes)."""

    @pytest.mark.parametrize("deterministic", [False, True])
    @pytest.mark.parametrize(
        "shape,dtype",
        [
            ((1, 256, 512, 16, 1, 128, 128, 128), jnp.bfloat16),  # DSA MQA tile
            ((2, 96, 300, 8, 2, 192, 128, 100), jnp.bfloat16),  # GQA, D != Dv, padded K and D
            ((1, 33, 70, 3, 1, 24, 40, 19), jnp.float32),  # awkward everything, f32
        ],
        ids=["mqa_bf16", "gqa_d192_bf16", "awkward_f32"],
    )
    def test_matches_reference(self, shape, dtype, deterministic):
        q, k, v, idx, d_out = inputs(7, *shape, dtype)
        out, grads = check_against_reference(
            q, k, v, idx, d_out, False, deterministic=deterministic
        )
        T = shape[1]
        assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()

    @pytest.mark.parametrize("schedule", ["dv_first", "split"])
    def test_backward_schedules(self, schedule):
        """The atomic backward under every schedule, on hytopk-like causal rows."""
        B, T, S, H, K = 1, 300, 300, 16, 128
        q, k, v, _, d_out = inputs(15, B, T, S, H, 1, 64, 64, K, jnp.bfloat16)
        idx = causal_padded_idx(16, B, T, S, K)
        check_against_reference(
            q,
            k,
            v,
            idx,
            d_out,
            False,
            deterministic=False,
            block_sizes=psa.BlockSizes(bwd_schedule=schedule),
        )

    @pytest.mark.parametrize("skip_invalid", [True, False])
    def test_trailing_padding(self, skip_invalid):
        """hytopk-like causal rows (trailing -1 blocks): the loops stop at the last valid block
        and the invalid slots' atomics are masked (skip_invalid), or not; both match the
        reference, and the forwards agree bitwise."""
        B, T, S, H, K = 1, 300, 300, 16, 128
        q, k, v, _, d_out = inputs(12, B, T, S, H, 1, 64, 64, K, jnp.bfloat16)
        idx = causal_padded_idx(13, B, T, S, K)
        sizes = psa.BlockSizes(skip_invalid=skip_invalid)
        out, _ = check_against_reference(
            q, k, v, idx, d_out, False, block_sizes=sizes, deterministic=False
        )
        other = kernel_fn(idx, False, block_sizes=psa.BlockSizes(skip_invalid=not skip_invalid))
        np.testing.assert_array_equal(out, other(q, k, v))

    def test_public_api_auto_is_pallas(self):
        q, k, v, idx, _ = inputs(8, 1, 64, 128, 16, 1, 64, 64, 32, jnp.bfloat16)
        jaxpr = jax.make_jaxpr(lambda q: hs.sparse_attention(q, k, v, idx))(q)
        assert count_named_eqns(jaxpr, ("sparse_attn",)) == 1

    def test_deterministic_is_bitwise_reproducible(self):
        q, k, v, idx, d_out = inputs(9, 1, 128, 64, 16, 1, 64, 64, 64, jnp.bfloat16)
        f = jax.jit(
            lambda q, k, v: jax.vjp(kernel_fn(idx, False, deterministic=True), q, k, v)[1](d_out)
        )
        first = f(q, k, v)
        for _ in range(3):
            for a, b in zip(first, f(q, k, v)):
                np.testing.assert_array_equal(a, b)

    def test_invalid_entries_are_never_read(self):
        B, T, S, H, D, K = 1, 32, 64, 16, 64, 32
        q, k, v, _, d_out = inputs(10, B, T, S, H, 1, D, D, K, jnp.bfloat16)
        idx = np.random.default_rng(11).integers(1, S - 1, (B, T, K))
        idx[:, :, ::4] = -1
        idx[:, :, 1::4] = S + 5
        idx = jnp.asarray(idx, jnp.int32)
        bad_k = k.at[:, 0].set(jnp.nan).at[:, -1].set(jnp.inf)
        bad_v = v.at[:, 0].set(jnp.nan).at[:, -1].set(jnp.inf)
        for det in (False, True):
            f = kernel_fn(idx, False, deterministic=det)
            out, vjp = jax.vjp(f, q, bad_k, bad_v)
            assert np.isfinite(np.asarray(out, np.float32)).all()
            for g in vjp(d_out):
                assert np.isfinite(np.asarray(g, np.float32)).all()
