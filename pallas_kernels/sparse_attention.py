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
  * One program per (query t, batch b, kv group g, head block). Its selected keys are gathered
    `block_k` rows at a time, `k_ref[rows, :]`. The block_h heads of the query that share the
    group are the rows of the matmul: scores = q [block_h, D] x k_rows^T [D, block_k]. So with
    G = 1 (DSA's MQA mode) one gathered K/V block serves block_h heads, and the tensor cores see
    an [block_h, D] x [D, block_k] product, like a dense flash-attention tile with
    block_q = block_h. By default block_h is all of the group's heads (64 at D = Dv = 128);
    wide values split the heads over programs, as the f32 accumulator [block_h, Dv] must fit
    in registers: MLA's forward takes 64 heads a program on 8 warps, its backward's dQ kernel
    16 heads a program on 4 (key-major: the keys are its matmuls' rows, and dQ^T [D, 16] its
    accumulator), and its key-gradient kernel 64 heads (below).
  * MLA's absorbed form (DSA on GLM-5.1 and DeepSeek-V3.2): G = 1, D = 576 = 512 latent + 64
    rope, and the value is the key's leading 512 features (`value_dim`, v=None). A row is read
    as two power-of-two column windows, [0, 512) and [512, 576), the scores are the sum of two
    dots (a padded 1024-wide tile would double their FLOPs), and the gathered [block_k, 512]
    window is the value tile too: each selected row is gathered once.
  * Each program's key loops stop after the last slot block that holds a valid entry (hytopk
    pads rows with trailing -1s: rows of early causal queries are mostly padding).
  * Forward: online softmax in f32 (base-2 exponentials, FlashAttention-2), output plus the f32
    log-sum-exp per (t, h): the only statistic saved for the backward pass. On Hopper, MLA's
    absorbed form can run the warp-specialized Mosaic GPU forward of
    `pallas_kernels/sparse_attention_mosaic.py` instead (`BlockSizes.forward_kernel`), and
    the split backward its Mosaic GPU dQ kernel (`BlockSizes.dq_kernel`).
  * Backward, one kernel per query: it recomputes the scores from the inputs and the
    log-sum-exp. A first sweep over the selected keys gets delta = sum_j p_j (dO . v_j) (the
    softmax correction, so the output need not be saved); a second sweep forms
    dS = p * (dP - delta), accumulates dQ = scale * dS K in registers, and gives each gathered
    key its rows dK_rows = scale * dS^T Q and dV_rows = P^T dO, each added right after its own
    matmul. Different queries select the same key, so those rows are summed across programs:
      - atomic (the default on GPU): f32 atomic adds with relaxed ordering
        (pallas_kernels/relaxed_atomics.py) into f32 dK/dV buffers, masked off for invalid
        slots. Fast, not bitwise deterministic (the order of the float adds varies). Where a
        query's heads span several backward programs (MLA), the backward is split: a delta
        kernel sums delta = sum_j P_j dP_j in the forward's layout, one kernel
        makes dQ per head block in one sweep, and a key-gradient kernel takes 64 heads a program,
        key-major (the slot block's 128 keys are the rows of every matmul, so Triton emits
        `wgmma`) with the features in 64-wide column chunks, so its heads' q and dO fit in
        shared memory and each key's rows are added once per 64 heads.
      - deterministic (`deterministic=True`, and the default in interpret mode): the kernel
        stores each (query, slot) pair's rows, XLA sorts the pairs by key (stable), and a second
        kernel sums each key's rows in that fixed order. Queries are processed in chunks of
        `block_t_deterministic` so the row buffer stays bounded; chunks are added in order.
        Bitwise reproducible.

Pallas-Triton constraints shape the wrapper: every loaded tile is a power of two, and `tl.dot`
wants every dimension >= 16. So the heads of a group are zero-padded to a power of two (at
least 16), the feature axis to one or two power-of-two pieces (`_Layout`), the value to a power
of two, and idx with -1 to a multiple of block_k. Zero-padded heads have zero queries and zero
output cotangents, so they add nothing to dK / dV.
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

from pallas_kernels import relaxed_atomics, sparse_attention_mosaic

_dot = getattr(pltriton, "dot", None) or pl.dot  # moved to the triton module in jax 0.10
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)  # base-2 log-sum-exps to natural ones
# A finite "minus infinity" for the running max, so exp2(m_old - m_new) never sees inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_TILE = 16  # tl.dot wants every matmul dimension >= 16
_KERNEL_CHOICES = ("auto", "triton", "mosaic")  # BlockSizes.forward_kernel and dq_kernel
# Bytes of per-(query, slot) dK/dV rows one chunk of the deterministic backward may hold.
_DETERMINISTIC_BUDGET_BYTES = 1 << 30
# f32 output-accumulator elements one program of 4 warps holds by default (BlockSizes.block_h).
_ACC_ELEMENTS = 64 * 128
# Heads per forward program with a shared value (MLA), on 8 warps (BlockSizes.block_h).
_SHARED_VALUE_HEADS = 64
# Heads per program of the key-gradient kernel by default (BlockSizes.block_h_dkv): with a
# shared value (MLA), and with a separate one (where 64 was never timed).
_DKV_HEADS_SHARED = 64
_DKV_HEADS = 32
# Selected keys per step and feature columns per matmul of the key-gradient kernel by default
# (BlockSizes.block_k_dkv, dkv_chunk).
_DKV_KEYS = 128
_DKV_CHUNK = 64
# The split backward's dQ kernel by default (BlockSizes.block_h_dq, block_k_dq, num_warps_dq,
# num_stages_dq): 16 heads a program on 4 warps, 4 pipelining stages, 64 selected keys a step
# (the rows of its key-major matmuls: `wgmma` from 64). MLA at T = 32K, H = 64 (H100):
# forward+backward 266.56 ms against 272.24 at 32 heads, 8 warps, 2 stages.
_DQ_HEADS = 16
_DQ_KEYS = 64
_DQ_WARPS = 4
_DQ_STAGES = 4
# Gathered K (and V) bytes of one 64-key dQ step above which the step halves to 32 keys: the
# program's shared memory grows about 2.3x with them (sm_90 compile: 224,000 bytes at
# 98,304 per step, a separate 512-wide value beside 256-wide keys; 297,472 at 131,072, over
# the 232,448 a program may have).
_DQ_STEP_BUDGET_BYTES = 96 * 1024
# Gathered K/V tile bytes the default pipelining depth may stage: Triton's shared memory also
# holds the dot operands' copies, and 227 KiB is all there is.
_STAGE_BUDGET_BYTES = 80 * 1024
# The same for the forward with a shared value (MLA), whose one tile is both K and V: 5 stages
# of 36 KiB tiles beside 64 heads' queries (185,088 bytes of shared memory): forward 47.60 ms
# against 52.96 at 3 stages (H100, BlockSizes.num_stages). Triton keeps num_stages - 2 gathered
# tiles: a step's gather then overlaps the previous step's matmuls.
_SHARED_STAGE_BUDGET_BYTES = 180 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the sparse attention kernels (powers of two).

    Times quoted below: one H200, jax 0.11.2, B=1, T=S=32K, H=64, G=1, D=Dv=128, k=2048, bf16,
    causal random indices (experiments/bench_attention.py); figures compared with each other
    come from one run unless the comment says otherwise.
    """

    # The forward's kernel. "auto": MLA's absorbed form (a shared 512-wide value, G = 1, bf16 or
    # f16) on a Hopper GPU runs the warp-specialized Mosaic GPU kernel
    # (`pallas_kernels/sparse_attention_mosaic.py`; H100, T = 32K, H = 64: 31.06 ms against
    # 48.71 for the Triton kernel, forward+backward 231.96 against 248.26, same run), everything
    # else the Triton kernel. "triton": always the Triton kernel (block_k, block_h, num_warps and
    # num_stages below are its settings; the Mosaic kernel has its own). "mosaic": the Mosaic
    # kernel, or a ValueError saying why it cannot run.
    forward_kernel: str = "auto"
    # The split backward's dQ kernel, chosen as forward_kernel: the Mosaic GPU kernel
    # (`sparse_attention_mosaic.dq`; MLA's absorbed form with D <= 576, the atomic backward)
    # or the Triton one (`_dq_kernel`). H100, T = 32K, forward+backward with the Mosaic
    # forward: 219.10 ms against 231.13 at H = 64, 434.78 against 456.27 at H = 128 (same run).
    dq_kernel: str = "auto"
    # Selected keys gathered per step of the forward kernel. Forward 9.82 ms at 32 against 10.46
    # at 64 (both 5 stages) and 11.54 at 16 (8 stages); in another run 128 keys (8 warps) took
    # 19.35 ms against 10.94 at 64.
    block_k: int = 32
    # Selected keys per step of the single backward kernel. Forward+backward 48.20 ms at 64 against
    # 49.79 at 32 and 64.64 at 16; in another run 95.69 at 128 against 47.97 at 64. None: 64,
    # or 32 where a key row and its value exceed 512 features together (MLA: 576 + 512).
    block_k_bwd: int | None = None
    # Query heads per program of the forward kernel (the rows of its matmuls), of one kv group.
    # None: all of the group's heads while block_h * Dv <= 8192 (the f32 output accumulator at
    # H=64, Dv=128: 64 registers a thread on 4 warps); with a shared value (MLA) up to 64 heads,
    # on 8 warps: H100, MLA (D = 576, value 512), T = 32K, H = 64: 67.86 ms at 64 heads on 8
    # warps and 3 stages against 79.88 at 16 heads on 4 warps and 2 stages (same run); else the
    # largest power of two within 8192. A query's head blocks run in neighbouring programs, so
    # the later ones find its gathered rows in L2.
    block_h: int | None = None
    # Query heads per program of the single backward kernel (dQ and the key gradients of one
    # query's heads; also the deterministic backward's). None: all of the group's heads while
    # block_h_bwd * Dv <= 8192, else the largest power of two within that (16 at MLA's
    # Dv = 512): the kernel holds dQ and dO beside the accumulator, so it keeps the 4-warp
    # budget. Where block_h_dkv is larger, the atomic backward is split into a dQ kernel and a
    # key-gradient kernel (below) instead.
    block_h_bwd: int | None = None
    # Triton warps of the forward kernel. None: 4, or 8 where block_h * Dv exceeds 8192. (The
    # split backward's delta kernel, in the forward's layout, holds no output accumulator and
    # always takes 4.) 64-key tiles at D = 128: 14.27 ms with 8 warps (3 stages) against 10.94
    # with 4 (2 stages).
    num_warps: int | None = None
    # Software-pipelining depth of the forward's gathers and matmuls: 9.82 ms with 5 stages,
    # 10.58 with 3, 9.76 with 6 (within noise, and more shared memory), 11.4-11.5 with 7-8.
    # None: 5, or fewer where 5 gathered tiles would exceed 80 KiB (180 KiB with a shared value:
    # MLA's rows, 5 stages). Not the delta kernel's: its own budget, less its resident dO
    # (3 stages at MLA).
    num_stages: int | None = None
    # Query heads per program of the key-gradient kernel, where the backward's heads span
    # several programs (block_h_bwd < the group's heads, e.g. MLA): the backward then runs a
    # delta kernel (delta = sum P dP from the saved log-sum-exp) in the forward's layout, one
    # kernel per head block for dQ (no atomics), and
    # one per block_h_dkv heads that sums its heads' dK/dV rows in its matmuls before adding
    # them, so a key's rows are added heads / block_h_dkv times per query instead of
    # heads / block_h_bwd. That kernel is key-major (the slot block's keys are the rows of
    # every matmul, on `wgmma` from 64 keys) and runs the feature axis in column chunks
    # (dkv_chunk), so 64 heads' q and dO fit its shared memory: H100, MLA (D = 576, value 512),
    # T = 32K, H = 64, k = 2048, forward+backward 402.8 ms at 64 heads and 128 keys against
    # 478.2 with head-major 32-head programs (same run). None: 64 with a shared value (MLA),
    # else 32 (the separate-value backward kept its layout: 64 there is untimed); capped at the
    # group's heads; no larger than block_h_bwd: the single backward kernel.
    block_h_dkv: int | None = None
    # Selected keys per step of the key-gradient kernel: the rows of its matmuls. None: 128;
    # 402.8 ms against 463.6 at 64 keys (same run).
    block_k_dkv: int | None = None
    # Feature columns per matmul of the key-gradient kernel (capped at the key's main piece and
    # the value width). None: 64. At 64-key steps 128 columns took 439.5 ms against 463.6 (same
    # run); at 128-key steps only 64 was timed (128 columns compile to 204,800 bytes of shared
    # memory and 428 B of spills, against 172,032 and 288).
    dkv_chunk: int | None = None
    # Triton warps of the key-gradient kernel: two warpgroups, each its half of the rows.
    num_warps_dkv: int = 8
    # The split backward's dQ kernel: query heads per program (None: 16, capped at the group's
    # heads), selected keys per step (None: 64, the rows of its key-major matmuls, `wgmma` from
    # 64; 32 where one step's gathered rows exceed 96 KiB), Triton warps (None: 4) and
    # pipelining stages (None: 4). Per slot block it computes S^T = K Q^T and dP^T = V dO^T
    # ([keys, heads]) with q and dO resident as right operands, then dQ^T += K^T dS^T. MLA,
    # T = 32K, H = 64 (H100): forward+backward 266.56 ms against 272.24 at 32 heads on 8 warps
    # and 2 stages, and 304.58 with the head-major dQ kernel it replaced (same machine).
    block_h_dq: int | None = None
    block_k_dq: int | None = None
    num_warps_dq: int | None = None
    num_stages_dq: int | None = None
    # Triton warps of the single backward kernel. 8 warps: 64.53 ms against 48.20 with 4
    # (64-key tiles), 85.54 against 49.79 (32-key tiles).
    num_warps_bwd: int = 4
    # Pipelining depth of the single backward kernel. Forward+backward 47.97 / 47.83 ms with 2
    # stages, 47.97 with 3, 47.89 with 4 (within noise: the backward is bound by its atomics),
    # 56.29 with 1; 2 takes the least shared memory of the fast ones. None: 2, or 1 where two
    # gathered tiles would exceed 80 KiB. The key-gradient kernel always runs at 1 stage: it
    # and the head-major dQ kernel it ran beside, both at 2 stages, took 704.3 ms against
    # 463.6 at 1 (MLA forward+backward, 64-key steps; H100, same run).
    num_stages_bwd: int | None = None
    # Queries per chunk of the deterministic backward, whose per-(query, slot) dK/dV rows take
    # B * G * block_t * Kp * (D + Dv) * 4 bytes. None: the largest power of two that keeps one
    # chunk within 1 GiB, so memory stays bounded at any T.
    block_t_deterministic: int | None = None
    # Rows summed per step of the deterministic backward's key-wise sum (its gather tile; a key
    # chosen by n queries takes ceil(n / segment_chunk) steps). Not tuned.
    segment_chunk: int = 16

    def __post_init__(self):
        for name in (
            "block_k",
            "block_k_bwd",
            "block_h",
            "block_h_bwd",
            "block_h_dkv",
            "block_k_dkv",
            "dkv_chunk",
            "block_h_dq",
            "block_k_dq",
            "segment_chunk",
        ):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{name} must be a power of two; got {value}")
        for name in ("forward_kernel", "dq_kernel"):
            if getattr(self, name) not in _KERNEL_CHOICES:
                raise ValueError(
                    f"BlockSizes.{name} must be one of {_KERNEL_CHOICES}; "
                    f"got {getattr(self, name)!r}"
                )


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one call's features and heads map onto the kernels' power-of-two tiles.

    The feature axis of q and k is one or two pieces, each a power of two >= 16, read with two
    column windows of the same rows: [0, d_main) and [d_main, d_main + d_tail). Scores are the
    sum of the two pieces' dot products. MLA's d_qk = 576 is 512 + 64 (no padding; one padded
    1024-wide tile would double the score FLOPs). With `shared`, the value of a key is its
    leading d_main features (MLA's absorbed form), so the one gathered tile is both K and V.
    """

    d_main: int  # width of the first feature piece
    d_tail: int  # width of the second piece, 0 when one piece holds D
    dv: int  # padded value width (d_main when shared)
    shared: bool  # the value is the key's leading d_main features
    heads: int  # padded heads of one kv group (a multiple of block_h)
    block_h: int  # heads per program
    block_h_dkv: int  # heads per program of the key-gradient kernel (block_h: none runs)

    @property
    def width(self) -> int:  # padded feature width of q and k
        return self.d_main + self.d_tail

    @property
    def head_blocks(self) -> int:
        return self.heads // self.block_h

    @property
    def split_backward(self) -> bool:
        """dQ and the key gradients in separate kernels (atomic backward)."""
        return self.block_h_dkv > self.block_h


def _feature_split(D: int, value_dim: int | None) -> tuple[int, int]:
    """(d_main, d_tail) covering D: one piece of next_pow2(D) unless two pieces pad less; with a
    shared value (value_dim a power of two >= 16) the first piece is exactly the value."""
    if value_dim is not None:
        return value_dim, (_next_pow2(D - value_dim, _MIN_TILE) if D > value_dim else 0)
    whole = _next_pow2(D, _MIN_TILE)
    main = max(_MIN_TILE, whole // 2)
    if D > main and main + _next_pow2(D - main, _MIN_TILE) < whole:
        return main, _next_pow2(D - main, _MIN_TILE)
    return whole, 0


def _layout(
    H: int, G: int, D: int, Dv: int, shared: bool, sizes: BlockSizes, backward: bool = False
) -> _Layout:
    """The layout of the forward kernel, or with `backward` of the backward kernels (their own
    head block, BlockSizes.block_h_bwd)."""
    d_main, d_tail = _feature_split(D, Dv if shared else None)
    dv = d_main if shared else _next_pow2(Dv, _MIN_TILE)
    heads = _next_pow2(H // G, _MIN_TILE)
    default = max(_MIN_TILE, _ACC_ELEMENTS // dv)
    if shared and not backward and heads * dv > _ACC_ELEMENTS:
        default = _SHARED_VALUE_HEADS
    block_h = (sizes.block_h_bwd if backward else sizes.block_h) or default
    block_h = max(_MIN_TILE, min(block_h, heads))
    dkv_default = _DKV_HEADS_SHARED if shared else _DKV_HEADS
    block_h_dkv = max(block_h, min(sizes.block_h_dkv or dkv_default, heads))
    return _Layout(d_main, d_tail, dv, shared, heads, block_h, block_h_dkv)


def _tile_bytes(lay: _Layout, block_k: int, dtype) -> int:
    """Bytes of one gathered step: block_k key rows, and their value rows unless shared."""
    return block_k * (lay.width + (0 if lay.shared else lay.dv)) * jnp.dtype(dtype).itemsize


def _stages(
    requested: int | None, default: int, tile_bytes: int, budget: int = _STAGE_BUDGET_BYTES
) -> int:
    if requested is not None:
        return requested
    return max(1, min(default, budget // tile_bytes))


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


def _masked_rows(ref, rows, valid, start: int, size: int):
    """[n, size]: columns [start, start + size) of `ref`'s rows `rows` [n], zeros where `valid`
    [n] is False (a NaN/inf in the clamped row 0 cannot leak through 0 * v).

    The mask is the load's own (Triton's `cp.async` zero-fill), not a select on the loaded
    tile: a select needs the tile in registers and then in shared memory again for the next
    matmul, and Triton then stages it once, so each step's gather waited on the previous
    step's matmuls (MLA forward, H100: 52.96 ms against 66.66 at 3 stages). Integer indexers on
    both axes: interpret mode has no masked load with a slice indexer."""
    n = rows.shape[0]
    row_ids = jnp.broadcast_to(rows[:, None], (n, size))
    col_ids = jnp.broadcast_to(start + lax.broadcasted_iota(jnp.int32, (1, size), 1), (n, size))
    mask = jnp.broadcast_to(valid[:, None], (n, size))
    return pltriton.load(ref.at[row_ids, col_ids], mask=mask, other=0)


def _masked_pieces(ref, rows, valid, lay):
    """`_pieces` of the gathered rows `rows` [n] with `_masked_rows`' masked loads: (main
    [n, d_main], tail [n, d_tail] or None), zeros where `valid` [n] is False."""
    main = _masked_rows(ref, rows, valid, 0, lay.d_main)
    tail = _masked_rows(ref, rows, valid, lay.d_main, lay.d_tail) if lay.d_tail else None
    return main, tail


def _pieces(ref, rows, lay):
    """The feature pieces of `ref` ([S, width] with `rows` an index vector, or [R, width] with
    rows=None): (main [n, d_main], tail [n, d_tail] or None). `lay`: a `_Layout`, or anything
    with its d_main and d_tail (the indexer loss kernels' feature split)."""
    sel = slice(None) if rows is None else rows
    if not lay.d_tail:
        return ref[sel, :], None
    return ref[sel, pl.ds(0, lay.d_main)], ref[sel, pl.ds(lay.d_main, lay.d_tail)]


def _scores(q_main, q_tail, k_main, k_tail, precision):
    """[R, n] f32: q . k over both feature pieces."""
    s = _dot(q_main, k_main, trans_b=True, precision=precision)
    if k_tail is not None:
        s = s + _dot(q_tail, k_tail, trans_b=True, precision=precision)
    return s


def _probabilities(q_main, q_tail, k_main, k_tail, v_blk, do, lse, valid, *, scale_log2, precision):
    """One gathered slot block of the backward: (p, dp), both [block_h, block_k] f32. p from the
    forward's base-2 log-sum-exp lse [block_h] (0 on invalid slots), dp = dO V^T."""
    s = _scores(q_main, q_tail, k_main, k_tail, precision) * scale_log2
    p = jnp.where(valid[None, :], jnp.exp2(s - lse[:, None]), 0.0)
    return p, _dot(do, v_blk, trans_b=True, precision=precision)


# ---------------------------------------------------------------------------------------------
# Kernels (on refs). One program = block_h heads of one query t, batch b and kv group g.
# ---------------------------------------------------------------------------------------------


def _online_softmax(idx_ref, q_ref, k_ref, v_ref, *, scale_log2, block_k, lay: _Layout, precision):
    """One query's block_h heads over its selected keys: (acc [block_h, dv] f32, the unnormalized
    output; m [block_h], the running max of the base-2 logits; total [block_h], the softmax
    denominator, 0 on rows with no valid entry). Refs as in `_forward_kernel`."""
    num_keys = k_ref.shape[0]
    q_main, q_tail = _pieces(q_ref, None, lay)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        # [block_k, d_main], [block_k, d_tail]; invalid slots' rows read as zeros
        k_main, k_tail = _masked_pieces(k_ref, rows, valid, lay)
        s = _scores(q_main, q_tail, k_main, k_tail, precision) * scale_log2  # [block_h, block_k]
        # Invalid slots' logits (NaN or inf where row 0 holds them) are replaced, not scaled.
        s = jnp.where(valid[None, :], s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # Invalid slots get probability exactly 0, also while every slot so far was invalid.
        p = jnp.where(valid[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
        correction = jnp.exp2(m_prev - m_next)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        v_blk = k_main if lay.shared else _masked_rows(v_ref, rows, valid, 0, lay.dv)
        acc = acc * correction[:, None] + _dot(p.astype(v_blk.dtype), v_blk, precision=precision)
        return acc, m_next, l_next

    init = (
        jnp.zeros((lay.block_h, lay.dv), jnp.float32),
        jnp.full((lay.block_h,), _MASK_VALUE, jnp.float32),
        jnp.zeros((lay.block_h,), jnp.float32),
    )
    return lax.fori_loop(0, _live_blocks(idx_ref, block_k, num_keys), body, init)


def _forward_kernel(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, **statics):
    """Online-softmax attention of one query's block_h heads over its selected keys.

    Args (refs):
      idx_ref: [Kp] int32 selected keys of this query, -1 padded to a multiple of block_k.
      q_ref: [block_h, width] the query's heads (padded as in `_Layout`).
      k_ref: [S, width] keys of the group.
      v_ref: [S, dv] values of the group, or None when the value is the key's main piece.
      o_ref: [block_h, dv] output.
      lse_ref: [block_h] f32 log2-sum-exp2 of the base-2 logits (-inf on rows with no valid
        entry).
    """
    acc, m, total = _online_softmax(idx_ref, q_ref, k_ref, v_ref, **statics)
    nonempty = total > 0.0
    o_ref[...] = (acc / jnp.where(nonempty, total, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, total, 1.0)), -jnp.inf)


def _delta_kernel(
    idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *, block_k, lay, **statics
):
    """The backward's softmax correction delta = dO . o = sum_j P_j (dO . v_j) per head, from
    the probabilities the forward's saved log-sum-exp gives (the output is not saved).

    Summing f32 `P dP` (dP = dO V^T on the tensor cores) keeps delta accurate where the keys
    share a vector much larger than their spread; `dO . o` with `o` recomputed from bf16
    probabilities is off there by a fraction of a large number, and dQ with it. No [block_h, dv]
    accumulator and no rescaling either. Refs as in `_forward_kernel`, and do_ref [block_h, dv]
    the output cotangent, lse_ref [block_h] f32 (the forward's; padded heads have q = dO = 0),
    delta_ref [block_h] f32 (out; 0 on rows with no valid entry)."""
    num_keys = k_ref.shape[0]
    q_main, q_tail = _pieces(q_ref, None, lay)
    do = do_ref[...]
    lse = lse_ref[...]

    def body(j, delta):
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = _masked_pieces(k_ref, rows, valid, lay)  # zeros where invalid
        v_blk = k_main if lay.shared else _masked_rows(v_ref, rows, valid, 0, lay.dv)
        p, dp = _probabilities(q_main, q_tail, k_main, k_tail, v_blk, do, lse, valid, **statics)
        return delta + jnp.sum(p * dp, axis=1)

    live = _live_blocks(idx_ref, block_k, num_keys)
    delta_ref[...] = lax.fori_loop(0, live, body, jnp.zeros((lay.block_h,), jnp.float32))


def _write_key_rows(
    row_refs, j, rows, valid, ds, p, q_main, q_tail, do, *, scale, block_k, lay, precision, atomic
):
    """The gradient rows of slot block j's keys from this program's heads: dK main piece
    (scale * dS^T Q, plus P^T dO when the value is that piece), dK tail piece, dV = P^T dO.

    atomic=True: added into the shared f32 buffers with masked relaxed atomics (invalid slots
    read row 0; their adds are masked off, so they neither touch row 0, a hotspot shared by
    every padded query, nor carry anything into it). atomic=False: this program's row per slot.
    """
    refs = iter(row_refs)

    def write(rows_val):
        ref = next(refs)
        if atomic:
            mask = jnp.broadcast_to(valid[:, None], rows_val.shape)
            relaxed_atomics.atomic_add(ref, (rows, slice(None)), rows_val, mask=mask)
        else:
            ref[pl.ds(j * block_k, block_k), :] = rows_val

    dk_main = _dot(ds.astype(q_main.dtype), q_main, trans_a=True, precision=precision) * scale
    dv_rows = _dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
    write(dk_main + dv_rows if lay.shared else dk_main)
    if lay.d_tail:
        dk_tail = _dot(ds.astype(q_tail.dtype), q_tail, trans_a=True, precision=precision)
        write(dk_tail * scale)
    if not lay.shared:
        write(dv_rows)


def _backward_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    dq_ref,
    row_refs,
    *,
    scale,
    scale_log2,
    block_k,
    lay: _Layout,
    precision,
    atomic: bool,
):
    """One query's backward over block_h heads: dQ, and the gradient rows of its selected keys.

    Args (refs):
      idx_ref: [Kp] int32; q_ref: [block_h, width]; k_ref: [S, width]; v_ref: [S, dv] or None,
        as in the forward.
      do_ref: [block_h, dv] output cotangent; lse_ref: [block_h] f32 log2-sum-exp2 from the
        forward.
      dq_ref: [block_h, width] (out).
      row_refs: f32 gradient rows (dK main piece, then dK tail piece if d_tail, then dV unless
        shared; a shared value's gradient is added into the dK main piece):
        atomic=True: [S, piece width] buffers shared by all programs (zeros on entry); this
          program's rows are added with masked relaxed atomics.
        atomic=False: [Kp, piece width], this program's row per slot (the key-wise sum never
          reads the rows of invalid slots).
    """
    num_keys = k_ref.shape[0]
    q_main, q_tail = _pieces(q_ref, None, lay)
    do = do_ref[...]
    lse = lse_ref[...]

    def recompute(j):
        """Slot block j recomputed: (rows, valid, k_main, k_tail, p [block_h, block_k],
        dp [block_h, block_k]). Gathered rows of invalid slots are zeroed by a select on the
        loaded tile (a NaN/inf in row 0 stays out). Masked loads instead (`_masked_rows`) lost
        here: forward+backward 54.92 ms against 47.41 at D = 128 (H100)."""
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = _pieces(k_ref, rows, lay)
        k_main = jnp.where(valid[:, None], k_main, 0)
        k_tail = None if k_tail is None else jnp.where(valid[:, None], k_tail, 0)
        v_blk = k_main if lay.shared else jnp.where(valid[:, None], v_ref[rows, :], 0)
        p, dp = _probabilities(
            q_main,
            q_tail,
            k_main,
            k_tail,
            v_blk,
            do,
            lse,
            valid,
            scale_log2=scale_log2,
            precision=precision,
        )
        return rows, valid, k_main, k_tail, p, dp

    write_rows = functools.partial(  # (j, rows, valid, ds, p): add or write block j's rows
        _write_key_rows,
        row_refs,
        q_main=q_main,
        q_tail=q_tail,
        do=do,
        scale=scale,
        block_k=block_k,
        lay=lay,
        precision=precision,
        atomic=atomic,
    )
    # Trailing blocks without a valid entry contribute nothing; the per-slot path still runs
    # them, since it must write every slot's rows into its uninitialized buffers.
    if atomic:
        num_blocks = _live_blocks(idx_ref, block_k, num_keys)
    else:
        num_blocks = idx_ref.shape[0] // block_k

    def delta_body(j, delta):  # delta[r] = sum_j p[r,j] dP[r,j] = dO[r] . o[r]
        *_, p, dp = recompute(j)
        return delta + jnp.sum(p * dp, axis=1)

    delta = lax.fori_loop(0, num_blocks, delta_body, jnp.zeros((lay.block_h,), jnp.float32))

    def grad_body(j, dq):
        dq_main, dq_tail = dq
        rows, valid, k_main, k_tail, p, dp = recompute(j)
        ds = p * (dp - delta[:, None])  # [block_h, block_k] f32
        dq_main = dq_main + _dot(ds.astype(k_main.dtype), k_main, precision=precision)
        if lay.d_tail:
            dq_tail = dq_tail + _dot(ds.astype(k_tail.dtype), k_tail, precision=precision)
        write_rows(j, rows, valid, ds, p)
        return dq_main, dq_tail

    init = (
        jnp.zeros((lay.block_h, lay.d_main), jnp.float32),
        jnp.zeros((lay.block_h, lay.d_tail), jnp.float32) if lay.d_tail else None,
    )
    dq_main, dq_tail = lax.fori_loop(0, num_blocks, grad_body, init)
    _store_dq(dq_ref, dq_main, dq_tail, scale, lay)


def _store_dq(dq_ref, dq_main, dq_tail, scale, lay: _Layout, transposed: bool = False):
    """dq_ref [heads, width] (out) <- scale * the accumulated pieces dq_main [heads, d_main] and
    dq_tail [heads, d_tail] or None ([d_main, heads], [d_tail, heads] when `transposed`: the
    key-major dQ kernel's), in dq_ref's dtype."""

    def rows(x):
        return ((x.T if transposed else x) * scale).astype(dq_ref.dtype)

    if not lay.d_tail:
        dq_ref[...] = rows(dq_main)
    else:
        dq_ref[:, pl.ds(0, lay.d_main)] = rows(dq_main)
        dq_ref[:, pl.ds(lay.d_main, lay.d_tail)] = rows(dq_tail)


def _dq_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    scale,
    scale_log2,
    block_k,
    lay: _Layout,
    precision,
):
    """The split backward's dQ of one query over block_h_dq heads, key-major: the slot block's
    keys are the rows of every matmul (M = block_k, on Hopper's warpgroup MMA from 64 keys) and
    the heads its columns, so q and dO are right operands that stay in shared memory.

    Per slot block: S^T = K Q^T and dP^T = V dO^T ([block_k, heads]), P^T and dS^T from the
    saved log-sum-exp and the delta kernel's delta, then dQ^T += K^T dS^T ([width, heads] f32
    accumulators, one per feature piece). Gathers are masked loads (`_masked_rows`).

    Args (refs): idx_ref [Kp] int32, k_ref [S, width], v_ref [S, dv] or None, as in the
      forward; q_ref [block_h_dq, width], do_ref [block_h_dq, dv], lse_ref and delta_ref
      [block_h_dq] f32; dq_ref [block_h_dq, width] (out).
    """
    num_keys = k_ref.shape[0]
    # Right operands transposed once, here: transposed inside the loop, a loop-invariant
    # operand goes from registers to shared memory again at every step.
    q_main, q_tail = (None if x is None else x.T for x in _pieces(q_ref, None, lay))
    do = do_ref[...].T  # [dv, heads]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def body(j, acc):
        dqt_main, dqt_tail = acc
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = _masked_pieces(k_ref, rows, valid, lay)  # [block_k, d_main], [.., d_tail]
        v_blk = k_main if lay.shared else _masked_rows(v_ref, rows, valid, 0, lay.dv)
        s_t = _dot(k_main, q_main, precision=precision)  # [block_k, heads]
        if lay.d_tail:
            s_t = s_t + _dot(k_tail, q_tail, precision=precision)
        dp_t = _dot(v_blk, do, precision=precision)
        p_t = jnp.where(valid[:, None], jnp.exp2(s_t * scale_log2 - lse[None, :]), 0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).astype(k_main.dtype)
        dqt_main = dqt_main + _dot(k_main, ds_t, trans_a=True, precision=precision)
        if lay.d_tail:
            dqt_tail = dqt_tail + _dot(k_tail, ds_t, trans_a=True, precision=precision)
        return dqt_main, dqt_tail

    heads = q_ref.shape[0]
    init = (
        jnp.zeros((lay.d_main, heads), jnp.float32),
        jnp.zeros((lay.d_tail, heads), jnp.float32) if lay.d_tail else None,
    )
    dqt_main, dqt_tail = lax.fori_loop(0, _live_blocks(idx_ref, block_k, num_keys), body, init)
    _store_dq(dq_ref, dqt_main, dqt_tail, scale, lay, transposed=True)


def _key_grad_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    row_refs,
    *,
    scale,
    scale_log2,
    block_k,
    lay: _Layout,
    precision,
    chunk,
):
    """One query's key gradients over block_h_dkv heads, key-major: every matmul has the slot
    block's keys as its rows (M = block_k, on Hopper's warpgroup MMA from 64 keys), and the
    feature axis runs in column chunks, so no operand is transposed in registers and no
    accumulator is wider than [block_k, chunk].

    Per slot block: S^T = K Q^T and dP^T = V dO^T ([block_k, heads], summed over the chunks
    of K and V, each gathered chunk dead after its two matmuls), P^T and dS^T from the saved
    log-sum-exp and delta, then each chunk's key-gradient rows dS^T Q_c (+ P^T dO_c where the
    value is that chunk) and P^T dO_c, added with masked relaxed atomics.

    Args (refs): idx_ref [Kp] int32, k_ref [S, width], v_ref [S, dv] or None, as in the
      forward; q_ref [block_h_dkv, width], do_ref [block_h_dkv, dv], lse_ref and delta_ref
      [block_h_dkv] f32 (delta from the delta kernel); row_refs: the f32 [S, piece width]
      buffers of `_backward_kernel`'s atomic path (zeros on entry).
    chunk: column chunk width, dividing d_main and (separate value) dv.
    """
    num_keys = k_ref.shape[0]
    dtype = q_ref.dtype

    def columns(ref, width):  # [n, chunk] column windows of a resident [n, width] ref
        return [ref[:, pl.ds(c, chunk)] for c in range(0, width, chunk)]

    q_chunks = columns(q_ref, lay.d_main)
    q_tail = q_ref[:, pl.ds(lay.d_main, lay.d_tail)] if lay.d_tail else None
    do_chunks = columns(do_ref, lay.dv)
    lse = lse_ref[...]
    delta = delta_ref[...]
    dk_main_ref, *others = row_refs
    dk_tail_ref = others.pop(0) if lay.d_tail else None
    dv_ref = None if lay.shared else others[0]

    def add_rows(ref, rows, valid, cols, val):
        mask = jnp.broadcast_to(valid[:, None], val.shape)
        relaxed_atomics.atomic_add(ref, (rows, cols), val, mask=mask)

    def gathered(ref, rows, valid, col, width):  # zeroed for invalid slots (row 0 stays out)
        return jnp.where(valid[:, None], ref[rows, pl.ds(col, width)], 0)

    def body(j, carry):
        rows, valid = _gather_block(idx_ref, j, block_k, num_keys)
        s_t = dp_t = None  # [block_k, heads] f32: sums of the chunks' dots

        def plus(total, term):
            return term if total is None else total + term

        for c, q_c in enumerate(q_chunks):
            k_c = gathered(k_ref, rows, valid, c * chunk, chunk)  # [block_k, chunk]
            s_t = plus(s_t, _dot(k_c, q_c, trans_b=True, precision=precision))
            if lay.shared:  # the value is the key's main piece: this chunk is a value chunk
                dp_t = plus(dp_t, _dot(k_c, do_chunks[c], trans_b=True, precision=precision))
        if lay.d_tail:
            k_t = gathered(k_ref, rows, valid, lay.d_main, lay.d_tail)
            s_t = s_t + _dot(k_t, q_tail, trans_b=True, precision=precision)
        if not lay.shared:
            for c, do_c in enumerate(do_chunks):
                v_c = gathered(v_ref, rows, valid, c * chunk, chunk)
                dp_t = plus(dp_t, _dot(v_c, do_c, trans_b=True, precision=precision))
        p_t = jnp.where(valid[:, None], jnp.exp2(s_t * scale_log2 - lse[None, :]), 0.0)
        ds_t = (p_t * (dp_t - delta[None, :]) * scale).astype(dtype)  # scale folded in
        p_t = p_t.astype(dtype)
        for c, q_c in enumerate(q_chunks):
            dk_c = _dot(ds_t, q_c, precision=precision)
            if lay.shared:
                dk_c = dk_c + _dot(p_t, do_chunks[c], precision=precision)
            add_rows(dk_main_ref, rows, valid, pl.ds(c * chunk, chunk), dk_c)
        if lay.d_tail:
            add_rows(dk_tail_ref, rows, valid, slice(None), _dot(ds_t, q_tail, precision=precision))
        if not lay.shared:
            for c, do_c in enumerate(do_chunks):
                dv_c = _dot(p_t, do_c, precision=precision)
                add_rows(dv_ref, rows, valid, pl.ds(c * chunk, chunk), dv_c)
        return carry

    lax.fori_loop(0, _live_blocks(idx_ref, block_k, num_keys), body, 0)


def _key_sum_kernel(start_ref, order_ref, *refs, chunk: int):
    """Deterministic reduction: key s sums the rows of the (query, slot) pairs that chose it.

    Args (refs):
      start_ref: [S + 1] int32; the pairs choosing key s are order[start[s]:start[s+1]].
      order_ref: [N + chunk] int32 pair positions sorted by key (stable), zero padded.
      refs: n inputs [N, width_i] f32 per-pair rows, then n outputs [width_i] f32, the key's
        gradient rows.
    """
    n = len(refs) // 2
    rows_refs, out_refs = refs[:n], refs[n:]
    s = pl.program_id(2)
    begin = start_ref[s]
    end = start_ref[s + 1]

    def body(i, accs):
        first = begin + i * chunk
        live = first + jnp.arange(chunk) < end
        pos = jnp.where(live, order_ref[pl.ds(first, chunk)], 0)
        return tuple(
            acc + jnp.sum(jnp.where(live[:, None], ref[pos, :], 0.0), axis=0)
            for acc, ref in zip(accs, rows_refs)
        )

    steps = lax.div(end - begin + (chunk - 1), chunk)
    init = tuple(jnp.zeros(ref.shape, jnp.float32) for ref in out_refs)
    for ref, acc in zip(out_refs, lax.fori_loop(0, steps, body, init)):
        ref[...] = acc


# ---------------------------------------------------------------------------------------------
# pallas_call builders. Arrays arrive padded: q [B, T, G, heads, width], k [B, S, G, width],
# v [B, S, G, dv] or None, idx [B, T, Kp]. Grid (T * head_blocks, B, G): the fastest axis walks
# a query's head blocks, then the next query, so neighbouring programs read the same or
# neighbouring (causally similar) key sets of one group from L2.
# ---------------------------------------------------------------------------------------------


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _query_map(lay: _Layout, *trailing, block_h: int | None = None):
    """Index map of a per-(query, head block) array [B, T, G, heads, ...], head blocks of
    block_h heads (default lay.block_h)."""
    n = lay.heads // (block_h or lay.block_h)
    if n == 1:
        return lambda i, b, g: (b, i, g, 0, *trailing)
    return lambda i, b, g: (b, i // n, g, i % n, *trailing)


def _input_specs(lay: _Layout, S: int, Kp: int, block_h: int | None = None):
    """Specs of (idx, q, k[, v]) for programs of block_h heads (default lay.block_h)."""
    block_h = block_h or lay.block_h
    n = lay.heads // block_h
    idx_map = (lambda i, b, g: (b, i, 0)) if n == 1 else (lambda i, b, g: (b, i // n, 0))
    specs = [
        pl.BlockSpec((None, None, Kp), idx_map),  # idx
        pl.BlockSpec(
            (None, None, None, block_h, lay.width), _query_map(lay, 0, block_h=block_h)
        ),  # q
        pl.BlockSpec((None, S, None, lay.width), lambda i, b, g: (b, 0, g, 0)),  # k
    ]
    if not lay.shared:
        specs.append(pl.BlockSpec((None, S, None, lay.dv), lambda i, b, g: (b, 0, g, 0)))  # v
    return specs


def _with_optional_v(kernel, lay: _Layout, n_before: int):
    """kernel(*refs) with v_ref=None inserted after the first n_before refs when shared."""
    if not lay.shared:
        return kernel

    def body(*refs):
        kernel(*refs[:n_before], None, *refs[n_before:])

    return body


def _forward_call(
    q, k, v, idx, *, scale, block_k, lay: _Layout, sizes: BlockSizes, interpret, do=None, lse=None
):
    """q [B,T,G,heads,width], k [B,S,G,width], v [B,S,G,dv] or None, idx [B,T,Kp]
    -> o [B,T,G,heads,dv], lse [B,T,G,heads]; with do [B,T,G,heads,dv] (the output cotangent)
    and lse [B,T,G,heads] f32 (the forward's) -> delta [B,T,G,heads] f32 instead
    (`_delta_kernel`)."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    kernel = functools.partial(
        _forward_kernel if do is None else _delta_kernel,
        scale_log2=scale * _LOG2E,
        block_k=block_k,
        lay=lay,
        precision=_precision(q.dtype),
    )
    tile_bytes = _tile_bytes(lay, block_k, q.dtype)
    budget = _SHARED_STAGE_BUDGET_BYTES if lay.shared else _STAGE_BUDGET_BYTES
    args = (idx, q, k) if lay.shared else (idx, q, k, v)
    heads_spec = pl.BlockSpec((None, None, None, lay.block_h), _query_map(lay))
    rows_spec = pl.BlockSpec((None, None, None, lay.block_h, lay.dv), _query_map(lay, 0))
    heads_shape = jax.ShapeDtypeStruct((B, T, G, lay.heads), jnp.float32)
    if do is None:
        extra_specs, out_specs = [], [rows_spec, heads_spec]
        out_shape = [jax.ShapeDtypeStruct((B, T, G, lay.heads, lay.dv), q.dtype), heads_shape]
        # the output accumulator [block_h, dv] f32 needs the warps' registers
        warps = sizes.num_warps or (8 if lay.block_h * lay.dv > _ACC_ELEMENTS else 4)
        stages = _stages(sizes.num_stages, 5, tile_bytes, budget)
    else:
        if lse is None:
            raise ValueError("the delta kernel needs the forward's log-sum-exp (lse)")
        args += (do, lse)
        extra_specs, out_specs, out_shape = [rows_spec, heads_spec], heads_spec, heads_shape
        # The forward's num_warps / num_stages do not apply: this kernel has its own budget.
        # dO stays resident in shared memory beside q, so fewer gathered tiles fit (3 at MLA's
        # shape; the forward's 5 would ask for 250,368 bytes). No [block_h, dv] accumulator,
        # so 4 warps: one warpgroup owns each wgmma's 64 rows (H100, MLA, T = 32K, H = 64, the
        # lab probe's kernel at 8cd822f: 31.06 ms against 53.91 on 8 warps, 57.86 on 8 warps
        # at 2 stages, 48.80 for the forward recomputed for dO . o). A separate value's
        # 16-head programs (mma.sync) take 4 warps too, untimed.
        budget -= lay.block_h * lay.dv * jnp.dtype(q.dtype).itemsize
        warps, stages = 4, _stages(None, 5, tile_bytes, budget)
    return pl.pallas_call(
        _with_optional_v(kernel, lay, 3),
        grid=(T * lay.head_blocks, B, G),
        in_specs=_input_specs(lay, S, Kp) + extra_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sparse_attn_fwd" if do is None else "sparse_attn_bwd_delta",
    )(*args)


def _row_widths(lay: _Layout) -> tuple[int, ...]:
    """Widths of the backward's gradient-row outputs: dK main, dK tail, dV (see the kernel)."""
    return (lay.d_main,) + ((lay.d_tail,) if lay.d_tail else ()) + (() if lay.shared else (lay.dv,))


def _backward_call(
    q, k, v, idx, lse, do, *, scale, block_k, lay: _Layout, sizes: BlockSizes, interpret, atomic
):
    """q [B,T,G,heads,width], k [B,S,G,width], v [B,S,G,dv] or None, idx [B,T,Kp],
    lse [B,T,G,heads], do [B,T,G,heads,dv] -> dQ [B,T,G,heads,width] and the gradient rows of
    `_row_widths`: f32 [B,S,G,width_i] (atomic) or per slot f32 [B,G,T*head_blocks,Kp,width_i]
    (deterministic)."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    widths = _row_widths(lay)
    n_rows = len(widths)

    def kernel(*refs):  # inputs (5 or 6), then dq, then the row outputs
        n_in = len(refs) - 1 - n_rows
        *ins, dq_ref = refs[: n_in + 1]
        ins = ins[:3] + ([None] if lay.shared else []) + ins[3:]
        _backward_kernel(
            *ins,
            dq_ref,
            refs[n_in + 1 :],
            scale=scale,
            scale_log2=scale * _LOG2E,
            block_k=block_k,
            lay=lay,
            precision=_precision(q.dtype),
            atomic=atomic,
        )

    in_specs = _input_specs(lay, S, Kp) + [
        pl.BlockSpec((None, None, None, lay.block_h, lay.dv), _query_map(lay, 0)),  # do
        pl.BlockSpec((None, None, None, lay.block_h), _query_map(lay)),  # lse
    ]
    args = ((idx, q, k) if lay.shared else (idx, q, k, v)) + (do, lse)
    dq_spec = pl.BlockSpec((None, None, None, lay.block_h, lay.width), _query_map(lay, 0))
    if atomic:  # one f32 buffer per gradient piece, shared by all programs
        row_specs = [
            pl.BlockSpec((None, S, None, width), lambda i, b, g: (b, 0, g, 0)) for width in widths
        ]
        row_shapes = [jax.ShapeDtypeStruct((B, S, G, width), jnp.float32) for width in widths]
    else:  # this program's row per slot
        row_specs = [
            pl.BlockSpec((None, None, None, Kp, width), lambda i, b, g: (b, g, i, 0, 0))
            for width in widths
        ]
        row_shapes = [
            jax.ShapeDtypeStruct((B, G, T * lay.head_blocks, Kp, width), jnp.float32)
            for width in widths
        ]
    tile_bytes = _tile_bytes(lay, block_k, q.dtype)
    call = functools.partial(
        pl.pallas_call,
        grid=(T * lay.head_blocks, B, G),
        out_specs=[dq_spec, *row_specs],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), *row_shapes],
        compiler_params=pltriton.CompilerParams(
            num_warps=sizes.num_warps_bwd,
            num_stages=_stages(sizes.num_stages_bwd, 2, tile_bytes),
        ),
        interpret=interpret,
        name=f"sparse_attn_bwd_{'atomic' if atomic else 'rows'}",
    )
    if not atomic:
        return call(kernel, in_specs=in_specs)(*args)
    n_in = len(args)

    def body(*refs):  # drop the aliased zero inputs: the kernel adds into the outputs
        kernel(*refs[:n_in], *refs[n_in + n_rows :])

    zeros = [jnp.zeros(shape.shape, shape.dtype) for shape in row_shapes]
    aliases = {n_in + i: 1 + i for i in range(n_rows)}
    return call(body, in_specs=in_specs + row_specs, input_output_aliases=aliases)(*args, *zeros)


def _per_head(lay: _Layout, block_h: int, *width):
    """BlockSpec of block_h heads of a [B, T, G, heads(, width)] operand."""
    index_map = _query_map(lay, *(0,) * len(width), block_h=block_h)
    return pl.BlockSpec((None, None, None, block_h, *width), index_map)


def _dq_block(sizes: BlockSizes, lay: _Layout, K: int, dtype) -> int:
    """Slot block of the split backward's dQ kernel for rows of K selected keys."""
    default = _DQ_KEYS
    if _tile_bytes(lay, _DQ_KEYS, dtype) > _DQ_STEP_BUDGET_BYTES:
        default = _DQ_KEYS // 2
    return max(_MIN_TILE, min(sizes.block_k_dq or default, _next_pow2(K)))


def _dq_call(q, k, v, idx, lse, do, delta, *, scale, lay: _Layout, sizes, interpret):
    """The split backward's first kernel: dQ per block_h_dq heads (`_dq_kernel`, no atomics).
    Operands as `_backward_call`'s and delta [B,T,G,heads] f32 (the delta kernel's) -> dQ
    [B,T,G,heads,width] in q's dtype."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    hq = max(_MIN_TILE, min(sizes.block_h_dq or _DQ_HEADS, lay.heads))
    kernel = functools.partial(
        _dq_kernel,
        scale=scale,
        scale_log2=scale * _LOG2E,
        block_k=_dq_block(sizes, lay, Kp, q.dtype),
        lay=lay,
        precision=_precision(q.dtype),
    )
    args = ((idx, q, k) if lay.shared else (idx, q, k, v)) + (do, lse, delta)
    return pl.pallas_call(
        _with_optional_v(kernel, lay, 3),
        grid=(T * (lay.heads // hq), B, G),
        in_specs=_input_specs(lay, S, Kp, block_h=hq)
        + [_per_head(lay, hq, lay.dv), _per_head(lay, hq), _per_head(lay, hq)],
        out_specs=_per_head(lay, hq, lay.width),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=sizes.num_warps_dq or _DQ_WARPS,
            num_stages=sizes.num_stages_dq or _DQ_STAGES,
        ),
        interpret=interpret,
        name="sparse_attn_bwd_dq",
    )(*args)


def _key_grad_call(q, k, v, idx, lse, do, delta, *, scale, lay: _Layout, sizes, interpret):
    """The split backward's second kernel: the key gradients per block_h_dkv heads, added
    atomically. Operands as `_backward_call`'s and delta [B,T,G,heads] f32 -> the gradient
    rows of `_row_widths`, f32 [B,S,G,width_i]."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    widths = _row_widths(lay)
    hd = lay.block_h_dkv
    statics = dict(
        scale=scale,
        scale_log2=scale * _LOG2E,
        block_k=_key_block(sizes, Kp),
        lay=lay,
        precision=_precision(q.dtype),
        chunk=min(sizes.dkv_chunk or _DKV_CHUNK, lay.d_main, lay.dv),
    )
    args = ((idx, q, k) if lay.shared else (idx, q, k, v)) + (do, lse, delta)
    row_specs = [pl.BlockSpec((None, S, None, w), lambda i, b, g: (b, 0, g, 0)) for w in widths]

    def key_kernel(*refs):  # idx, q, k, v, do, lse, delta, the aliased zeros, the row outputs
        _key_grad_kernel(*refs[:7], refs[7 + len(widths) :], **statics)

    zeros = [jnp.zeros((B, S, G, w), jnp.float32) for w in widths]
    return pl.pallas_call(
        _with_optional_v(key_kernel, lay, 3),
        grid=(T * (lay.heads // hd), B, G),
        in_specs=_input_specs(lay, S, Kp, block_h=hd)
        + [_per_head(lay, hd, lay.dv), _per_head(lay, hd), _per_head(lay, hd)]
        + row_specs,
        out_specs=row_specs,
        out_shape=[jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros],
        input_output_aliases={len(args) + i: i for i in range(len(widths))},
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps_dkv, num_stages=1),
        interpret=interpret,
        name="sparse_attn_bwd_dkv",
    )(*args, *zeros)


def _split_backward_call(q, k, v, idx, lse, do, delta, *, scale, lay: _Layout, sizes, interpret):
    """The atomic backward in two kernels (lay.split_backward): dQ per block_h_dq heads, then
    the key gradients per block_h_dkv heads. Operands and results as `_backward_call`'s atomic
    path, and delta [B,T,G,heads] f32 (the delta kernel's, `_forward`)."""
    common = dict(scale=scale, lay=lay, sizes=sizes, interpret=interpret)
    dq = _dq_call(q, k, v, idx, lse, do, delta, **common)
    return (dq, *_key_grad_call(q, k, v, idx, lse, do, delta, **common))


def _key_sum_call(idx, rows, num_keys: int, *, sizes: BlockSizes, interpret):
    """Sum per-slot rows into keys in a fixed order.

    idx [B, P, Kp] (any ints; P row sets, one per program), rows: f32 [B, G, P, Kp, width_i]
    -> f32 [B, S, G, width_i] each.
    """
    B, G, P, Kp = rows[0].shape[:4]
    S, N, chunk = num_keys, P * Kp, sizes.segment_chunk
    keys = jnp.where((idx >= 0) & (idx < S), idx, S).reshape(B, N)  # invalid pairs sort last
    order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    sorted_keys = jnp.take_along_axis(keys, order, axis=-1)
    starts = jax.vmap(lambda sk: jnp.searchsorted(sk, jnp.arange(S + 1), side="left"))(
        sorted_keys
    ).astype(jnp.int32)  # [B, S + 1]
    order = jnp.pad(order, ((0, 0), (0, chunk)))  # reads past N stay inside
    widths = [r.shape[-1] for r in rows]
    return pl.pallas_call(
        functools.partial(_key_sum_kernel, chunk=chunk),
        grid=(B, G, S),
        in_specs=[
            pl.BlockSpec((None, S + 1), lambda b, g, s: (b, 0)),
            pl.BlockSpec((None, N + chunk), lambda b, g, s: (b, 0)),
        ]
        + [pl.BlockSpec((None, None, N, w), lambda b, g, s: (b, g, 0, 0)) for w in widths],
        out_specs=[
            pl.BlockSpec((None, None, None, w), lambda b, g, s: (b, s, g, 0)) for w in widths
        ],
        out_shape=[jax.ShapeDtypeStruct((B, S, G, w), jnp.float32) for w in widths],
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=2),
        interpret=interpret,
        name="sparse_attn_bwd_keysum",
    )(starts, order, *(r.reshape(B, G, N, r.shape[-1]) for r in rows))


def _deterministic_backward(q, k, v, idx, lse, do, *, scale, block_k, lay, sizes, interpret):
    """Chunks of block_t queries: per-slot rows, then the key-wise sum; chunks added in order."""
    B, T, G = q.shape[:3]
    S, Kp = k.shape[1], idx.shape[-1]
    widths = _row_widths(lay)
    block_t = sizes.block_t_deterministic
    if block_t is None:
        per_query = B * G * lay.head_blocks * Kp * sum(widths) * 4
        fits = max(1, _DETERMINISTIC_BUDGET_BYTES // per_query)
        block_t = 1 << (fits.bit_length() - 1)  # largest power of two within the budget
    block_t = min(block_t, T)
    n_chunks = -(-T // block_t)
    pad_t = n_chunks * block_t - T

    def chunks(x, fill=0):
        x = jnp.pad(x, [(0, 0), (0, pad_t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(B, n_chunks, block_t, *x.shape[2:]).swapaxes(0, 1)

    def step(sums, xs):
        q_c, idx_c, lse_c, do_c = xs
        dq_c, *rows = _backward_call(
            q_c,
            k,
            v,
            idx_c,
            lse_c,
            do_c,
            scale=scale,
            block_k=block_k,
            lay=lay,
            sizes=sizes,
            interpret=interpret,
            atomic=False,
        )
        # Each program (query, head block) wrote its own row set: repeat the query's idx.
        idx_p = idx_c if lay.head_blocks == 1 else jnp.repeat(idx_c, lay.head_blocks, axis=1)
        parts = _key_sum_call(idx_p, rows, S, sizes=sizes, interpret=interpret)
        return tuple(a + b for a, b in zip(sums, parts)), dq_c

    init = tuple(jnp.zeros((B, S, G, w), jnp.float32) for w in widths)
    xs = (chunks(q), chunks(idx, fill=-1), chunks(lse), chunks(do))
    sums, dq = lax.scan(step, init, xs)
    dq = dq.swapaxes(0, 1).reshape(B, n_chunks * block_t, *q.shape[2:])[:, :T]
    return dq, list(sums)


# ---------------------------------------------------------------------------------------------
# custom_vjp wrapper: pads to kernel-friendly shapes, saves (q, k, v, idx, lse [B, T, H] f32).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static arguments of the custom_vjp. `sparse_attention` pairs interpret=True with
    deterministic=True; interpret=True with deterministic=False runs the atomic backward kernel
    in the interpreter (tests; it needs `relaxed_atomics.RELAXED`, whose primitive has an exact
    interpret rule). value_dim: None when v is given; with v=None the value is
    k[..., :value_dim], value_dim a power of two >= 16."""

    scale: float
    interpret: bool
    deterministic: bool
    sizes: BlockSizes
    value_dim: int | None = None


def _key_block(sizes: BlockSizes, K: int) -> int:
    """Slot block of the key-gradient kernel for rows of K selected keys."""
    return max(_MIN_TILE, min(sizes.block_k_dkv or _DKV_KEYS, _next_pow2(K)))


def _pad_axis(x, axis: int, size: int, fill=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=fill)


def _prepare(q, k, v, idx, cfg: _Config, backward: bool):
    """Padded kernel operands q [B,T,G,heads,width], k [B,S,G,width], v [B,S,G,dv] or None,
    idx [B,T,Kp], with their layout and slot block size."""
    B, T, H, D = q.shape
    G = k.shape[2]
    shared = v is None  # the value is k[..., :value_dim], value_dim a power of two >= 16
    Dv = cfg.value_dim if shared else v.shape[-1]
    lay = _layout(H, G, D, Dv, shared, cfg.sizes, backward)
    K = idx.shape[-1]
    if not backward:
        block_k = cfg.sizes.block_k
    else:
        block_k = cfg.sizes.block_k_bwd or (64 if lay.width + lay.dv <= 512 else 32)
    block_k = max(_MIN_TILE, min(block_k, _next_pow2(K)))
    dtype = jnp.result_type(*(x.dtype for x in (q, k, v) if x is not None))
    qg = q.astype(dtype).reshape(B, T, G, H // G, D)
    qg = _pad_axis(_pad_axis(qg, 3, lay.heads), 4, lay.width)
    kp = _pad_axis(k.astype(dtype), 3, lay.width)
    vp = None if shared else _pad_axis(v.astype(dtype), 3, lay.dv)
    # The split backward's slot blocks (dQ's and the key-gradient kernel's, powers of two)
    # both tile Kp.
    split = backward and lay.split_backward and not cfg.deterministic
    step = max(_dq_block(cfg.sizes, lay, K, dtype), _key_block(cfg.sizes, K)) if split else block_k
    idxp = _pad_axis(idx.astype(jnp.int32), 2, -(-K // step) * step, fill=-1)
    return qg, kp, vp, idxp, block_k, lay


def _value_width(k, v, cfg: _Config) -> int:
    return cfg.value_dim if v is None else v.shape[-1]


def _forward(q, k, v, idx, cfg: _Config, d_out=None, lse=None):
    """The public op's operands -> (out [B,T,H,Dv] in q's dtype, lse [B,T,H] f32); with d_out
    [B,T,H,Dv], the output cotangent, and lse [B,T,G,heads] f32 (the forward's, padded heads
    0): delta = sum_j P_j dP_j per head, f32 [B,T,G,R], by the delta kernel in the forward's
    layout (the output is not saved).

    The split backward's dQ kernel then sweeps the keys once. MLA, H100, T = 32K, H = 64, with
    the head-major dQ kernel of c74edc7: delta kernel 48.13 + one-sweep dQ 118.02 ms against
    220.94 for the dQ kernel's own two sweeps (forward+backward 303.86 against 359.80); its
    launch, and what summing P dP gained over recomputing the output, in `_forward_call`."""
    if d_out is None and _use_mosaic("forward", q, k, v, idx, cfg):
        return sparse_attention_mosaic.forward(
            q, k, idx, scale_log2=cfg.scale * _LOG2E, mask_value=_MASK_VALUE
        )
    B, T, H, _ = q.shape
    G = k.shape[2]
    R = H // G
    Dv = _value_width(k, v, cfg)
    qg, kp, vp, idxp, block_k, lay = _prepare(q, k, v, idx, cfg, backward=False)
    dog = None
    if d_out is not None:
        dog = d_out.astype(qg.dtype).reshape(B, T, G, R, Dv)
        dog = _pad_axis(_pad_axis(dog, 3, lay.heads), 4, lay.dv)
    result = _forward_call(
        qg,
        kp,
        vp,
        idxp,
        scale=cfg.scale,
        block_k=block_k,
        lay=lay,
        sizes=cfg.sizes,
        interpret=cfg.interpret,
        do=dog,
        lse=lse,
    )
    if d_out is not None:
        return result[:, :, :, :R]
    o, lse2 = result
    out = o[:, :, :, :R, :Dv].reshape(B, T, H, Dv).astype(q.dtype)
    return out, lse2[:, :, :, :R].reshape(B, T, H)


def _use_mosaic(kernel: str, q, k, v, idx, cfg: _Config, lay: _Layout | None = None) -> bool:
    """Whether the Mosaic GPU kernel runs `kernel` ("forward" or "dq"), as
    `BlockSizes.{kernel}_kernel` and the operands allow; "mosaic" raises where it cannot.
    lay: the backward's layout (for "dq", which replaces the split backward's dQ kernel)."""
    choice = getattr(cfg.sizes, f"{kernel}_kernel")
    if choice == "triton":
        return False
    if cfg.interpret:
        reason = "a GPU: interpret mode runs the Triton kernels"
    elif kernel == "dq" and (cfg.deterministic or not lay.split_backward):
        reason = (
            "deterministic=False"
            if cfg.deterministic
            else "the split backward (dQ in a kernel of its own), which these heads and "
            "BlockSizes do not use"
        )
    else:
        dtype = jnp.result_type(*(x.dtype for x in (q, k, v) if x is not None))
        value_dim = cfg.value_dim if v is None else None
        reason = sparse_attention_mosaic.unsupported_reason(
            k.shape, dtype, idx.shape[-1], value_dim, kernel
        )
    if reason is not None and choice == "mosaic":
        raise ValueError(
            f"BlockSizes({kernel}_kernel='mosaic'): the Mosaic GPU {kernel} kernel needs {reason}"
        )
    return reason is None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sparse_attention(q, k, v, idx, cfg: _Config):
    """(out, lse): lse f32 [B, T, H] is the base-2 log-sum-exp of the base-2 logits, which the
    public wrapper hands out detached (`return_lse`): its cotangent is never used."""
    return _forward(q, k, v, idx, cfg)


def _sparse_attention_fwd(q, k, v, idx, cfg: _Config):
    out, lse = _forward(q, k, v, idx, cfg)
    return (out, lse), (q, k, v, idx, lse)


def _sparse_attention_bwd(cfg: _Config, residuals, cotangents):
    d_out, _ = cotangents  # the log-sum-exp leaves the op detached: no cotangent reaches it
    q, k, v, idx, lse = residuals  # lse: f32 [B, T, H], base-2 log-sum-exp of the logits
    B, T, H, D = q.shape
    G = k.shape[2]
    R = H // G
    Dv = _value_width(k, v, cfg)
    qg, kp, vp, idxp, block_k, lay = _prepare(q, k, v, idx, cfg, backward=True)
    dog = d_out.astype(qg.dtype).reshape(B, T, G, R, Dv)
    dog = _pad_axis(_pad_axis(dog, 3, lay.heads), 4, lay.dv)
    lseg = _pad_axis(lse.reshape(B, T, G, R), 3, lay.heads)  # padded heads: q = 0, dO = 0
    kwargs = dict(scale=cfg.scale, lay=lay, sizes=cfg.sizes, interpret=cfg.interpret)
    mosaic_dq = _use_mosaic("dq", q, k, v, idx, cfg, lay)
    if cfg.deterministic:
        dq, rows = _deterministic_backward(qg, kp, vp, idxp, lseg, dog, block_k=block_k, **kwargs)
    elif lay.split_backward:  # each of its kernels has its own slot block
        delta = _pad_axis(_forward(q, k, v, idx, cfg, d_out, lseg), 3, lay.heads)
        if mosaic_dq:
            rows = _key_grad_call(qg, kp, vp, idxp, lseg, dog, delta, **kwargs)
            dq = sparse_attention_mosaic.dq(
                q,
                k,
                idx,
                lse,
                delta[:, :, 0, :H],
                d_out,
                scale=cfg.scale,
                scale_log2=cfg.scale * _LOG2E,
            )
            dq = dq.reshape(B, T, 1, H, D)  # the Triton kernels' layout, G = 1, no padding
        else:
            dq, *rows = _split_backward_call(qg, kp, vp, idxp, lseg, dog, delta, **kwargs)
    else:
        dq, *rows = _backward_call(
            qg, kp, vp, idxp, lseg, dog, block_k=block_k, atomic=True, **kwargs
        )
    dq = dq[:, :, :, :R, :D].reshape(B, T, H, D).astype(q.dtype)
    dk = rows[0] if not lay.d_tail else jnp.concatenate(rows[:2], axis=-1)
    dk = dk[..., :D]
    if v is None:  # shared value: its gradient is already in dK's main piece
        return dq, dk.astype(k.dtype), None, None
    return dq, dk.astype(k.dtype), rows[-1][..., :Dv].astype(v.dtype), None


_sparse_attention.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


def sparse_attention(
    q,
    k,
    v,
    idx,
    *,
    scale: float,
    value_dim: int | None = None,
    interpret: bool = False,
    deterministic: bool | None = None,
    block_sizes: BlockSizes | None = None,
    return_lse: bool = False,
):
    """Sparse attention with Pallas kernels; differentiable in q, k, v (`jax.custom_vjp`).

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, G, D] keys, H % G == 0; head h reads group h // (H // G).
      v: [B, S, G, Dv] values (Dv may differ from D), or None with `value_dim`.
      idx: [B, T, K] int selected key indices; entries outside [0, S) are ignored, never read.
      scale: logit scale (the public `hs.sparse_attention` defaults it to D ** -0.5).
      value_dim: with v=None, the value of a key is its leading value_dim features,
        k[..., :value_dim] (MLA's absorbed form: D = 576, value_dim = 512); a power of two
        >= 16 is read from the gathered key tile itself, any other width as a sliced copy.
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      deterministic: bitwise-reproducible dK/dV (sorted key-wise sum instead of f32 atomics).
        None: atomics on GPU (fast, run-to-run f32 rounding differences in dK/dV only; dQ and the
        forward are deterministic), deterministic in interpret mode.
      block_sizes: tile sizes, default `BlockSizes()`.
      return_lse: also return the softmax's log-sum-exp.
    Returns:
      [B, T, H, Dv] in q's dtype. Softmax and accumulation in f32. The VJP saves q, k, v, idx and
      one f32 [B, T, H] log-sum-exp; nothing of size T * K. With return_lse, (out, lse): lse f32
      [B, T, H], log sum_j exp(scale * q . k_j) over the valid entries (natural log; -inf on rows
      without one), detached (no gradient flows through it).
    """
    if deterministic is None:
        deterministic = bool(interpret)
    if interpret and not deterministic:
        raise ValueError(
            f"deterministic={deterministic!r} with interpret={interpret!r}: interpret mode runs "
            "the deterministic backward (deterministic=None or True)"
        )
    if (v is None) == (value_dim is None):
        raise ValueError(
            f"pass either v or value_dim (the value is then k[..., :value_dim]); got "
            f"v={None if v is None else tuple(v.shape)} and value_dim={value_dim!r}"
        )
    if v is None and not (_is_pow2(value_dim) and value_dim >= _MIN_TILE):
        v, value_dim = k[..., :value_dim], None  # a copy; autodiff adds its gradient into dK
    cfg = _Config(
        scale=float(scale),
        interpret=bool(interpret),
        deterministic=bool(deterministic),
        sizes=block_sizes or BlockSizes(),
        value_dim=value_dim,
    )
    out, lse = _sparse_attention(q, k, v, idx, cfg)
    if not return_lse:
        return out
    return out, lax.stop_gradient(lse) * _LN2
