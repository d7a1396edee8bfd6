"""The indexer score formula and causal visibility.

    score[b,t,s] = k_scale[b,s] * sum_h w[b,t,h] * relu( q_idx[b,t,h,:] . k_idx[b,s,:] )

Products of the inputs summed in f32, relu, the head sum in f32, then one f32 multiply by the
key's scale (all ones when there is none; docs/design.md, "Indexer score").

The order selection ranks these scores by lives in `pallas_kernels.order_keys`, shared with
the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def exact_operand(x):
    """x with float8_e4m3fn widened to bf16, other dtypes unchanged.

    The widening is exact (3 mantissa bits into 7, and e4m3fn's range, +-448, inside bf16's),
    so scores computed from the bf16 copy are the FP8 inputs' scores bit for bit. jnp gives
    8-bit floats no implicit promotion, so this also lets FP8 meet bf16 or f32 operands.
    """
    return x.astype(jnp.bfloat16) if x.dtype == FP8 else x


def indexer_scores(q_idx, k_idx, w, k_scale=None):
    """Indexer scores for a block of queries against a block of keys.

    Args:
      q_idx: [B, Tq, HI, DI] indexer queries.
      k_idx: [B, Sk, DI] indexer keys (shared by all indexer heads).
      w: [B, Tq, HI] per-head weights.
      k_scale: [B, Sk] f32 per-key scales, or None (all ones: no multiply).
    Returns:
      [B, Tq, Sk] f32 scores. Products are formed in the input dtype's exact f32 widening and
      summed in f32 (HIGHEST precision: no TF32 or bf16 passes on GPU); the head sum is then
      multiplied by the key's scale.
    """
    q_idx, k_idx = exact_operand(q_idx), exact_operand(k_idx)
    logits = jnp.einsum(
        "bthd,bsd->bths",
        q_idx,
        k_idx,
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )
    scores = jnp.einsum(
        "bths,bth->bts", jax.nn.relu(logits), w.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    if k_scale is not None:
        scores = scores * k_scale.astype(jnp.float32)[:, None, :]
    return scores


def visible(t_pos, s_pos, T: int, S: int, causal: bool):
    """End-aligned causal visibility: key s is visible to query t iff s <= t + (S - T).

    t_pos, s_pos: broadcastable int32 positions. Keys at s >= S (block padding) are never visible.
    """
    ok = s_pos < S
    if causal:
        ok = ok & (s_pos <= t_pos + (S - T))
    return ok
