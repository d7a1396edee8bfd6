"""Pallas sparse attention kernels (pallas_kernels/sparse_attention.py).

On CPU the kernels run in Pallas interpret mode: the deterministic backward (what
`interpret=True` runs), and the atomic backward that the GPU runs by default, through the
custom_vjp's config (its relaxed atomic add has an exact interpret rule, see
pallas_kernels/relaxed_atomics.py). `TestCompiledGPU` runs the same checks on the compiled
Triton kernels, both backward paths, and skips elsewhere. Every check compares against the
dense f32 reference (`hs.sparse_attention_reference`) with a flash-attention style budget: at
most 2x the error of the reference run in the same dtype, plus a dtype noise floor.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs
from pallas_kernels import relaxed_atomics
from pallas_kernels import sparse_attention as psa
from tests.helpers import count_named_eqns, lower_for_cuda, poisoned_index_rows, rel_err

ON_GPU = jax.default_backend() == "gpu"
# Small tiles in interpret mode so the awkward shapes below span several key blocks.
SMALL = psa.BlockSizes(block_k=16, block_k_bwd=16)
NOISE_FLOOR = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2e-3}
needs_relaxed = pytest.mark.skipif(
    not relaxed_atomics.RELAXED,
    reason="the atomic backward runs in interpret mode only through the relaxed atomic add",
)
# Both backward paths in interpret mode: the sorted-sum one and the GPU's atomic one.
both_backwards = pytest.mark.parametrize(
    "deterministic",
    [True, pytest.param(False, marks=needs_relaxed)],
    ids=["deterministic", "atomic"],
)


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


def kernel_fn(idx, interpret, deterministic=None, block_sizes=None):
    """The kernels as a function of (q, k, v). interpret=True, deterministic=False: the atomic
    backward in the interpreter (through the custom_vjp's config, which the public function
    does not offer)."""

    def f(q, k, v):
        scale = q.shape[-1] ** -0.5
        if interpret and deterministic is False:
            sizes = block_sizes or psa.BlockSizes()
            cfg = psa._Config(scale=scale, interpret=True, deterministic=False, sizes=sizes)
            return psa._sparse_attention(q, k, v, idx, cfg)[0]
        return psa.sparse_attention(
            q,
            k,
            v,
            idx,
            scale=scale,
            interpret=interpret,
            deterministic=deterministic,
            block_sizes=block_sizes,
        )

    return f


def check_against_reference(q, k, v, idx, d_out, interpret, clean=None, **kw):
    """Output and all three gradients (random cotangent) against the f32 reference.

    clean: optional (q, k, v) for the reference when q, k, v hold poisoned rows that no valid
    entry names (their values must not matter)."""
    dtype = q.dtype
    clean = (q, k, v) if clean is None else clean

    def ref(q, k, v):
        return hs.sparse_attention_reference(q, k, v, idx)

    out, vjp = jax.vjp(kernel_fn(idx, interpret, **kw), q, k, v)
    want, vjp_ref = jax.vjp(ref, *(x.astype(jnp.float32) for x in clean))
    naive, vjp_naive = jax.vjp(ref, *clean)
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


def case_id(c):
    return "B{}T{}S{}H{}G{}D{}Dv{}K{}".format(*c) if isinstance(c, tuple) else jnp.dtype(c).name


@pytest.mark.parametrize("shape,dtype", CASES, ids=case_id)
def test_interpret_matches_reference(shape, dtype):
    """Forward and the deterministic backward (interpret mode's default)."""
    q, k, v, idx, d_out = inputs(0, *shape, dtype)
    out, grads = check_against_reference(q, k, v, idx, d_out, True, block_sizes=SMALL)
    T = shape[1]
    assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()


@needs_relaxed
@pytest.mark.parametrize("shape,dtype", [CASES[0], CASES[3], CASES[4]], ids=case_id)
def test_interpret_atomic_backward_matches_reference(shape, dtype):
    """The GPU's default backward (masked f32 atomics into shared dK/dV buffers) in the
    interpreter; the inputs repeat keys inside a row and across queries, and hold invalid
    entries in every block."""
    q, k, v, idx, d_out = inputs(0, *shape, dtype)
    _, grads = check_against_reference(
        q, k, v, idx, d_out, True, deterministic=False, block_sizes=SMALL
    )
    assert not np.asarray(grads[0][0, shape[1] // 2]).any()


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


@both_backwards
def test_trailing_padding_interpret(deterministic):
    """Rows ending in whole blocks of -1 (the forward and the atomic backward stop at each
    row's last block with a valid entry; the per-slot backward runs every block)."""
    B, T, S, H, G, D, K = 1, 40, 40, 4, 1, 16, 48
    q, k, v, _, d_out = inputs(4, B, T, S, H, G, D, D, K, jnp.float32)
    idx = causal_padded_idx(5, B, T, S, K)
    check_against_reference(
        q, k, v, idx, d_out, True, deterministic=deterministic, block_sizes=SMALL
    )


def poisoned_inputs(seed, B, T, S, H, G, D, Dv, K, dtype):
    """Inputs for the contract that an invalid entry is never read: (clean, poisoned, idx,
    d_out) with clean = poisoned = (q, k, v) except for rows no valid entry names.

    Valid entries name keys 3 .. S-2 only, with repeats; keys 0 (where invalid entries are
    clamped), 1, 2 and S-1 hold NaN, +inf and -inf in the poisoned k and v. Each row holds
    invalid entries (-1 padding at its end, S, -5, 2**31 - 1, -2**31, S + 1000); row T // 2 of
    batch 0 holds only invalid entries, and the poisoned q holds NaN in it."""
    q, k, v, _, d_out = inputs(seed, B, T, S, H, G, D, Dv, K, dtype)
    idx = poisoned_index_rows(seed, B, T, S, K)
    poison = jnp.array([jnp.nan, jnp.inf, -jnp.inf, jnp.nan], dtype)[:, None, None]
    rows = np.array([0, 1, 2, S - 1])
    bad_q = q.at[0, T // 2].set(jnp.nan)
    bad_k = k.at[:, rows].set(jnp.broadcast_to(poison, (B, 4, G, D)))
    bad_v = v.at[:, rows].set(jnp.broadcast_to(poison[::-1], (B, 4, G, Dv)))
    return (q, k, v), (bad_q, bad_k, bad_v), idx, d_out


def check_poisoned(interpret, deterministic, shape, dtype, block_sizes=None):
    """Output and gradients on poisoned inputs: those of the reference on clean inputs, exact
    zeros in the empty row and in the poisoned rows' dK / dV; where the backward is
    deterministic, also bit for bit those of the kernels on clean inputs."""
    clean, bad, idx, d_out = poisoned_inputs(20, *shape, dtype)
    kw = dict(deterministic=deterministic, block_sizes=block_sizes)
    out, grads = check_against_reference(*bad, idx, d_out, interpret, clean=clean, **kw)
    T, S = shape[1], shape[2]
    assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()
    for g in grads[1:]:
        assert not np.asarray(g[:, [0, 1, 2, S - 1]]).any()
    if interpret or deterministic:
        out_clean, vjp = jax.vjp(kernel_fn(idx, interpret, **kw), *clean)
        np.testing.assert_array_equal(out, out_clean)
        for g, g_clean in zip(grads, vjp(d_out)):
            np.testing.assert_array_equal(g, g_clean)


@both_backwards
def test_poisoned_rows_are_never_read_interpret(deterministic):
    check_poisoned(True, deterministic, (1, 6, 29, 4, 2, 16, 24, 21), jnp.float32, SMALL)


def test_public_api_interpret_dispatch():
    q, k, v, idx, _ = inputs(1, 1, 5, 11, 2, 1, 8, 8, 6, jnp.float32)
    got = hs.sparse_attention(q, k, v, idx, impl="interpret")
    want = hs.sparse_attention_reference(q, k, v, idx)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="deterministic=False with interpret=True"):
        psa.sparse_attention(q, k, v, idx, scale=0.5, interpret=True, deterministic=False)


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


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_lowers_to_triton(deterministic):
    """The GPU lowering (Pallas -> Triton IR) runs on CPU too: catches ops Triton lacks, in the
    forward and in the backward kernels (atomic, or per-slot rows and the key-wise sum)."""
    specs = [
        jax.ShapeDtypeStruct(s, jnp.bfloat16)
        for s in ((1, 100, 16, 128), (1, 300, 1, 128), (1, 300, 1, 128))
    ]
    idx = jax.ShapeDtypeStruct((1, 100, 200), jnp.int32)

    def loss(q, k, v, idx):
        return jnp.sum(
            psa.sparse_attention(q, k, v, idx, scale=0.1, deterministic=deterministic).astype(
                jnp.float32
            )
        )

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *specs, idx).as_text()
    if deterministic:
        names = ["sparse_attn_fwd", "sparse_attn_bwd_rows", "sparse_attn_bwd_keysum"]
    else:
        names = ["sparse_attn_fwd", "sparse_attn_bwd_atomic"]
    assert text.count("xla.gpu.triton") == len(names), text.count("xla.gpu.triton")
    for name in names:
        assert name in text, name


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas-Triton kernels need a GPU")
class TestCompiledGPU:
    """The compiled Triton kernels on realistic tiles (default BlockSizes)."""

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
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

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
    def test_trailing_padding(self, deterministic):
        """hytopk-like causal rows (trailing -1 blocks): the loops stop at each row's last valid
        block; the per-slot backward runs every block."""
        B, T, S, H, K = 1, 300, 300, 16, 128
        q, k, v, _, d_out = inputs(12, B, T, S, H, 1, 64, 64, K, jnp.bfloat16)
        idx = causal_padded_idx(13, B, T, S, K)
        check_against_reference(q, k, v, idx, d_out, False, deterministic=deterministic)

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
    @pytest.mark.parametrize(
        "shape,dtype",
        [
            ((1, 32, 64, 16, 1, 64, 64, 96), jnp.bfloat16),
            ((1, 19, 45, 6, 2, 24, 40, 37), jnp.float32),
        ],
        ids=["mqa_bf16", "awkward_f32"],
    )
    def test_poisoned_rows_are_never_read(self, shape, dtype, deterministic):
        check_poisoned(False, deterministic, shape, dtype)

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
