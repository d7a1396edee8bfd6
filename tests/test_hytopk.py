"""Exactness of selection (docs/design.md, "Tie rule") for every impl that runs here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hyscale_jax as hs
from hyscale_jax import reference
from tests.helpers import KERNEL_IMPL, key_ordered, topk_oracle

# Interpret-mode Pallas joins this list in tests/test_hytopk_pallas.py.
IMPLS = ["reference", "xla"]
DTYPES = [jnp.float32, jnp.bfloat16]


def small_int_inputs(rng, B, T, S, HI, DI, dtype, lo=-2, hi=2):
    """Integer-valued inputs: every score is an exactly representable integer, ties abound."""
    q = rng.integers(lo, hi + 1, (B, T, HI, DI))
    k = rng.integers(lo, hi + 1, (B, S, DI))
    w = rng.integers(-1, 3, (B, T, HI))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


def run(impl, q, k, w, topk, causal, blocks=None):
    kwargs = {}
    if impl == "xla" and blocks is not None:
        kwargs = dict(block_q=blocks[0], block_k=blocks[1])
    return np.asarray(hs.hytopk(q, k, w, k=topk, causal=causal, impl=impl, **kwargs))


@pytest.mark.parametrize("impl", IMPLS)
@given(data=st.data())
def test_matches_oracle_on_heavy_ties(impl, data):
    B = data.draw(st.integers(1, 2), label="B")
    T = data.draw(st.integers(1, 19), label="T")
    causal = data.draw(st.booleans(), label="causal")
    S = data.draw(st.integers(T if causal else 1, 37), label="S")
    HI = data.draw(st.integers(1, 4), label="HI")
    DI = data.draw(st.sampled_from([1, 3, 8]), label="DI")
    topk = data.draw(st.integers(1, S + 5), label="k")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    blocks = (data.draw(st.sampled_from([1, 4, 7, 16])), data.draw(st.sampled_from([1, 5, 8, 32])))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, w = small_int_inputs(np.random.default_rng(seed), B, T, S, HI, DI, dtype)
    got = run(impl, q, k, w, topk, causal, blocks)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))


@pytest.mark.parametrize("impl", IMPLS)
def test_adversarial_values(impl):
    """All-equal scores, a few huge ones, NaN and -inf keys, NaN query rows."""
    rng = np.random.default_rng(1)
    B, T, S, HI, DI, topk = 2, 13, 29, 3, 5, 9
    q, k, w = (np.array(x, np.float32) for x in small_int_inputs(rng, B, T, S, HI, DI, jnp.float32))
    q[0] = 0.0  # batch 0: every score is 0, pure tie-breaking by index
    # Huge scores (~1e30). A power of two: its logits and head sums are small-integer
    # multiples of it, exact in f32 in any summation order (1e30's are not).
    k[1, 3] = 2.0**100
    k[1, 7] = np.nan  # NaN key: never selected
    w[1, 2, :] = -np.inf  # -inf weights: scores of -inf or NaN in row 2
    q[1, 5, 0, 0] = np.nan  # NaN query: its whole row is unselectable -> all -1
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    for causal in (True, False):
        got = run(impl, *args, topk, causal, blocks=(4, 8))
        want = topk_oracle(q, k, w, topk, causal)
        np.testing.assert_array_equal(got, want)
    assert (want[1, 5] == -1).all() and not (want == 7)[1].any()


@pytest.mark.parametrize("scaled", [False, True], ids=["no_scale", "k_scale"])
def test_reference_builds_one_table_per_batch_element_past_the_limit(scaled, monkeypatch):
    """Where [B, T, S] reaches TABLE_ENTRIES_LIMIT, topk_reference maps over the batch (one
    [T, S] table at a time) and selects exactly what the batched table does: tie-heavy
    integer scores, a NaN key, k > S, power-of-two key scales."""
    rng = np.random.default_rng(3)
    B, T, S, HI, DI, topk = 3, 11, 17, 2, 4, 20
    q, k, w = small_int_inputs(rng, B, T, S, HI, DI, jnp.float32)
    k = k.at[1, 5].set(jnp.nan)
    k_scale = jnp.asarray(2.0 ** rng.integers(-2, 3, (B, S)), jnp.float32) if scaled else None
    want = topk_oracle(q, k, w, topk, True, k_scale)

    def select(q, k, w):
        return hs.topk_reference(q, k, w, k=topk, k_scale=k_scale)

    monkeypatch.setattr(reference, "TABLE_ENTRIES_LIMIT", B * T * S)
    one_table, batched_table = f"f32[1,{T},{S}]", f"f32[{B},{T},{S}]"

    def jaxpr():  # a new function each time: make_jaxpr caches traces by function
        return str(jax.make_jaxpr(lambda *args: select(*args))(q, k, w))

    assert one_table in jaxpr() and batched_table not in jaxpr()  # the per-element path ran
    np.testing.assert_array_equal(np.asarray(select(q, k, w)), want)
    monkeypatch.setattr(reference, "TABLE_ENTRIES_LIMIT", B * T * S + 1)
    assert batched_table in jaxpr() and one_table not in jaxpr()
    np.testing.assert_array_equal(np.asarray(select(q, k, w)), want)


@pytest.mark.parametrize("impl", IMPLS)
def test_more_slots_than_keys_pads_with_minus_one(impl):
    q, k, w = small_int_inputs(np.random.default_rng(2), 1, 5, 6, 2, 4, jnp.float32)
    got = run(impl, q, k, w, 9, True)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, 9, True))
    assert (got[0, 0, 2:] == -1).all()  # query 0 sees keys 0..1 only


@pytest.mark.parametrize("impl", [*IMPLS, KERNEL_IMPL])
def test_index_order_is_the_selection_by_key_index(impl):
    """order="index": the same keys as the tie rule's selection, ascending, then the -1 slots;
    with heavy ties, NaN keys (never selected) and rows that see fewer than k keys."""
    B, T, S, HI, DI, topk = 2, 21, 70, 2, 8, 30
    q, k, w = (
        np.array(x, np.float32)
        for x in small_int_inputs(np.random.default_rng(4), B, T, S, HI, DI, jnp.float32)
    )
    k[1, 5:40] = np.nan  # batch 1: rows t < 15 see fewer than 30 real keys
    q, k, w = (jnp.asarray(x) for x in (q, k, w))
    got = np.asarray(hs.hytopk(q, k, w, k=topk, impl=impl, order="index"))
    want = topk_oracle(q, k, w, topk, True)
    assert (want[1] == -1).any() and (want[0] >= 0).all()
    np.testing.assert_array_equal(got, key_ordered(want))


def test_bad_order():
    q, k, w = small_int_inputs(np.random.default_rng(2), 1, 5, 6, 2, 4, jnp.float32)
    for select in (hs.hytopk, hs.topk_reference):
        with pytest.raises(ValueError, match="order='desc' is not one of 'score', 'index'"):
            select(q, k, w, k=2, order="desc")


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_floats_match_reference_up_to_near_ties(dtype):
    """On arbitrary floats a different f32 summation order may flip a near-tie, nothing more."""
    rng = np.random.default_rng(3)
    B, T, S, HI, DI, topk = 2, 45, 77, 4, 16, 11
    q = jnp.asarray(rng.normal(size=(B, T, HI, DI)), dtype)
    k = jnp.asarray(rng.normal(size=(B, S, DI)), dtype)
    w = jnp.asarray(rng.normal(size=(B, T, HI)), dtype)
    ref = np.asarray(hs.topk_reference(q, k, w, k=topk))
    got = run("xla", q, k, w, topk, True, blocks=(16, 32))
    scores = np.asarray(hs.reference.indexer_score_table(q, k, w)[0])
    rows_ref = np.take_along_axis(scores, np.maximum(ref, 0), -1)
    rows_got = np.take_along_axis(scores, np.maximum(got, 0), -1)
    np.testing.assert_array_equal(got == -1, ref == -1)
    tol = 1e-5 * np.abs(scores).max()
    np.testing.assert_allclose(rows_got, rows_ref, rtol=0, atol=tol)
    assert (got == ref).mean() > 0.99


@pytest.mark.parametrize("causal", [True, False])
def test_xla_block_sizes_agree_with_reference(causal):
    """The streaming path's blocking changes only the order in which it merges key blocks:
    query/key blocks that divide T and S or not, down to single keys and up to all of them,
    give the reference's selection index for index on inputs where most scores tie."""
    q, k, w = small_int_inputs(np.random.default_rng(4), 2, 40, 67, 3, 4, jnp.float32, -1, 1)
    want = np.asarray(hs.topk_reference(q, k, w, k=24, causal=causal))
    assert len(np.unique(want)) > 24  # many distinct keys chosen, with heavy ties among them
    for blocks in [(1, 1), (8, 16), (7, 5), (40, 67), (16, 64), (3, 67)]:
        np.testing.assert_array_equal(run("xla", q, k, w, 24, causal, blocks), want, str(blocks))


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_xla_never_builds_the_score_table():
    """Peak temporaries of the streaming path are one query block's working set (its scores
    over one key block, and its candidates), not the table; the reference pays T*S."""
    B, T, S, HI, DI, topk = 1, 2048, 2048, 4, 32, 32
    shapes = (
        jax.ShapeDtypeStruct((B, T, HI, DI), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, S, DI), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, T, HI), jnp.bfloat16),
    )
    table_bytes = B * T * S * 4
    streaming = _temp_bytes(
        lambda q, k, w: hs.hytopk(q, k, w, k=topk, impl="xla", block_q=128, block_k=256), *shapes
    )
    materialized = _temp_bytes(lambda q, k, w: hs.topk_reference(q, k, w, k=topk), *shapes)
    assert materialized >= table_bytes
    assert streaming < table_bytes / 4, (streaming, table_bytes)


def test_auto_is_xla_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks the Pallas kernel on GPU")
    q, k, w = small_int_inputs(np.random.default_rng(5), 1, 9, 9, 2, 4, jnp.float32)
    np.testing.assert_array_equal(run("auto", q, k, w, 4, True), run("xla", q, k, w, 4, True))


def test_order_key_is_monotone_and_zeros_tie():
    from pallas_kernels.order_keys import INVALID_KEY, order_key

    ladder = np.array(
        [-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 1.5, 3e38, np.inf], np.float32
    )
    keys = np.asarray(order_key(jnp.asarray(ladder), True))
    assert keys[4] == keys[5]  # -0.0 and +0.0 are equal scores: they tie
    assert (np.diff(np.delete(keys, 4)) > 0).all()
    assert keys.min() > INVALID_KEY
    nan_and_hidden = order_key(jnp.asarray([np.nan, 1.0], jnp.float32), jnp.asarray([True, False]))
    assert (np.asarray(nan_and_hidden) == INVALID_KEY).all()
