"""Bad input gets a ValueError/TypeError naming the argument, before any kernel runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs

f32, bf16 = jnp.float32, jnp.bfloat16


def sel(B=1, T=8, S=8, HI=2, DI=4, dtype=f32):
    return (
        jnp.zeros((B, T, HI, DI), dtype),
        jnp.zeros((B, S, DI), dtype),
        jnp.zeros((B, T, HI), dtype),
    )


def att(B=1, T=8, S=8, H=4, G=2, D=8, Dv=8, K=3, dtype=f32):
    return (
        jnp.zeros((B, T, H, D), dtype),
        jnp.zeros((B, S, G, D), dtype),
        jnp.zeros((B, S, G, Dv), dtype),
        jnp.zeros((B, T, K), jnp.int32),
    )


@pytest.mark.parametrize("fn", [hs.hytopk, hs.topk_reference])
@pytest.mark.parametrize(
    "args,kw,err,words",
    [
        (sel()[:1] + (jnp.zeros((1, 8, 4, 1)),) + sel()[2:], {}, ValueError, "k_idx"),
        ((jnp.zeros((1, 8, 4)),) + sel()[1:], {}, ValueError, "q_idx"),
        (sel()[:2] + (jnp.zeros((1, 8, 3)),), {}, ValueError, "w"),
        (sel()[:1] + (jnp.zeros((2, 8, 4)),) + sel()[2:], {}, ValueError, "k_idx"),
        (sel(), {"k": 0}, ValueError, "k=0"),
        (sel(), {"k": 2.0}, ValueError, "k=2.0"),
        (sel(T=9, S=8), {}, ValueError, "T=9"),
        (sel()[:2] + (jnp.zeros((1, 8, 2), jnp.int32),), {}, TypeError, "w"),
        ((jnp.zeros((1, 8, 2, 4), jnp.complex64),) + sel()[1:], {}, TypeError, "q_idx"),
    ],
)
def test_selection_bad_input(fn, args, kw, err, words):
    kw = {"k": 2, **kw}
    with pytest.raises(err, match=words):
        fn(*args, **kw)


def _scales(*shape, value=1.0, dtype=f32):
    return jnp.full(shape, value, dtype)


@pytest.mark.parametrize("fn", [hs.hytopk, hs.topk_reference])
@pytest.mark.parametrize(
    "args,kw,err,words",
    [
        (sel(), {"k_scale": _scales(1, 8, 1)}, ValueError, r"k_scale must be \[B, S\] = \(1, 8\)"),
        (sel(), {"k_scale": _scales(8)}, ValueError, r"got k_scale \(8,\)"),
        (sel(), {"k_scale": _scales(1, 9)}, ValueError, r"k_idx \(1, 8, 4\); got k_scale \(1, 9\)"),
        (sel(), {"k_scale": _scales(1, 8, dtype=jnp.int32)}, TypeError, "k_scale.*int32"),
        (sel(), {"k_scale": [[1.0] * 8]}, TypeError, "k_scale must be an array"),
        (sel(), {"k_scale": _scales(1, 8).at[0, 3].set(0.0)}, ValueError, r"k_scale\[0, 3\] = 0"),
        (sel(), {"k_scale": _scales(1, 8).at[0, 5].set(-2)}, ValueError, r"k_scale\[0, 5\] = -2"),
        (sel(), {"k_scale": _scales(1, 8).at[0, 6].set(jnp.nan)}, ValueError, "1 entries.*nan"),
        (sel(), {"k_scale": _scales(1, 8).at[0, 1].set(jnp.inf)}, ValueError, "positive finite"),
        (sel(dtype=jnp.float8_e5m2), {}, TypeError, "q_idx .*float8_e5m2"),
        (sel()[:1] + (jnp.zeros((1, 8, 4), jnp.float8_e4m3fnuz),) + sel()[2:], {}, TypeError,
         "k_idx .*float8_e4m3fnuz"),
        (sel()[:2] + (jnp.zeros((1, 8, 2), jnp.float8_e5m2),), {}, TypeError, "w .*float8_e5m2"),
    ],
)  # fmt: skip
def test_fp8_and_k_scale_bad_input(fn, args, kw, err, words):
    with pytest.raises(err, match=words):
        fn(*args, k=2, **kw)


def test_fp8_mixes_and_traced_scales_are_accepted():
    """float8_e4m3fn q_idx / k_idx / w, alone or mixed with bf16 and f32, and a k_scale under
    jit (its values cannot be checked there: they follow the NaN rule)."""
    q, k, w = sel()
    fp8 = jnp.float8_e4m3fn
    for dq, dk, dw in [(fp8, fp8, f32), (fp8, bf16, fp8), (f32, fp8, bf16)]:
        got = hs.hytopk(q.astype(dq), k.astype(dk), w.astype(dw), k=2, k_scale=_scales(1, 8))
        assert got.shape == (1, 8, 2)
    scaled = jax.jit(lambda s: hs.hytopk(q.astype(fp8), k, w, k=2, k_scale=s))
    assert scaled(_scales(1, 8, value=-1.0)).shape == (1, 8, 2)


def test_selection_non_causal_allows_more_queries_than_keys():
    assert hs.hytopk(*sel(T=9, S=4), k=2, causal=False).shape == (1, 9, 2)


@pytest.mark.parametrize("fn", [hs.sparse_attention, hs.sparse_attention_reference])
@pytest.mark.parametrize(
    "args,err,words",
    [
        (att(H=3, G=2), ValueError, "multiple of G"),
        (att()[:1] + (jnp.zeros((1, 8, 2, 7)),) + att()[2:], ValueError, "k must be"),
        (att()[:2] + (jnp.zeros((1, 9, 2, 8)),) + att()[3:], ValueError, "v must be"),
        (att()[:3] + (jnp.zeros((1, 7, 3), jnp.int32),), ValueError, "idx must be"),
        (att()[:3] + (jnp.zeros((1, 8, 3), jnp.float32),), TypeError, "idx"),
        (att()[:3] + (jnp.zeros((1, 8), jnp.int32),), ValueError, "idx must have rank 3"),
        ((jnp.zeros((1, 8, 4, 8), jnp.int32),) + att()[1:], TypeError, "q must be"),
        (att()[:2] + (jnp.zeros((1, 8, 2, 8), jnp.complex64),) + att()[3:], TypeError, "v must be"),
        ((jnp.zeros((8, 4, 8)),) + att()[1:], ValueError, "q must have rank 4"),
        (([[0.0]],) + att()[1:], TypeError, "q must be an array"),
        (att()[:3] + ([[[0]]],), TypeError, "idx must be an array"),
        (att(D=0), ValueError, "feature"),
        (att(Dv=0), ValueError, "feature"),
        (att(T=0), ValueError, "query"),
    ],
)
def test_attention_bad_input(fn, args, err, words):
    with pytest.raises(err, match=words):
        fn(*args)


IMPL_CALLS = [
    lambda impl: hs.hytopk(*sel(), k=2, impl=impl),
    lambda impl: hs.sparse_attention(*att(), impl=impl),
    lambda impl: hs.hyscale_attention(*att()[:3], *sel(), topk=2, impl=impl),
]


@pytest.mark.parametrize("fn", IMPL_CALLS)
def test_unknown_impl_lists_the_choices(fn):
    with pytest.raises(ValueError, match="'xla'"):
        fn("triton")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="impl='pallas' runs on a GPU")
@pytest.mark.parametrize("fn", IMPL_CALLS)
def test_pallas_off_gpu_says_what_to_use(fn):
    with pytest.raises(ValueError, match="impl='pallas'.*impl='interpret'"):
        fn("pallas")


@pytest.mark.parametrize("k", [np.int64(2), np.int32(2), jnp.int32(2)])
def test_numpy_and_jax_integer_k(k):
    np.testing.assert_array_equal(hs.hytopk(*sel(), k=k), hs.hytopk(*sel(), k=2))
    assert hs.hyscale_attention(*att()[:3], *sel(), topk=k)[1].shape == (1, 8, 2)


def test_layer_checks_shapes_between_attention_and_indexer():
    with pytest.raises(ValueError, match="same S"):
        hs.hyscale_attention(*att()[:3], *sel(S=9), topk=2)
    with pytest.raises(ValueError, match="q and q_idx"):
        hs.hyscale_attention(*att()[:3], *sel(T=4), topk=2)
    with pytest.raises(ValueError, match="topk must be a positive int; got topk=0"):
        hs.hyscale_attention(*att()[:3], *sel(), topk=0)


def test_selection_empty_heads_or_features():
    with pytest.raises(ValueError, match="head and feature"):
        hs.hytopk(*sel(DI=0), k=2)
    with pytest.raises(ValueError, match="head and feature"):
        hs.hytopk(*sel(HI=0), k=2)


def test_traced_scale_is_a_clear_type_error():
    q, k, v, idx = att()
    with pytest.raises(TypeError, match="scale must be a static"):
        jax.jit(lambda s: hs.sparse_attention(q, k, v, idx, scale=s))(0.5)


def test_indexer_loss_bad_input():
    q, k, _, idx = att()
    with pytest.raises(ValueError, match="q_idx"):
        hs.indexer_kl_loss(q, k, *sel(T=5))
    with pytest.raises(TypeError, match="idx"):
        hs.indexer_kl_loss(q, k, *sel(), idx.astype(jnp.float32))


# ----------------------------------------------------------------------------- scale


def _scale_calls():
    """Every public function that takes `scale`, as scale -> result (small f32 inputs)."""
    q, k, v, idx = att()
    q_idx, k_idx, w = sel()
    mesh = hs.parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    return {
        "sparse_attention": lambda s: hs.sparse_attention(q, k, v, idx, scale=s),
        "sparse_attention_reference": lambda s: hs.sparse_attention_reference(
            q, k, v, idx, scale=s
        ),
        "hyscale_attention": lambda s: hs.hyscale_attention(
            q, k, v, q_idx, k_idx, w, topk=2, scale=s
        ),
        "indexer_kl_loss dense": lambda s: hs.indexer_kl_loss(q, k, q_idx, k_idx, w, scale=s),
        "indexer_kl_loss sparse": lambda s: hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, scale=s),
        "parallel.hyscale_attention": lambda s: hs.parallel.hyscale_attention(
            q, k, v, q_idx, k_idx, w, topk=2, mesh=mesh, scale=s
        ),
        "parallel.indexer_kl_loss": lambda s: hs.parallel.indexer_kl_loss(
            q, k, q_idx, k_idx, w, idx, mesh=mesh, scale=s
        ),
    }


SCALE_CALLS = list(_scale_calls())


@pytest.mark.parametrize("name", SCALE_CALLS)
@pytest.mark.parametrize(
    "scale,err,words",
    [
        (float("nan"), ValueError, "scale must be a finite real number; got scale=nan"),
        (float("inf"), ValueError, "scale must be a finite real number; got scale=inf"),
        (-np.inf, ValueError, "got scale=-inf"),
        (np.float32("nan"), ValueError, "got scale=np.float32\\(nan\\)"),
        ("abc", TypeError, "scale must be a finite real number; got str 'abc'"),
        (1j, TypeError, "scale must be a finite real number; got complex 1j"),
        (True, TypeError, "got bool True"),
        (np.array([0.5]), TypeError, "scale must be a finite real number; got ndarray"),
    ],
)
def test_scale_must_be_a_finite_real_number(name, scale, err, words):
    with pytest.raises(err, match=words):
        _scale_calls()[name](scale)


@pytest.mark.parametrize("name", SCALE_CALLS)
def test_traced_scale_is_a_clear_type_error_everywhere(name):
    with pytest.raises(TypeError, match="scale must be a static Python number.*traced"):
        jax.jit(_scale_calls()[name])(0.5)


@pytest.mark.parametrize("scale", [2, np.int64(2), np.float32(2.0), jnp.float32(2.0)])
def test_numpy_and_concrete_jax_scalars_are_scales(scale):
    q, k, v, _ = att()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in (q, k, v))
    idx = jnp.asarray(rng.integers(0, 8, (1, 8, 3)), jnp.int32)
    want = hs.sparse_attention(q, k, v, idx, scale=2.0)
    np.testing.assert_array_equal(hs.sparse_attention(q, k, v, idx, scale=scale), want)


# ----------------------------------------------------------------------------- huge k

HUGE_K = 2**31 - 1


@pytest.mark.parametrize("impl", ["xla", "reference", "interpret"])
def test_huge_k_is_rejected_up_front(impl):
    words = "k=2147483647 is larger than the S=8 keys.*8589934588 elements"
    with pytest.raises(ValueError, match=words):
        hs.hytopk(*sel(B=1, T=4), k=HUGE_K, impl=impl)
    with pytest.raises(ValueError, match="topk=2147483647 is larger than the S=8 keys"):
        hs.hyscale_attention(*att()[:3], *sel(), topk=HUGE_K, impl=impl)


def test_huge_k_is_rejected_by_the_reference_and_the_sharded_op():
    with pytest.raises(ValueError, match="k=2147483647 is larger"):
        hs.topk_reference(*sel(B=1, T=4), k=HUGE_K)
    mesh = hs.parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="topk=2147483647 is larger"):
        hs.parallel.hyscale_attention(*att()[:3], *sel(), topk=HUGE_K, mesh=mesh)


def test_k_past_s_is_bounded_by_the_result_size():
    """k > S is fine while [B, T, k] stays within 2**31 - 1 elements, also for an empty batch."""
    assert hs.hytopk(*sel(B=0), k=HUGE_K).shape == (0, 8, HUGE_K)
    with pytest.raises(ValueError, match="k=2147483648 is larger"):
        hs.hytopk(*sel(B=0), k=HUGE_K + 1)
    with pytest.raises(ValueError, match="k=268435456 .* 2147483648 elements"):
        hs.hytopk(*sel(B=1, T=8), k=2**28)
