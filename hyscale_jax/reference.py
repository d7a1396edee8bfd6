"""Plain-jnp references: obviously right, O(T*S) memory. The baselines every path is checked
and benchmarked against (docs/design.md, "Tie rule" and "Sparse attention")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hyscale_jax import _checks
from hyscale_jax.scores import exact_operand, visible
from pallas_kernels.order_keys import INVALID_KEY, check_order, in_key_order, order_key

_HIGHEST = lax.Precision.HIGHEST
# XLA's GPU kernels index a tensor with int32: a [B, T, S] score table of 2**31 entries or more
# dies with an illegal memory access (H200, jax 0.11.2), so `topk_reference` builds one batch
# element's table at a time from there on (the same selection; it still needs T * S < 2**31).
TABLE_ENTRIES_LIMIT = 2**31


def _finite(x):
    """x with NaN and +-inf read as zeros."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


# The dense formulas below compute every (query, key) pair and then mask the pairs that are
# not visible / not selected. In reverse mode, the masked pairs' zero cotangents meet the
# operands again in sums over all keys or all queries (d q_idx, d w, dq, dk), where a NaN or
# inf stored in a row that no valid entry names would give 0 * inf = NaN. The derivatives
# below therefore read the operands' finite parts. That changes no other result: a non-finite
# operand row makes every pair it enters non-finite, and a non-finite pair's cotangent is zero
# (masked, or a -inf logit's zero weight) or NaN already
# (docs/design.md, "Values jit cannot check").


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _all_pairs(pattern, x, y):
    """jnp.einsum(pattern, x, y) in f32 (HIGHEST), with finite-part derivatives."""
    return jnp.einsum(pattern, x, y, preferred_element_type=jnp.float32, precision=_HIGHEST)


@_all_pairs.defjvp
def _all_pairs_jvp(pattern, primals, tangents):
    (x, y), (dx, dy) = primals, tangents
    contract = functools.partial(
        jnp.einsum, pattern, preferred_element_type=jnp.float32, precision=_HIGHEST
    )
    return _all_pairs(pattern, x, y), contract(dx, _finite(y)) + contract(_finite(x), dy)


@jax.custom_jvp
def _weighted(w, r):
    """w * r (broadcasting), whose derivative in w reads r's finite part."""
    return w * r


@_weighted.defjvp
def _weighted_jvp(primals, tangents):
    (w, r), (dw, dr) = primals, tangents
    return w * r, dw * _finite(r) + w * dr


@functools.partial(jax.jit, static_argnames=("causal",))
def indexer_score_table(q_idx, k_idx, w, *, causal: bool = True, k_scale=None):
    """The full indexer table, accumulated one head at a time so nothing [B,T,HI,S] exists.

    Args:
      q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI] (FP8 widened exactly to bf16).
      k_scale: [B, S] per-key scales, or None (all ones).
    Returns:
      scores [B, T, S] f32 (every pair, visible or not): the f32 head sum, then times the
      key's scale; and the visibility mask [T, S] bool.
      Differentiable; the derivative of a score the caller masks out is read as a strong
      zero, so NaN or inf in rows a query cannot see never reach its gradients.
    """
    q_idx, k_idx = exact_operand(q_idx), exact_operand(k_idx)
    B, T, HI, _ = q_idx.shape
    S = k_idx.shape[1]
    w32 = w.astype(jnp.float32)

    def add_head(h, acc):
        logits = _all_pairs("btd,bsd->bts", q_idx[:, :, h], k_idx)
        return acc + _weighted(w32[:, :, h, None], jax.nn.relu(logits))

    scores = lax.fori_loop(0, HI, add_head, jnp.zeros((B, T, S), jnp.float32))
    if k_scale is not None:
        scores = scores * k_scale.astype(jnp.float32)[:, None, :]
    mask = visible(jnp.arange(T)[:, None], jnp.arange(S)[None, :], T, S, causal)
    return scores, mask


@functools.partial(jax.jit, static_argnames=("k", "causal"))
def topk_reference_impl(q_idx, k_idx, w, *, k: int, causal: bool, k_scale=None):
    """`topk_reference` without checks, k <= S."""
    scores, mask = indexer_score_table(q_idx, k_idx, w, causal=causal, k_scale=k_scale)
    keys = order_key(scores, mask[None])
    top_keys, top_idx = lax.top_k(keys, k)
    return jnp.where(top_keys == INVALID_KEY, -1, top_idx).astype(jnp.int32)


def topk_reference(
    q_idx, k_idx, w, *, k: int, causal: bool = True, k_scale=None, order: str = "score"
):
    """Exact top-k selection by materializing the [B, T, S] f32 score table and `lax.top_k`
    (one batch element's [T, S] table at a time where [B, T, S] reaches 2**31 entries).

    Args:
      q_idx: [B, T, HI, DI] indexer queries (bf16, f16, f32 or float8_e4m3fn).
      k_idx: [B, S, DI] indexer keys (same dtypes).
      w: [B, T, HI] indexer head weights.
      k: slots per query (k > S leaves trailing -1 slots, as in `hytopk`).
      causal: end-aligned causal visibility (key s visible to query t iff s <= t + S - T).
      k_scale: [B, S] positive per-key scales (f32), or None (all ones); multiplies the f32
        head sum, as in `hytopk`.
      order: "score" (by score descending, ties to the smaller index) or "index" (the same
        keys by ascending key index), as in `hytopk`.
    Returns:
      int32 [B, T, k]: the selected key indices in `order`, NaN scores and invisible keys never
      selected, -1 in slots left empty (after the selected ones).
    """
    check_order(order)
    k = _checks.check_selection_args(q_idx, k_idx, w, k, causal)
    k_scale = _checks.check_k_scale(k_scale, k_idx)
    B, T, S = q_idx.shape[0], q_idx.shape[1], k_idx.shape[1]
    if B == 0:
        return jnp.full((0, T, k), -1, jnp.int32)
    select = functools.partial(topk_reference_impl, k=min(k, S), causal=causal)
    if B > 1 and B * T * S >= TABLE_ENTRIES_LIMIT:

        def one_element(args):  # [T, HI, DI], [S, DI], [T, HI], [S] or None -> [T, k]
            q1, k1, w1, s1 = args
            return select(q1[None], k1[None], w1[None], k_scale=None if s1 is None else s1[None])[0]

        idx = lax.map(one_element, (q_idx, k_idx, w, k_scale))
    else:
        idx = select(q_idx, k_idx, w, k_scale=k_scale)
    if order == "index":
        idx = in_key_order(idx)
    return _checks.pad_slots(idx, k)


def _occurrence_counts(idx, S: int):
    """counts [B, T, S] f32: how often each key appears in its row of idx [B, T, K]."""
    B, T, _ = idx.shape
    in_range = (idx >= 0) & (idx < S)
    safe = jnp.where(in_range, idx, S)  # S is out of bounds: dropped by the scatter
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    return jnp.zeros((B, T, S), jnp.float32).at[b, t, safe].add(1.0, mode="drop")


@jax.custom_jvp
def _weighted_values(p, named, v):
    """out[b,t,g,r] = sum_s p[b,t,g,r,s] * v[b,s,g], f32 [B, T, G, R, Dv], over the keys
    `named` [B, T, S] only: a key that is not named adds nothing, even a NaN or inf value
    (p [B, T, G, R, S] is zero there; a plain contraction would give 0 * inf = NaN). A named
    key's non-finite value adds as in IEEE arithmetic: NaN, or its infinity."""
    out = jnp.einsum("btgrs,bsgd->btgrd", p, _finite(v).astype(jnp.float32), precision=_HIGHEST)
    v32 = v.astype(jnp.float32)
    kinds = jnp.stack([jnp.isnan(v32), v32 == jnp.inf, v32 == -jnp.inf]).astype(jnp.float32)
    n_nan, n_pos, n_neg = jnp.einsum(
        "bts,kbsgd->kbtgd", named.astype(jnp.float32), kinds, precision=_HIGHEST
    )
    extra = jnp.where(
        (n_nan > 0) | ((n_pos > 0) & (n_neg > 0)),
        jnp.nan,
        jnp.where(n_pos > 0, jnp.inf, jnp.where(n_neg > 0, -jnp.inf, 0.0)),
    )
    return out + extra[:, :, :, None, :]


@_weighted_values.defjvp
def _weighted_values_jvp(primals, tangents):
    (p, named, v), (dp, _, dv) = primals, tangents
    d_out = jnp.einsum(
        "btgrs,bsgd->btgrd", dp, _finite(v).astype(jnp.float32), precision=_HIGHEST
    ) + jnp.einsum("btgrs,bsgd->btgrd", p, dv.astype(jnp.float32), precision=_HIGHEST)
    return _weighted_values(p, named, v), d_out


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_attention_with_lse(q, k, v, idx, *, scale: float):
    """(`sparse_attention_reference`'s output, lse f32 [B, T, H]): the softmax's natural
    log-sum-exp over the valid entries, each counted once per occurrence; -inf on a row
    without one. Arguments as `sparse_attention_reference`, checked by the caller."""
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    counts = _occurrence_counts(idx, S)  # [B, T, S]
    named = counts > 0
    qg = q.reshape(B, T, G, H // G, D)
    logits = _all_pairs("btgrd,bsgd->btgrs", qg, k) * scale
    mask = named[:, :, None, None, :]
    masked = jnp.where(mask, logits, -jnp.inf)
    row_max = lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    # A key chosen c times is c terms of the softmax: weight exp(logit) by c.
    p = jnp.where(mask, jnp.exp(masked - row_max), 0.0) * counts[:, :, None, None, :]
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = _weighted_values(p, named, v)
    out = out / jnp.where(denom > 0, denom, 1.0)  # rows with no valid entry output zeros
    lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(B, T, H, v.shape[-1]).astype(q.dtype), lse.reshape(B, T, H)


def sparse_attention_reference(q, k, v, idx, *, scale: float | None = None):
    """Dense masked attention over all T x S scores, each key weighted by its count in idx.

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, G, D] keys, H % G == 0 (head h reads group h // (H // G)).
      v: [B, S, G, Dv] values.
      idx: [B, T, K] integer key indices; entries outside [0, S) are ignored.
      scale: logit scale, default D ** -0.5 (a finite real number).
    Returns:
      [B, T, H, Dv] in q's dtype; rows with no valid entry are zero. NaN or inf stored in a key
      row that no valid entry of a query names reaches neither that query's output nor any
      gradient through it (docs/design.md, "Values jit cannot check").
    """
    _checks.check_attention_args(q, k, v, idx)
    scale = _checks.static_scale(scale, q.shape[-1])
    return sparse_attention_with_lse(q, k, v, idx, scale=scale)[0]
