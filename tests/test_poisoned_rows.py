"""NaN and inf stored where no valid entry looks (docs/design.md, "Values jit cannot check").

An index entry outside [0, S) (-1 padding, S, -5, ...) is never read, a row with no valid entry
outputs zeros with zero gradients, and nothing stored in a key row that no valid entry names, or
in the query row of a row with no valid entry, reaches an output or a gradient. Every check runs
the same computation twice, on clean inputs and on inputs poisoned (NaN, +inf) only where no
valid entry looks, and asks for the same outputs and gradients (random cotangents), bit for bit
(the GPU kernels' f32 atomics aside): the poisoned values must not be read at all, so not even
the last bit may move.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs
from hyscale_jax import indexer_loss, parallel
from tests.helpers import topk_oracle

ON_GPU = jax.default_backend() == "gpu"
PALLAS = pytest.param(
    "pallas", marks=pytest.mark.skipif(not ON_GPU, reason="compiled Pallas kernels need a GPU")
)
ATTENTION_IMPLS = ["xla", "reference", "interpret", PALLAS]
LOSS_IMPLS = ["xla", "interpret", PALLAS]
POISONS = [np.nan, np.inf]

B, T, S, H, G, D, Dv, K = 2, 6, 11, 4, 2, 8, 4, 5
POISONED = (0, 7)  # key rows no valid entry names
EMPTY = (1, 3)  # (batch, query) whose entries are all invalid


def _normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def messy_indices(rng):
    """idx [B, T, K] over the keys outside POISONED, with -1 padding, out-of-range entries on
    both sides (S, S + 3, -5), a repeated key and one row (EMPTY) with no valid entry."""
    allowed = np.setdiff1d(np.arange(S), POISONED)
    idx = rng.choice(allowed, size=(B, T, K))
    idx[:, ::2, 0] = -1
    idx[:, 1::3, 1] = S
    idx[:, 2::3, 2] = -5
    idx[0, :, 4] = S + 3
    idx[1, 0, 3] = idx[1, 0, 4]  # a key named twice counts twice
    idx[EMPTY] = [-1, S, -5, S + 3, -1]
    return jnp.asarray(idx, jnp.int32)


def poison_rows(x, value, rows=POISONED):
    """x [B, S, ...] with `value` in rows `rows` of every batch element."""
    return x.at[:, jnp.asarray(rows)].set(value)


def assert_same(got, want, what, impl):
    """Bit for bit, except where f32 atomics sum dK/dV (dk_idx), whose order, and so whose
    last bits, changes from run to run: the compiled GPU kernels, and on a GPU the xla path's
    scatter-adds (XLA lowers them to atomics there)."""
    for name, g, w in zip(("out", "d0", "d1", "d2", "d3", "d4"), got, want):
        g, w, msg = np.asarray(g), np.asarray(w), f"{what}: {name}"
        if impl == "pallas" or (impl == "xla" and ON_GPU):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=msg)
        else:
            np.testing.assert_array_equal(g, w, err_msg=msg)


def value_and_grads(f, args, cotangent):
    """f(*args) and the gradients of sum(f(*args) * cotangent) in every argument."""
    out, vjp = jax.vjp(f, *args)
    return (out, *vjp(cotangent))


@functools.partial(jax.jit, static_argnums=0)
def jit_value_and_grads(f, args, cotangent):
    return value_and_grads(f, args, cotangent)


# ----------------------------------------------------------------------------- attention


def attention_case(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = _normal(rng, B, T, H, D), _normal(rng, B, S, G, D), _normal(rng, B, S, G, Dv)
    return q, k, v, messy_indices(rng), _normal(rng, B, T, H, Dv)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_value_rows_no_entry_names_do_not_reach_the_output(impl):
    """The smallest case: key 0 holds inf in v and is never selected; the query attends to key
    2 alone, whose value is all ones."""
    q, k = jnp.ones((1, 1, 1, 4)), jnp.ones((1, 4, 1, 4))
    v = jnp.ones((1, 4, 1, 4)).at[0, 0].set(jnp.inf)
    idx = jnp.array([[[2, -1]]], jnp.int32)
    np.testing.assert_array_equal(
        hs.sparse_attention(q, k, v, idx, impl=impl), np.ones((1, 1, 1, 4))
    )


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@pytest.mark.parametrize("poison", POISONS)
def test_attention_ignores_poison_where_no_valid_entry_looks(impl, poison):
    q, k, v, idx, ct = attention_case()
    f = functools.partial(hs.sparse_attention, idx=idx, impl=impl)
    want = value_and_grads(f, (q, k, v), ct)
    bad_q = q.at[EMPTY].set(poison)  # the query of a row with no valid entry
    bad_k, bad_v = poison_rows(k, poison), poison_rows(v, poison)
    got = value_and_grads(f, (bad_q, bad_k, bad_v), ct)
    assert_same(got, want, f"{impl} poison={poison}", impl)
    out, dq, dk, dv = got
    assert not np.asarray(out[EMPTY]).any() and not np.asarray(dq[EMPTY]).any()
    assert not np.asarray(dk[:, list(POISONED)]).any()
    assert not np.asarray(dv[:, list(POISONED)]).any()
    assert np.isfinite(np.asarray(out)).all()


# ----------------------------------------------------------------------------- indexer loss

HI, DI = 2, 4


def loss_case(seed=1):
    rng = np.random.default_rng(seed)
    q, k = _normal(rng, B, T, H, D), _normal(rng, B, S, G, D)
    q_idx, k_idx, w = _normal(rng, B, T, HI, DI), _normal(rng, B, S, DI), _normal(rng, B, T, HI)
    return q, k, q_idx, k_idx, w, messy_indices(rng)


@pytest.mark.parametrize("impl", LOSS_IMPLS)
@pytest.mark.parametrize("poison", POISONS)
def test_sparse_indexer_loss_ignores_poison_where_no_valid_entry_looks(impl, poison):
    """Sparse stage: key rows (k, k_idx) that idx never names, and every input of the row with
    no valid entry (q, q_idx, w), may hold NaN or inf."""
    q, k, q_idx, k_idx, w, idx = loss_case()

    def loss(q_idx, k_idx, w, q, k):
        return hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, impl=impl, block_q=4)

    want = value_and_grads(loss, (q_idx, k_idx, w, q, k), jnp.float32(1.0))
    bad = (
        q_idx.at[EMPTY].set(poison),
        poison_rows(k_idx, poison),
        w.at[EMPTY].set(poison),
        q.at[EMPTY].set(poison),
        poison_rows(k, poison),
    )
    got = value_and_grads(loss, bad, jnp.float32(1.0))
    assert_same(got, want, f"{impl} poison={poison}", impl)
    assert np.isfinite(np.asarray(got[0])) and np.asarray(got[1]).any()
    assert not np.asarray(got[1][EMPTY]).any() and not np.asarray(got[3][EMPTY]).any()
    assert not np.asarray(got[2][:, list(POISONED)]).any()


@pytest.mark.parametrize("poison", POISONS)
def test_dense_indexer_loss_rows_do_not_read_keys_they_cannot_see(poison):
    """Dense stage, per query row: key S - 1 is visible only to the last query (T == S), so
    the other rows' losses, and their gradients in q_idx and w, must not depend on it. (The
    public loss sums all rows, and every key is visible to the last one, so this checks the
    per-row function under it.) The last row's cotangent is zero."""
    rng = np.random.default_rng(2)
    q, k = _normal(rng, B, S, H, D), _normal(rng, B, S, G, D)
    q_idx, k_idx, w = _normal(rng, B, S, HI, DI), _normal(rng, B, S, DI), _normal(rng, B, S, HI)
    ct = _normal(rng, B, S).at[:, -1].set(0.0)

    def rows(q_idx, w, k_idx, k):
        return indexer_loss._dense_loss(q, k, q_idx, k_idx, w, True, D**-0.5)

    want = value_and_grads(rows, (q_idx, w, k_idx, k), ct)
    got = value_and_grads(
        rows, (q_idx, w, poison_rows(k_idx, poison, [-1]), poison_rows(k, poison, [-1])), ct
    )
    for name, i in (("loss rows", 0), ("d q_idx", 1), ("d w", 2)):
        np.testing.assert_array_equal(
            np.asarray(got[i])[:, :-1], np.asarray(want[i])[:, :-1], err_msg=name
        )
    assert np.isfinite(np.asarray(got[0])[:, :-1]).all()


# ----------------------------------------------------------------------------- selection


def selection_case(seed=3, t=T, s=S):
    """Small-integer indexer inputs (exact scores, many ties)."""
    rng = np.random.default_rng(seed)
    ints = lambda *shape: jnp.asarray(rng.integers(-3, 4, size=shape), jnp.float32)  # noqa: E731
    return ints(B, t, HI, DI), ints(B, s, DI), ints(B, t, HI)


@pytest.mark.parametrize("impl", ["xla", "reference", "interpret", PALLAS])
@pytest.mark.parametrize("poison", POISONS)
def test_selection_with_poisoned_key_rows_follows_the_rule(impl, poison):
    """A NaN k_idx row scores NaN for every query and is never chosen; an inf row scores
    +inf, -inf or NaN per query (IEEE: no summation order changes that). Other keys' ranks
    are those of the rule either way."""
    q_idx, k_idx, w = selection_case()
    k_idx = poison_rows(k_idx, poison)
    got = hs.hytopk(q_idx, k_idx, w, k=4, causal=False, impl=impl)
    np.testing.assert_array_equal(got, topk_oracle(q_idx, k_idx, w, 4, causal=False))
    if np.isnan(poison):
        assert not np.isin(np.asarray(got), POISONED).any()


@pytest.mark.parametrize("impl", ["xla", "reference", "interpret", PALLAS])
@pytest.mark.parametrize("poison", POISONS)
def test_layer_ignores_poison_in_keys_it_does_not_select(impl, poison):
    """k_idx rows that are NaN are never selected, so the k and v rows at those positions are
    never read: outputs and gradients are those of clean k and v."""
    rng = np.random.default_rng(4)
    q_idx, k_idx, w = selection_case(5)
    k_idx = poison_rows(k_idx, np.nan)
    q, k, v = _normal(rng, B, T, H, D), _normal(rng, B, S, G, D), _normal(rng, B, S, G, Dv)
    ct = _normal(rng, B, T, H, Dv)

    def out(q, k, v):
        return hs.hyscale_attention(q, k, v, q_idx, k_idx, w, topk=4, impl=impl)[0]

    want = value_and_grads(out, (q, k, v), ct)
    got = value_and_grads(out, (q, poison_rows(k, poison), poison_rows(v, poison)), ct)
    assert_same(got, want, f"{impl} poison={poison}", impl)
    assert np.isfinite(np.asarray(got[0])).all()


# ----------------------------------------------------------------------------- sharded

PT, PS = 8, 8


@pytest.mark.parametrize("poison", POISONS)
def test_one_device_mesh_ignores_poison(poison):
    rng = np.random.default_rng(6)
    mesh = parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    q_idx, k_idx, w = selection_case(7, t=PT, s=PS)
    k_idx = poison_rows(k_idx, np.nan, [0, 5])
    q, k, v = _normal(rng, B, PT, H, D), _normal(rng, B, PS, G, D), _normal(rng, B, PS, G, Dv)
    ct = _normal(rng, B, PT, H, Dv)

    def out(q, k, v):
        return parallel.hyscale_attention(q, k, v, q_idx, k_idx, w, topk=3, mesh=mesh, impl="xla")[
            0
        ]

    want = jit_value_and_grads(out, (q, k, v), ct)
    bad = (q, poison_rows(k, poison, [0, 5]), poison_rows(v, poison, [0, 5]))
    assert_same(jit_value_and_grads(out, bad, ct), want, f"mesh 1x1 poison={poison}", "xla")

    idx = hs.hytopk(q_idx, k_idx, w, k=3, impl="xla").at[:, 1, :].set(-1)

    def loss(q_idx, k_idx, w):
        return parallel.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, mesh=mesh, impl="xla")

    want = jit_value_and_grads(loss, (q_idx, k_idx, w), jnp.float32(1.0))
    bad = (q_idx.at[:, 1].set(poison), poison_rows(k_idx, poison, [0, 5]), w.at[:, 1].set(poison))
    assert_same(
        jit_value_and_grads(loss, bad, jnp.float32(1.0)), want, f"loss poison={poison}", "xla"
    )
