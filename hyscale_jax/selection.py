"""HyTopK: each query's exact top-k keys under the indexer, without the T x S score table.

`hytopk` is the public entry point; `impl` picks the Pallas GPU kernel (pallas_kernels/hytopk.py),
the portable streaming version below (`impl="xla"`), or the materializing reference.

The streaming version (paper section 3, "on-the-fly exact top-k") walks key blocks in ascending
order and keeps, for every query, the best k (order key, key index) pairs seen so far. Merging a
block is one `lax.top_k` over [running best | block]: running entries all have smaller key indices
than the block's, and within each part positions follow key index, so `top_k`'s rule "equal values:
lower position first" is exactly the tie rule (docs/design.md, "Tie rule"). Nothing larger than
[B, block_q, HI, block_k] exists at once; with causal masks, key blocks past a query block's last
visible key are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hyscale_jax import _checks, reference
from hyscale_jax.scores import indexer_scores
from pallas_kernels import hytopk as hytopk_kernel
from pallas_kernels.order_keys import INVALID_KEY, check_order, in_key_order, order_key

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 4096


def _cdiv(a, b):
    return (a + b - 1) // b


@functools.partial(jax.jit, static_argnames=("k", "causal", "block_q", "block_k"))
def hytopk_xla(
    q_idx,
    k_idx,
    w,
    *,
    k: int,
    causal: bool,
    block_q: int,
    block_k: int,
    diagonal=None,
    k_scale=None,
):
    """Streaming exact top-k. Shapes as `hytopk`; block_q <= T and block_k <= S.

    k_scale: [B, S] f32 per-key scales, or None (all ones: no multiply).

    diagonal: with `causal`, key s is visible to (local) query t iff s <= t + diagonal. None is
      the end-aligned S - T. A traced int32 scalar is allowed: a sequence-parallel shard passes
      (global position of its first query) + S - T_global, so a query chunk selects exactly as
      it would inside the whole sequence (hyscale_jax/parallel.py).
    """
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    if diagonal is None:
        diagonal = S - T
    n_q, n_k = _cdiv(T, block_q), _cdiv(S, block_k)
    q_idx = jnp.pad(q_idx, ((0, 0), (0, n_q * block_q - T), (0, 0), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, n_q * block_q - T), (0, 0)))
    key_blocks = jnp.pad(k_idx, ((0, 0), (0, n_k * block_k - S), (0, 0)))
    key_blocks = key_blocks.reshape(B, n_k, block_k, DI).swapaxes(0, 1)  # [n_k, B, block_k, DI]
    if k_scale is not None:  # padded keys are never selectable: their scale is irrelevant
        k_scale = jnp.pad(k_scale, ((0, 0), (0, n_k * block_k - S)), constant_values=1.0)
        scale_blocks = k_scale.reshape(B, n_k, block_k).swapaxes(0, 1)  # [n_k, B, block_k]

    def select_for_query_block(i):
        q_blk = lax.dynamic_slice_in_dim(q_idx, i * block_q, block_q, axis=1)
        w_blk = lax.dynamic_slice_in_dim(w, i * block_q, block_q, axis=1)
        t_pos = i * block_q + jnp.arange(block_q)
        if causal:  # the block's last query sees keys up to (last t) + diagonal
            last_visible = jnp.minimum((i + 1) * block_q, T) - 1 + diagonal
            n_blocks = jnp.clip(last_visible // block_k + 1, 0, n_k)
        else:
            n_blocks = n_k

        def merge_key_block(j, best):
            best_keys, best_idx = best  # [B, block_q, k] each
            scale = None if k_scale is None else scale_blocks[j]
            scores = indexer_scores(q_blk, key_blocks[j], w_blk, scale)  # [B, block_q, block_k]
            s_pos = j * block_k + jnp.arange(block_k)
            selectable = s_pos[None, :] < S
            if causal:
                selectable = selectable & (s_pos[None, :] <= t_pos[:, None] + diagonal)
            keys = order_key(scores, selectable)
            cand_keys = jnp.concatenate([best_keys, keys], axis=-1)
            cand_idx = jnp.concatenate(
                [best_idx, jnp.broadcast_to(s_pos, keys.shape).astype(jnp.int32)], axis=-1
            )
            top_keys, pos = lax.top_k(cand_keys, k)
            return top_keys, jnp.take_along_axis(cand_idx, pos, axis=-1)

        init = (
            jnp.full((B, block_q, k), INVALID_KEY, jnp.int32),
            jnp.full((B, block_q, k), -1, jnp.int32),
        )
        best_keys, best_idx = lax.fori_loop(0, n_blocks, merge_key_block, init)
        return jnp.where(best_keys == INVALID_KEY, -1, best_idx)

    per_block = lax.map(select_for_query_block, jnp.arange(n_q))  # [n_q, B, block_q, k]
    return per_block.swapaxes(0, 1).reshape(B, n_q * block_q, k)[:, :T]


def hytopk(
    q_idx,
    k_idx,
    w,
    *,
    k: int,
    causal: bool = True,
    k_scale=None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    order: str = "score",
):
    """Exact top-k keys per query under the DSA lightning indexer, with no T x S table.

    score[b,t,s] = k_scale[b,s] * sum_h w[b,t,h] * relu(q_idx[b,t,h,:] . k_idx[b,s,:]):
    products summed in f32, the head sum in f32, then one f32 multiply by the key's scale.

    Args:
      q_idx: [B, T, HI, DI] indexer queries (bf16, f16, f32 or float8_e4m3fn; FP8 scores are
        exact, as FP8 products are exact in f32).
      k_idx: [B, S, DI] indexer keys, one per position, shared by all indexer heads (same
        dtypes; q_idx and k_idx may differ).
      w: [B, T, HI] indexer head weights (q's own FP8 scale is folded in by the caller).
      k: slots per query (1 <= k; k > S leaves trailing -1 slots, up to a result of
        2**31 - 1 elements).
      causal: end-aligned causal visibility, key s visible to query t iff s <= t + (S - T);
        needs T <= S. False: every key is visible.
      k_scale: [B, S] positive finite per-key scales (f32; other float dtypes are cast), or
        None (all ones). Checked where concrete; under jit a NaN scale makes that key's
        scores NaN, so it is never selected.
      impl: "pallas" | "interpret" | "xla" | "reference" | "auto" (pallas on GPU, else xla).
      block_q, block_k: tile lengths of the xla path (memory ~ B*block_q*HI*block_k f32).
      order: "score": by score descending, ties to the smaller key index (the tie rule).
        "index": the same keys by ascending key index, for consumers that read the selection
        as a set (sparse attention, the indexer loss); the Pallas kernel then skips its
        ordering sort, the other impls sort their result by index.
    Returns:
      int32 [B, T, k]: the selected visible keys in `order`; keys with NaN scores are never
      chosen; slots beyond the selectable keys hold -1 (after the selected ones). Identical,
      index for index, across impls whenever scores are exactly representable.
    """
    check_order(order)
    impl = _checks.resolve_impl(impl, _checks.SELECTION_IMPLS)
    k = _checks.check_selection_args(q_idx, k_idx, w, k, causal)
    k_scale = _checks.check_k_scale(k_scale, k_idx)
    B, T, S = q_idx.shape[0], q_idx.shape[1], k_idx.shape[1]
    if B == 0:  # nothing to select: every impl returns the same empty array, no kernel runs
        return jnp.full((0, T, k), -1, jnp.int32)
    slots = min(k, S)  # slots past S can only hold -1: the kernels never see them
    if impl == "reference":
        idx = reference.topk_reference(
            q_idx, k_idx, w, k=slots, causal=causal, k_scale=k_scale, order=order
        )
    elif impl == "xla":
        idx = hytopk_xla(
            q_idx,
            k_idx,
            w,
            k=slots,
            causal=causal,
            block_q=_checks.pick_block(block_q, DEFAULT_BLOCK_Q, T),
            block_k=_checks.pick_block(block_k, DEFAULT_BLOCK_K, S),
            k_scale=k_scale,
        )
        if order == "index":
            idx = in_key_order(idx)
    else:
        idx = hytopk_kernel.hytopk(
            q_idx,
            k_idx,
            w,
            k=slots,
            causal=causal,
            k_scale=k_scale,
            interpret=(impl == "interpret"),
            order=order,
        )
    return _checks.pad_slots(idx, k)
