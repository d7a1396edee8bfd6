"""Sparse attention over selected keys: Pallas GPU (Triton) kernels, forward and backward.

Each query (b, t) attends to the keys its row `idx[b, t]` selects (docs/design.md, 'Sparse
attention'):

    o[b,t,h] = sum_j softmax_j(scale * q[b,t,h] . k[b,idx_j,g]) * v[b,idx_j,g],  g = h // (H // G)

over the entries j of idx[b,t] inside [0, S). A repeated index counts once per occurrence; a row
without a valid entry outputs zeros and gets zero gradients. Entries outside [0, S) (including
-1) are never read: the gather reads row 0 in their place, and every value gathered for such a
slot is replaced by zero before it is used, so nothing stored in a row that no valid entry names
(NaN, inf) reaches an output or a gradient.

Layout of the work (after selection the attention is O(T * k), HyScale section 1):
  * One program per (query t, batch b, kv group g). Its selected keys are gathered `block_k`
    rows at a time, `k_ref[rows, :]`. The R = H // G heads of the query that share the group are
    the rows of the matmul: scores = q [R, D] x k_rows^T [D, block_k]. So with G = 1 (DSA's MQA
    mode) one gathered K/V block serves all H heads, and the tensor cores see an
    [H, D] x [D, block_k] product, like a dense flash-attention tile with block_q = H.
  * Each program's key loops stop after the last slot block that holds a valid entry (hytopk
    pads rows with trailing -1s: rows of early causal queries are mostly padding).
  * Forward: online softmax in f32 (base-2 exponentials, FlashAttention-2), output plus the f32
    log-sum-exp per (t, h): the only statistic saved for the backward pass.
  * Backward, one kernel per query: it recomputes the scores from the inputs and the
    log-sum-exp. A first sweep over the selected keys gets delta = sum_j p_j (dO . v_j) (the
    softmax correction, so the output need not be saved); a second sweep forms
    dS = p * (dP - delta), accumulates dQ = scale * dS K in registers, and gives each gathered
    key its rows dK_rows = scale * dS^T Q and dV_rows = P^T dO, each added right after its own
    matmul. Different queries select the same key, so those rows are summed across programs:
      - atomic (the default on GPU): f32 atomic adds with relaxed ordering
        (pallas_kernels/relaxed_atomics.py) into f32 dK/dV buffers, masked off for invalid
        slots. Fast, not bitwise deterministic (the order of the float adds varies).
      - deterministic (`deterministic=True`, and the default in interpret mode): the kernel
        stores each (query, slot) pair's rows, XLA sorts the pairs by key (stable), and a second
        kernel sums each key's rows in that fixed order. Queries are processed in chunks of
        `block_t_deterministic` so the row buffer stays bounded; chunks are added in order.
        Bitwise reproducible.

Pallas-Triton constraints shape the wrapper: every loaded tile is a power of two, and `tl.dot`
wants every dimension >= 16, so R, D, Dv are zero-padded to powers of two (at least 16) and idx
is padded with -1 to a multiple of block_k. Zero-padded heads have zero queries and zero output
cotangents, so they add nothing to dK / dV.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import relaxed_atomics

_dot = getattr(pltriton, "dot", None) or pl.dot  # moved to the triton module in jax 0.10
_LOG2E = math.log2(math.e)
# A finite "minus infinity" for the running max, so exp2(m_old - m_new) never sees inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_TILE = 16  # tl.dot wants every matmul dimension >= 16
# Bytes of per-(query, slot) dK/dV rows one chunk of the deterministic backward may hold.
_DETERMINISTIC_BUDGET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the sparse attention kernels (powers of two).

    Times quoted below: one H200, jax 0.11.2, B=1, T=S=32K, H=64, G=1, D=Dv=128, k=2048, bf16,
    causal random indices (experiments/bench_attention.py); figures compared with each other
    come from one run unless the comment says otherwise.
    """

    # Selected keys gathered per step of the forward kernel. Forward 9.82 ms at 32 against 10.46
    # at 64 (both 5 stages) and 11.54 at 16 (8 stages); in another run 128 keys (8 warps) took
    # 19.35 ms against 10.94 at 64.
    block_k: int = 32
    # Selected keys per step of the backward kernel. Forward+backward 48.20 ms at 64 against
    # 49.79 at 32 and 64.64 at 16; in another run 95.69 at 128 against 47.97 at 64.
    block_k_bwd: int = 64
    # Triton warps of the forward kernel. 64-key tiles: 14.27 ms with 8 warps (3 stages) against
    # 10.94 with 4 (2 stages).
    num_warps: int = 4
    # Software-pipelining depth of the forward's gathers and matmuls: 9.82 ms with 5 stages,
    # 10.58 with 3, 9.76 with 6 (within noise, and more shared memory), 11.4-11.5 with 7-8.
    num_stages: int = 5
    # Triton warps of the backward kernel. 8 warps: 64.53 ms against 48.20 with 4 (64-key
    # tiles), 85.54 against 49.79 (32-key tiles).
    num_warps_bwd: int = 4
    # Pipelining depth of the backward. Forward+backward 47.97 / 47.83 ms with 2 stages, 47.97
    # with 3, 47.89 with 4 (within noise: the backward is bound by its atomics), 56.29 with 1;
    # 2 takes the least shared memory of the fast ones.
    num_stages_bwd: int = 2
    # Queries per chunk of the deterministic backward, whose per-(query, slot) dK/dV rows take
    # B * G * block_t * Kp * (D + Dv) * 4 bytes. None: the largest power of two that keeps one
    # chunk within 1 GiB, so memory stays bounded at any T.
    block_t_deterministic: int | None = None
    # Rows summed per step of the deterministic backward's key-wise sum (its gather tile; a key
    # chosen by n queries takes ceil(n / segment_chunk) steps). Not tuned.
    segment_chunk: int = 16


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _gather_block(idx_ref, j, block_k: int, num_keys: int):
    """Slot block j of one query: (safe rows [block_k] int32, valid mask [block_k] bool).

    Entries outside [0, num_keys) are clamped to row 0 (never an out-of-bounds read); callers
    replace everything gathered for those slots (logits, K and V rows) using the mask.
    """
    ids = idx_ref[pl.ds(j * block_k, block_k)]
    valid = (ids >= 0) & (ids < num_keys)
    return jnp.where(valid, ids, 0), valid


def _live_blocks(idx_ref, block_k: int, num_keys: int):
    """Slot blocks of one query up to and including the last that holds a valid entry.

    hytopk pads each row with trailing -1s (rows of early causal queries are mostly padding), so
    the loops stop there instead of gathering and masking empty blocks. Scans back from the last
    block: usually one block load. H200, T=32K, H=64: forward 9.01 ms against 10.02 running every
    block, forward+backward 50.07 against 60.02 ms (with the masked atomics below).
    """
    num_blocks = idx_ref.shape[0] // block_k

    def empty(j):  # block j - 1 has no valid entry
        ids = idx_ref[pl.ds((j - 1) * block_k, block_k)]
        return jnp.max(((ids >= 0) & (ids < num_keys)).astype(jnp.int32)) == 0

    return lax.while_loop(
        lambda j: (j > 0) & empty(jnp.maximum(j, 1)), lambda j: j - 1, jnp.int32(num_blocks)
    )


# ---------------------------------------------------------------------------------------------
# Kernels (on refs). One program = one query t of batch b and kv group g.
# ---------------------------------------------------------------------------------------------


def _forward_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    scale_log2: float,
    block_k: int,
    precision,
):
    """Online-softmax attention of one query's R heads over its selected keys.

    Args (refs):
      idx_ref: [Kp] int32 selected keys of this query, -1 padded to a multiple of block_k.
      q_ref: [R, D] the query's heads of this kv group (R, D padded to powers of two).
      k_ref: [S, D] keys of the group.   v_ref: [S, Dv] values of the group.
      o_ref: [R, Dv] output.
      lse_ref: [R] f32 log2-sum-exp2 of the base-2 logits (-inf on rows with no valid entry).
    """
    num_keys = k_ref.shape[0]
    rows_q, dv = q_ref.shape[0], v_ref.shape[1]
    q = q_ref[...]

    def body(j, carry):
        acc, m_prev, l_prev = carry
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        k_blk = k_ref[rows, :]  # [block_k, D]
        s = _dot(q, k_blk, trans_b=True, precision=precision) * scale_log2  # [R, block_k] f32
        # Invalid slots' logits (NaN or inf where row 0 holds them) are replaced, not scaled.
        s = jnp.where(valid[None, :], s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # Invalid slots get probability exactly 0, also while every slot so far was invalid.
        p = jnp.where(valid[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
        correction = jnp.exp2(m_prev - m_next)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        # Zero the clamped rows too: a NaN/inf in row 0 must not leak through 0 * v.
        v_blk = jnp.where(valid[:, None], v_ref[rows, :], 0)  # [block_k, Dv]
        acc = acc * correction[:, None] + _dot(p.astype(v_blk.dtype), v_blk, precision=precision)
        return acc, m_next, l_next

    init = (
        jnp.zeros((rows_q, dv), jnp.float32),
        jnp.full((rows_q,), _MASK_VALUE, jnp.float32),
        jnp.zeros((rows_q,), jnp.float32),
    )
    acc, m, total = lax.fori_loop(0, _live_blocks(idx_ref, block_k, num_keys), body, init)
    nonempty = total > 0.0
    o_ref[...] = (acc / jnp.where(nonempty, total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, total, 1.0)), -jnp.inf)


def _backward_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    *,
    scale: float,
    scale_log2: float,
    block_k: int,
    precision,
    atomic: bool,
):
    """One query's backward: dQ, and the dK / dV rows of its selected keys.

    Args (refs):
      idx_ref: [Kp] int32; q_ref: [R, D]; k_ref: [S, D]; v_ref: [S, Dv] as in the forward.
      do_ref: [R, Dv] output cotangent; lse_ref: [R] f32 log2-sum-exp2 from the forward.
      dq_ref: [R, D] (out).
      atomic=True: dk_ref [S, D], dv_ref [S, Dv] f32 buffers shared by all queries (zeros on
        entry); this query's rows are added with masked relaxed atomics.
      atomic=False: dk_ref [Kp, D], dv_ref [Kp, Dv] f32, this query's row per slot (the key-wise
        sum never reads the rows of invalid slots).
    """
    num_keys = k_ref.shape[0]
    rows_q, d = q_ref.shape
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    # Trailing blocks without a valid entry contribute nothing; the per-slot path still runs
    # them, since it must write every slot's rows into its uninitialized buffers.
    if atomic:
        num_blocks = _live_blocks(idx_ref, block_k, num_keys)
    else:
        num_blocks = idx_ref.shape[0] // block_k

    def recompute(j):
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        k_blk = jnp.where(valid[:, None], k_ref[rows, :], 0)  # [block_k, D]
        v_blk = jnp.where(valid[:, None], v_ref[rows, :], 0)  # [block_k, Dv]
        s = _dot(q, k_blk, trans_b=True, precision=precision) * scale_log2
        p = jnp.where(valid[None, :], jnp.exp2(s - lse[:, None]), 0.0)  # [R, block_k]
        dp = _dot(do, v_blk, trans_b=True, precision=precision)  # [R, block_k]
        return rows, valid, k_blk, p, dp

    def write_rows(ref, j, rows, valid, rows_val):
        if atomic:
            # Invalid slots read row 0; their adds are masked off, so they neither touch row 0
            # (a hotspot shared by every padded query) nor carry anything into it.
            mask = jnp.broadcast_to(valid[:, None], rows_val.shape)
            relaxed_atomics.atomic_add(ref, (rows, slice(None)), rows_val, mask=mask)
        else:
            ref[pl.ds(j * block_k, block_k), :] = rows_val

    def delta_body(j, delta):  # delta[r] = sum_j p[r,j] dP[r,j] = dO[r] . o[r]
        _, _, _, p, dp = recompute(j)
        return delta + jnp.sum(p * dp, axis=1)

    delta = lax.fori_loop(0, num_blocks, delta_body, jnp.zeros((rows_q,), jnp.float32))

    def grad_body(j, dq):
        rows, valid, k_blk, p, dp = recompute(j)
        ds = p * (dp - delta[:, None])  # [R, block_k] f32
        dq = dq + _dot(ds.astype(k_blk.dtype), k_blk, precision=precision)
        dk_rows = _dot(ds.astype(q.dtype), q, trans_a=True, precision=precision) * scale
        write_rows(dk_ref, j, rows, valid, dk_rows)
        dv_rows = _dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        write_rows(dv_ref, j, rows, valid, dv_rows)
        return dq

    dq = lax.fori_loop(0, num_blocks, grad_body, jnp.zeros((rows_q, d), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _key_sum_kernel(start_ref, order_ref, ck_ref, cv_ref, dk_ref, dv_ref, *, chunk: int):
    """Deterministic reduction: key s sums the rows of the (query, slot) pairs that chose it.

    Args (refs):
      start_ref: [S + 1] int32; the pairs choosing key s are order[start[s]:start[s+1]].
      order_ref: [N + chunk] int32 pair positions sorted by key (stable), zero padded.
      ck_ref: [N, D] f32, cv_ref: [N, Dv] f32 per-pair dK / dV rows.
      dk_ref: [D] f32, dv_ref: [Dv] f32 the key's gradient rows.
    """
    s = pl.program_id(2)
    begin = start_ref[s]
    end = start_ref[s + 1]

    def body(i, carry):
        acc_k, acc_v = carry
        first = begin + i * chunk
        live = first + jnp.arange(chunk) < end
        pos = jnp.where(live, order_ref[pl.ds(first, chunk)], 0)
        acc_k = acc_k + jnp.sum(jnp.where(live[:, None], ck_ref[pos, :], 0.0), axis=0)
        acc_v = acc_v + jnp.sum(jnp.where(live[:, None], cv_ref[pos, :], 0.0), axis=0)
        return acc_k, acc_v

    steps = lax.div(end - begin + (chunk - 1), chunk)
    acc_k, acc_v = lax.fori_loop(
        0, steps, body, (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    )
    dk_ref[...] = acc_k
    dv_ref[...] = acc_v


# ---------------------------------------------------------------------------------------------
# pallas_call builders. Arrays arrive padded: q [B, T, G, R, D], k [B, S, G, D],
# v [B, S, G, Dv], idx [B, T, Kp]; grid (T, B, G) with t fastest, so neighbouring programs read
# neighbouring (causally similar) key sets of one group from L2.
# ---------------------------------------------------------------------------------------------


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _common_specs(B, T, G, R, D, Dv, S, Kp):
    return [
        pl.BlockSpec((None, None, Kp), lambda t, b, g: (b, t, 0)),  # idx
        pl.BlockSpec((None, None, None, R, D), lambda t, b, g: (b, t, g, 0, 0)),  # q
        pl.BlockSpec((None, S, None, D), lambda t, b, g: (b, 0, g, 0)),  # k
        pl.BlockSpec((None, S, None, Dv), lambda t, b, g: (b, 0, g, 0)),  # v
    ]


def _forward_call(q, k, v, idx, *, scale, block_k, sizes: BlockSizes, interpret):
    """q [B,T,G,R,D], k [B,S,G,D], v [B,S,G,Dv], idx [B,T,Kp] -> o [B,T,G,R,Dv], lse [B,T,G,R]."""
    B, T, G, R, D = q.shape
    S, Dv, Kp = k.shape[1], v.shape[-1], idx.shape[-1]
    kernel = functools.partial(
        _forward_kernel,
        scale_log2=scale * _LOG2E,
        block_k=block_k,
        precision=_precision(q.dtype),
    )
    return pl.pallas_call(
        kernel,
        grid=(T, B, G),
        in_specs=_common_specs(B, T, G, R, D, Dv, S, Kp),
        out_specs=[
            pl.BlockSpec((None, None, None, R, Dv), lambda t, b, g: (b, t, g, 0, 0)),
            pl.BlockSpec((None, None, None, R), lambda t, b, g: (b, t, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, G, R, Dv), q.dtype),
            jax.ShapeDtypeStruct((B, T, G, R), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages
        ),
        interpret=interpret,
        name="sparse_attn_fwd",
    )(idx, q, k, v)


def _backward_call(q, k, v, idx, lse, do, *, scale, block_k, sizes: BlockSizes, interpret, atomic):
    """q [B,T,G,R,D], k [B,S,G,D], v [B,S,G,Dv], idx [B,T,Kp], lse [B,T,G,R], do [B,T,G,R,Dv]
    -> dQ [B,T,G,R,D] and either dK/dV f32 [B,S,G,D]/[B,S,G,Dv] (atomic) or per-slot rows
    f32 [B,G,T,Kp,D]/[B,G,T,Kp,Dv] (deterministic)."""
    B, T, G, R, D = q.shape
    S, Dv, Kp = k.shape[1], v.shape[-1], idx.shape[-1]
    kernel = functools.partial(
        _backward_kernel,
        scale=scale,
        scale_log2=scale * _LOG2E,
        block_k=block_k,
        precision=_precision(q.dtype),
        atomic=atomic,
    )
    in_specs = _common_specs(B, T, G, R, D, Dv, S, Kp) + [
        pl.BlockSpec((None, None, None, R, Dv), lambda t, b, g: (b, t, g, 0, 0)),  # do
        pl.BlockSpec((None, None, None, R), lambda t, b, g: (b, t, g, 0)),  # lse
    ]
    args = (idx, q, k, v, do, lse)
    dq_spec = pl.BlockSpec((None, None, None, R, D), lambda t, b, g: (b, t, g, 0, 0))
    if atomic:  # one f32 buffer per gradient, shared by all queries
        row_specs = [
            pl.BlockSpec((None, S, None, width), lambda t, b, g: (b, 0, g, 0)) for width in (D, Dv)
        ]
        row_shapes = [jax.ShapeDtypeStruct((B, S, G, width), jnp.float32) for width in (D, Dv)]
    else:  # this query's row per slot
        row_specs = [
            pl.BlockSpec((None, None, None, Kp, width), lambda t, b, g: (b, g, t, 0, 0))
            for width in (D, Dv)
        ]
        row_shapes = [jax.ShapeDtypeStruct((B, G, T, Kp, width), jnp.float32) for width in (D, Dv)]
    call = functools.partial(
        pl.pallas_call,
        grid=(T, B, G),
        out_specs=[dq_spec, *row_specs],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), *row_shapes],
        compiler_params=pltriton.CompilerParams(
            num_warps=sizes.num_warps_bwd, num_stages=sizes.num_stages_bwd
        ),
        interpret=interpret,
        name=f"sparse_attn_bwd_{'atomic' if atomic else 'rows'}",
    )
    if not atomic:
        return call(kernel, in_specs=in_specs)(*args)
    n_in = len(args)

    def body(*refs):  # drop the aliased zero inputs: the kernel adds into the outputs
        kernel(*refs[:n_in], *refs[n_in + 2 :])

    zeros = [jnp.zeros(shape.shape, shape.dtype) for shape in row_shapes]
    return call(body, in_specs=in_specs + row_specs, input_output_aliases={n_in: 1, n_in + 1: 2})(
        *args, *zeros
    )


def _key_sum_call(idx, rows_k, rows_v, num_keys: int, *, sizes: BlockSizes, interpret):
    """Sum per-slot rows into keys in a fixed order.

    idx [B, T, Kp] (any ints), rows_k [B, G, T, Kp, D], rows_v [B, G, T, Kp, Dv] f32
    -> dK [B, S, G, D], dV [B, S, G, Dv] f32.
    """
    B, G, T, Kp, D = rows_k.shape
    Dv = rows_v.shape[-1]
    S, N, chunk = num_keys, T * Kp, sizes.segment_chunk
    keys = jnp.where((idx >= 0) & (idx < S), idx, S).reshape(B, N)  # invalid pairs sort last
    order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    sorted_keys = jnp.take_along_axis(keys, order, axis=-1)
    starts = jax.vmap(lambda sk: jnp.searchsorted(sk, jnp.arange(S + 1), side="left"))(
        sorted_keys
    ).astype(jnp.int32)  # [B, S + 1]
    order = jnp.pad(order, ((0, 0), (0, chunk)))  # reads past N stay inside
    return pl.pallas_call(
        functools.partial(_key_sum_kernel, chunk=chunk),
        grid=(B, G, S),
        in_specs=[
            pl.BlockSpec((None, S + 1), lambda b, g, s: (b, 0)),
            pl.BlockSpec((None, N + chunk), lambda b, g, s: (b, 0)),
            pl.BlockSpec((None, None, N, D), lambda b, g, s: (b, g, 0, 0)),
            pl.BlockSpec((None, None, N, Dv), lambda b, g, s: (b, g, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, D), lambda b, g, s: (b, s, g, 0)),
            pl.BlockSpec((None, None, None, Dv), lambda b, g, s: (b, s, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, S, G, D), jnp.float32),
            jax.ShapeDtypeStruct((B, S, G, Dv), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=2),
        interpret=interpret,
        name="sparse_attn_bwd_keysum",
    )(starts, order, rows_k.reshape(B, G, N, D), rows_v.reshape(B, G, N, Dv))


def _deterministic_backward(q, k, v, idx, lse, do, *, scale, block_k, sizes, interpret):
    """Chunks of block_t queries: per-slot rows, then the key-wise sum; chunks added in order."""
    B, T, G, R, D = q.shape
    S, Dv, Kp = k.shape[1], v.shape[-1], idx.shape[-1]
    block_t = sizes.block_t_deterministic
    if block_t is None:
        per_query = B * G * Kp * (D + Dv) * 4
        fits = max(1, _DETERMINISTIC_BUDGET_BYTES // per_query)
        block_t = 1 << (fits.bit_length() - 1)  # largest power of two within the budget
    block_t = min(block_t, T)
    n_chunks = -(-T // block_t)
    pad_t = n_chunks * block_t - T

    def chunks(x, fill=0):
        x = jnp.pad(x, [(0, 0), (0, pad_t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(B, n_chunks, block_t, *x.shape[2:]).swapaxes(0, 1)

    def step(carry, xs):
        dk, dv = carry
        q_c, idx_c, lse_c, do_c = xs
        dq_c, rows_k, rows_v = _backward_call(
            q_c,
            k,
            v,
            idx_c,
            lse_c,
            do_c,
            scale=scale,
            block_k=block_k,
            sizes=sizes,
            interpret=interpret,
            atomic=False,
        )
        dk_c, dv_c = _key_sum_call(idx_c, rows_k, rows_v, S, sizes=sizes, interpret=interpret)
        return (dk + dk_c, dv + dv_c), dq_c

    init = (jnp.zeros((B, S, G, D), jnp.float32), jnp.zeros((B, S, G, Dv), jnp.float32))
    xs = (chunks(q), chunks(idx, fill=-1), chunks(lse), chunks(do))
    (dk, dv), dq = lax.scan(step, init, xs)
    dq = dq.swapaxes(0, 1).reshape(B, n_chunks * block_t, G, R, D)[:, :T]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# custom_vjp wrapper: pads to kernel-friendly shapes, saves (q, k, v, idx, lse [B, T, H] f32).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static arguments of the custom_vjp. `sparse_attention` pairs interpret=True with
    deterministic=True; interpret=True with deterministic=False runs the atomic backward kernel
    in the interpreter (tests; it needs `relaxed_atomics.RELAXED`, whose primitive has an exact
    interpret rule)."""

    scale: float
    interpret: bool
    deterministic: bool
    sizes: BlockSizes


def _pad_axis(x, axis: int, size: int, fill=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=fill)


def _padded_shapes(q, v, idx, sizes: BlockSizes, backward: bool):
    B, T, H, D = q.shape
    K = idx.shape[-1]
    block_k = sizes.block_k_bwd if backward else sizes.block_k
    block_k = max(_MIN_TILE, min(block_k, _next_pow2(K)))
    return dict(
        Kp=-(-K // block_k) * block_k,
        block_k=block_k,
        Dp=_next_pow2(D, _MIN_TILE),
        Dvp=_next_pow2(v.shape[-1], _MIN_TILE),
    )


def _prepare(q, k, v, idx, sizes: BlockSizes, backward: bool):
    """Padded kernel operands: q [B,T,G,Rp,Dp], k [B,S,G,Dp], v [B,S,G,Dvp], idx [B,T,Kp]."""
    B, T, H, D = q.shape
    G = k.shape[2]
    R = H // G
    p = _padded_shapes(q, v, idx, sizes, backward)
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    qg = q.astype(dtype).reshape(B, T, G, R, D)
    qg = _pad_axis(_pad_axis(qg, 3, _next_pow2(R, _MIN_TILE)), 4, p["Dp"])
    kp = _pad_axis(k.astype(dtype), 3, p["Dp"])
    vp = _pad_axis(v.astype(dtype), 3, p["Dvp"])
    idxp = _pad_axis(idx.astype(jnp.int32), 2, p["Kp"], fill=-1)
    return qg, kp, vp, idxp, p["block_k"]


def _forward(q, k, v, idx, cfg: _Config):
    B, T, H, _ = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    R = H // G
    qg, kp, vp, idxp, block_k = _prepare(q, k, v, idx, cfg.sizes, backward=False)
    o, lse2 = _forward_call(
        qg, kp, vp, idxp, scale=cfg.scale, block_k=block_k, sizes=cfg.sizes, interpret=cfg.interpret
    )
    out = o[:, :, :, :R, :Dv].reshape(B, T, H, Dv).astype(q.dtype)
    return out, lse2[:, :, :, :R].reshape(B, T, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sparse_attention(q, k, v, idx, cfg: _Config):
    return _forward(q, k, v, idx, cfg)[0]


def _sparse_attention_fwd(q, k, v, idx, cfg: _Config):
    out, lse = _forward(q, k, v, idx, cfg)
    return out, (q, k, v, idx, lse)


def _sparse_attention_bwd(cfg: _Config, residuals, d_out):
    q, k, v, idx, lse = residuals  # lse: f32 [B, T, H], base-2 log-sum-exp of the logits
    B, T, H, D = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    R = H // G
    qg, kp, vp, idxp, block_k = _prepare(q, k, v, idx, cfg.sizes, backward=True)
    Rp, Dvp = qg.shape[3], vp.shape[-1]
    dog = _pad_axis(_pad_axis(d_out.astype(qg.dtype).reshape(B, T, G, R, Dv), 3, Rp), 4, Dvp)
    lseg = _pad_axis(lse.reshape(B, T, G, R), 3, Rp)  # padded heads: q = 0, dO = 0 -> no gradient
    kwargs = dict(scale=cfg.scale, block_k=block_k, sizes=cfg.sizes, interpret=cfg.interpret)
    if cfg.deterministic:
        dq, dk, dv = _deterministic_backward(qg, kp, vp, idxp, lseg, dog, **kwargs)
    else:
        dq, dk, dv = _backward_call(qg, kp, vp, idxp, lseg, dog, atomic=True, **kwargs)
    dq = dq[:, :, :, :R, :D].reshape(B, T, H, D).astype(q.dtype)
    return dq, dk[..., :D].astype(k.dtype), dv[..., :Dv].astype(v.dtype), None


_sparse_attention.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


def sparse_attention(
    q,
    k,
    v,
    idx,
    *,
    scale: float,
    interpret: bool = False,
    deterministic: bool | None = None,
    block_sizes: BlockSizes | None = None,
):
    """Sparse attention with Pallas kernels; differentiable in q, k, v (`jax.custom_vjp`).

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, G, D] keys, H % G == 0; head h reads group h // (H // G).
      v: [B, S, G, Dv] values (Dv may differ from D).
      idx: [B, T, K] int selected key indices; entries outside [0, S) are ignored, never read.
      scale: logit scale (the public `hs.sparse_attention` defaults it to D ** -0.5).
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      deterministic: bitwise-reproducible dK/dV (sorted key-wise sum instead of f32 atomics).
        None: atomics on GPU (fast, run-to-run f32 rounding differences in dK/dV only; dQ and the
        forward are deterministic), deterministic in interpret mode.
      block_sizes: tile sizes, default `BlockSizes()`.
    Returns:
      [B, T, H, Dv] in q's dtype. Softmax and accumulation in f32. The VJP saves q, k, v, idx and
      one f32 [B, T, H] log-sum-exp; nothing of size T * K.
    """
    if deterministic is None:
        deterministic = bool(interpret)
    if interpret and not deterministic:
        raise ValueError(
            f"deterministic={deterministic!r} with interpret={interpret!r}: interpret mode runs "
            "the deterministic backward (deterministic=None or True)"
        )
    cfg = _Config(
        scale=float(scale),
        interpret=bool(interpret),
        deterministic=bool(deterministic),
        sizes=block_sizes or BlockSizes(),
    )
    return _sparse_attention(q, k, v, idx, cfg)
