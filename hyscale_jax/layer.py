"""The HyScale layer op and selection replay (paper section 4).

`hyscale_attention` selects on `stop_gradient` inputs and tags the int32 indices with
`checkpoint_name(INDICES_NAME)`. Under `jax.checkpoint(f, policy=replay_policy())` the indices
are the one thing the forward pass keeps: rematerialization in the backward pass replays them
instead of re-running the O(T*S) selection, and everything else (projections, attention) is
recomputed as usual. Under plain `jax.checkpoint(f)` the selection runs twice: the baseline.
`replay_policy(offload=True)` keeps the saved indices in pinned host memory until the backward
pass needs them; `replay_policy(indexer_statistics=True)` also saves the indexer loss's small
per-query statistics, so its forward kernel does not run again in the backward pass, and
`indexer_target=True` the loss's target distribution (`hs.indexer_kl_loss(save_target=True)`),
so its backward kernel reads no main keys.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from hyscale_jax import _checks
from hyscale_jax.attention import sparse_attention
from hyscale_jax.selection import check_order, hytopk
from pallas_kernels import indexer_loss as indexer_loss_kernels

INDICES_NAME = "hyscale_indices"
# The sparse-stage indexer loss's saved statistics (its Pallas kernels' residuals).
INDEXER_STATISTICS_NAME = indexer_loss_kernels.STATISTICS_NAME
# The sparse-stage indexer loss's target p, kept under `save_target=True`.
INDEXER_TARGET_NAME = indexer_loss_kernels.TARGET_NAME

# While tracing under `hyscale_jax.replay_check.observe_selections`: a function applied to every
# selection result before it is tagged, so that it runs wherever the selection itself runs
# (docs/design.md, 'Replay fidelity'). None otherwise.
_selection_tap = None


def replay_policy(
    offload: bool = False, indexer_statistics: bool = False, indexer_target: bool = False
):
    """A `jax.checkpoint` policy that saves only the selection's indices (INDICES_NAME).

    offload: keep the saved indices in pinned host memory between the forward and the backward
      pass instead of device memory (int32 [B, T, topk] per layer: 8 GiB at T = 1M, k = 2048);
      the backward copies each layer's indices back when it reaches that layer.
    indexer_statistics: also save the sparse-stage indexer loss's per-query statistics
      (INDEXER_STATISTICS_NAME, f32 [B, T, H] and [B, T, 2] per layer, in device memory) that
      its Pallas backward reads, so the rematerialized forward need not run the loss's forward
      kernel again for them. Same gradients; the `xla` path has no such residual.
    indexer_target: also save the indexer loss's target p (INDEXER_TARGET_NAME, f32
      [B, T, topk rounded up to the kernels' slot block] per layer, about as large as the
      indices, and with offload=True offloaded with them), written where the loss runs with
      `save_target=True`; its backward kernel then
      gathers no main keys and computes no main logits. Without it such a loss's forward
      kernel runs again in the backward pass, to make p.
    """
    saved = [INDEXER_STATISTICS_NAME] if indexer_statistics else []
    large = [INDICES_NAME] + ([INDEXER_TARGET_NAME] if indexer_target else [])
    if offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=saved,
            names_which_can_be_offloaded=large,
            offload_src="device",
            offload_dst="pinned_host",
        )
    return jax.checkpoint_policies.save_only_these_names(*large, *saved)


def hyscale_attention(
    q,
    k,
    v,
    q_idx,
    k_idx,
    w,
    *,
    topk: int,
    causal: bool = True,
    scale: float | None = None,
    k_scale=None,
    impl: str = "auto",
    value_dim: int | None = None,
    return_lse: bool = False,
    order: str = "score",
):
    """Learned sparse attention: exact HyTopK selection, then attention over the selected keys.

    Args:
      q: [B, T, H, D] queries; k: [B, S, G, D] keys; v: [B, S, G, Dv] values (H % G == 0).
      q_idx: [B, T, HI, DI] indexer queries; k_idx: [B, S, DI] indexer keys; w: [B, T, HI]
        (bf16, f16, f32 or float8_e4m3fn, as in `hytopk`).
      topk: keys per query (topk > S leaves trailing -1 slots, as in `hytopk`).
      causal: end-aligned causal selection (T <= S).
      scale: attention logit scale, a finite real number; default D ** -0.5.
      k_scale: [B, S] positive per-key indexer scales, or None (all ones), as in `hytopk`.
      impl: kernel choice for both ops, as in `hytopk` / `sparse_attention`.
      value_dim: with v=None, the value is k[..., :value_dim] (MLA's absorbed form), as in
        `sparse_attention`.
      return_lse: also return the attention's log-sum-exp, as `sparse_attention` does, for
        `indexer_kl_loss(..., attention_lse=)`.
      order: the order of each row's selected keys, as in `hytopk`: "score", or "index" (the
        same keys by ascending index; the Pallas selection then skips its ordering sort). The
        attention reads the selection as a set: the same output up to f32 summation order.
    Returns:
      (out [B, T, H, Dv] in q's dtype, idx int32 [B, T, topk]), and with return_lse the
      detached lse f32 [B, T, H]. No gradient reaches the indexer through this op: it learns
      from `indexer_kl_loss`.
    """
    values = _checks.value_operand(k, v, value_dim)
    topk = _checks.check_layer_args(q, k, values, q_idx, k_idx, w, topk, causal, impl)
    check_order(order)
    scale = _checks.static_scale(scale, q.shape[-1])
    sg = jax.lax.stop_gradient
    if k_scale is not None:
        k_scale = sg(_checks.check_k_scale(k_scale, k_idx))
    idx = hytopk(
        sg(q_idx), sg(k_idx), sg(w), k=topk, causal=causal, k_scale=k_scale, impl=impl, order=order
    )
    if _selection_tap is not None:
        idx = _selection_tap(idx)
    return attend_selected(
        q, k, v, idx, scale=scale, impl=impl, value_dim=value_dim, return_lse=return_lse
    )


def attend_selected(q, k, v, idx, *, return_lse: bool, **attention_kwargs):
    """Names the selection `idx` [B, T, topk] for replay (`INDICES_NAME`) and attends over it
    (`sparse_attention(q, k, v, idx, **attention_kwargs)`): (out, idx), or with return_lse
    (out, idx, lse f32 [B, T, H])."""
    idx = checkpoint_name(idx, INDICES_NAME)
    result = sparse_attention(q, k, v, idx, return_lse=return_lse, **attention_kwargs)
    return (result[0], idx, result[1]) if return_lse else (result, idx)
