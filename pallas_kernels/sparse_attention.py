"""Sparse attention over selected keys: Pallas GPU (Triton) kernels, forward and backward.

Each query (b, t) attends to the keys its row `idx[b, t]` selects (SPEC section 2):

    o[b,t,h] = sum_j softmax_j(scale * q[b,t,h] . k[b,idx_j,g]) * v[b,idx_j,g],  g = h // (H // G)

over the entries j of idx[b,t] inside [0, S). Entries outside [0, S) (including -1) are never
read: the gather uses a clamped row 0 and the entry's probability is forced to zero. A repeated
index counts once per occurrence; a row without a valid entry outputs zeros.

Layout of the work (HyScale: after selection the attention is O(T * k), section 1):
  * One program per (query t, batch b, kv group g). Its selected keys are gathered
    `block_k` rows at a time, `k_ref[rows, :]`. The R = H // G heads of the query that share
    the group are the rows of the matmul: scores = q [R, D] x k_rows^T [D, block_k]. So with
    G = 1 (DSA's MQA mode) one gathered K/V block serves all H heads, and the tensor cores see
    an [H, D] x [D, block_k] product, like a dense flash-attention tile with block_q = H.
  * Forward: online softmax in f32 (base-2 exponentials, FlashAttention-2), output plus the
    f32 log-sum-exp per (t, h): the only statistic saved for the backward pass.
  * Backward: recomputes the scores from the inputs and the log-sum-exp. A first sweep over the
    selected keys gets delta = sum_j p_j (dO . v_j) (the softmax correction, so the output need
    not be saved); a second sweep forms dS = p * (dP - delta) and accumulates
    dQ = scale * dS K in registers, while each gathered key receives dK_rows = scale * dS^T Q
    and dV_rows = P^T dO. Different queries select the same key, so those rows must be summed
    across programs:
      - atomic (default on GPU): float32 `atomic_add` into dK/dV f32 buffers, one read-modify-
        write per gathered element. Fast, NOT bitwise deterministic (the order of float adds
        varies from run to run).
      - deterministic (`deterministic=True`, and always in interpret mode, whose vector atomics
        mishandle duplicate indices): the kernel writes the per-(query, slot) rows, XLA sorts
        the (query, slot) pairs by key (stable), and a second kernel sums each key's rows in that
        fixed order. Queries are processed in chunks of `block_t_deterministic` so the row
        buffer stays bounded; chunks are added in order. Bitwise reproducible.

Pallas-Triton constraints (SPEC section 4) shape the wrapper: every loaded tile is a power of
two, and `tl.dot` wants every dimension >= 16, so R, D, Dv are zero-padded to powers of two
(at least 16) and idx is padded with -1 to a multiple of block_k. Zero-padded heads have zero
queries and zero output cotangents, so they add nothing to dK / dV.
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

_dot = getattr(pltriton, "dot", None) or pl.dot  # moved to the triton module in jax 0.10
_LOG2E = math.log2(math.e)
# A finite "minus infinity" for the running max, so exp2(m_old - m_new) never sees inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_TILE = 16  # tl.dot wants every matmul dimension >= 16
# Bytes of per-(query, slot) dK/dV rows one chunk of the deterministic backward may hold.
_DETERMINISTIC_BUDGET_BYTES = 1 << 30


_BWD_SCHEDULES = ("fused", "dv_first", "split")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the sparse attention kernels (powers of two).

    Attributes:
      block_k: selected keys gathered per step of the forward kernel.
      block_k_bwd: selected keys gathered per step of the backward kernel.
      num_warps, num_stages: Triton launch parameters of the forward kernel.
      num_warps_bwd, num_stages_bwd: the same for the backward kernel.
      block_t_deterministic: queries per chunk of the deterministic backward (None: sized so one
        chunk's per-slot dK/dV rows take at most ~1 GiB).
      segment_chunk: rows summed per step of the deterministic key-wise reduction.
      relaxed_atomics: relaxed (not acquire-release) ordering for the dK/dV atomics.
      skip_invalid: stop each query's key loops after its last block holding a valid entry
        (hytopk pads rows with trailing -1s), and mask the dK/dV atomics of invalid slots. With
        False, those blocks are gathered and masked, and invalid slots add zeros into row 0
        (kept for the same-run comparison in experiments/bench_attention.py --tune).
      bwd_schedule: where the backward forms dV's rows, P^T dO (they need no delta):
        "fused": one kernel, dK and dV rows both in the gradient sweep;
        "dv_first": one kernel, dV's rows in the delta sweep, so each sweep carries half of the
          dK/dV writes beside its matmuls;
        "split": two kernels, the delta sweep with dV's rows, then the gradient sweep with dQ and
          dK's rows, so each kernel's atomics target one f32 [S, D] buffer, not two.
    """

    block_k: int = 32
    # H200, T=32K, H=64, same run: fwd+bwd 48.20 ms with 64, 49.79 with 32, 64.64 with 16; 8
    # backward warps are slower at both 32 and 64 (results/hytopk_bk256/attn_bwd_tune/).
    block_k_bwd: int = 64
    num_warps: int = 4
    # H200, T=32K, H=64: forward 9.8 ms with 5 stages, 10.4-10.6 ms with 3 (results/bounds/).
    num_stages: int = 5
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    block_t_deterministic: int | None = None
    segment_chunk: int = 16
    relaxed_atomics: bool = True
    skip_invalid: bool = True
    bwd_schedule: str = "fused"

    def __post_init__(self):
        if self.bwd_schedule not in _BWD_SCHEDULES:
            raise ValueError(f"bwd_schedule={self.bwd_schedule!r}; choose one of {_BWD_SCHEDULES}")


def _relaxed_atomic_add_factory():
    """`atomic_add` with relaxed memory ordering, or None where jax's internals differ.

    `pltriton.atomic_add` emits acquire-release atomics: every add orders all earlier memory
    traffic. The dK/dV sums need atomicity only (no other memory is published through them), so
    the backward uses a private copy of jax's atomic primitive whose Triton lowering asks for
    `sem=relaxed`. It only exists on the compiled GPU path (no interpret rule).
    """
    try:
        from jax._src import core as jax_core  # noqa: PLC0415
        from jax._src import tree_util  # noqa: PLC0415
        from jax._src.lib.triton import dialect as tt_dialect  # noqa: PLC0415
        from jax._src.pallas.triton import lowering as tt_lowering  # noqa: PLC0415
        from jax._src.pallas.triton import primitives as tt_primitives  # noqa: PLC0415
        from jax._src.state import primitives as state_primitives  # noqa: PLC0415

        base_rule = tt_primitives._atomic_lowering_rule
        abstract_eval = tt_primitives._atomic_abstract_eval
        add = tt_primitives.AtomicOpType.ADD
        relaxed = tt_dialect.MemSemantic.RELAXED
        default_rmw = tt_lowering._atomic_rmw
    except (ImportError, AttributeError):
        return None

    prim = jax_core.Primitive("sparse_attn_atomic_add_relaxed")
    prim.def_effectful_abstract_eval(abstract_eval)

    def lowering_rule(ctx, *args, args_tree, atomic_type):
        tt_lowering._atomic_rmw = functools.partial(default_rmw, semantic=relaxed)
        try:
            return base_rule(ctx, *args, args_tree=args_tree, atomic_type=atomic_type)
        finally:
            tt_lowering._atomic_rmw = default_rmw

    tt_lowering.register_lowering(prim)(lowering_rule)

    def atomic_add(ref, idx, val, *, mask=None):
        x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
        args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
        return prim.bind(*args_flat, args_tree=args_tree, atomic_type=add)

    return atomic_add


_relaxed_atomic_add = _relaxed_atomic_add_factory()


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _gather_block(idx_ref, j, block_k: int, num_keys: int):
    """Slot block j of one query: (safe rows [block_k] int32, valid mask [block_k] bool).

    Entries outside [0, num_keys) are clamped to row 0 (never an out-of-bounds read); callers
    zero their contribution with the mask.
    """
    ids = idx_ref[pl.ds(j * block_k, block_k)]
    valid = (ids >= 0) & (ids < num_keys)
    return jnp.where(valid, ids, 0), valid


def _live_blocks(idx_ref, block_k: int, num_keys: int, skip_invalid: bool):
    """Slot blocks of one query up to and including the last that holds a valid entry.

    hytopk pads each row with trailing -1s (rows of early causal queries are mostly padding), so
    the loops stop there instead of gathering and masking empty blocks. Scans back from the last
    block: usually one block load. skip_invalid=False: all blocks.
    """
    num_blocks = idx_ref.shape[0] // block_k
    if not skip_invalid:
        return num_blocks

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
    skip_invalid: bool,
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
    acc, m, total = lax.fori_loop(
        0, _live_blocks(idx_ref, block_k, num_keys, skip_invalid), body, init
    )
    nonempty = total > 0.0
    o_ref[...] = (acc / jnp.where(nonempty, total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, total, 1.0)), -jnp.inf)


def _backward_sweeps(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    *,
    scale: float,
    scale_log2: float,
    block_k: int,
    precision,
    atomic: bool,
    skip_invalid: bool,
    atomic_add,
):
    """The two sweeps of one query's backward over its selected keys, as closures on its refs.

    Refs: idx_ref [Kp] int32; q_ref [R, D]; k_ref [S, D]; v_ref [S, Dv]; do_ref [R, Dv] output
    cotangent; lse_ref [R] f32 log2-sum-exp2 from the forward kernel.

    Returns (delta_sweep, grad_sweep):
      delta_sweep(dv_ref=None) -> delta [R] f32, delta[r] = sum_j p[r,j] dP[r,j] = dO[r] . o[r]
        (the softmax correction, so the output need not be saved). dV = P^T dO needs no delta,
        so given dv_ref it also writes dV's rows here.
      grad_sweep(delta, dk_ref, dv_ref=None) -> dQ [R, D] f32 (unscaled) from
        dS = p * (dP - delta); writes dK's rows, scale * dS^T Q, and dV's if given dv_ref.
    Row writes: atomic=True adds into f32 [S, D] / [S, Dv] buffers shared by all queries;
    atomic=False stores this query's row per slot into [Kp, D] / [Kp, Dv].
    """
    num_keys = k_ref.shape[0]
    rows_q, d = q_ref.shape
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    # Trailing blocks without a valid entry contribute nothing; the deterministic path still
    # runs them, since it must write every slot's (zero) rows into its uninitialized buffers.
    num_blocks = _live_blocks(idx_ref, block_k, num_keys, skip_invalid and atomic)

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
            # Invalid slots were clamped to row 0 and carry exact zeros (p = 0 there); skip_invalid
            # masks their adds off instead of piling them onto row 0.
            mask = jnp.broadcast_to(valid[:, None], rows_val.shape) if skip_invalid else None
            atomic_add(ref, (rows, slice(None)), rows_val, mask=mask)
        else:
            ref[pl.ds(j * block_k, block_k), :] = rows_val

    def write_dv(dv_ref, j, rows, valid, p):
        write_rows(
            dv_ref, j, rows, valid, _dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        )

    def delta_sweep(dv_ref=None):
        def body(j, delta):
            rows, valid, _, p, dp = recompute(j)
            if dv_ref is not None:
                write_dv(dv_ref, j, rows, valid, p)
            return delta + jnp.sum(p * dp, axis=1)

        return lax.fori_loop(0, num_blocks, body, jnp.zeros((rows_q,), jnp.float32))

    def grad_sweep(delta, dk_ref, dv_ref=None):
        def body(j, dq):
            rows, valid, k_blk, p, dp = recompute(j)
            ds = p * (dp - delta[:, None])  # [R, block_k] f32
            dq = dq + _dot(ds.astype(k_blk.dtype), k_blk, precision=precision)
            write_rows(
                dk_ref,
                j,
                rows,
                valid,
                _dot(ds.astype(q.dtype), q, trans_a=True, precision=precision) * scale,
            )
            if dv_ref is not None:
                write_dv(dv_ref, j, rows, valid, p)
            return dq

        return lax.fori_loop(0, num_blocks, body, jnp.zeros((rows_q, d), jnp.float32))

    return delta_sweep, grad_sweep


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
    dv_in_delta_sweep: bool,
    **sweep_kw,
):
    """One query's whole backward in one kernel: dQ [R, D] into dq_ref, dK/dV rows (see
    `_backward_sweeps`) into dk_ref and dv_ref."""
    delta_sweep, grad_sweep = _backward_sweeps(
        idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, scale=scale, **sweep_kw
    )
    delta = delta_sweep(dv_ref if dv_in_delta_sweep else None)
    dq = grad_sweep(delta, dk_ref, None if dv_in_delta_sweep else dv_ref)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _delta_dv_kernel(
    idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dv_ref, *, scale: float, **sweep_kw
):
    """First kernel of the split backward: delta [R] f32 into delta_ref, dV's rows."""
    delta_sweep, _ = _backward_sweeps(
        idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, scale=scale, **sweep_kw
    )
    delta_ref[...] = delta_sweep(dv_ref)


def _dq_dk_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    dk_ref,
    *,
    scale: float,
    **sweep_kw,
):
    """Second kernel of the split backward: dQ from delta_ref [R] f32, and dK's rows."""
    _, grad_sweep = _backward_sweeps(
        idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, scale=scale, **sweep_kw
    )
    dq = grad_sweep(delta_ref[...], dk_ref)
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
        skip_invalid=sizes.skip_invalid,
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
    """dQ [B,T,G,R,D] and either dK/dV f32 [B,S,G,D]/[B,S,G,Dv] (atomic) or per-slot rows
    f32 [B,G,T,Kp,D]/[B,G,T,Kp,Dv] (deterministic). lse [B,T,G,R], do [B,T,G,R,Dv].

    sizes.bwd_schedule picks the kernels: "fused" and "dv_first" run one kernel per query (dV's
    rows formed in the gradient sweep or in the delta sweep); "split" runs the delta sweep with
    dV in one kernel and the gradient sweep with dQ/dK in a second, passing delta [B,T,G,R] f32.
    """
    B, T, G, R, D = q.shape
    S, Dv, Kp = k.shape[1], v.shape[-1], idx.shape[-1]
    atomic_add = pltriton.atomic_add
    if atomic and sizes.relaxed_atomics and _relaxed_atomic_add is not None:
        atomic_add = _relaxed_atomic_add
    sweep_kw = dict(
        scale=scale,
        scale_log2=scale * _LOG2E,
        block_k=block_k,
        precision=_precision(q.dtype),
        atomic=atomic,
        skip_invalid=sizes.skip_invalid,
        atomic_add=atomic_add,
    )
    in_specs = _common_specs(B, T, G, R, D, Dv, S, Kp) + [
        pl.BlockSpec((None, None, None, R, Dv), lambda t, b, g: (b, t, g, 0, 0)),  # do
        pl.BlockSpec((None, None, None, R), lambda t, b, g: (b, t, g, 0)),  # lse
    ]
    args = (idx, q, k, v, do, lse)
    per_head_spec = pl.BlockSpec((None, None, None, R), lambda t, b, g: (b, t, g, 0))
    dq_out = (
        pl.BlockSpec((None, None, None, R, D), lambda t, b, g: (b, t, g, 0, 0)),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
    )
    delta_out = (per_head_spec, jax.ShapeDtypeStruct((B, T, G, R), jnp.float32))
    params = pltriton.CompilerParams(num_warps=sizes.num_warps_bwd, num_stages=sizes.num_stages_bwd)

    def rows_out(width):
        if atomic:  # one f32 buffer shared by all queries
            return (
                pl.BlockSpec((None, S, None, width), lambda t, b, g: (b, 0, g, 0)),
                jax.ShapeDtypeStruct((B, S, G, width), jnp.float32),
            )
        return (
            pl.BlockSpec((None, None, None, Kp, width), lambda t, b, g: (b, g, t, 0, 0)),
            jax.ShapeDtypeStruct((B, G, T, Kp, width), jnp.float32),
        )

    def launch(kernel, name, args, in_specs, outs, row_widths):
        """outs: (spec, shape) of the plain outputs; then one row buffer per width. Atomic row
        buffers start as zeros passed in and aliased to the outputs."""
        rows = [rows_out(w) for w in row_widths]
        call = functools.partial(
            pl.pallas_call,
            grid=(T, B, G),
            out_specs=[s for s, _ in outs + rows],
            out_shape=[shape for _, shape in outs + rows],
            compiler_params=params,
            interpret=interpret,
            name=f"{name}_{'atomic' if atomic else 'rows'}",
        )
        if not atomic:
            return call(kernel, in_specs=in_specs)(*args)
        n_in, n_rows = len(args), len(rows)

        def body(*refs):  # drop the aliased zero inputs: the kernel adds into the outputs
            kernel(*refs[:n_in], *refs[n_in + n_rows :])

        zeros = [jnp.zeros(shape.shape, shape.dtype) for _, shape in rows]
        return call(
            body,
            in_specs=in_specs + [s for s, _ in rows],
            input_output_aliases={n_in + i: len(outs) + i for i in range(n_rows)},
        )(*args, *zeros)

    if sizes.bwd_schedule == "split":
        delta, dv = launch(
            functools.partial(_delta_dv_kernel, **sweep_kw),
            "sparse_attn_bwd_dv",
            args,
            in_specs,
            [delta_out],
            [Dv],
        )
        dq, dk = launch(
            functools.partial(_dq_dk_kernel, **sweep_kw),
            "sparse_attn_bwd_dq_dk",
            args + (delta,),
            in_specs + [per_head_spec],
            [dq_out],
            [D],
        )
        return dq, dk, dv
    kernel = functools.partial(
        _backward_kernel, dv_in_delta_sweep=sizes.bwd_schedule == "dv_first", **sweep_kw
    )
    return launch(kernel, "sparse_attn_bwd", args, in_specs, [dq_out], [D, Dv])


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
            "interpret=True needs deterministic=True: interpret-mode vector atomics "
            "mis-add duplicate indices"
        )
    cfg = _Config(
        scale=float(scale),
        interpret=bool(interpret),
        deterministic=bool(deterministic),
        sizes=block_sizes or BlockSizes(),
    )
    return _sparse_attention(q, k, v, idx, cfg)
