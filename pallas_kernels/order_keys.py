"""The total order that exact selection uses, shared by the kernels and the library.

Selection ranks keys by score descending, ties to the smaller key index, and never selects a
NaN score. Every selection path compares the same int32 *order key* instead of raw floats: a
monotone map of the f32 score onto int32 in which -0.0 and +0.0 coincide, and `INVALID_KEY`
(int32 min, which no non-NaN float maps to) marks NaN, invisible and padding entries. Because
`lax.top_k` puts equal values in ascending position order, ranking order keys laid out in
ascending key-index order implements the tie rule exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

INVALID_KEY = jnp.iinfo(jnp.int32).min
_INT32_MAX = jnp.iinfo(jnp.int32).max
# The orders a selection's row can be returned in: by score (the tie rule's order), or the same
# keys by ascending key index.
ORDERS = ("score", "index")


def order_key(score, selectable):
    """Monotone int32 image of f32 scores; INVALID_KEY where not selectable or NaN.

    Args:
      score: float array of any shape (cast to f32).
      selectable: bool array broadcastable to `score`.
    Returns:
      int32 array of `score`'s shape.
    """
    score = score.astype(jnp.float32) + 0.0  # -0.0 + 0.0 == +0.0: the two zeros tie
    bits = lax.bitcast_convert_type(score, jnp.int32)
    # Negative floats order backwards as integers; flipping their magnitude bits fixes that.
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(selectable & ~jnp.isnan(score), key, INVALID_KEY)


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(repr(c) for c in ORDERS)}")


def in_key_order(idx):
    """idx [..., k] int32 key indices, -1 in empty slots -> the same keys by ascending key
    index, the -1 slots after them."""
    ordered = jnp.sort(jnp.where(idx < 0, _INT32_MAX, idx), axis=-1)
    return jnp.where(ordered == _INT32_MAX, -1, ordered)
