"""Sparse attention at MLA shapes (pallas_kernels/sparse_attention.py, `_Layout`).

DSA runs MLA's attention in the absorbed (MQA) form: G = 1, every head has D = 576 features
(512 latent + 64 rope) and the value is the key's leading 512 (`value_dim=512`, v=None). The
kernels read such a row as two power-of-two pieces (512 + 64), gather it once for both K and V,
and split the heads over programs (`BlockSizes.block_h`, `block_h_bwd`). On CPU the same
layouts run at small analogues (D = 72 = 64 + 8, value_dim = 64, 32 heads in two head blocks)
in interpret mode, against the dense f32 reference with the value sliced out of the key, both
backward paths;
`TestCompiledGPU` runs the real shapes and skips elsewhere.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import hyscale_jax as hs
from pallas_kernels import sparse_attention as psa
from tests.helpers import lower_for_cuda, poisoned_index_rows, rel_err
from tests.test_sparse_attention_pallas import (
    NOISE_FLOOR,
    both_backwards,
    causal_padded_idx,
    check_against_reference,
    inputs,
    needs_relaxed,
)

ON_GPU = jax.default_backend() == "gpu"
# 16-slot blocks and 16-head programs: the small shapes below span several of each.
SMALL = psa.BlockSizes(block_k=16, block_k_bwd=16, block_h=16, block_h_bwd=16)


def mla_inputs(seed, B, T, S, H, D, Dv, K, dtype):
    """q [B,T,H,D], kv [B,S,1,D] (the value is kv[..., :Dv]), idx [B,T,K] with -1,
    out-of-range entries, repeated keys and one empty row, d_out [B,T,H,Dv]."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    kv = jnp.asarray(rng.normal(size=(B, S, 1, D)), dtype)
    idx = rng.integers(0, S, (B, T, K))
    idx[:, ::3, 0] = -1
    idx[:, 1::4, -1] = S + 2
    idx[:, ::2, 2] = idx[:, ::2, 3]
    idx[0, T // 2] = -1
    d_out = jnp.asarray(rng.normal(size=(B, T, H, Dv)), dtype)
    return q, kv, jnp.asarray(idx, jnp.int32), d_out


def shared_kernel(idx, Dv, interpret, **kw):
    """(q, kv) -> out through the kernels with v=None, value_dim=Dv. interpret=True with
    deterministic=False: the atomic backward in the interpreter (the custom_vjp's config)."""

    def f(q, kv):
        scale = q.shape[-1] ** -0.5
        sizes = kw.get("block_sizes") or psa.BlockSizes()
        if interpret and kw.get("deterministic") is False:
            cfg = psa._Config(scale, True, False, sizes, value_dim=Dv)
            return psa._sparse_attention(q, kv, None, idx, cfg)[0]
        return psa.sparse_attention(
            q,
            kv,
            None,
            idx,
            scale=scale,
            value_dim=Dv,
            interpret=interpret,
            deterministic=kw.get("deterministic"),
            block_sizes=sizes,
        )

    return f


def reference(idx, Dv):
    return lambda q, kv: hs.sparse_attention_reference(q, kv, kv[..., :Dv], idx)


def assert_separate_values_match(kernel, q, k, v, idx, d_out, scale):
    """kernel(q, k, v) and its three gradients equal the f32 reference's (f32 tolerances)."""
    out, vjp = jax.vjp(kernel, q, k, v)
    want, vjp_ref = jax.vjp(
        lambda q, k, v: hs.sparse_attention_reference(q, k, v, idx, scale=scale), q, k, v
    )
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    for g, g_ref in zip(vjp(d_out), vjp_ref(d_out)):
        np.testing.assert_allclose(g, g_ref, rtol=2e-5, atol=2e-5)


def check_shared(q, kv, idx, d_out, Dv, interpret, **kw):
    """Output, dQ and dKV (value gradient included) against the f32 reference, within 2x the
    same-dtype reference's error plus the dtype's noise floor."""
    dtype = q.dtype
    out, vjp = jax.vjp(shared_kernel(idx, Dv, interpret, **kw), q, kv)
    want, vjp_ref = jax.vjp(reference(idx, Dv), q.astype(jnp.float32), kv.astype(jnp.float32))
    naive, vjp_naive = jax.vjp(reference(idx, Dv), q, kv)
    floor = NOISE_FLOOR[jnp.dtype(dtype)]
    assert out.dtype == dtype and out.shape == d_out.shape
    assert rel_err(out, want) <= 2 * rel_err(naive, want) + floor
    grads = vjp(d_out)
    for g, g_ref, g_naive, x in zip(
        grads, vjp_ref(d_out.astype(jnp.float32)), vjp_naive(d_out), (q, kv)
    ):
        assert g.dtype == x.dtype and g.shape == x.shape
        err, bound = rel_err(g, g_ref), 2 * rel_err(g_naive, g_ref) + floor
        assert err <= bound, (err, bound)
    return out, grads


def test_layout_of_the_papers_shapes():
    """MLA: 512 + 64 feature pieces, the value read from the key tile; the forward takes 64
    heads a program, the backward 16 a dQ program and 64 a key-gradient program (the split
    backward). The square D = Dv = 128 tile keeps one piece and all 64 heads in one program,
    forward and backward, and one backward kernel."""
    sizes = psa.BlockSizes()
    mla = psa._layout(128, 1, 576, 512, True, sizes)
    assert (mla.d_main, mla.d_tail, mla.dv, mla.width) == (512, 64, 512, 576)
    assert (mla.block_h, mla.head_blocks) == (64, 2)
    mla_bwd = psa._layout(128, 1, 576, 512, True, sizes, backward=True)
    assert (mla_bwd.block_h, mla_bwd.head_blocks, mla_bwd.block_h_dkv) == (16, 8, 64)
    assert mla_bwd.split_backward
    assert psa._layout(16, 1, 576, 512, True, sizes).block_h == 16  # capped at the heads
    for backward in (False, True):
        square = psa._layout(64, 1, 128, 128, False, sizes, backward)
        assert (square.d_main, square.d_tail, square.block_h, square.head_blocks) == (128, 0, 64, 1)
        assert not square.split_backward
    # A separate wide value keeps the 4-warp budget in the forward too: 32 heads at Dv = 256.
    assert psa._layout(64, 1, 256, 256, False, sizes).block_h == 32
    # Two pieces only where they pad less than one: 192 = 128 + 64, but 24 -> one 32 tile.
    assert psa._feature_split(192, None) == (128, 64)
    assert psa._feature_split(24, None) == (32, 0)
    assert psa._feature_split(100, None) == (128, 0)
    assert psa._feature_split(72, 64) == (64, 16)


# (B, T, S, H, D, Dv, K): two feature pieces (64 + 8 padded to 16), 32 heads in two programs,
# K spanning two 16-slot blocks and a partial one; a second shape with two batches and 20 heads
# (padded to 32).
MLA_SHAPES = [(1, 4, 37, 32, 72, 64, 37), (2, 3, 29, 20, 80, 64, 19)]
MLA_CASES = [
    (MLA_SHAPES[0], jnp.float32),
    (MLA_SHAPES[0], jnp.bfloat16),
    (MLA_SHAPES[1], jnp.bfloat16),
]


def mla_case_id(c):
    return "B{}T{}S{}H{}D{}Dv{}K{}".format(*c) if isinstance(c, tuple) else jnp.dtype(c).name


@pytest.mark.parametrize("shape,dtype", MLA_CASES, ids=mla_case_id)
def test_shared_value_interpret(shape, dtype):
    """Forward and the deterministic backward with v=None, value_dim=Dv."""
    q, kv, idx, d_out = mla_inputs(0, *shape, dtype)
    out, grads = check_shared(q, kv, idx, d_out, shape[5], True, block_sizes=SMALL)
    T = shape[1]
    assert not np.asarray(out[0, T // 2]).any() and not np.asarray(grads[0][0, T // 2]).any()


@needs_relaxed
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=mla_case_id)
@pytest.mark.parametrize("block_h_dkv", [None, 16], ids=["split", "single"])
def test_shared_value_atomic_backward_interpret(dtype, block_h_dkv):
    """The GPU's default backward. split (the default where heads span programs): dQ per
    16-head block, then one key-gradient program over all 32 heads adds their summed dK rows
    (value gradient in the main piece, tail separately) into the shared f32 buffers. single
    (block_h_dkv = block_h): each head block's backward adds its own rows."""
    shape = MLA_SHAPES[0]
    q, kv, idx, d_out = mla_inputs(1, *shape, dtype)
    sizes = dataclasses.replace(SMALL, block_h_dkv=block_h_dkv)
    lay = psa._layout(shape[3], 1, shape[4], shape[5], True, sizes, backward=True)
    assert lay.split_backward == (block_h_dkv is None)
    check_shared(q, kv, idx, d_out, shape[5], True, deterministic=False, block_sizes=sizes)


@needs_relaxed
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=mla_case_id)
def test_key_gradient_column_chunks_interpret(dtype):
    """The key-gradient kernel's column chunks: 16 wide, the 64-wide key and value piece runs
    as four chunks (their scores and dP summed, each chunk's rows added apart), at 32-key
    steps (two, over 37 slots padded to 64), 32 heads in one program."""
    shape = MLA_SHAPES[0]
    q, kv, idx, d_out = mla_inputs(6, *shape, dtype)
    sizes = dataclasses.replace(SMALL, block_k_dkv=32, dkv_chunk=16)
    lay = psa._layout(shape[3], 1, shape[4], shape[5], True, sizes, backward=True)
    assert lay.split_backward and lay.block_h_dkv == 32
    check_shared(q, kv, idx, d_out, shape[5], True, deterministic=False, block_sizes=sizes)


@needs_relaxed
@pytest.mark.parametrize(
    "G,D,Dv,extra",
    [
        (1, 72, 40, dict(dkv_chunk=32)),
        # two groups of 64 heads, each in two key-gradient programs of 32; a 32-wide main key
        # piece against a 16-wide value (two chunks against one); dQ's 32-key steps against
        # the key-gradient kernel's 16
        (2, 40, 16, dict(block_h_dkv=32, block_k_bwd=32, block_k_dkv=16, dkv_chunk=16)),
    ],
    ids=["one_group", "groups_and_uneven_blocks"],
)
def test_split_backward_with_separate_values_interpret(G, D, Dv, extra):
    """A separate value through the split backward (dQ per 16 heads, the key gradients per
    block_h_dkv heads): dV rows in their own column chunks, two key pieces (D = 72 = 64 + a
    16-padded tail, or 40 = 32 + 16-padded), invalid and repeated entries."""
    B, T, S, K = 1, 5, 23, 21
    H = 32 * G * G  # 32 heads in one group, or 2 groups of 64
    q, k, v, idx, d_out = inputs(7, B, T, S, H, G, D, Dv, K, jnp.float32)
    sizes = dataclasses.replace(SMALL, **extra)
    lay = psa._layout(H, G, D, Dv, False, sizes, backward=True)
    assert lay.split_backward and lay.heads // lay.block_h_dkv == G
    cfg = psa._Config(0.2, True, False, sizes)  # the atomic backward, in the interpreter

    def kernel(q, k, v):
        return psa._sparse_attention(q, k, v, idx, cfg)[0]

    assert_separate_values_match(kernel, q, k, v, idx, d_out, 0.2)


@needs_relaxed
@pytest.mark.parametrize("shape,dtype", MLA_CASES, ids=mla_case_id)
def test_split_backward_interpret(shape, dtype):
    """The GPU's default MLA backward at both shapes (20 heads padded to 32, two batches):
    delta from the delta kernel (f32 P dP from the saved log-sum-exp, in the forward's layout),
    then one sweep of 16-head dQ programs and the key-gradient kernel (32-key steps)."""
    q, kv, idx, d_out = mla_inputs(8, *shape, dtype)
    sizes = dataclasses.replace(SMALL, block_k_dkv=32)
    assert psa._layout(shape[3], 1, shape[4], shape[5], True, sizes, backward=True).split_backward
    check_shared(q, kv, idx, d_out, shape[5], True, deterministic=False, block_sizes=sizes)


def check_keys_sharing_a_large_vector(q, kv, idx, d_out, Dv, interpret, sizes):
    """Keys that share a large vector (10x their own spread) give dP a large mean over the
    keys, so delta is large and any error in it reaches dQ times sum_j P_j K_j. The split
    backward's dQ and dKV at `sizes` against the f32 reference, within 2x the deterministic
    backward's error (its delta also summed from f32 P dP) plus the dtype's noise. A delta of
    dO . o, with o recomputed from bf16 probabilities, put dQ 6-8x off it (docs/performance.md)."""
    kv = kv.astype(jnp.float32) + 10 * jax.random.normal(jax.random.key(0), (kv.shape[-1],))
    kv = kv.astype(q.dtype)
    _, vjp_ref = jax.vjp(reference(idx, Dv), q.astype(jnp.float32), kv.astype(jnp.float32))
    want = vjp_ref(d_out.astype(jnp.float32))
    errors = {}
    for deterministic in (False, True):
        kernel = shared_kernel(idx, Dv, interpret, deterministic=deterministic, block_sizes=sizes)
        grads = jax.vjp(kernel, q, kv)[1](d_out)
        errors[deterministic] = [rel_err(g, g_ref) for g, g_ref in zip(grads, want)]
    floor = NOISE_FLOOR[jnp.dtype(q.dtype)]
    for split, sorted_sum in zip(errors[False], errors[True]):
        assert split <= 2 * sorted_sum + floor, errors


@needs_relaxed
def test_split_backward_where_keys_share_a_large_vector_interpret():
    """The split backward's delta kernel sums f32 P dP, so dQ keeps the deterministic
    backward's precision where every key carries one large shared vector."""
    shape = MLA_SHAPES[0]
    q, kv, idx, d_out = mla_inputs(15, *shape, jnp.bfloat16)
    sizes = dataclasses.replace(SMALL, block_k_dkv=32)
    assert psa._layout(shape[3], 1, shape[4], shape[5], True, sizes, backward=True).split_backward
    check_keys_sharing_a_large_vector(q, kv, idx, d_out, shape[5], True, sizes)


@needs_relaxed
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
def test_split_backward_never_reads_unnamed_rows_interpret(poison):
    """Masked-load gathers (forward, delta and dQ kernels) and the key-gradient kernel: NaN or
    inf in rows no valid entry names (row 0, where invalid entries are clamped, and rows 1, 2
    and S-1) changes no output or gradient bit, and those rows' own gradients stay zero."""
    shape = MLA_SHAPES[1]  # 20 heads padded to 32, two batches, an empty row
    q, kv, _, d_out = mla_inputs(9, *shape, jnp.bfloat16)
    B, T, S, *_, Dv, K = shape
    idx = poisoned_index_rows(9, B, T, S, K)  # valid entries name keys 3 .. S-2 only
    unnamed = np.array([0, 1, 2, S - 1])
    poisoned = kv.at[:, unnamed].set(poison)
    sizes = dataclasses.replace(SMALL, block_k_dkv=32)
    f = shared_kernel(idx, Dv, True, deterministic=False, block_sizes=sizes)

    def run(kv_in):
        out, vjp = jax.vjp(f, q, kv_in)
        return (out, *vjp(d_out))

    clean, dirty = run(kv), run(poisoned)
    for a, b in zip(clean[:2], dirty[:2]):  # out, dQ
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    dkv_clean, dkv_dirty = (np.asarray(x, np.float32) for x in (clean[2], dirty[2]))
    np.testing.assert_array_equal(dkv_dirty, dkv_clean)
    assert not dkv_dirty[:, unnamed].any()


@both_backwards
def test_forward_and_backward_head_blocks_differ_interpret(deterministic):
    """The forward runs all 32 heads in one program and the backward splits them into 16-head
    dQ programs (as MLA's defaults do at 64 and 16): the saved log-sum-exp is per head, so
    either layout reads it."""
    shape = MLA_SHAPES[0]
    q, kv, idx, d_out = mla_inputs(5, *shape, jnp.bfloat16)
    sizes = dataclasses.replace(SMALL, block_h=32)
    assert psa._layout(shape[3], 1, shape[4], shape[5], True, sizes).head_blocks == 1
    bwd = psa._layout(shape[3], 1, shape[4], shape[5], True, sizes, backward=True)
    assert (bwd.head_blocks, bwd.split_backward) == (2, True)
    check_shared(q, kv, idx, d_out, shape[5], True, deterministic=deterministic, block_sizes=sizes)


@both_backwards
def test_shared_value_trailing_padding_interpret(deterministic):
    B, T, S, H, D, Dv, K = 1, 12, 40, 16, 72, 64, 48
    q, kv, _, d_out = mla_inputs(2, B, T, S, H, D, Dv, K, jnp.float32)
    idx = causal_padded_idx(3, B, T, S, K)
    check_shared(q, kv, idx, d_out, Dv, True, deterministic=deterministic, block_sizes=SMALL)


def test_two_pieces_with_separate_values_and_groups_interpret():
    """D = 72 in two pieces with a separate v (Dv = 40), G = 2 groups of 32 heads, each group
    in two head blocks: the grid's (query, head block, group) mapping."""
    B, T, S, H, G, D, Dv, K = 1, 3, 23, 64, 2, 72, 40, 21
    q, k, v, idx, d_out = inputs(4, B, T, S, H, G, D, Dv, K, jnp.float32)
    assert psa._layout(H, G, D, Dv, False, SMALL).head_blocks == 2

    def kernel(q, k, v):
        return psa.sparse_attention(q, k, v, idx, scale=0.2, interpret=True, block_sizes=SMALL)

    assert_separate_values_match(kernel, q, k, v, idx, d_out, 0.2)


@pytest.mark.parametrize("impl", ["reference", "xla", "interpret"])
def test_public_value_dim_equals_explicit_value(impl):
    """hs.sparse_attention(q, kv, None, idx, value_dim=Dv) is attention with v = kv[..., :Dv],
    gradients included (the value's gradient lands in dKV); a value_dim that is not a power of
    two (24) runs as a sliced copy. (interpret: the sliced copy only; the shared tile is
    tested above.)"""
    for D, Dv in ((72, 64), (40, 24))[impl == "interpret" :]:
        q, kv, idx, d_out = mla_inputs(5, 1, 3, 19, 4, D, Dv, 11, jnp.float32)

        def shared(q, kv):
            return hs.sparse_attention(q, kv, None, idx, value_dim=Dv, impl=impl)

        def explicit(q, kv):
            return hs.sparse_attention(q, kv, kv[..., :Dv], idx, impl=impl)

        out, vjp = jax.vjp(shared, q, kv)
        want, vjp_want = jax.vjp(explicit, q, kv)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        for g, g_want in zip(vjp(d_out), vjp_want(d_out)):
            np.testing.assert_allclose(g, g_want, rtol=2e-5, atol=2e-5)


def test_value_dim_errors():
    q, kv, idx, _ = mla_inputs(6, 1, 4, 9, 2, 24, 16, 5, jnp.float32)
    with pytest.raises(ValueError, match="either v .* or value_dim"):
        hs.sparse_attention(q, kv, None, idx)
    with pytest.raises(ValueError, match="either v .* or value_dim"):
        hs.sparse_attention(q, kv, kv, idx, value_dim=16)
    with pytest.raises(ValueError, match=r"value_dim must be in \[1, D=24\]"):
        hs.sparse_attention(q, kv, None, idx, value_dim=25)
    with pytest.raises(TypeError, match="value_dim must be an int"):
        hs.sparse_attention(q, kv, None, idx, value_dim=16.0)


def test_shared_value_residuals_are_q_kv_indices_and_lse():
    """With v=None nothing value-shaped is saved: q, kv, idx and the f32 [B, T, H] statistic."""
    B, T, S, H, D, Dv, K = 1, 6, 24, 32, 72, 64, 24
    q, kv, idx, _ = mla_inputs(7, B, T, S, H, D, Dv, K, jnp.bfloat16)
    res = saved_residuals(shared_kernel(idx, Dv, True, block_sizes=SMALL), q, kv)
    shapes = {(tuple(a.shape), str(a.dtype)) for a, _ in res}
    allowed = {(tuple(x.shape), str(x.dtype)) for x in (q, kv, idx)} | {((B, T, H), "float32")}
    assert shapes <= allowed and ((B, T, H), "float32") in shapes, shapes


def mla_gradient_for_cuda(heads, deterministic, block_sizes=None) -> str:
    """The MLA gradient (D = 576, value_dim = 512, 64 queries over 300 keys, k = 256) lowered
    for CUDA on any host: the StableHLO text with its Triton calls."""
    q = jax.ShapeDtypeStruct((1, 64, heads, 576), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 1, 576), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, 64, 256), jnp.int32)

    def loss(q, kv, idx):
        out = psa.sparse_attention(
            q,
            kv,
            None,
            idx,
            scale=0.1,
            value_dim=512,
            deterministic=deterministic,
            block_sizes=block_sizes,
        )
        return jnp.sum(out.astype(jnp.float32))

    return lower_for_cuda(jax.grad(loss, argnums=(0, 1)), q, kv, idx).as_text()


def triton_launches(text: str) -> dict:
    """Kernel name -> (num_stages, num_warps) of each Triton call in lowered text."""
    return {
        name: (int(stages), int(warps))
        for name, stages, warps in re.findall(
            r'name = "([^"]+)".*?num_stages = (\d+) : i32, num_warps = (\d+)', text
        )
    }


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("heads", [64, 128])
def test_mla_shape_lowers_to_triton(heads, deterministic):
    """The paper's shape (D = 576, value_dim = 512, 64 or 128 heads) lowers to Triton on CPU:
    the forward and its backward kernels, and no 1024-wide (padded) feature tile."""
    text = mla_gradient_for_cuda(heads, deterministic)
    names = ["sparse_attn_fwd"] + (
        ["sparse_attn_bwd_rows", "sparse_attn_bwd_keysum"]
        if deterministic
        # delta in the forward's layout, then 16-head dQ and 64-head key-gradient programs
        else ["sparse_attn_bwd_delta", "sparse_attn_bwd_dq", "sparse_attn_bwd_dkv"]
    )
    assert text.count("xla.gpu.triton") == len(names)
    for name in names:
        assert name in text, name
    assert "x1024x" not in text and "1024xbf16" not in text
    # The forward's launch: 64 heads a program on 8 warps, 5 pipelining stages.
    grid, stages, warps = re.search(
        r"grid_x = (\d+) .*?num_stages = (\d+) .*?num_warps = (\d+)", text
    ).groups()
    assert (int(grid), int(stages), int(warps)) == (64 * heads // 64, 5, 8)
    if not deterministic:  # the key-gradient kernel: 64 heads a program, 8 warps, 1 stage
        launches = triton_launches(text)
        assert launches["sparse_attn_bwd_dkv"] == (1, 8), launches
        # the key-major dQ kernel: 16 heads a program on 4 warps, 4 pipelining stages
        assert launches["sparse_attn_bwd_dq"] == (4, 4), launches
        # the delta kernel: dO resident beside q, 3 stages on 4 warps
        assert launches["sparse_attn_bwd_delta"] == (3, 4), launches


def test_forward_launch_overrides_leave_the_delta_kernel_alone():
    """BlockSizes.num_stages / num_warps set the forward's launch only: the delta kernel keeps
    its own (the forward's 5 stages would not fit beside its resident dO)."""
    sizes = psa.BlockSizes(num_stages=4, num_warps=4)
    launches = triton_launches(mla_gradient_for_cuda(64, False, sizes))
    assert launches["sparse_attn_fwd"] == (4, 4), launches
    assert launches["sparse_attn_bwd_delta"] == (3, 4), launches


def test_dq_step_fits_shared_memory():
    """The split backward's dQ kernel steps 64 selected keys (the rows of its `wgmma`
    matmuls) unless one step's gathered rows would exceed 96 KiB: a separate 512-wide value
    beside 576-wide keys asks for 316,160 bytes of shared memory at 64 keys (sm_90 compile), more
    than a Hopper program has, so it steps 32. An explicit block_k_dq is taken as given."""
    sizes = psa.BlockSizes()

    def step(D, Dv, shared, dtype, K=2048, sizes=sizes):
        lay = psa._layout(64, 1, D, Dv, shared, sizes, backward=True)
        assert lay.split_backward
        return psa._dq_block(sizes, lay, K, dtype)

    assert step(576, 512, True, jnp.bfloat16) == 64  # MLA's absorbed shape: 72 KiB a step
    assert step(256, 512, False, jnp.bfloat16) == 64  # 96 KiB: 224,000 bytes in all
    assert step(576, 512, False, jnp.bfloat16) == 32
    assert step(576, 512, True, jnp.float32) == 32
    assert step(576, 512, False, jnp.bfloat16, sizes=psa.BlockSizes(block_k_dq=64)) == 64
    assert step(576, 512, True, jnp.bfloat16, K=20) == 32  # never past the padded row


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas-Triton kernels need a GPU")
class TestCompiledGPU:
    """The compiled kernels at the paper's shapes (default BlockSizes): GLM-5.1's 64 and
    DeepSeek-V3.2's 128 heads of D = 576 over one shared 576-wide key, value = its first 512."""

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
    @pytest.mark.parametrize("heads", [64, 128])
    def test_matches_reference(self, heads, deterministic):
        q, kv, idx, d_out = mla_inputs(8, 1, 128, 512, heads, 576, 512, 256, jnp.bfloat16)
        check_shared(q, kv, idx, d_out, 512, False, deterministic=deterministic)

    @pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
    def test_trailing_padding_and_awkward_sizes(self, deterministic):
        B, T, S, H, D, Dv, K = 1, 200, 300, 20, 72, 64, 160
        q, kv, _, d_out = mla_inputs(9, B, T, S, H, D, Dv, K, jnp.bfloat16)
        idx = causal_padded_idx(10, B, T, S, K)
        check_shared(q, kv, idx, d_out, Dv, False, deterministic=deterministic)

    @pytest.mark.parametrize(
        "heads, D, Dv", [(64, 576, 512), (20, 72, 64)], ids=["mosaic_forward", "triton_forward"]
    )
    def test_return_lse_matches_reference(self, heads, D, Dv):
        """The compiled forward's log-sum-exps, as `return_lse` converts them (base 2 to natural),
        against the reference impl's: at D = 576 the Mosaic GPU forward's, at D = 72 the
        Triton forward's (on Hopper)."""
        q, kv, idx, _ = mla_inputs(13, 2, 96, 300, heads, D, Dv, 100, jnp.bfloat16)
        got = hs.sparse_attention(q, kv, None, idx, impl="pallas", value_dim=Dv, return_lse=True)
        want = hs.sparse_attention(
            q, kv, None, idx, impl="reference", value_dim=Dv, return_lse=True
        )
        np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
        assert np.isinf(np.asarray(got[1][0, 96 // 2])).all()  # the empty row
        finite = np.isfinite(np.asarray(want[1]))
        np.testing.assert_allclose(
            np.asarray(got[1])[finite], np.asarray(want[1])[finite], rtol=1e-5, atol=1e-5
        )

    def test_split_backward_at_awkward_sizes(self):
        """The split backward (16-head dQ programs, one key-gradient program for all 40 heads
        padded to 64) with 300 selected keys padded to 384 (three 128-key steps) and trailing
        -1 rows."""
        B, T, S, H, D, Dv, K = 1, 160, 700, 40, 576, 512, 300
        assert psa._layout(H, 1, D, Dv, True, psa.BlockSizes(), backward=True).split_backward
        q, kv, _, d_out = mla_inputs(11, B, T, S, H, D, Dv, K, jnp.bfloat16)
        idx = causal_padded_idx(12, B, T, S, K)
        check_shared(q, kv, idx, d_out, Dv, False, deterministic=False)

    def test_split_backward_where_keys_share_a_large_vector(self):
        """64 heads of 576 over keys sharing a large vector: the default split backward within
        2x of the deterministic backward's error (`check_keys_sharing_a_large_vector`)."""
        q, kv, idx, d_out = mla_inputs(16, 1, 128, 512, 64, 576, 512, 256, jnp.bfloat16)
        check_keys_sharing_a_large_vector(q, kv, idx, d_out, 512, False, psa.BlockSizes())

    @staticmethod
    def poisoned_mla_inputs(heads, D, kernel):
        """MLA operands for the Mosaic GPU `kernel` ("forward" or "dq"): two batches, awkward
        T, S and K (100 indices, padded to 32-key blocks), `heads` heads (40: padded to 64) of
        D features (576; 512: the dQ kernel's one column matmul a consumer),
        -1, out-of-range and repeated entries, an empty row, and NaN / inf in every key row no
        valid entry names (every fifth key: its entries become -1). Skips where the kernel
        cannot run. -> (q, kv, poisoned kv, idx, d_out, Dv)."""
        from pallas_kernels import sparse_attention_mosaic as psm

        B, T, S, Dv, K = 2, 150, 333, 512, 100
        q, kv, idx, d_out = mla_inputs(17, B, T, S, heads, D, Dv, K, jnp.bfloat16)
        idx = jnp.where((idx >= 0) & (idx < S) & (idx % 5 == 0), -1, idx)
        reason = psm.unsupported_reason(kv.shape, q.dtype, K, Dv, kernel)
        if reason:
            pytest.skip(f"the Mosaic GPU {kernel} kernel needs {reason}")
        named = np.zeros((B, S), bool)
        ids = np.asarray(idx)
        for b in range(B):
            named[b, ids[b][(ids[b] >= 0) & (ids[b] < S)]] = True
        assert (~named).sum() > 10
        poison = np.where(np.arange(S) % 2, np.nan, np.inf)[None, :, None, None]
        poisoned = jnp.where(jnp.asarray(named)[..., None, None], kv, poison.astype(np.float32))
        return q, kv, poisoned.astype(kv.dtype), idx, d_out, Dv

    @pytest.mark.parametrize("heads, D", [(64, 576), (40, 576), (64, 512)])
    def test_mosaic_forward_matches_the_triton_forward(self, heads, D):
        """The Mosaic GPU forward (`BlockSizes(forward_kernel="mosaic")`) against the Triton
        forward and the f32 reference on `poisoned_mla_inputs` (the poison reaches neither)."""
        q, _, poisoned, idx, _, Dv = self.poisoned_mla_inputs(heads, D, "forward")

        def forward(kernel):
            cfg = psa._Config(D**-0.5, False, False, psa.BlockSizes(forward_kernel=kernel), Dv)
            return jax.jit(lambda q, kv: psa._forward(q, kv, None, idx, cfg))(q, poisoned)

        (out, lse), (out_t, lse_t) = forward("mosaic"), forward("triton")
        want = reference(idx, Dv)(q.astype(jnp.float32), poisoned.astype(jnp.float32))
        assert bool(jnp.all(jnp.isfinite(out)))
        assert rel_err(out, want) <= 2 * rel_err(out_t, want) + NOISE_FLOOR[jnp.dtype(q.dtype)]
        finite = np.isfinite(np.asarray(lse_t))
        assert (np.isfinite(np.asarray(lse)) == finite).all() and not finite.all()
        np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_t)[finite], atol=1e-4)
        assert bool(jnp.all(out[~jnp.asarray(finite)] == 0))

    @pytest.mark.parametrize("heads, D", [(64, 576), (40, 576), (64, 512)])
    def test_mosaic_dq_matches_the_triton_dq(self, heads, D):
        """The Mosaic GPU dQ kernel (`BlockSizes(dq_kernel="mosaic")`) in the atomic split
        backward against the Triton dQ kernel and the f32 reference's dQ on
        `poisoned_mla_inputs`, random cotangents: dQ finite (the poison reaches no gradient of
        a valid row), zero on the empty row, and within twice the Triton kernel's error."""
        q, kv, poisoned, idx, d_out, Dv = self.poisoned_mla_inputs(heads, D, "dq")
        scale = D**-0.5

        def grads(kernel):
            """dQ with BlockSizes(dq_kernel=kernel), and the Mosaic GPU kernels it launched."""
            sizes = psa.BlockSizes(dq_kernel=kernel)

            def loss(q):
                out = psa.sparse_attention(
                    q, poisoned, None, idx, scale=scale, value_dim=Dv, block_sizes=sizes
                )
                return jnp.vdot(out.astype(jnp.float32), d_out.astype(jnp.float32))

            fn = jax.jit(jax.grad(loss))
            return fn(q), fn.lower(q).as_text().count("custom_call @mosaic_gpu")

        (dq, launched), (dq_t, launched_t) = grads("mosaic"), grads("triton")
        assert launched == launched_t + 1  # the dQ kernel, beside whichever forward runs

        def ref_loss(q):  # the clean keys: the poisoned rows are named by no valid entry
            out = reference(idx, Dv)(q, kv.astype(jnp.float32))
            return jnp.vdot(out, d_out.astype(jnp.float32))

        want = jax.grad(ref_loss)(q.astype(jnp.float32))
        assert dq.dtype == q.dtype and dq.shape == q.shape
        assert bool(jnp.all(jnp.isfinite(dq)))
        empty = ~np.asarray(((idx >= 0) & (idx < poisoned.shape[1])).any(-1))
        assert empty.any() and bool(jnp.all(dq[jnp.asarray(empty)] == 0))
        assert rel_err(dq, want) <= 2 * rel_err(dq_t, want) + NOISE_FLOOR[jnp.dtype(q.dtype)]

    def test_split_backward_with_separate_values(self):
        """A separate 512-wide value: 16-head dQ programs, 32-head key-gradient programs whose
        dV rows run in their own 64-wide column chunks."""
        B, T, S, H, D, Dv, K = 1, 96, 400, 64, 256, 512, 200
        assert psa._layout(H, 1, D, Dv, False, psa.BlockSizes(), backward=True).split_backward
        q, k, v, idx, d_out = inputs(13, B, T, S, H, 1, D, Dv, K, jnp.bfloat16)
        check_against_reference(q, k, v, idx, d_out, False, deterministic=False)
