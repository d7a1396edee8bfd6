"""HyScale-JAX: exact learned sparse attention (HyTopK selection + selection replay).

Public API (docs/design.md describes each call):
  hytopk, topk_reference                  exact top-k selection, streaming / materialized
  sparse_attention, sparse_attention_reference
  hyscale_attention, INDICES_NAME, replay_policy
  indexer_kl_loss
  quantize_indexer                        FP8 indexer inputs (Hadamard rotation, per-row scales)
"""

from hyscale_jax import parallel
from hyscale_jax.attention import sparse_attention
from hyscale_jax.indexer_loss import indexer_kl_loss
from hyscale_jax.layer import (
    INDEXER_STATISTICS_NAME,
    INDEXER_TARGET_NAME,
    INDICES_NAME,
    hyscale_attention,
    replay_policy,
)
from hyscale_jax.quantize import quantize_indexer
from hyscale_jax.reference import sparse_attention_reference, topk_reference
from hyscale_jax.selection import hytopk

__all__ = [
    "INDEXER_STATISTICS_NAME",
    "INDEXER_TARGET_NAME",
    "INDICES_NAME",
    "hyscale_attention",
    "hytopk",
    "indexer_kl_loss",
    "parallel",
    "quantize_indexer",
    "replay_policy",
    "sparse_attention",
    "sparse_attention_reference",
    "topk_reference",
]
__version__ = "0.1.0"
