"""DSA indexer training loss (docs/design.md, "Indexer loss"): KL distillation from the
main attention.

    L_I = sum_t KL( p[t,:] || softmax(score[t,:]) )

p[t,:] is the main attention probability summed over heads and L1-normalized, computed on
detached q, k so the loss only trains the indexer. Dense warm-up: over every visible key
(O(T*S), short sequences). Sparse stage: over the selected entries idx[t] only (O(T*K)):
the Pallas kernels of pallas_kernels/indexer_loss.py on GPU, or the portable version below,
which walks query blocks so memory stays bounded.

An entry of idx outside [0, S) is not a member and is never read (the gathers read zeros for
it, their transposes drop it), so NaN or inf stored in a key row that no member names, or in
the inputs of a row with no member, reaches neither the loss nor a gradient
(docs/design.md, "Values jit cannot check").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hyscale_jax import _checks, reference
from pallas_kernels import indexer_loss as indexer_loss_kernel

_HIGHEST = lax.Precision.HIGHEST


def _product_precision(*arrays):
    """HIGHEST only where an input is f32 (so GPUs do not round it to TF32). Products of 16-bit
    floats are exact in f32, and with f32 accumulation DEFAULT computes the same function on
    the tensor cores, where HIGHEST would make XLA upcast to slow f32 matmuls."""
    return _HIGHEST if any(a.dtype == jnp.float32 for a in arrays) else None


def _kl_rows(attn_logits, index_scores, member, attn_lse=None):
    """Per-row KL(p || softmax(index_scores)) over the entries where `member` holds.

    attn_logits: [..., H, N] f32 main-attention logits; index_scores: [..., N] f32;
    member: [..., N] bool; attn_lse: None, or [..., H] f32 the logits' log-sum-exps over the
    members (the attention's), which then normalize the softmax. Returns [...] f32 (zero for
    rows with no member).
    """
    neg_inf = -jnp.inf
    if attn_lse is None:
        attn = jax.nn.softmax(
            jnp.where(member[..., None, :], attn_logits, neg_inf),
            axis=-1,
            where=member[..., None, :],
        )
    else:
        lse = jnp.where(jnp.isfinite(attn_lse), attn_lse, 0.0)[..., None]
        attn = jnp.exp(jnp.where(member[..., None, :], attn_logits - lse, neg_inf))
    p = jnp.mean(jnp.where(member[..., None, :], attn, 0.0), axis=-2)  # heads summed, L1-normed
    log_q = jax.nn.log_softmax(jnp.where(member, index_scores, neg_inf), axis=-1, where=member)
    terms = jnp.where(
        member & (p > 0),
        p * (jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.where(member, log_q, 0.0)),
        0.0,
    )
    return jnp.sum(terms, axis=-1)


def _grouped_logits(q, k_rows, scale, pattern):
    B, T, H, D = q.shape
    G = k_rows.shape[-2]
    q = lax.stop_gradient(q).reshape(B, T, G, H // G, D)
    logits = (
        jnp.einsum(
            pattern,
            q,
            lax.stop_gradient(k_rows),
            preferred_element_type=jnp.float32,
            precision=_product_precision(q, k_rows),
        )
        * scale
    )
    return logits.reshape(B, T, H, logits.shape[-1])


def _dense_loss(q, k, q_idx, k_idx, w, causal, scale):
    scores, mask = reference.indexer_score_table(q_idx, k_idx, w, causal=causal)
    logits = _grouped_logits(q, k, scale, "btgrd,bsgd->btgrs")
    return _kl_rows(logits, scores, jnp.broadcast_to(mask, scores.shape))


def _sparse_loss(q, k, q_idx, k_idx, w, idx, scale, block_q, attention_lse=None):
    B, T = q.shape[:2]
    S = k.shape[1]
    n_blocks = -(-T // block_q)
    pad_T = n_blocks * block_q

    def blocks(x, fill=0):
        x = jnp.pad(x, [(0, 0), (0, pad_T - T)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(B, n_blocks, block_q, *x.shape[2:]).swapaxes(0, 1)

    def gather(x, rows):  # x [B, S, ...], rows [B, bq, K] in [0, S]; row S reads zeros
        return jax.vmap(lambda xb, rb: xb.at[rb].get(mode="fill", fill_value=0))(x, rows)

    # Gathering from an f32 copy makes the backward's scatter-add, and the sum over blocks,
    # accumulate k_idx's gradient in f32: many queries select the same key, and a 16-bit
    # accumulator rounds after each of them (bf16, T=256 on CPU: 2.8% off the f32 result).
    k_idx_f32 = k_idx.astype(jnp.float32)

    def one_block(args):
        q_blk, qi_blk, w_blk, idx_blk, lse_blk = args
        member = (idx_blk >= 0) & (idx_blk < S)
        rows = jnp.where(member, idx_blk, S)
        k_rows = gather(k, rows)  # [B, bq, K, G, D]
        ki_rows = gather(k_idx_f32, rows).astype(k_idx.dtype)
        logits = _grouped_logits(q_blk, k_rows, scale, "btgrd,btjgd->btgrj")
        per_head = jnp.einsum(
            "bthd,btjd->bthj",
            qi_blk,
            ki_rows,
            preferred_element_type=jnp.float32,
            precision=_product_precision(qi_blk, ki_rows),
        )
        # Non-members' products are zeroed before the head sum: a NaN/inf query row of a row
        # with no member times the zeros read for its entries is NaN, which w's gradient
        # (a sum over entries) would otherwise pick up.
        relu = jnp.where(member[:, :, None, :], jax.nn.relu(per_head), 0.0)
        scores = jnp.einsum("bthj,bth->btj", relu, w_blk.astype(jnp.float32), precision=_HIGHEST)
        return _kl_rows(logits, scores, member, lse_blk)

    # Checkpointed per block: the backward pass recomputes one block's gathered rows
    # ([bq, K, D] and [bq, K, DI]) instead of saving them for every block (T * K * D in all).
    lse = None if attention_lse is None else blocks(lax.stop_gradient(attention_lse))
    per_row = lax.map(
        jax.checkpoint(one_block),
        (blocks(q), blocks(q_idx), blocks(w), blocks(idx, fill=-1), lse),
    )
    return per_row.swapaxes(0, 1).reshape(B, pad_T)[:, :T]


def check_args(
    q, k, q_idx, k_idx, w, idx, causal: bool, impl: str, attention_lse=None, save_target=False
) -> None:
    """The loss's argument checks (shapes, dtypes, impl), before anything is traced."""
    _checks.check_impl(impl, _checks.INDEXER_LOSS_IMPLS)
    _checks.check_qkv(q, k, k)
    _checks.check_selection_args(q_idx, k_idx, w, 1, causal and idx is None)
    if q.shape[:2] != q_idx.shape[:2] or k.shape[1] != k_idx.shape[1]:
        raise ValueError(
            f"q/q_idx must share [B, T] and k/k_idx must share S; got q "
            f"{tuple(q.shape)}, q_idx {tuple(q_idx.shape)}, k {tuple(k.shape)}, "
            f"k_idx {tuple(k_idx.shape)}"
        )
    if idx is not None:
        _checks.check_attention_args(q, k, k, idx)
    if not isinstance(save_target, bool):
        raise TypeError(f"save_target must be a bool; got {save_target!r}")
    if save_target and idx is None:
        raise ValueError(
            "save_target is the sparse stage's (its kernels' backward); the dense warm-up stage "
            "(idx=None) has no target to keep"
        )
    if attention_lse is not None:
        if idx is None:
            raise ValueError(
                "attention_lse is the sparse stage's (the attention over idx); the dense "
                "warm-up stage (idx=None) takes none"
            )
        if tuple(attention_lse.shape) != tuple(q.shape[:3]):
            raise ValueError(
                f"attention_lse must be [B, T, H] = {tuple(q.shape[:3])} (q's), got "
                f"{tuple(attention_lse.shape)}"
            )
        if attention_lse.dtype != jnp.float32:
            raise TypeError(
                f"attention_lse must be f32 (as sparse_attention returns it), got "
                f"{attention_lse.dtype}"
            )


def sparse_rows(
    q,
    k,
    q_idx,
    k_idx,
    w,
    idx,
    *,
    scale: float,
    impl: str = "auto",
    block_q: int | None = None,
    attention_lse=None,
    save_target: bool = False,
):
    """Sparse-stage loss per query, f32 [B, T] (arguments as `indexer_kl_loss`, checked)."""
    impl = _checks.resolve_impl(impl, _checks.INDEXER_LOSS_IMPLS)
    idx = _checks.int32_indices(idx, k.shape[1])
    if impl in ("pallas", "interpret"):
        return indexer_loss_kernel.indexer_kl_rows(
            q,
            k,
            q_idx,
            k_idx,
            w,
            idx,
            scale=scale,
            attention_lse=attention_lse,
            save_target=save_target,
            interpret=(impl == "interpret"),
        )
    block = _checks.pick_block(block_q, 256, q.shape[1])
    return _sparse_loss(q, k, q_idx, k_idx, w, idx, scale, block, attention_lse)


def indexer_kl_loss(
    q,
    k,
    q_idx,
    k_idx,
    w,
    idx=None,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_q: int | None = None,
    impl: str = "auto",
    attention_lse=None,
    save_target: bool = False,
):
    """KL distillation loss of the lightning indexer against the main attention.

    Args:
      q: [B, T, H, D] main-attention queries (detached here).
      k: [B, S, G, D] main-attention keys (detached here), H % G == 0.
      q_idx: [B, T, HI, DI], k_idx: [B, S, DI], w: [B, T, HI]: the indexer's inputs; gradients
        flow to these.
      idx: None for the dense warm-up stage (all visible keys, O(T*S)); or the selected
        indices [B, T, K] for the sparse stage (entries outside [0, S) are not members).
      causal: visibility for the dense stage (end-aligned, T <= S).
      scale: attention logit scale, a finite real number; default D ** -0.5.
      block_q: queries per block of the sparse stage's xla path (default 256).
      impl: sparse stage: "pallas" | "interpret" | "xla" | "auto" (pallas on GPU, else xla).
        The dense warm-up stage always runs the XLA table formula. On GPU the Pallas backward
        sums dk_idx with f32 atomics (not bitwise deterministic).
      attention_lse: sparse stage only: None, or [B, T, H] the main attention's log-sum-exps
        over idx, as `sparse_attention(..., return_lse=True)` (or `hyscale_attention`) returns
        them for these q, k, idx and scale (treated as constants). They normalize p instead of
        a sweep of the loss's own: the Pallas forward then reads the selected keys once, not
        twice. The loss is the same up to f32 rounding.
      save_target: sparse stage, Pallas kernels: the forward also keeps the target p of every
        slot (f32 [B, T, Kp], K rounded up to the kernels' slot block: about as many bytes as
        the indices; checkpoint name `hs.INDEXER_TARGET_NAME`, saved by
        `hs.replay_policy(indexer_target=True)`), and the backward reads it instead of
        gathering the main keys again and recomputing the main logits. The same loss and
        gradients up to f32 rounding. The xla path recomputes p in its checkpointed blocks
        either way.
    Returns:
      f32 scalar: KL summed over queries, averaged over the batch (0 for an empty batch).
    """
    check_args(q, k, q_idx, k_idx, w, idx, causal, impl, attention_lse, save_target)
    scale = _checks.static_scale(scale, q.shape[-1])
    if q.shape[0] == 0:  # an empty batch: no loss and no gradient, from every impl
        return jnp.zeros((), jnp.float32)
    if idx is None:
        per_row = _dense_loss(q, k, q_idx, k_idx, w, causal, scale)
    else:
        kw = dict(scale=scale, impl=impl, block_q=block_q, attention_lse=attention_lse)
        per_row = sparse_rows(q, k, q_idx, k_idx, w, idx, save_target=save_target, **kw)
    return jnp.sum(per_row) / q.shape[0]
