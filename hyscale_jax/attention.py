"""Sparse attention over selected keys, as a `jax.custom_vjp` whose residuals are the inputs,
the index tensor and one f32 [B, T, H] log-sum-exp (docs/design.md, "Residual contract").

`sparse_attention` is the public entry point; `impl` picks the Pallas kernels
(pallas_kernels/sparse_attention.py), the portable gather version below (`impl="xla"`), or the
dense reference. The xla version walks query blocks: each gathers its rows' selected K/V
([B, block_q, K, G, D]), so memory stays bounded by the block, never by T x K x H.

Backward recomputes the probabilities from the saved log-sum-exp, gets the softmax correction
term from delta = sum_j p_j (dO . v_j) (so the output need not be saved), and scatter-adds dK/dV
rows at the selected indices.

An entry outside [0, S) is never read: its gather reads zeros (mode="fill" on an out-of-bounds
row) and its scatter is dropped, so whatever is stored in a key row that no valid entry names,
NaN and inf included, reaches no output or gradient (docs/design.md, "Values jit cannot check").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hyscale_jax import _checks, reference
from pallas_kernels import sparse_attention as attention_kernel

_HIGHEST = lax.Precision.HIGHEST
# Bytes of one query block's gathered K/V and f32 probabilities the xla path aims for.
_BLOCK_BUDGET_BYTES = 256 * 2**20


def _default_block_q(T, K, H, G, D, Dv, itemsize):
    per_query = K * (G * (D + Dv) * itemsize + 4 * H * 4)
    block = 1
    while block * 2 * per_query <= _BLOCK_BUDGET_BYTES and block * 2 <= T:
        block *= 2
    return block


def _gather_rows(x, rows):
    """x [B, S, G, D], rows [B, Tq, K] in [0, S] -> [B, Tq, K, G, D]; row S reads zeros."""
    return jax.vmap(lambda xb, rb: xb.at[rb].get(mode="fill", fill_value=0))(x, rows)


def _block_logits(q_blk, k, idx_blk, scale):
    """Scores of one query block against its selected keys.

    q_blk [B, Tq, H, D], k [B, S, G, D], idx_blk [B, Tq, K].
    Returns grouped queries [B, Tq, G, R, D], gathered keys [B, Tq, K, G, D] (zeros for invalid
    entries), the validity mask [B, Tq, 1, 1, K], logits [B, Tq, G, R, K] f32 (-inf where
    invalid), and the rows [B, Tq, K] to gather (S, out of bounds, for invalid entries).
    """
    B, Tq, H, D = q_blk.shape
    S, G = k.shape[1], k.shape[2]
    valid = (idx_blk >= 0) & (idx_blk < S)
    rows = jnp.where(valid, idx_blk, S)
    q_grouped = q_blk.reshape(B, Tq, G, H // G, D)
    k_rows = _gather_rows(k, rows)
    logits = (
        jnp.einsum(
            "btgrd,btjgd->btgrj",
            q_grouped,
            k_rows,
            preferred_element_type=jnp.float32,
            precision=_HIGHEST,
        )
        * scale
    )
    valid = valid[:, :, None, None, :]
    return q_grouped, k_rows, valid, jnp.where(valid, logits, -jnp.inf), rows


def _pad_queries(x, padded_T, fill=0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, padded_T - x.shape[1])
    return jnp.pad(x, pad, constant_values=fill)


def _query_blocks(x, block_q):
    """[B, T_padded, ...] -> [n_blocks, B, block_q, ...]."""
    B, Tp = x.shape[:2]
    return x.reshape(B, Tp // block_q, block_q, *x.shape[2:]).swapaxes(0, 1)


def _from_query_blocks(x, T):
    n, B, bq = x.shape[:3]
    return x.swapaxes(0, 1).reshape(B, n * bq, *x.shape[3:])[:, :T]


def _forward(q, k, v, idx, scale, block_q):
    B, T, H, _ = q.shape
    Dv = v.shape[-1]
    padded_T = -(-T // block_q) * block_q
    q_blocks = _query_blocks(_pad_queries(q, padded_T), block_q)
    idx_blocks = _query_blocks(_pad_queries(idx, padded_T, fill=-1), block_q)  # padding: empty

    def attend(args):
        q_blk, idx_blk = args
        _, _, valid, logits, rows = _block_logits(q_blk, k, idx_blk, scale)
        row_max = jnp.max(logits, axis=-1)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(valid, jnp.exp(logits - row_max[..., None]), 0.0)
        denom = jnp.sum(p, axis=-1)
        v_rows = _gather_rows(v, rows).astype(jnp.float32)
        out = jnp.einsum("btgrj,btjgd->btgrd", p, v_rows, precision=_HIGHEST)
        out = out / jnp.where(denom > 0, denom, 1.0)[..., None]  # empty rows stay zero
        lse = jnp.where(denom > 0, row_max + jnp.log(denom), -jnp.inf)
        return (out.reshape(B, block_q, H, Dv).astype(q.dtype), lse.reshape(B, block_q, H))

    out, lse = lax.map(attend, (q_blocks, idx_blocks))
    return _from_query_blocks(out, T), _from_query_blocks(lse, T)


def _backward(q, k, v, idx, lse, d_out, scale, block_q):
    B, T, H, D = q.shape
    S, G, Dv = k.shape[1], k.shape[2], v.shape[-1]
    padded_T = -(-T // block_q) * block_q
    blocks = [
        _query_blocks(_pad_queries(x, padded_T, fill), block_q)
        for x, fill in ((q, 0), (idx, -1), (lse, 0), (d_out, 0))
    ]

    def accumulate(carry, args):
        dk_acc, dv_acc = carry
        q_blk, idx_blk, lse_blk, do_blk = args
        q_grouped, k_rows, valid, logits, rows = _block_logits(q_blk, k, idx_blk, scale)
        lse_blk = lse_blk.reshape(B, block_q, G, H // G)
        p = jnp.where(valid, jnp.exp(logits - lse_blk[..., None]), 0.0)
        v_rows = _gather_rows(v, rows).astype(jnp.float32)
        do_grouped = do_blk.reshape(B, block_q, G, H // G, Dv).astype(jnp.float32)
        dp = jnp.einsum("btgrd,btjgd->btgrj", do_grouped, v_rows, precision=_HIGHEST)
        delta = jnp.sum(p * dp, axis=-1, keepdims=True)
        d_logits = p * (dp - delta) * scale
        dq = jnp.einsum(
            "btgrj,btjgd->btgrd", d_logits, k_rows.astype(jnp.float32), precision=_HIGHEST
        )
        dk_rows = jnp.einsum(
            "btgrj,btgrd->btjgd", d_logits, q_grouped.astype(jnp.float32), precision=_HIGHEST
        )
        dv_rows = jnp.einsum("btgrj,btgrd->btjgd", p, do_grouped, precision=_HIGHEST)
        # Invalid entries scatter to row S, which mode="drop" discards.
        b = jnp.arange(B)[:, None, None]
        dk_acc = dk_acc.at[b, rows].add(dk_rows, mode="drop")
        dv_acc = dv_acc.at[b, rows].add(dv_rows, mode="drop")
        return (dk_acc, dv_acc), dq.reshape(B, block_q, H, D)

    init = (jnp.zeros((B, S, G, D), jnp.float32), jnp.zeros((B, S, G, Dv), jnp.float32))
    (dk, dv), dq = lax.scan(accumulate, init, blocks)
    return (_from_query_blocks(dq, T).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def sparse_attention_xla(q, k, v, idx, scale: float, block_q: int):
    """Gather-based sparse attention; shapes as `sparse_attention`, idx int32. Returns (out,
    lse f32 [B, T, H]); lse's cotangent is never used (`sparse_attention` detaches it)."""
    return _forward(q, k, v, idx, scale, block_q)


def _sparse_attention_xla_fwd(q, k, v, idx, scale, block_q):
    out, lse = _forward(q, k, v, idx, scale, block_q)
    return (out, lse), (q, k, v, idx, lse)


def _sparse_attention_xla_bwd(scale, block_q, residuals, cotangents):
    d_out, _ = cotangents
    q, k, v, idx, lse = residuals
    dq, dk, dv = _backward(q, k, v, idx, lse, d_out, scale, block_q)
    return dq, dk, dv, None  # idx is an integer input: no cotangent


sparse_attention_xla.defvjp(_sparse_attention_xla_fwd, _sparse_attention_xla_bwd)


def sparse_attention(
    q,
    k,
    v,
    idx,
    *,
    scale: float | None = None,
    impl: str = "auto",
    value_dim: int | None = None,
    block_q: int | None = None,
    deterministic: bool | None = None,
    return_lse: bool = False,
):
    """Attention of each query over its selected keys only; differentiable in q, k, v.

    o[b,t,h] = sum_j softmax_j(scale * q[b,t,h] . k[b,idx_j,g]) * v[b,idx_j,g], g = h // (H // G),
    over the entries j of idx[b,t] inside [0, S); other entries are ignored and never read, a
    repeated index counts once per occurrence, and a row with no valid entry outputs zeros with
    zero gradients. NaN or inf stored in a key row that no valid entry of a query names reaches
    neither its output nor any gradient (docs/design.md, "Values jit cannot check").

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, G, D] keys; H % G == 0 (G = 1 is DSA's MQA mode).
      v: [B, S, G, Dv] values; Dv may differ from D. Or None with `value_dim`.
      idx: [B, T, K] integer key indices (e.g. from `hytopk`), shared by all heads.
      scale: logit scale, a finite real number (static: compiled in); default D ** -0.5.
      impl: "pallas" | "interpret" | "xla" | "reference" | "auto" (pallas on GPU, else xla).
      value_dim: with v=None, the value of each key is its leading value_dim features,
        k[..., :value_dim]: MLA's absorbed form (D = 576 = 512 latent + 64 rope, value_dim =
        512), in which the Pallas kernels gather each selected row once for both K and V. The
        gradient of the shared rows lands in dK. Exactly one of v and value_dim is given.
      block_q: queries per block of the xla path (default: sized to ~256 MiB of gathered rows).
      deterministic: Pallas backward only. True sums dK/dV per key in a fixed order (bitwise
        reproducible, slower); None/False on GPU uses f32 atomics (fast; dK/dV may differ in the
        last bits from run to run). Interpret mode is always deterministic. The xla path uses
        XLA's scatter-add (deterministic on CPU; on GPU XLA decides).
      return_lse: also return the softmax's log-sum-exp, which the indexer loss can take
        (`indexer_kl_loss(..., attention_lse=)`) instead of computing it again.
    Returns:
      [B, T, H, Dv] in q's dtype (B = 0: an empty array). Softmax and accumulation in f32.
      With return_lse, (out, lse): lse f32 [B, T, H], log sum_j exp(scale * q . k_j) over the
      valid entries j (natural log; -inf on a row with none), detached: no gradient flows
      through it.
    """
    impl = _checks.resolve_impl(impl, _checks.ATTENTION_IMPLS)
    values = _checks.value_operand(k, v, value_dim)  # v, or the key's leading features
    _checks.check_attention_args(q, k, values, idx)
    scale = _checks.static_scale(scale, q.shape[-1])
    B, T, H, D = q.shape
    if B == 0:  # an empty batch: every impl gives this empty result, and no kernel runs
        out = jnp.zeros((0, T, H, values.shape[-1]), q.dtype)
        return (out, jnp.zeros((0, T, H), jnp.float32)) if return_lse else out
    idx = _checks.int32_indices(idx, k.shape[1])
    if impl == "pallas" or impl == "interpret":
        return attention_kernel.sparse_attention(
            q,
            k,
            v,
            idx,
            scale=scale,
            value_dim=None if value_dim is None else int(value_dim),
            interpret=(impl == "interpret"),
            deterministic=deterministic,
            return_lse=return_lse,
        )
    if impl == "reference":
        out, lse = reference.sparse_attention_with_lse(q, k, values, idx, scale=scale)
    else:
        default = _default_block_q(
            T, idx.shape[-1], H, k.shape[2], D, values.shape[-1], jnp.dtype(k.dtype).itemsize
        )
        block_q = _checks.pick_block(block_q, default, T)
        out, lse = sparse_attention_xla(q, k, values, idx, scale, block_q)
    return (out, lax.stop_gradient(lse)) if return_lse else out
