"""Sparse-stage DSA indexer loss: Pallas GPU (Triton) kernels, forward and backward.

The loss is defined in docs/design.md, 'Indexer loss'.

For each query (b, t) and its selected keys J = {idx[b,t,j] inside [0, S)}:

    a[h,j] = scale * q[b,t,h] . k[b,J_j,g(h)]                       main logits (detached)
    p[j]   = (1/H) sum_h softmax_j(a[h,:])[j]                       the distillation target
    s[j]   = sum_i w[b,t,i] * relu(q_idx[b,t,i] . k_idx[b,J_j])     indexer scores (f32)
    loss[b,t] = sum_j p[j] * (log p[j] - log_softmax_j(s)[j])

Only the indexer receives gradients. With sum_j p[j] = 1 the score gradient is
ds[j] = softmax_j(s)[j] - p[j], and through the relu head sum:

    dq_idx[i]    = sum_j ds[j] w[i] [q_idx[i] . k_idx[J_j] > 0] k_idx[J_j]
    dw[i]        = sum_j ds[j] relu(q_idx[i] . k_idx[J_j])
    dk_idx[J_j] += sum_i ds[j] w[i] [q_idx[i] . k_idx[J_j] > 0] q_idx[i]

The work is O(T * K), like the sparse attention after selection (HyScale section 1); done in
XLA it gathers [T, K, DI] rows and scatter-adds their gradient, which made this loss the
slowest part of a training step. Layout (as pallas_kernels/sparse_attention.py):
  * One program per query (t, b). Its selected rows of k and k_idx are gathered `block_k` at a
    time; the H main heads and the HI indexer heads are the rows of tensor-core matmuls
    ([H, D] x [D, block_k] and [HI, DI] x [DI, block_k]).
  * Forward: sweep 1 gets the log-sum-exps of every main head and of s (online, f32); sweep 2
    sums the loss. Both statistics are outputs, saved for the backward (f32 [B, T, H], [B, T]).
  * Backward: one sweep. dq_idx and dw accumulate in registers; the dk_idx rows of a block are
    added into a f32 [S, DI] buffer with relaxed f32 atomics (pallas_kernels/relaxed_atomics.py;
    GPU: not bitwise deterministic, the order of the adds varies), or, in interpret mode,
    written per slot and summed into keys by XLA's scatter-add.
  * save_target: the forward also writes p per slot (f32 [B, T, Kp], as many bytes as the
    indices), and the backward reads it: it then gathers only the k_idx rows and computes no
    main logits (at GLM-5.1's shape the gathered main rows are 1152 of each slot's 1408 bytes,
    and the main logits 3/4 of its matmul FLOPs). Whether it is kept between the passes is the
    checkpoint policy's choice (TARGET_NAME).
  * GQA: a query head's D features sit at its group's offset of a [G * D] vector, zeros
    elsewhere, so one gather of the flattened [S, G * D] keys serves every group. Exact (the
    zeros add nothing); costs G x the logit FLOPs, nothing for DSA's G = 1.
  * The main keys' feature axis is read as one or two power-of-two column windows, as in the
    attention kernels (MLA's D = 576 is 512 + 64, not a padded 1024: half the logit FLOPs and
    shared memory), and the main logits are the sum of the two pieces' dot products.
Triton wants power-of-two tiles of at least 16 per matmul dimension: heads and features are
zero padded (padded indexer heads have w = 0; padded main heads are excluded from p).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import relaxed_atomics

# Shared with the attention kernels: the dot, the finite mask value, Triton's minimum matmul
# tile, the padding helpers and the split of a feature axis into power-of-two pieces.
from pallas_kernels.sparse_attention import (
    _MASK_VALUE,
    _MIN_TILE,
    _dot,
    _feature_split,
    _gather_block,
    _live_blocks,
    _masked_pieces,
    _masked_rows,
    _next_pow2,
    _pad_axis,
    _pieces,
    _scores,
)

_STATS = 2  # per-row outputs: (loss, log-sum-exp of the indexer scores)
# Wide main keys (MLA's 576 features): the default pipelining depth is five stages where the
# program's resident queries (main and indexer heads) and three gathered tiles (main and
# indexer keys) take at most this many bytes, else one. GLM-5.1's 64 heads of 576 with 32 x 128
# indexer heads: 81,920 + 3 x 45,056 bytes, compiled (Triton 3.9, sm_90) to 209,920 / 218,368
# bytes of shared memory (forward / backward) with three buffers in flight; 64 indexer heads
# asked for 250,880 in the backward, and 128 main heads (DeepSeek-V3.2) fit one stage only.
_PIPELINE_BYTES = 212 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters (powers of two).

    Times quoted below: one H200, jax 0.11.2, B=1, T=S=32K, H=16, G=1, D=128, HI=32, DI=64,
    k=2048, bf16, one run (forward / forward+backward), on the kernels of 75c5d0e (before their
    masked-load gathers and once-read queries).
    """

    # Selected rows gathered per step (both kernels): 12.06 / 31.90 ms at 64 against
    # 33.60 / 54.85 at 32, 31.50 / 58.33 at 16 and 13.68 / 38.40 at 128 (8 warps). None: 64, or
    # 32 where the main keys are wider than 512 features (MLA's 576: a 64-row tile is 72 KiB,
    # and the pipelined stages of it beside the [64, 576] queries exceed a program's shared
    # memory).
    block_k: int | None = None
    # Triton warps of the forward kernel; 8 warps (and 8 in the backward) at 64-key tiles:
    # 15.24 / 44.58 ms.
    num_warps: int = 4
    # Pipelining depth of the forward kernel. Not swept at 64-key tiles; at 32, 3 stages (both
    # kernels) gave 31.96 / 53.83 ms against 33.60 / 54.85 with 2. None: 2, or with main keys
    # wider than 512 features (MLA) 5 where three 32-key tiles fit beside the program's
    # queries (`_PIPELINE_BYTES`: GLM-5.1's 64 heads and 32 indexer heads), else 1.
    num_stages: int | None = None
    # Triton warps of the backward kernel (see num_warps).
    num_warps_bwd: int = 4
    # Pipelining depth of both backward kernels (see num_stages). None: as the forward's for
    # the one that recomputes the target; for the one given it (save_target), 2 with narrow
    # main keys, else 5 where three gathered k_idx tiles fit beside the indexer queries (they
    # are all it gathers), else 1.
    num_stages_bwd: int | None = None


def _precision(*dtypes):
    f32 = any(jnp.dtype(d) == jnp.float32 for d in dtypes)
    return lax.Precision.HIGHEST if f32 else None


# ---------------------------------------------------------------------------------------------
# Kernels (on refs). One program = one query t of batch b.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Features:
    """The main keys' feature axis as column windows [0, d_main) and [d_main, d_main + d_tail)
    (d_tail = 0: one window), both powers of two; read by sparse_attention's `_pieces`."""

    d_main: int
    d_tail: int


def _index_scores(qi, ki_blk, w, prec_index):
    """Per-head indexer dots ph [HI, bk] f32 of the queries qi [HI, DI] with gathered k_idx
    rows ki_blk [bk, DI], and their scores s [bk] f32 (relu, x w, head sum in f32)."""
    ph = _dot(qi, ki_blk, trans_b=True, precision=prec_index)
    return ph, jnp.sum(w[:, None] * jnp.maximum(ph, 0.0), axis=0)


def _slot_block(
    idx_ref, k_ref, ki_ref, queries, w, j, *, scale, block_k, features, prec_main, prec_index
):
    """Recompute slot block j: safe rows [bk], valid [bk], gathered k_idx rows [bk, DI], main
    logits a [R, bk] f32, per-head indexer dots ph [HI, bk] f32, scores s [bk] f32.

    queries: (q_main [R, d_main], q_tail [R, d_tail] or None, qi [HI, DI]), loaded once per
    program (`_queries`). Invalid slots' rows read as zeros through the loads' own mask (a
    NaN in the clamped row 0 must not leak through 0 * x), so the gathers pipeline as in the
    attention forward (sparse_attention._masked_rows).
    """
    q_main, q_tail, qi = queries
    rows, valid = _gather_block(idx_ref, j, block_k, k_ref.shape[0])
    k_main, k_tail = _masked_pieces(k_ref, rows, valid, features)
    ki_blk = _masked_rows(ki_ref, rows, valid, 0, ki_ref.shape[1])
    a = _scores(q_main, q_tail, k_main, k_tail, prec_main) * scale
    ph, s = _index_scores(qi, ki_blk, w, prec_index)
    return rows, valid, ki_blk, a, ph, s


def _index_block(idx_ref, ki_ref, qi, w, j, *, block_k, prec_index):
    """`_slot_block` without the main keys (the backward given the target p): rows, valid,
    ki_blk, ph, s."""
    rows, valid = _gather_block(idx_ref, j, block_k, ki_ref.shape[0])
    ki_blk = _masked_rows(ki_ref, rows, valid, 0, ki_ref.shape[1])
    return (rows, valid, ki_blk, *_index_scores(qi, ki_blk, w, prec_index))


def _queries(q_ref, qi_ref, features):
    """(q_main, q_tail, qi): this program's queries, read once before its sweeps over the slot
    blocks (read inside a sweep, Triton reloads them and stages them again at every step)."""
    q_main, q_tail = _pieces(q_ref, None, features)
    return q_main, q_tail, qi_ref[...]


def _target(a, lse_a, valid, num_heads: int):
    """p [bk]: the main heads' probabilities averaged (padded heads excluded), 0 where invalid."""
    live_head = lax.broadcasted_iota(jnp.int32, a.shape, 0) < num_heads
    probs = jnp.where(live_head, jnp.exp(a - lse_a[:, None]), 0.0)
    return jnp.where(valid, jnp.sum(probs, axis=0) * (1.0 / num_heads), 0.0)


def _store_target(target, j, block_k: int, p):
    """With target = (target_ref,) ([Kp] f32), p [block_k] into slot block j; () stores none."""
    if target:
        target[0][pl.ds(j * block_k, block_k)] = p


def _clear_target_after(target_ref, num_blocks, block_k: int):
    """Zeros in target_ref's slot blocks after the last live one, which the sweeps skip."""

    def body(j, carry):
        target_ref[pl.ds(j * block_k, block_k)] = jnp.zeros((block_k,), jnp.float32)
        return carry

    lax.fori_loop(num_blocks, target_ref.shape[0] // block_k, body, 0)


def _forward_kernel(
    idx_ref,
    q_ref,
    k_ref,
    qi_ref,
    ki_ref,
    w_ref,
    lse_ref,
    stats_ref,
    *target,
    num_heads: int,
    **block,
):
    """Loss of one query, in two sweeps: the log-sum-exps, then the loss.

    Args (refs):
      idx_ref: [Kp] int32 selected keys, -1 padded to a multiple of block_k.
      q_ref: [R, Dk] main query heads (group layout above); k_ref: [S, Dk] main keys.
      qi_ref: [HI, DI] indexer query heads; ki_ref: [S, DI] indexer keys; w_ref: [HI] f32.
      lse_ref: [R] f32 per main head log-sum-exp of a (out).
      stats_ref: [2] f32 (loss, log-sum-exp of s) (out). A row without a valid slot: (0, 0).
      target: () or (target_ref,): [Kp] f32, the target p per slot, 0 on invalid slots (out).
    """
    w = w_ref[...]
    rows_q = q_ref.shape[0]
    queries = _queries(q_ref, qi_ref, block["features"])
    num_blocks = _live_blocks(idx_ref, block["block_k"], k_ref.shape[0])

    def stats_body(j, carry):
        m_a, l_a, m_s, l_s = carry
        _, valid, _, a, _, s = _slot_block(idx_ref, k_ref, ki_ref, queries, w, j, **block)
        a = jnp.where(valid[None, :], a, _MASK_VALUE)
        m_a_next = jnp.maximum(m_a, jnp.max(a, axis=1))
        l_a = l_a * jnp.exp(m_a - m_a_next) + jnp.sum(
            jnp.where(valid[None, :], jnp.exp(a - m_a_next[:, None]), 0.0), axis=1
        )
        s = jnp.where(valid, s, _MASK_VALUE)
        m_s_next = jnp.maximum(m_s, jnp.max(s))
        l_s = l_s * jnp.exp(m_s - m_s_next) + jnp.sum(jnp.where(valid, jnp.exp(s - m_s_next), 0.0))
        return m_a_next, l_a, m_s_next, l_s

    init = (
        jnp.full((rows_q,), _MASK_VALUE, jnp.float32),
        jnp.zeros((rows_q,), jnp.float32),
        jnp.float32(_MASK_VALUE),
        jnp.float32(0.0),
    )
    m_a, l_a, m_s, l_s = lax.fori_loop(0, num_blocks, stats_body, init)
    nonempty = l_s > 0.0
    lse_a = jnp.where(l_a > 0.0, m_a + jnp.log(jnp.where(l_a > 0.0, l_a, 1.0)), 0.0)
    lse_s = jnp.where(nonempty, m_s + jnp.log(jnp.where(nonempty, l_s, 1.0)), 0.0)

    def loss_body(j, total):
        _, valid, _, a, _, s = _slot_block(idx_ref, k_ref, ki_ref, queries, w, j, **block)
        p = _target(a, lse_a, valid, num_heads)
        _store_target(target, j, block["block_k"], p)
        positive = p > 0.0
        terms = jnp.where(positive, p * (jnp.log(jnp.where(positive, p, 1.0)) - (s - lse_s)), 0.0)
        return total + jnp.sum(terms)

    loss = lax.fori_loop(0, num_blocks, loss_body, jnp.float32(0.0))
    if target:
        _clear_target_after(target[0], num_blocks, block["block_k"])
    lse_ref[...] = lse_a
    stats_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (_STATS,), 0) == 0, loss, lse_s)


def _forward_kernel_given_lse(
    idx_ref,
    q_ref,
    k_ref,
    qi_ref,
    ki_ref,
    w_ref,
    lse_ref,
    stats_ref,
    *target,
    num_heads: int,
    **block,
):
    """Loss of one query in one sweep, the main heads' log-sum-exps given (the attention's).

    With p known per block, only s's log-sum-exp is online. The loss is
    sum_j p_j (log p_j - s_j + lse_s) = t + log(l) * sum_j p_j, where t sums
    p_j (log p_j - (s_j - m)) against the running maximum m of s and l = sum_j exp(s_j - m):
    when m rises to m', t gains (m' - m) times the p summed so far, so every term stays the
    size of the scores' spread rather than of the scores.

    Args (refs): as `_forward_kernel`, but lse_ref [R] f32 is an input: the natural log-sum-exp
      of a per main head (0 on a row without a valid slot; padded heads are not read).
    """
    w = w_ref[...]
    lse_a = lse_ref[...]
    queries = _queries(q_ref, qi_ref, block["features"])
    num_blocks = _live_blocks(idx_ref, block["block_k"], k_ref.shape[0])

    def body(j, carry):
        m_s, l_s, t, p_sum = carry
        _, valid, _, a, _, s = _slot_block(idx_ref, k_ref, ki_ref, queries, w, j, **block)
        p = _target(a, lse_a, valid, num_heads)
        _store_target(target, j, block["block_k"], p)
        m_s_next = jnp.maximum(m_s, jnp.max(jnp.where(valid, s, _MASK_VALUE)))
        l_s = l_s * jnp.exp(m_s - m_s_next) + jnp.sum(jnp.where(valid, jnp.exp(s - m_s_next), 0.0))
        positive = p > 0.0
        log_p = jnp.log(jnp.where(positive, p, 1.0))
        t = (
            t
            + (m_s_next - m_s) * p_sum
            + jnp.sum(jnp.where(positive, p * (log_p - (s - m_s_next)), 0.0))
        )
        return m_s_next, l_s, t, p_sum + jnp.sum(p)

    init = (jnp.float32(_MASK_VALUE), jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0))
    m_s, l_s, t, p_sum = lax.fori_loop(0, num_blocks, body, init)
    if target:
        _clear_target_after(target[0], num_blocks, block["block_k"])
    nonempty = l_s > 0.0
    log_l = jnp.log(jnp.where(nonempty, l_s, 1.0))
    loss = jnp.where(nonempty, t + log_l * p_sum, 0.0)
    lse_s = jnp.where(nonempty, m_s + log_l, 0.0)
    stats_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (_STATS,), 0) == 0, loss, lse_s)


def _gradient_sweep(
    idx_ref, qi, w, stats_ref, g_ref, dqi_ref, dw_ref, dki_ref, block_fn, *, atomic, **block
):
    """Indexer gradients of one query's loss times its cotangent, over its slot blocks.

    qi [HI, DI], w [HI] f32: the program's indexer queries and weights, loaded once.
    block_fn(j) -> (rows [bk], valid [bk], ki_blk [bk, DI], ph [HI, bk], s [bk], p [bk]): slot
    block j's gathered rows, indexer dots and scores, and the target p (0 on invalid slots).
    Refs as `_backward_kernel`'s.
    """
    stats = stats_ref[...]
    first = lax.broadcasted_iota(jnp.int32, (_STATS,), 0) == 0
    lse_s = jnp.sum(jnp.where(first, 0.0, stats))
    g = jnp.sum(jnp.where(first, g_ref[...], 0.0))
    block_k = block["block_k"]
    # The atomic path stops after the last block with a valid entry; the per-slot path writes
    # every slot's row.
    if atomic:
        num_blocks = _live_blocks(idx_ref, block_k, dki_ref.shape[0])  # dki_ref: [S, DI]
    else:
        num_blocks = idx_ref.shape[0] // block_k

    def body(j, carry):
        dqi, dw = carry
        rows, valid, ki_blk, ph, s, p = block_fn(j)
        ds = jnp.where(valid, jnp.exp(s - lse_s) - p, 0.0) * g  # [bk]
        dph = jnp.where(ph > 0.0, w[:, None] * ds[None, :], 0.0)  # [HI, bk]
        dqi = dqi + _dot(dph.astype(ki_blk.dtype), ki_blk, precision=block["prec_index"])
        # ds and dph are 0 on invalid slots, but their ph = qi . 0 is NaN where this row's own
        # q_idx is (a row with no valid entry may hold anything): mask before the products.
        relu = jnp.where(valid[None, :], jnp.maximum(ph, 0.0), 0.0)
        dw = dw + jnp.sum(relu * ds[None, :], axis=1)
        dki_rows = _dot(dph.astype(qi.dtype), qi, trans_a=True, precision=block["prec_index"])
        if atomic:
            # Invalid slots read row 0; their adds (0 * q_idx, NaN where q_idx is) are masked.
            mask = jnp.broadcast_to(valid[:, None], dki_rows.shape)
            relaxed_atomics.atomic_add(dki_ref, (rows, slice(None)), dki_rows, mask=mask)
        else:
            dki_ref[pl.ds(j * block_k, block_k), :] = dki_rows
        return dqi, dw

    init = (jnp.zeros(qi.shape, jnp.float32), jnp.zeros((qi.shape[0],), jnp.float32))
    dqi, dw = lax.fori_loop(0, num_blocks, body, init)
    dqi_ref[...] = dqi
    dw_ref[...] = dw


def _backward_kernel(
    idx_ref,
    q_ref,
    k_ref,
    qi_ref,
    ki_ref,
    w_ref,
    lse_ref,
    stats_ref,
    g_ref,
    dqi_ref,
    dw_ref,
    dki_ref,
    *,
    num_heads: int,
    atomic: bool,
    **block,
):
    """Indexer gradients of one query's loss times its cotangent, the target p recomputed from
    the main logits.

    Args (refs): idx, q, k, qi, ki, w as in the forward; lse_ref [R], stats_ref [2] its outputs;
      g_ref: [2] f32, element 0 is the cotangent of this row's loss.
      dqi_ref: [HI, DI] f32 (out); dw_ref: [HI] f32 (out).
      atomic=True:  dki_ref [S, DI] f32, zero-initialized, shared by all queries; invalid slots
        add nothing.
      atomic=False: dki_ref [Kp, DI] f32, this query's row per slot (the caller's key-wise sum
        drops the invalid slots' rows).
    """
    w = w_ref[...]
    lse_a = lse_ref[...]
    queries = _queries(q_ref, qi_ref, block["features"])

    def block_fn(j):
        rows, valid, ki_blk, a, ph, s = _slot_block(idx_ref, k_ref, ki_ref, queries, w, j, **block)
        return rows, valid, ki_blk, ph, s, _target(a, lse_a, valid, num_heads)

    sweep = (idx_ref, queries[2], w, stats_ref, g_ref, dqi_ref, dw_ref, dki_ref, block_fn)
    _gradient_sweep(*sweep, atomic=atomic, **block)


def _backward_kernel_given_target(
    idx_ref,
    qi_ref,
    ki_ref,
    w_ref,
    target_ref,
    stats_ref,
    g_ref,
    dqi_ref,
    dw_ref,
    dki_ref,
    *,
    atomic: bool,
    **block,
):
    """`_backward_kernel` with the forward's target p read, not recomputed: no main keys are
    gathered and no main logits computed, only the indexer's side of each slot block.

    Args (refs): as `_backward_kernel`, without q, k and lse; target_ref: [Kp] f32, the
      forward's p per slot (0 on invalid slots).
    """
    w = w_ref[...]
    qi = qi_ref[...]
    block_k = block["block_k"]

    def block_fn(j):
        index_side = _index_block(
            idx_ref, ki_ref, qi, w, j, block_k=block_k, prec_index=block["prec_index"]
        )
        return (*index_side, target_ref[pl.ds(j * block_k, block_k)])

    sweep = (idx_ref, qi, w, stats_ref, g_ref, dqi_ref, dw_ref, dki_ref, block_fn)
    _gradient_sweep(*sweep, atomic=atomic, **block)


# ---------------------------------------------------------------------------------------------
# pallas_call builders. Operands arrive padded: idx [B,T,Kp], q [B,T,R,Dk], k [B,S,Dk],
# qi [B,T,HI,DI], ki [B,S,DI], w [B,T,HI] f32; grid (T, B), t fastest.
# ---------------------------------------------------------------------------------------------


def _in_specs(R, Dk, S, HI, DI, Kp):
    return [
        pl.BlockSpec((None, None, Kp), lambda t, b: (b, t, 0)),  # idx
        pl.BlockSpec((None, None, R, Dk), lambda t, b: (b, t, 0, 0)),  # q
        pl.BlockSpec((None, S, Dk), lambda t, b: (b, 0, 0)),  # k
        pl.BlockSpec((None, None, HI, DI), lambda t, b: (b, t, 0, 0)),  # qi
        pl.BlockSpec((None, S, DI), lambda t, b: (b, 0, 0)),  # ki
        pl.BlockSpec((None, None, HI), lambda t, b: (b, t, 0)),  # w
    ]


def _row_spec(width):
    return pl.BlockSpec((None, None, width), lambda t, b: (b, t, 0))


def _block_kwargs(ops, cfg):
    idx, q, k, qi, ki, _ = ops
    return dict(
        scale=cfg.scale,
        block_k=cfg.block_k,
        features=cfg.features,
        prec_main=None if q is None else _precision(q.dtype, k.dtype),
        prec_index=_precision(qi.dtype, ki.dtype),
        num_heads=cfg.num_heads,
    )


def _forward_call(ops, cfg, lse=None):
    """-> lse [B, T, R] f32, stats [B, T, 2] f32 (loss, lse of s), target: [B, T, Kp] f32 (the
    target p per slot, cfg.save_target) or None. With lse given (the main heads' natural
    log-sum-exps, padded, 0 on rows without a valid slot), one sweep computes the stats and lse
    is returned as it came."""
    idx, q, k, qi, ki, _ = ops
    B, T, R, Dk = q.shape
    S, HI, DI, Kp = k.shape[1], qi.shape[2], qi.shape[3], idx.shape[2]
    given = lse is not None  # then lse is an input, not an output
    out_specs = [_row_spec(_STATS)] if given else [_row_spec(R), _row_spec(_STATS)]
    out_shape = [jax.ShapeDtypeStruct((B, T, _STATS), jnp.float32)]
    if not given:
        out_shape.insert(0, jax.ShapeDtypeStruct((B, T, R), jnp.float32))
    if cfg.save_target:
        out_specs.append(_row_spec(Kp))
        out_shape.append(jax.ShapeDtypeStruct((B, T, Kp), jnp.float32))
    result = pl.pallas_call(
        functools.partial(
            _forward_kernel_given_lse if given else _forward_kernel, **_block_kwargs(ops, cfg)
        ),
        grid=(T, B),
        in_specs=_in_specs(R, Dk, S, HI, DI, Kp) + ([_row_spec(R)] if given else []),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=cfg.sizes.num_warps, num_stages=cfg.sizes.num_stages or cfg.stages
        ),
        interpret=cfg.interpret,
        name="indexer_kl_fwd_given_lse" if given else "indexer_kl_fwd",
    )(*ops, *([lse] if given else []))
    if given:
        result = [lse, *result]
    return (*result, None) if not cfg.save_target else tuple(result)


def _backward_call(ops, lse, stats, g, cfg, target=None):
    """-> dqi [B,T,HI,DI] f32, dw [B,T,HI] f32, dki f32: [B,S,DI] (cfg.atomic) or per-slot
    rows [B,T,Kp,DI]. With target (the forward's p, [B, T, Kp] f32) the backward reads it
    instead of recomputing it, and neither lse nor the main q and k are read (pass None)."""
    idx, _, _, qi, ki, _ = ops
    B, T, HI, DI = qi.shape
    S, Kp = ki.shape[1], idx.shape[2]
    atomic = cfg.atomic
    block = _block_kwargs(ops, cfg)
    index_specs = [
        pl.BlockSpec((None, None, HI, DI), lambda t, b: (b, t, 0, 0)),  # qi
        pl.BlockSpec((None, S, DI), lambda t, b: (b, 0, 0)),  # ki
        pl.BlockSpec((None, None, HI), lambda t, b: (b, t, 0)),  # w
    ]
    if target is None:
        R, Dk = ops[1].shape[2:]
        kernel = functools.partial(_backward_kernel, atomic=atomic, **block)
        in_specs = _in_specs(R, Dk, S, HI, DI, Kp) + [_row_spec(R)]
        args = (*ops, lse)
        stages = cfg.stages
        name = "indexer_kl_bwd"
    else:
        del block["num_heads"]
        kernel = functools.partial(_backward_kernel_given_target, atomic=atomic, **block)
        in_specs = [_row_spec(Kp), *index_specs, _row_spec(Kp)]
        args = (idx, qi, ki, ops[5], target)
        stages = cfg.target_stages
        name = "indexer_kl_bwd_given_target"
    in_specs += [_row_spec(_STATS), _row_spec(_STATS)]
    args += (stats, g)
    out_specs = [index_specs[0], _row_spec(HI)]
    out_shape = [
        jax.ShapeDtypeStruct((B, T, HI, DI), jnp.float32),
        jax.ShapeDtypeStruct((B, T, HI), jnp.float32),
    ]
    params = pltriton.CompilerParams(
        num_warps=cfg.sizes.num_warps_bwd, num_stages=cfg.sizes.num_stages_bwd or stages
    )
    if atomic:
        dki_spec = pl.BlockSpec((None, S, DI), lambda t, b: (b, 0, 0))
        n_in = len(args)

        def body(*refs):
            # refs[n_in]: the aliased zero buffer, written through the last output ref
            kernel(*refs[:n_in], *refs[n_in + 1 :])

        return pl.pallas_call(
            body,
            grid=(T, B),
            in_specs=in_specs + [dki_spec],
            out_specs=out_specs + [dki_spec],
            out_shape=out_shape + [jax.ShapeDtypeStruct((B, S, DI), jnp.float32)],
            input_output_aliases={n_in: 2},
            compiler_params=params,
            interpret=cfg.interpret,
            name=f"{name}_atomic",
        )(*args, jnp.zeros((B, S, DI), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(T, B),
        in_specs=in_specs,
        out_specs=out_specs + [pl.BlockSpec((None, None, Kp, DI), lambda t, b: (b, t, 0, 0))],
        out_shape=out_shape + [jax.ShapeDtypeStruct((B, T, Kp, DI), jnp.float32)],
        compiler_params=params,
        interpret=cfg.interpret,
        name=f"{name}_rows",
    )(*args)


# The two statistics' checkpoint name: a jax.checkpoint policy that saves it (with the selected
# indices) lets the backward skip re-running the forward kernel for them (f32 [B, T, Hp], the
# main heads' log-sum-exps with the heads padded, and [B, T, 2]: small beside the activations).
STATISTICS_NAME = "hyscale_indexer_statistics"
# The target p's checkpoint name (`save_target`): f32 [B, T, Kp] per layer, as many bytes as the
# selected indices. A policy that saves it lets the backward skip the main keys altogether.
TARGET_NAME = "hyscale_indexer_target"


# ---------------------------------------------------------------------------------------------
# custom_vjp wrapper over per-row losses [B, T]; residuals: inputs and the two statistics.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static arguments of the custom_vjp. atomic: dk_idx by f32 atomics (what the GPU runs),
    else per-slot rows summed by XLA (interpret mode). Atomics under interpret=True need
    `relaxed_atomics.RELAXED`, whose primitive has an exact interpret rule."""

    scale: float
    num_heads: int
    block_k: int
    features: _Features
    stages: int  # default pipelining depth of both kernels
    interpret: bool
    atomic: bool
    sizes: BlockSizes
    # The forward also writes the target p per slot (f32 [B, T, Kp], named TARGET_NAME), a
    # residual the backward reads instead of recomputing the main logits.
    save_target: bool = False
    target_stages: int = 2  # default pipelining depth of the backward given the target


def _prepare_index(q_idx, k_idx, w, idx, cfg: _Config):
    """The indexer's padded kernel operands: (idx [B,T,Kp], qi [B,T,HIp,DIp], ki [B,S,DIp],
    w f32 [B,T,HIp])."""
    HIp = _next_pow2(q_idx.shape[2], _MIN_TILE)
    DIp = _next_pow2(q_idx.shape[3], _MIN_TILE)
    qi = _pad_axis(_pad_axis(q_idx, 2, HIp), 3, DIp)
    ki = _pad_axis(k_idx, 2, DIp)
    wp = _pad_axis(w.astype(jnp.float32), 2, HIp)
    Kp = -(-idx.shape[2] // cfg.block_k) * cfg.block_k
    idxp = _pad_axis(idx.astype(jnp.int32), 2, Kp, fill=-1)
    return idxp, qi, ki, wp


def _prepare(q, k, q_idx, k_idx, w, idx, cfg: _Config):
    """Padded kernel operands (idx, q [B,T,Rp,Dk], k [B,S,Dk], qi, ki, w f32), see the layout."""
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    Gp = _next_pow2(G)
    width = cfg.features.d_main + cfg.features.d_tail  # covers Gp * D
    q = lax.stop_gradient(q)
    k = lax.stop_gradient(k)
    # Head h's features at its group's offset g(h) * D of a [Gp * D] vector, zeros elsewhere.
    group_of_head = jax.nn.one_hot(jnp.arange(H) // (H // G), Gp, dtype=q.dtype)  # [H, Gp]
    q_wide = jnp.einsum("bthd,hg->bthgd", q, group_of_head).reshape(B, T, H, Gp * D)
    q_wide = _pad_axis(_pad_axis(q_wide, 3, width), 2, _next_pow2(H, _MIN_TILE))
    k_wide = _pad_axis(_pad_axis(k, 2, Gp).reshape(B, S, Gp * D), 2, width)
    idxp, qi, ki, wp = _prepare_index(q_idx, k_idx, w, idx, cfg)
    return (idxp, q_wide, k_wide, qi, ki, wp)


def _kernel_lse(attention_lse, rows: int):
    """The attention's log-sum-exps [B, T, H] (natural, -inf on rows without a valid entry) as
    the kernels' [B, T, rows] f32: padded heads and empty rows 0."""
    lse = lax.stop_gradient(attention_lse).astype(jnp.float32)
    return _pad_axis(jnp.where(jnp.isfinite(lse), lse, 0.0), 2, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _row_losses(q, k, q_idx, k_idx, w, idx, attention_lse, cfg: _Config):
    # Evaluated without a gradient, the forward need not write the target.
    cfg = dataclasses.replace(cfg, save_target=False)
    return _row_losses_fwd(q, k, q_idx, k_idx, w, idx, attention_lse, cfg)[0]


def _row_losses_fwd(q, k, q_idx, k_idx, w, idx, attention_lse, cfg: _Config):
    ops = _prepare(q, k, q_idx, k_idx, w, idx, cfg)
    if attention_lse is None:
        lse, stats, target = _forward_call(ops, cfg)
        lse = checkpoint_name(lse, STATISTICS_NAME)
    else:  # the given lse comes back with the attention's recomputation: only stats is named
        lse, stats, target = _forward_call(ops, cfg, _kernel_lse(attention_lse, ops[1].shape[2]))
    stats = checkpoint_name(stats, STATISTICS_NAME)
    if cfg.save_target:  # the backward reads neither the main q, k nor their lse
        residuals = (None, None, q_idx, k_idx, w, idx, None, stats)
        target = checkpoint_name(target, TARGET_NAME)
    else:
        residuals = (q, k, q_idx, k_idx, w, idx, lse, stats)
    return stats[..., 0], (residuals, target)


def _row_losses_bwd(cfg: _Config, residuals, g_rows):
    (q, k, q_idx, k_idx, w, idx, lse, stats), target = residuals
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    if target is None:
        ops = _prepare(q, k, q_idx, k_idx, w, idx, cfg)
    else:
        idxp, qi, ki, wp = _prepare_index(q_idx, k_idx, w, idx, cfg)
        ops = (idxp, None, None, qi, ki, wp)
    g = jnp.broadcast_to(g_rows.astype(jnp.float32)[..., None], (B, T, _STATS))
    dqi, dw, dki = _backward_call(ops, lse, stats, g, cfg, target)
    if not cfg.atomic:  # per-slot rows: sum into keys; invalid and padded slots are dropped
        keys = jnp.where((idx >= 0) & (idx < S), idx, S).astype(jnp.int32)
        keys = _pad_axis(keys, 2, dki.shape[2], fill=S)
        dki = jax.vmap(
            lambda rows, keys: (
                jnp.zeros((S, rows.shape[-1]), jnp.float32)
                .at[keys.reshape(-1)]
                .add(rows.reshape(-1, rows.shape[-1]), mode="drop")
            )
        )(dki, keys)
    return (
        None,  # q and k: constants of the loss (detached)
        None,
        dqi[:, :, :HI, :DI].astype(q_idx.dtype),
        dki[..., :DI].astype(k_idx.dtype),
        dw[:, :, :HI].astype(w.dtype),
        None,
        None,  # attention_lse: a constant of the loss
    )


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def indexer_kl_rows(
    q,
    k,
    q_idx,
    k_idx,
    w,
    idx,
    *,
    scale: float,
    attention_lse=None,
    save_target: bool = False,
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
):
    """Per-query sparse-stage KL loss; differentiable in q_idx, k_idx, w (`jax.custom_vjp`).

    Args:
      q: [B, T, H, D], k: [B, S, G, D] main attention queries / keys (detached), H % G == 0.
      q_idx: [B, T, HI, DI], k_idx: [B, S, DI], w: [B, T, HI] the indexer's inputs.
      idx: [B, T, K] int selected keys; entries outside [0, S) are not members, never read.
      scale: main-attention logit scale.
      attention_lse: None, or [B, T, H] f32, the main heads' natural log-sum-exps of the scaled
        logits over the valid entries of idx (-inf on rows without one), as the sparse attention
        gives them: the forward kernel then sweeps the selected keys once instead of twice. The
        backward, as without it, takes p to sum to 1 (ds = softmax(s) - p), which holds for the
        attention's own lse up to f32 rounding.
      save_target: the forward kernel also writes the target p of every slot (f32 [B, T, Kp],
        Kp = K rounded up to the slot block; named TARGET_NAME), the residual the backward then
        reads in place of the main q, k and their log-sum-exps: it gathers only the k_idx rows
        and computes no main logits. The same gradients (the forward's p is the one the
        backward would recompute), for as many residual bytes as the indices.
      interpret: Pallas interpret mode (CPU tests).
      block_sizes: tile sizes, default `BlockSizes()`.
    Returns:
      [B, T] f32 loss per query (0 and zero gradients for rows without a valid entry). dk_idx is
      summed with f32 atomics on GPU (not bitwise deterministic); q and k get zero gradients.
    """
    return _kl_rows(
        q,
        k,
        q_idx,
        k_idx,
        w,
        idx,
        scale=scale,
        attention_lse=attention_lse,
        save_target=save_target,
        interpret=interpret,
        atomic=not interpret,
        block_sizes=block_sizes,
    )


def _config(
    q, k, q_idx, idx, *, scale, interpret, atomic, block_sizes, save_target=False
) -> _Config:
    """The static configuration for main q [B,T,H,D], k [B,S,G,D], the indexer's queries q_idx
    [B,T,HI,DI] and idx [B,T,K]."""
    sizes = block_sizes or BlockSizes()
    features = _Features(*_feature_split(_next_pow2(k.shape[2]) * q.shape[-1], None))
    width = features.d_main + features.d_tail
    narrow = width <= 512
    block_k = max(
        _MIN_TILE, min(sizes.block_k or (64 if narrow else 32), _next_pow2(idx.shape[-1]))
    )
    if narrow:
        stages = target_stages = 2
    else:  # five stages where three gathered tiles fit beside the program's queries, else one
        itemsize = jnp.dtype(q.dtype).itemsize
        index_dim = _next_pow2(q_idx.shape[3], _MIN_TILE)
        index_queries = _next_pow2(q_idx.shape[2], _MIN_TILE) * index_dim * itemsize
        rows = _next_pow2(q.shape[2], _MIN_TILE) * width
        resident = rows * itemsize + index_queries
        tile = block_k * (width + index_dim) * itemsize
        stages = 5 if resident + 3 * tile <= _PIPELINE_BYTES else 1
        # The backward given the target gathers the k_idx rows alone (8 KiB per 32 slots at
        # DI = 128), beside the indexer queries only.
        index_tile = block_k * index_dim * itemsize
        target_stages = 5 if index_queries + 3 * index_tile <= _PIPELINE_BYTES else 1
    return _Config(
        scale=float(scale),
        num_heads=q.shape[2],
        block_k=block_k,
        features=features,
        stages=stages,
        interpret=bool(interpret),
        atomic=bool(atomic),
        sizes=sizes,
        save_target=bool(save_target),
        target_stages=target_stages,
    )


def _kl_rows(
    q,
    k,
    q_idx,
    k_idx,
    w,
    idx,
    *,
    scale,
    interpret,
    atomic,
    block_sizes,
    attention_lse=None,
    save_target=False,
):
    """`indexer_kl_rows` with the dk_idx path chosen: atomic=True with interpret=True runs the
    GPU's atomic backward kernel in the interpreter (tests)."""
    cfg = _config(
        q,
        k,
        q_idx,
        idx,
        scale=scale,
        save_target=save_target,
        interpret=interpret,
        atomic=atomic,
        block_sizes=block_sizes,
    )
    return _row_losses(q, k, q_idx, k_idx, w, idx, attention_lse, cfg)
