"""FP8 indexer inputs and per-key scales (docs/design.md, "Indexer score"): every impl against
the float64 numpy oracle, index for index.

q_idx and k_idx are float8_e4m3fn small integers and k_scale holds powers of two or small
integers, so every score (head sum, then times the key's scale) is exact in f32 and ties
abound. The kernel runs in interpret mode on CPU with small tiles (short sequences span many
key blocks and compact mid-stream), compiled as in tests/test_hytopk_pallas.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs
from pallas_kernels import hytopk as phk
from tests.helpers import KERNEL_IMPL, lower_for_cuda, topk_oracle
from tests.test_hytopk_pallas import ON_GPU, UNSEEDED, run

FP8 = jnp.float8_e4m3fn
SEEDED = dataclasses.replace(UNSEEDED, seed_rate=4)


def fp8_inputs(seed, B, T, S, HI, DI, lo=-3, hi=3, scales="pow2"):
    """q [B,T,HI,DI] and k [B,S,DI] FP8 small integers, w [B,T,HI] f32 small integers, and
    k_scale [B,S] f32: powers of two 2**-3..2**3 ("pow2"), integers 1..5 ("int"), or None."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(lo, hi + 1, (B, T, HI, DI)), FP8)
    k = jnp.asarray(rng.integers(lo, hi + 1, (B, S, DI)), FP8)
    w = jnp.asarray(rng.integers(-1, 3, (B, T, HI)), jnp.float32)
    if scales == "pow2":
        k_scale = jnp.asarray(2.0 ** rng.integers(-3, 4, (B, S)), jnp.float32)
    elif scales == "int":
        k_scale = jnp.asarray(rng.integers(1, 6, (B, S)), jnp.float32)
    else:
        k_scale = None
    return q, k, w, k_scale


def select(impl, q, k, w, k_scale, topk, causal, bs=UNSEEDED):
    """The selection of `impl`; "kernel" is phk.hytopk with block sizes `bs`."""
    if impl == "kernel":
        return np.asarray(
            run(
                lambda q, k, w, s: phk.hytopk(
                    q, k, w, k=topk, causal=causal, k_scale=s, interpret=not ON_GPU, block_sizes=bs
                ),
                q,
                k,
                w,
                k_scale,
            )
        )
    kw = dict(block_q=5, block_k=16) if impl == "xla" else {}
    return np.asarray(hs.hytopk(q, k, w, k=topk, causal=causal, k_scale=k_scale, impl=impl, **kw))


# (B, T, S, HI, DI, k, causal, scales, value range, kernel block sizes): awkward T and S, k
# past the visible keys, heavy ties ({-1, 0, 1} values, two scales), seeded and not.
CASES = [
    (2, 21, 150, 3, 16, 12, True, "pow2", (-3, 3), SEEDED),
    (1, 19, 133, 2, 8, 30, False, "int", (-3, 3), UNSEEDED),
    (1, 33, 200, 4, 16, 40, True, "pow2", (-1, 1), SEEDED),
    (2, 7, 40, 3, 5, 50, True, "int", (-1, 1), UNSEEDED),
    (1, 17, 170, 2, 16, 20, True, None, (-2, 2), SEEDED),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "B{}T{}S{}k{}{}-{}".format(*c[:3], c[5], "cn"[not c[6]], c[7])
)
def test_every_impl_matches_oracle(case):
    B, T, S, HI, DI, topk, causal, scales, (lo, hi), bs = case
    q, k, w, k_scale = fp8_inputs(B + T + S + topk, B, T, S, HI, DI, lo, hi, scales)
    want = topk_oracle(q, k, w, topk, causal, k_scale)
    if k_scale is not None:  # the scales decide: without them the selection differs
        assert (topk_oracle(q, k, w, topk, causal) != want).any()
    for impl in ("reference", "xla", "kernel"):
        np.testing.assert_array_equal(select(impl, q, k, w, k_scale, topk, causal, bs), want, impl)


def test_nan_keys_queries_and_scales():
    """FP8 NaN in a key (never selected) and in a query element (its row all -1), -inf head
    weights (-inf or NaN scores), and a NaN scale passed under jit, where it cannot be checked:
    that key's scores are NaN, so it is never selected. e4m3fn holds no inf. (The kernel runs
    causal only: its non-causal masking is covered by test_every_impl_matches_oracle.)"""
    B, T, S, HI, DI, topk = 2, 20, 120, 3, 16, 24
    q, k, w, k_scale = fp8_inputs(7, B, T, S, HI, DI)
    q, k, w, k_scale = (np.array(x) for x in (q, k, w, k_scale))
    k[1, 7] = np.nan
    q[1, 5, 0, 0] = np.nan
    w[0, 3] = -np.inf
    k_scale[0, 11] = np.nan
    q, k, w, k_scale = (jnp.asarray(x) for x in (q, k, w, k_scale))
    for causal in (True, False):
        want = topk_oracle(q, k, w, topk, causal, k_scale)
        assert (want[1, 5] == -1).all() and not (want[1] == 7).any() and not (want[0] == 11).any()
        for impl in ("reference", "xla", "kernel") if causal else ("reference", "xla"):
            fn = jax.jit(lambda q, k, w, s, impl=impl: _traced(impl, q, k, w, s, topk, causal))
            got = np.asarray(fn(q, k, w, k_scale))
            np.testing.assert_array_equal(got, want, f"{impl} causal={causal}")


def _traced(impl, q, k, w, k_scale, topk, causal):
    if impl == "kernel":
        return phk.hytopk(
            q, k, w, k=topk, causal=causal, k_scale=k_scale, interpret=not ON_GPU,
            block_sizes=SEEDED,
        )  # fmt: skip
    return hs.hytopk(q, k, w, k=topk, causal=causal, k_scale=k_scale, impl=impl)


@pytest.mark.run_first
def test_no_scale_is_all_ones():
    """k_scale=None and k_scale=ones select the same indices on every impl (FP8; bf16 too for
    the reference and xla)."""
    q, k, w, _ = fp8_inputs(3, 1, 24, 90, 2, 16, -1, 1, scales=None)
    ones = jnp.ones(k.shape[:2], jnp.float32)
    want = topk_oracle(q, k, w, 30, True)
    for dtype in (FP8, jnp.bfloat16):
        qd, kd = q.astype(dtype), k.astype(dtype)
        for impl in ("reference", "xla", "kernel") if dtype == FP8 else ("reference", "xla"):
            plain = select(impl, qd, kd, w, None, 30, True, SEEDED)
            np.testing.assert_array_equal(plain, want, impl)
            np.testing.assert_array_equal(select(impl, qd, kd, w, ones, 30, True, SEEDED), plain)


def test_mixed_dtypes_and_public_kernel_dispatch():
    """FP8 meets bf16 / f32 operands (q and k may differ, w may be FP8), and hs.hytopk passes
    k_scale to the kernel at its default block sizes."""
    q, k, w, k_scale = fp8_inputs(5, 1, 25, 140, 4, 32, scales="int")
    want = topk_oracle(q, k, w, 16, True, k_scale)
    for qd, kd, wd in [(FP8, jnp.bfloat16, FP8), (jnp.float32, FP8, jnp.bfloat16)]:
        args = (q.astype(qd), k.astype(kd), w.astype(wd))
        for impl in ("reference", "xla"):
            got = hs.hytopk(*args, k=16, k_scale=k_scale, impl=impl)
            np.testing.assert_array_equal(np.asarray(got), want, f"{impl} {qd} {kd}")
    got = run(
        lambda q, k, w, s: hs.hytopk(q, k, w, k=16, k_scale=s, impl=KERNEL_IMPL), q, k, w, k_scale
    )
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("seed_rate", [16, 0])
def test_scaled_fp8_kernel_lowers_to_triton(seed_rate):
    """With k_scale (FP8 inputs), the seeded and unseeded kernels lower to Triton for CUDA."""
    args = (
        jax.ShapeDtypeStruct((2, 1000, 32, 128), FP8),
        jax.ShapeDtypeStruct((2, 3001, 128), FP8),
        jax.ShapeDtypeStruct((2, 1000, 32), jnp.float32),
        jax.ShapeDtypeStruct((2, 3001), jnp.float32),
    )
    bs = phk.BlockSizes(seed_rate=seed_rate)

    def f(q, k, w, s):
        return phk.hytopk(q, k, w, k=2048, causal=True, k_scale=s, block_sizes=bs)

    text = lower_for_cuda(f, *args).as_text()
    assert text.count("xla.gpu.triton") == 1 + bool(seed_rate)


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel: GPU only")
@pytest.mark.parametrize("seed_rate", [16, 0])
@pytest.mark.parametrize("scales", ["pow2", None])
def test_compiled_fp8_exact_vs_reference(seed_rate, scales):
    """The compiled kernel on FP8 inputs at production-like shapes, with and without scales."""
    q, k, w, k_scale = fp8_inputs(seed_rate, 1, 2048, 4096, 32, 128, -2, 2, scales)
    bs = phk.BlockSizes(seed_rate=seed_rate)
    got = select("kernel", q, k, w, k_scale, 2048, True, bs)
    want = hs.topk_reference(q, k, w, k=2048, causal=True, k_scale=k_scale)
    np.testing.assert_array_equal(got, np.asarray(want))


def test_layer_selects_with_the_scales():
    """hs.hyscale_attention passes FP8 indexer inputs and k_scale to the selection."""
    q_idx, k_idx, w, k_scale = fp8_inputs(9, 1, 12, 30, 2, 8, scales="int")
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, 2, 8)), jnp.float32) for n in (12, 30, 30))
    _, idx = hs.hyscale_attention(q, k, v, q_idx, k_idx, w, topk=6, k_scale=k_scale, impl="xla")
    np.testing.assert_array_equal(np.asarray(idx), topk_oracle(q_idx, k_idx, w, 6, True, k_scale))
    with pytest.raises(ValueError, match="k_scale must be"):
        hs.hyscale_attention(q, k, v, q_idx, k_idx, w, topk=6, k_scale=k_scale[:, :5])
