"""Plain-jnp references: obviously right, O(T*S) memory. The baselines every path is checked
and benchmarked against (SPEC sections 2 and 3)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hyscale_jax import _checks
from hyscale_jax.scores import visible
from pallas_kernels.order_keys import INVALID_KEY, order_key


@functools.partial(jax.jit, static_argnames=("causal",))
def indexer_score_table(q_idx, k_idx, w, *, causal: bool = True):
    """The full indexer table, accumulated one head at a time so nothing [B,T,HI,S] exists.

    Args:
      q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI].
    Returns:
      scores [B, T, S] f32 and the visibility mask [T, S] bool.
    """
    B, T, HI, _ = q_idx.shape
    S = k_idx.shape[1]
    w32 = w.astype(jnp.float32)

    def add_head(h, acc):
        logits = jnp.einsum(
            "btd,bsd->bts",
            q_idx[:, :, h],
            k_idx,
            preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )
        return acc + w32[:, :, h, None] * jax.nn.relu(logits)

    scores = lax.fori_loop(0, HI, add_head, jnp.zeros((B, T, S), jnp.float32))
    mask = visible(jnp.arange(T)[:, None], jnp.arange(S)[None, :], T, S, causal)
    return scores, mask


@functools.partial(jax.jit, static_argnames=("k", "causal"))
def topk_reference_impl(q_idx, k_idx, w, *, k: int, causal: bool):
    scores, mask = indexer_score_table(q_idx, k_idx, w, causal=causal)
    keys = order_key(scores, mask[None])
    S = keys.shape[-1]
    if k > S:  # fewer keys than slots: the missing slots are -1
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, k - S)), constant_values=INVALID_KEY)
    top_keys, top_idx = lax.top_k(keys, k)
    return jnp.where(top_keys == INVALID_KEY, -1, top_idx).astype(jnp.int32)


def topk_reference(q_idx, k_idx, w, *, k: int, causal: bool = True):
    """Exact top-k selection by materializing the [B, T, S] f32 score table and `lax.top_k`.

    Args:
      q_idx: [B, T, HI, DI] indexer queries.
      k_idx: [B, S, DI] indexer keys.
      w: [B, T, HI] indexer head weights.
      k: slots per query.
      causal: end-aligned causal visibility (key s visible to query t iff s <= t + S - T).
    Returns:
      int32 [B, T, k]: key indices by score descending, ties to the smaller index, NaN scores
      and invisible keys never selected, -1 in slots left empty.
    """
    k = _checks.check_selection_args(q_idx, k_idx, w, k, causal)
    return topk_reference_impl(q_idx, k_idx, w, k=k, causal=causal)


def _occurrence_counts(idx, S: int):
    """counts [B, T, S] f32: how often each key appears in its row of idx [B, T, K]."""
    B, T, _ = idx.shape
    in_range = (idx >= 0) & (idx < S)
    safe = jnp.where(in_range, idx, S)  # S is out of bounds: dropped by the scatter
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    return jnp.zeros((B, T, S), jnp.float32).at[b, t, safe].add(1.0, mode="drop")


@functools.partial(jax.jit, static_argnames=("scale",))
def _sparse_attention_reference(q, k, v, idx, *, scale: float):
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    counts = _occurrence_counts(idx, S)  # [B, T, S]
    qg = q.reshape(B, T, G, H // G, D)
    logits = (
        jnp.einsum(
            "btgrd,bsgd->btgrs",
            qg,
            k,
            preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )
        * scale
    )
    present = (counts > 0)[:, :, None, None, :]
    # A key chosen c times is c terms of the softmax: weight exp(logit) by c.
    masked = jnp.where(present, logits, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(present, jnp.exp(jnp.where(present, logits, 0.0) - row_max), 0.0)
    p = p * counts[:, :, None, None, :]
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)  # rows with no valid entry output zeros
    out = jnp.einsum("btgrs,bsgd->btgrd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def sparse_attention_reference(q, k, v, idx, *, scale: float | None = None):
    """Dense masked attention over all T x S scores, each key weighted by its count in idx.

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, G, D] keys, H % G == 0 (head h reads group h // (H // G)).
      v: [B, S, G, Dv] values.
      idx: [B, T, K] integer key indices; entries outside [0, S) are ignored.
      scale: logit scale, default D ** -0.5.
    Returns:
      [B, T, H, Dv] in q's dtype; rows with no valid entry are zero.
    """
    _checks.check_attention_args(q, k, v, idx)
    scale = _checks.static_scale(scale, q.shape[-1])
    return _sparse_attention_reference(q, k, v, idx, scale=scale)
