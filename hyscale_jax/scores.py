"""The indexer score formula and the total order that selection uses (SPEC section 2).

    score[b,t,s] = sum_h  w[b,t,h] * relu( q_idx[b,t,h,:] . k_idx[b,s,:] )   (f32 accumulation)

Selection ranks keys by score descending, ties to the smaller key index, NaN never selected.
All selection paths compare the same int32 *order key* instead of raw floats: a monotone map
of the f32 score onto int32 where -0.0 and +0.0 coincide, and `INVALID_KEY` (int32 min, which
no non-NaN float maps to) marks NaN, invisible and padding entries. Because `lax.top_k` puts
equal values in ascending position order, ranking order keys laid out in ascending key-index
order implements the tie rule exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

INVALID_KEY = jnp.iinfo(jnp.int32).min


def indexer_scores(q_idx, k_idx, w):
    """Indexer scores for a block of queries against a block of keys.

    Args:
      q_idx: [B, Tq, HI, DI] indexer queries.
      k_idx: [B, Sk, DI] indexer keys (shared by all indexer heads).
      w: [B, Tq, HI] per-head weights.
    Returns:
      [B, Tq, Sk] f32 scores. Products are formed in the input dtype's exact f32 widening and
      summed in f32 (HIGHEST precision: no TF32 or bf16 passes on GPU).
    """
    logits = jnp.einsum("bthd,bsd->bths", q_idx, k_idx,
                        preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(logits), w.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)


def visible(t_pos, s_pos, T: int, S: int, causal: bool):
    """End-aligned causal visibility: key s is visible to query t iff s <= t + (S - T).

    t_pos, s_pos: broadcastable int32 positions. Keys at s >= S (block padding) are never visible.
    """
    ok = s_pos < S
    if causal:
        ok = ok & (s_pos <= t_pos + (S - T))
    return ok


def order_key(score, selectable):
    """Monotone int32 image of f32 scores; INVALID_KEY where not selectable or NaN.

    score: f32 array; selectable: bool array broadcastable to it.
    """
    score = score.astype(jnp.float32) + 0.0  # -0.0 + 0.0 == +0.0: the two zeros tie
    bits = lax.bitcast_convert_type(score, jnp.int32)
    # Negative floats order backwards as integers; flipping their magnitude bits fixes that.
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(selectable & ~jnp.isnan(score), key, INVALID_KEY)
