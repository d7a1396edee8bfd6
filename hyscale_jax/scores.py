"""The indexer score formula and causal visibility.

    score[b,t,s] = sum_h  w[b,t,h] * relu( q_idx[b,t,h,:] . k_idx[b,s,:] )   (f32 accumulation)

The order selection ranks these scores by lives in `pallas_kernels.order_keys`, shared with
the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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
    logits = jnp.einsum(
        "bthd,bsd->bths",
        q_idx,
        k_idx,
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )
    return jnp.einsum(
        "bths,bth->bts", jax.nn.relu(logits), w.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )


def visible(t_pos, s_pos, T: int, S: int, causal: bool):
    """End-aligned causal visibility: key s is visible to query t iff s <= t + (S - T).

    t_pos, s_pos: broadcastable int32 positions. Keys at s >= S (block padding) are never visible.
    """
    ok = s_pos < S
    if causal:
        ok = ok & (s_pos <= t_pos + (S - T))
    return ok
