"""HyTopK as one fused Pallas (Triton) kernel: indexer scoring + exact streaming top-k.

    score[b,t,s] = k_scale[b,s] * sum_h w[b,t,h] * relu(q_idx[b,t,h,:] . k_idx[b,s,:])

(k_scale optional: without it the kernel has no multiply at all; FP8 inputs are widened
exactly to bf16) and each query's top-k keys in the order of docs/design.md ('Tie rule'), found
on the fly without the T x S table (HyScale section 3). Every program owns `block_q` queries
and streams their visible key blocks in ascending order, keeping per query row a threshold
`tau` and, in HBM, a *candidate buffer* of (order key, key index) pairs in key-index order
(order key: the f32 score's monotone int32 image, pallas_kernels/order_keys.py). Invariant: the
buffer holds the exact top-k of the keys seen so far (plus extra entries), and once tau has been
raised, >= k entries >= tau.

  * Append: a key is kept iff its order key is > tau (a key equal to tau has >= k buffered
    entries >= tau with smaller indices ahead of it, so ties cannot overflow the buffer);
    kept keys are scatter-stored at `count + rank` after a row-wise cumsum (no atomics).
  * Runs: an outer loop compacts when the fullest row has fewer than `min_steps * block_k`
    free slots, then runs as many key blocks as the free slots allow with append only: no
    nested loop or barrier in the run, so Triton software-pipelines it.
  * Compaction: a threshold search on the int32 key space, one count pass over the buffer per
    step (pivots from a sample of the buffer, then interpolated, then bisection; the pivots
    only change the number of passes), stops once [k, target] entries are >= its bracket's
    lower end lo; where ties prevent that, lo is the exact k-th key and the rewrite keeps the
    first (k - #entries > lo) entries == lo. The buffer is rewritten in place, in index order,
    with CTA barriers between stores and other threads' loads.
  * Seeded start (`seed_rate`): a 1/rate sample of the keys, scored first, starts each row at a
    tau that about m * rate keys beat (`seed_counts`), so mid-stream compactions become rare.
    No compaction runs while a row holds fewer than k entries, so a seed above the row's k-th
    key shows as a row ending its stream below k; its program re-runs from the floor in a
    second call over the same (aliased) buffers. Exactness never rests on the sample.
    Unseeded, the first run keeps every key, so it stores whole key blocks (no cumsum), with
    invalid keys as INVALID_KEY placeholders that rank below every real key.
  * Finish: a last compaction leaves exactly the top-k set, in index order; XLA sorts it by score
    (`order_candidates`), or, for `order="index"`, it is returned as it stands, invalid slots as
    -1 (`candidates_in_key_order`; a sort by index only where placeholders interrupt a row).

Triton constraints: no sort, value slicing or atomics; power-of-two shapes; one f32 dot per
head, unrolled (HIGHEST precision: no TF32); relu as `where(x < 0, 0, x)` so NaN
propagates (Triton's max is maxnum). Extra memory: 2 * B * rows_per_call * capacity int32 at most.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.order_keys import INVALID_KEY, check_order, in_key_order

_INT32_MAX = jnp.iinfo(jnp.int32).max
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_SIGN_FLIP = 0x7FFFFFFF
# Compaction threshold search: buffer entries per row sampled for the first count pass, the
# interpolated passes that follow it (then bisection), and where mid-stream pivots aim, as
# fractions of the window [k, stream target] above k, higher count first.
_SAMPLE = 32
_INTERPOLATED_PASSES = 8
_STREAM_AIMS = (0.75, 0.25)
# Bytes of a program's query tiles ([block_q, DI] per head) that stay in shared memory for the
# whole key stream: HI = 32, DI = 128 in bf16 at block_q = 16 is 128 KiB, and the kernel asks for
# 229,376 of the H100's/H200's 232,448 bytes; all 64 heads asked for 360,448. The heads past
# the budget are read again (L1/L2) at every key block, at one pipelining stage (two would
# multi-buffer them). At HI = 64 half the tiles stay: 163,840 bytes (Triton 3.9's figures for
# sm_90); one H100, T = S = 32K, DI = 128, k = 2048, causal, bf16: 62.86 ms against 80.27 with
# every tile read per key block, 64 sampled rows exact each. 48 resident heads (192 KiB) asked
# the H100 for 278,528 bytes.
_RESIDENT_QUERY_BYTES = 128 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the fused selection kernel (powers of two).

    Figures are H200 (jax 0.11.2) medians of the full selection at B=1, T=S=32K, HI=32,
    DI=128, k=2048, causal, bf16, each against the default in the same run.
    """

    # Queries per program: the M of each per-head dot (Triton needs >= 16). 32 asks for
    # 360448 bytes of shared memory, more than the H200's 232448.
    block_q: int = 16
    # Keys scored per step of the stream: 34.78 ms with 256, 39.70 ms with 128 (each head's
    # query tile is re-read once per key block); 512 exceeds shared memory at two stages and
    # takes 54.92 ms at one.
    block_k: int = 256
    # Buffer entries per row handled per step of a compaction pass: 26.2-26.4 ms with 256
    # (five runs), 28.90 with 128, 27.97 with 512.
    chunk: int = 256
    # Candidate slots per query row; None: next_pow2(2 * k + min_steps * block_k) (8192 at
    # k=2048), which leaves the stream target at least k / 2 above k: 32.92 ms against 34.63
    # with 4096 slots; 16384 slots took 29.64 ms against 26.2-26.4.
    capacity: int | None = None
    # Kernel 39 ms with 8 warps, 50 ms with 4; 27.03 ms with 16 against 26.2-26.4 with 8.
    num_warps: int = 8
    # Software-pipeline stages of the key loop: 26.40-26.51 ms with 2, 27.69 with 1; 3 asks
    # for more shared memory than there is. None: 2, or 1 where some heads' query tiles are
    # read at every key block (`_resident_heads`).
    num_stages: int | None = None
    # Key blocks a compaction leaves room for (the shortest run): 26.77 ms with 4, 26.2-26.4
    # with 8 (five runs), 26.29 / 26.30 with 12 / 16.
    min_steps: int = 8
    # Seeded start (0: off; else a power of two >= 2): one pseudo-random key in every window
    # of `seed_rate` keys is scored first (`seed_positions`; the rate rises to S / capacity
    # where S is longer) to set each row's starting threshold. 24.15 / 23.87 ms at 16 against
    # 26.05 unseeded and 24.64 at 32.
    seed_rate: int = 16
    # The seed leaves >= k keys above the threshold unless the sample is off by this many
    # standard deviations (a row where it does not re-runs unseeded). 4 sigmas took 23.70 ms
    # against 24.15 / 23.87 at 6: no clear gain for a thinner margin.
    seed_sigmas: float = 6.0
    # `hytopk` only: query rows per kernel call (a power of two >= block_q). Longer sequences
    # run as consecutive calls over query chunks, each on the key prefix its causal rows can
    # see, so the candidate buffers never exceed 2 * B * rows_per_call * capacity int32 at once
    # (4 GiB at B=1, k=2048) however long T is; two calls at T=128K cost 1.6% over one.
    rows_per_call: int = 65536
    # Heads whose query tiles stay in shared memory for a program's whole key stream; None: as
    # many as 128 KiB holds (all 32 at HI = 32, DI = 128, bf16; half of HI = 64).
    resident_heads: int | None = None

    def min_room(self) -> int:
        """Free slots per row the stream needs after a compaction."""
        return self.block_k * self.min_steps

    def resolve_seed_rate(self, S: int, k: int) -> int:
        """Keys per sampled key for a kernel over S keys (0: unseeded): seed_rate, raised to a
        power of two >= S / capacity so the sample fits the candidate buffer."""
        if not self.seed_rate:
            return 0
        return max(self.seed_rate, _next_pow2(_cdiv(S, self.resolve_capacity(k))))

    def resolve_capacity(self, k: int) -> int:
        cap = self.capacity or _next_pow2(2 * k + self.min_room())
        cap = max(cap, self.chunk)
        if cap < k + self.min_room() or cap & (cap - 1):
            raise ValueError(
                f"capacity must be a power of two >= k + block_k * min_steps; got "
                f"capacity={cap} for {k=} block_k={self.block_k} min_steps={self.min_steps}"
            )
        return cap


def _resident_heads(bs: BlockSizes, HI: int, DI: int, dtype) -> int:
    """Heads whose query tiles [bs.block_q, DI] stay in shared memory for the program's whole key
    stream: bs.resident_heads, or as many as `_RESIDENT_QUERY_BYTES` holds."""
    if bs.resident_heads is not None:
        return min(bs.resident_heads, HI)
    tile = bs.block_q * DI * jnp.dtype(dtype).itemsize
    return min(HI, _RESIDENT_QUERY_BYTES // tile)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _cdiv(a, b):
    return (a + b - 1) // b


def _any(mask):
    """Scalar bool: any element of a bool vector (int max reduce; lowers on Triton)."""
    return jnp.max(mask.astype(jnp.int32)) > 0


def _floor_mid(lo, hi):
    """floor((lo + hi) / 2) for int32 without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _order_key(scores, valid):
    """Monotone int32 image of f32 scores [bq, bk]; INVALID_KEY where not valid or NaN.

    Same map as pallas_kernels.order_keys.order_key, written so Triton cannot fold the -0.0
    fix away.
    """
    bits = lax.bitcast_convert_type(scores, jnp.int32)
    key = jnp.where(bits < 0, bits ^ _SIGN_FLIP, bits)
    key = jnp.where(scores == 0.0, 0, key)  # -0.0 and +0.0 tie
    ok = valid & (scores == scores)  # NaN != NaN
    return jnp.where(ok, key, INVALID_KEY)


_SEED_HASH = 0x2545F491  # odd multiplier of the sampled offsets' hash (any fixed one works)


def seed_positions(window, rate: int):
    """The key sampled in each window [i * rate, (i + 1) * rate) of `window` (int32 array of
    window numbers i): a fixed pseudo-random offset per window, so no key layout with a
    period dividing the rate lines up with the sample."""
    offset = lax.shift_right_logical(window * _SEED_HASH, 16) & (rate - 1)
    return window * rate + offset


def seed_counts(k: int, rate: int, sigmas: float) -> tuple[int, int]:
    """(m_lo, m_hi): the seed's threshold leaves m in [m_lo, m_hi] sampled keys at or above
    it. m_lo is the least m with m - sigmas * sqrt(m) >= k / rate: the m-th largest of a
    1 / rate sample sits near rank m * rate of all keys with a relative spread ~ 1 / sqrt(m),
    so at least k keys reach it unless the sample is sigmas spreads off. The bracket's width
    (a quarter) only lets the threshold search stop early."""
    need = k / rate
    root = (sigmas + math.sqrt(sigmas * sigmas + 4.0 * need)) / 2.0
    m_lo = max(1, math.ceil(root * root - 1e-9))
    return m_lo, m_lo + max(m_lo // 4, 8)


def _scatter_positions(keep, base, cap: int):
    """Stream compaction targets for one row-wise store.

    keep: [bq, n] bool (n <= cap); base: [bq] first free slot. Kept lanes go, in lane order, to
    base, base+1, ...; dropped lanes get the following slots modulo cap, so the n targets of a
    row are distinct and in bounds. The store masks dropped lanes off; distinct targets matter
    for interpret mode, whose masked scatter rewrites the old value at every target.
    Returns (positions [bq, n] int32, kept per row [bq]).
    """
    rank = jnp.cumsum(keep.astype(jnp.int32), axis=1)  # inclusive
    n_keep = jnp.sum(keep.astype(jnp.int32), axis=1)
    lane = lax.broadcasted_iota(jnp.int32, keep.shape, 1)
    off = jnp.where(keep, rank - 1, n_keep[:, None] + lane - rank)
    return (base[:, None] + off) & (cap - 1), n_keep


def _barrier(enabled: bool):
    """CTA-wide barrier (bar.sync): orders one thread's global stores to the candidate buffer
    before other threads' later loads of it. Interpret mode runs sequentially and has none."""
    if enabled:
        pltriton.debug_barrier()


def _sample_pivots(key_ref, cnt, counts):
    """Per row, buffer entries expected to have about `counts[i]` entries >= them.

    key_ref: [bq, cap] buffers (first cnt [bq] entries valid); counts: descending ints or [bq]
    int32 vectors. Ranks _SAMPLE entries at stratified positions among themselves (ties by
    position) and returns, per count c, the one of rank floor(c * _SAMPLE / cnt): a list of
    [bq] int32 pivots, ascending (meaningless for cnt == 0 rows, which are never active).
    """
    bq, sample = cnt.shape[0], _SAMPLE
    lane = lax.broadcasted_iota(jnp.int32, (bq, sample), 1)
    rows = lax.broadcasted_iota(jnp.int32, (bq, sample), 0)
    pos = (lane * cnt[:, None] + cnt[:, None] // 2) // sample  # stratum midpoints, < cnt
    vals = key_ref[rows, pos]  # [bq, sample]
    a, b = vals[:, :, None], vals[:, None, :]  # entry i against entry j
    i = lax.broadcasted_iota(jnp.int32, (bq, sample, sample), 1)
    j = lax.broadcasted_iota(jnp.int32, (bq, sample, sample), 2)
    before = (b > a) | ((b == a) & (j < i))
    rank = jnp.sum(before.astype(jnp.int32), axis=2)  # [bq, sample]
    out = []
    for c in counts:
        want = jnp.clip((c * sample) // jnp.maximum(cnt, 1), 0, sample - 1)
        out.append(jnp.max(jnp.where(rank == want[:, None], vals, INVALID_KEY), axis=1))
    return out


def _interpolated_pivots(lo, hi, c_lo, c_hi, counts):
    """Per row, non-decreasing pivots where about counts[i] entries would be >= them, as if
    the c_lo - c_hi entries of [lo, hi) were spread evenly over the key values.

    lo, hi, c_lo, c_hi: [bq] int32; counts: ints or [bq] int32 vectors, descending. The offset
    is taken on half the exact span, (hi >> 1) - (lo >> 1) (int32, exact in f32 below 2**24),
    so narrow brackets get the key value they ask for, not lo rounded to f32. Pivots are
    clamped into [lo + 1, hi - 1], so each pass shrinks every unfinished bracket.
    """
    half_span = ((hi >> 1) - (lo >> 1)).astype(jnp.float32)  # >= 0, (hi - lo) / 2 +- 1
    spread = jnp.maximum(c_lo - c_hi, 1).astype(jnp.float32)
    out = []
    for c in counts:
        frac = jnp.clip((c_lo - c).astype(jnp.float32) / spread, 0.0, 1.0)
        half_offset = (half_span * frac).astype(jnp.int32)  # in [0, half_span]
        point = lo + half_offset + half_offset
        out.append(jnp.clip(point, lo + 1, jnp.maximum(hi - 1, lo + 1)))
    return out


def _compact(key_ref, idx_ref, tau, cnt, kmax, active, *, k, target, chunk, cap, sync):
    """Raise `tau` for the `active` rows and rewrite their buffers to <= target entries (or
    exactly the top-k when ties leave no threshold with k <= count <= target).

    key_ref, idx_ref: [bq, cap] int32 candidate buffers (valid prefix of length cnt per row,
      ascending key index). tau, cnt, kmax, active: [bq] (threshold, count, max buffered key,
      rows to compact). Returns the new (tau, cnt).
    """
    bq = tau.shape[0]
    cols0 = lax.broadcasted_iota(jnp.int32, (bq, chunk), 1)
    rows = lax.broadcasted_iota(jnp.int32, (bq, chunk), 0)
    n_chunks = _cdiv(jnp.max(jnp.where(active, cnt, 0)), chunk)

    def count_pass(mids):
        """Per row and pivot m in `mids`: #entries >= m, min entry >= m, max entry < m. One
        read of the buffer serves every pivot; per-lane [bq, chunk] accumulators are reduced
        across lanes once per pass."""

        def body(c, carry):
            keys = key_ref[:, pl.ds(c * chunk, chunk)]
            inb = (cols0 + c * chunk) < cnt[:, None]
            out = []
            for mid, (n_ge, min_ge, max_lt) in zip(mids, carry):
                ge = inb & (keys >= mid[:, None])
                lt = inb & (keys < mid[:, None])
                out.append(
                    (
                        n_ge + ge.astype(jnp.int32),
                        jnp.minimum(min_ge, jnp.where(ge, keys, _INT32_MAX)),
                        jnp.maximum(max_lt, jnp.where(lt, keys, INVALID_KEY)),
                    )
                )
            return tuple(out)

        init = tuple(
            (
                jnp.zeros((bq, chunk), jnp.int32),
                jnp.full((bq, chunk), _INT32_MAX, jnp.int32),
                jnp.full((bq, chunk), INVALID_KEY, jnp.int32),
            )
            for _ in mids
        )
        counts = lax.fori_loop(0, n_chunks, body, init)
        return tuple(
            (jnp.sum(n, axis=1), jnp.min(mn, axis=1), jnp.max(mx, axis=1)) for n, mn, mx in counts
        )

    # Search state per row: count_ge(lo) = c_lo >= k, count_ge(hi) = c_hi < k, lo < hi.
    # Entries are all > tau_old >= lo at the start, and kmax + 1 has none at or above it.
    lo, c_lo = tau, cnt
    hi, c_hi = kmax + 1, jnp.zeros_like(cnt)

    def is_done(lo, hi, c_lo):
        return (~active) | (c_lo <= target) | (hi == lo + 1)

    def search_cond(state):
        lo, hi, c_lo, _, it = state
        # The sampled pass, the interpolated ones, then at most 32 bisection steps (each
        # halves [lo, hi), narrower than 2**32) always suffice; the cap only guards against an
        # infinite loop if an invariant were ever broken.
        return _any(~is_done(lo, hi, c_lo)) & (it < 40 + _INTERPOLATED_PASSES)

    def refine(state, mids):
        """One count pass at the ascending pivots `mids`; narrows [lo, hi) of unfinished rows."""
        lo, hi, c_lo, c_hi, it = state
        done = is_done(lo, hi, c_lo)
        counts = count_pass(mids)
        # n_ge falls as the pivot rises, so "the k-th key is >= pivot" holds for a prefix of
        # the pivots: lo moves up to the data at the last such pivot, hi down to the data at
        # the first pivot past it (ascending / descending overwrites pick those).
        new_lo, new_c_lo, new_hi, new_c_hi = lo, c_lo, hi, c_hi
        for n_ge, min_ge, _ in counts:
            up = (~done) & (n_ge >= k)
            new_lo = jnp.where(up, min_ge, new_lo)
            new_c_lo = jnp.where(up, n_ge, new_c_lo)
        for n_ge, _, max_lt in reversed(counts):
            down = (~done) & (n_ge < k)
            new_hi = jnp.where(down, max_lt + 1, new_hi)
            new_c_hi = jnp.where(down, n_ge, new_c_hi)
        return new_lo, new_hi, new_c_lo, new_c_hi, it + _any(~done).astype(jnp.int32)

    def bisect_body(state):
        return refine(state, [_floor_mid(state[0], state[1])])

    # Mid-stream, both pivots aim inside [k, target]; the lower count is the one that usually
    # lands (a bracket end with count >= k), the higher a fallback when the lower undershoots.
    stream_counts = tuple(k + int(a * (target - k)) for a in _STREAM_AIMS)

    # Interpolation aims two pivots just inside the wanted counts: around the k-th key when
    # the target is exactly k (the final compaction; a window of 1/16 of the bracket's
    # entries on each side, so a pass that lands within it shrinks the bracket ~8x), or at
    # stream_counts otherwise.
    def interpolate_body(state):
        lo, hi, c_lo, c_hi, _ = state
        if target > k:
            counts = stream_counts
        else:
            margin = jnp.maximum((c_lo - c_hi) // 16, 1)
            counts = (k + margin, k - margin)
        return refine(state, _interpolated_pivots(lo, hi, c_lo, c_hi, counts))

    state = (lo, hi, c_lo, c_hi, jnp.int32(0))
    # The sampled first pass: both pivots inside [k, target] (mid-stream), or around the
    # k-th key (final).
    if target > k:
        counts = stream_counts
    else:
        margin = jnp.maximum(cnt // 8, 8)
        counts = (k + margin, k - margin)
    state = refine(state, _sample_pivots(key_ref, cnt, counts))
    last = state[4] + _INTERPOLATED_PASSES
    state = lax.while_loop(lambda st: search_cond(st) & (st[4] < last), interpolate_body, state)
    lo, hi, c_lo, c_hi, _ = lax.while_loop(search_cond, bisect_body, state)

    # Rows with c_lo > target converged on lo = the exact k-th key (hi == lo + 1): keep all
    # entries > lo and only the first (k - c_hi) entries equal to lo.
    quota = jnp.where(c_lo > target, k - c_hi, _INT32_MAX)

    def rewrite_loop(ties: bool):
        """The in-place rewrite. ties=False: no active row has a quota, so every entry >= lo
        is kept and the per-chunk tie ranks (a second row-wise cumsum) are skipped."""

        def rewrite(c, carry):
            kept, eq_seen = carry
            _barrier(sync)  # every thread has loaded chunk c-1 before anyone writes into it
            cols = cols0 + c * chunk
            keys = key_ref[:, pl.ds(c * chunk, chunk)]
            idxs = idx_ref[:, pl.ds(c * chunk, chunk)]
            # `idxs >= 0` is always true for buffered entries; it makes every store of the row
            # depend on the idx loads at positions <= its own, so the in-place rewrite never
            # overtakes a load.
            inb = (cols < cnt[:, None]) & (idxs >= 0)
            if ties:
                eq = inb & (keys == lo[:, None])
                eq_rank = eq_seen[:, None] + jnp.cumsum(eq.astype(jnp.int32), axis=1) - 1
                keep = inb & ((keys > lo[:, None]) | (eq & (eq_rank < quota[:, None])))
                eq_seen = eq_seen + jnp.sum(eq.astype(jnp.int32), axis=1)
            else:
                keep = inb & (keys >= lo[:, None])
            new_pos, n_keep = _scatter_positions(keep, kept, cap)
            write = keep & active[:, None]
            pltriton.store(key_ref.at[rows, new_pos], keys, mask=write)
            pltriton.store(idx_ref.at[rows, new_pos], idxs, mask=write)
            return kept + n_keep, eq_seen

        return lax.fori_loop(0, n_chunks, rewrite, (jnp.zeros_like(cnt), jnp.zeros_like(cnt)))[0]

    kept = lax.cond(
        _any(active & (quota < _INT32_MAX)),
        lambda: rewrite_loop(True),
        lambda: rewrite_loop(False),
    )
    _barrier(sync)
    return jnp.where(active, lo, tau), jnp.where(active, kept, cnt)


def _dot_f32(a, b, contract):
    """f32-accumulated dot of a and b over the axes `contract` (HIGHEST: no TF32 for f32)."""
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _relu(x):
    return jnp.where(x < 0.0, 0.0, x)  # NaN stays NaN, as in XLA's relu (Triton's max drops it)


def _per_head_scores(q_ref, w_ref, *, bq, bk, resident_heads):
    """score_keys(kblk [bk, DI], kscale [bk] f32 or None) -> f32 scores [bq, bk] (q_ref
    [bq, HI, DI], w_ref [HI, bq]): one dot per indexer head, M = bq queries (16: below the 64
    rows of Hopper's `wgmma`, so `mma.sync`), each reading the key block from shared memory.
    The first `resident_heads` heads' query tiles are loaded once per program; the others
    where each dot needs them."""
    HI = q_ref.shape[1]
    # Each resident head's queries [bq, DI] and every head's weights [bq, 1], loaded once per
    # program.
    q_heads = [q_ref[:, h, :] for h in range(resident_heads)]
    w_heads = [w_ref[h, :][:, None] for h in range(HI)]

    def score_keys(kblk, kscale):
        acc = jnp.zeros((bq, bk), jnp.float32)
        for h in range(HI):  # unrolled: one f32-accumulated dot per head, f32 head sum
            q_h = q_heads[h] if h < resident_heads else q_ref[:, h, :]
            acc = acc + w_heads[h] * _relu(_dot_f32(q_h, kblk, ((1,), (1,))))
        if kscale is not None:  # one f32 multiply of the head sum, as in the reference
            acc = acc * kscale[None, :]
        return acc

    return score_keys


def _hytopk_kernel(
    q_ref,
    w_ref,
    k_ref,
    key_ref,
    idx_ref,
    cnt_ref,
    *,
    T,
    S,
    causal,
    k,
    bs,
    sync,
    resident_heads,
    failed_ref=None,
    scale_ref=None,
):
    """One program: `block_q` queries of one batch row against all their visible keys.

    q_ref: the program's indexer queries, [bq, HI, DI]; w_ref: their f32 head weights [HI, bq].
    k_ref: [S_pad, DI] all keys of the batch row.
    key_ref, idx_ref: [bq, cap] int32 candidate buffers (out); cnt_ref: [bq] int32 (out; -1
      flags a row whose seed failed).
    failed_ref: the re-run call only, [bq] int32, nonzero for rows flagged by the first call.
    scale_ref: [S_pad] f32 per-key scales of the batch row, or None (no multiply).
    resident_heads: heads whose query tiles are loaded once per program (the others at every
      key block).
    """
    bq, bk = bs.block_q, bs.block_k
    n_q, cap = _cdiv(T, bq), bs.resolve_capacity(k)
    # Heavier (later) query blocks run first: better tail balance under causal masking.
    qb = n_q - 1 - pl.program_id(1)
    t_pos = qb * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    s_off = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    rows = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    if causal:  # the block's last real query sees keys up to (last t) + S - T
        last_visible = jnp.minimum(qb * bq + bq, T) - 1 + (S - T)
        n_kb = last_visible // bk + 1
    else:
        n_kb = _cdiv(S, bk)
    # A compaction leaves >= min_room free slots; mid-stream it aims for ~stream_target entries.
    stream_target = k + (cap - bs.min_room() - k) // 2
    compact = functools.partial(_compact, key_ref, idx_ref, chunk=bs.chunk, cap=cap, sync=sync)
    zeros = jnp.zeros((bq,), jnp.int32)
    zero = jnp.int32(0)
    score_keys = _per_head_scores(q_ref, w_ref, bq=bq, bk=bk, resident_heads=resident_heads)
    invalid = jnp.full((bq,), INVALID_KEY, jnp.int32)

    def block_keys(j):
        """Order keys [bq, bk] of key block j and their key indices."""
        s_pos = j * bk + s_off
        valid = s_pos < S
        if causal:
            valid = valid & (s_pos <= t_pos + (S - T))
        span = pl.ds(j * bk, bk)
        kscale = None if scale_ref is None else scale_ref[span]
        return _order_key(score_keys(k_ref[span, :], kscale), valid), s_pos

    def seed_threshold():
        """[bq] int32 starting tau: one below the sampled key that m in [m_lo, m_hi] sampled
        keys reach (`seed_counts`), or INVALID_KEY where the sample has <= m_hi valid keys.
        The sample is written to the candidate buffers and searched like a compaction."""
        rate = bs.resolve_seed_rate(S, k)
        m_lo, m_hi = seed_counts(k, rate, bs.seed_sigmas)
        last_key = jnp.minimum(last_visible + 1, S) if causal else S
        n_blocks = _cdiv(_cdiv(last_key, rate), bk)
        lanes = lax.broadcasted_iota(jnp.int32, (bk,), 0)

        def sample_step(b, carry):
            n_valid, kmax = carry
            s_pos = seed_positions(b * bk + lanes, rate)  # [bk]
            row = jnp.minimum(s_pos, k_ref.shape[0] - 1)
            kblk = k_ref[row, :]  # [bk, DI]
            kscale = None if scale_ref is None else scale_ref[row]  # [bk]
            s_pos = jnp.broadcast_to(s_pos[None, :], (bq, bk))
            valid = s_pos < S
            if causal:
                valid = valid & (s_pos <= t_pos + (S - T))
            keys = _order_key(score_keys(kblk, kscale), valid)
            slots = pl.ds(pl.multiple_of(b * bk, bk), bk)
            key_ref[:, slots] = keys
            idx_ref[:, slots] = s_pos
            n_valid = n_valid + jnp.sum((keys != INVALID_KEY).astype(jnp.int32), axis=1)
            return n_valid, jnp.maximum(kmax, jnp.max(keys, axis=1))

        n_valid, kmax = lax.fori_loop(0, n_blocks, sample_step, (zeros, invalid))
        _barrier(sync)  # the sample's stores are visible to the search's loads
        tau, _ = compact(invalid, zeros + n_blocks * bk, kmax, n_valid > m_hi, k=m_lo, target=m_hi)
        # One below: the stream keeps keys > tau, so keys tied with the sampled one stay in.
        return jnp.where(tau != INVALID_KEY, tau - 1, INVALID_KEY)

    def first_run():
        """Key blocks [0, m0) with tau at the floor: each stored whole at slots
        [j * bk, (j + 1) * bk), no keep mask or cumsum. Returns (m0, cnt, kmax)."""

        def step(j, kmax):
            keys, s_pos = block_keys(j)
            slots = pl.ds(pl.multiple_of(j * bk, bk), bk)
            key_ref[:, slots] = keys
            idx_ref[:, slots] = s_pos
            return jnp.maximum(kmax, jnp.max(keys, axis=1))

        m0 = jnp.minimum(cap // bk, n_kb)
        kmax = lax.fori_loop(0, m0, step, invalid)
        return m0, zeros + m0 * bk, kmax

    def select(seeded: bool):
        """The exact selection, its stream started at a seeded threshold or at the floor."""
        if seeded:
            tau0 = seed_threshold()
            j0, cnt0, kmax0 = zero, zeros, invalid
        else:
            tau0 = invalid
            j0, cnt0, kmax0 = first_run()
            _barrier(sync)  # the first run's stores are visible to the first compaction's loads

        trigger = cap - bs.min_room()

        def outer_body(carry):
            """Compact if some row has fewer than min_room free slots, then a run of m >=
            min_steps key blocks that only append: it cannot overflow a row, and its loop has
            no nested loop and no barrier (Triton pipelines only innermost loops)."""
            j, tau, cnt, kmax = carry
            _barrier(sync)  # the previous run's appends are visible to the compaction
            active = (jnp.max(cnt) > trigger) & (cnt > stream_target)
            tau, cnt = compact(tau, cnt, kmax, active, k=k, target=stream_target)

            def run_step(j, carry):
                """Score key block j and store its keys > tau at count + rank. kmax runs over
                all keys, kept or not: a key above the running max is > tau, so kept."""
                cnt, kmax = carry
                keys, s_pos = block_keys(j)
                keep = keys > tau[:, None]
                pos, n_keep = _scatter_positions(keep, cnt, cap)
                pltriton.store(key_ref.at[rows, pos], keys, mask=keep)
                pltriton.store(idx_ref.at[rows, pos], s_pos, mask=keep)
                kmax = jnp.maximum(kmax, jnp.max(keys, axis=1))
                return cnt + n_keep, kmax

            m = jnp.minimum((cap - jnp.max(cnt)) // bk, n_kb - j)
            cnt, kmax = lax.fori_loop(j, j + m, run_step, (cnt, kmax))
            return j + m, tau, cnt, kmax

        _, tau, cnt, kmax = lax.while_loop(
            lambda carry: carry[0] < n_kb, outer_body, (j0, tau0, cnt0, kmax0)
        )
        _barrier(sync)

        # Final compaction: exactly the top-k set of each row, in index order.
        final_count = cnt
        _, cnt = compact(tau, cnt, kmax, cnt > k, k=k, target=k)
        if seeded:
            # No compaction runs while a row holds fewer than k entries, so a seeded row ends
            # the stream below k only if fewer than k of its keys beat the seed: then the seed
            # was above its k-th key and the row's buffer may lack some of its top-k.
            # cnt = -1 flags it for the re-run.
            cnt = jnp.where((tau0 != INVALID_KEY) & (final_count < k), -1, cnt)
        cnt_ref[:] = cnt

    if failed_ref is None:
        select(bs.seed_rate > 0)
    else:
        # The re-run call: a program with a row whose seed failed runs again unseeded; the
        # others store nothing, so their aliased buffers keep the first call's results.
        def rerun():
            select(False)
            return jnp.max(zeros)  # (a traced branch result: a literal does not lower)

        lax.cond(_any(failed_ref[...] != 0), rerun, lambda: jnp.max(zeros))


@functools.partial(jax.jit, static_argnames=("k", "causal", "interpret", "block_sizes"))
def hytopk_candidates(
    q_idx,
    k_idx,
    w,
    *,
    k: int,
    causal: bool,
    interpret: bool = False,
    block_sizes=BlockSizes(),
    k_scale=None,
):
    """Run the fused kernel (and its seed re-run): each row's top-k set, in key-index order.

    Args:
      q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI].
      k_scale: [B, S] f32 per-key scales, or None (the kernel then has no multiply).
    Returns:
      keys [B, T_pad, cap] int32 order keys, idx [B, T_pad, cap] int32 key indices, cnt
      [B, T_pad] int32 (<= k): the first cnt entries of each row are its top-k keys in
      ascending key-index order; INVALID_KEY entries among them (rows with fewer than k
      selectable keys) mean "no key". T_pad = T rounded up to block_q.
    """
    bs = block_sizes
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    for name, v in (("block_q", bs.block_q), ("block_k", bs.block_k), ("chunk", bs.chunk)):
        if not _is_pow2(v):
            raise ValueError(f"{name} must be a power of two; got {name}={v}")
    if bs.block_q < 16:
        raise ValueError(f"block_q must be >= 16 (Triton dot); got block_q={bs.block_q}")
    if bs.min_steps < 1:
        raise ValueError(f"min_steps must be >= 1; got min_steps={bs.min_steps}")
    if bs.resident_heads is not None and bs.resident_heads < 0:
        raise ValueError(f"resident_heads must be None or >= 0; got {bs.resident_heads=}")
    if bs.seed_rate and (not _is_pow2(bs.seed_rate) or bs.seed_rate < 2):
        raise ValueError(f"seed_rate must be 0 or a power of two >= 2; got {bs.seed_rate=}")
    if not bs.seed_sigmas >= 0.0:
        raise ValueError(f"seed_sigmas must be >= 0; got seed_sigmas={bs.seed_sigmas}")
    cap = bs.resolve_capacity(k)
    if cap % bs.chunk:
        raise ValueError(f"capacity={cap} must be a multiple of chunk={bs.chunk}")
    # float8_e4m3fn widens to bf16 exactly (3 mantissa bits into 7, range +-448 inside bf16's),
    # so FP8 inputs are scored from bf16 copies bit for bit. This saves no bandwidth yet: the
    # kernel streams 2-byte keys; loading FP8 directly is a later step.
    q_idx, k_idx = (x.astype(jnp.bfloat16) if x.dtype == _FP8 else x for x in (q_idx, k_idx))
    dtype = jnp.result_type(q_idx.dtype, k_idx.dtype)
    q_idx, k_idx = q_idx.astype(dtype), k_idx.astype(dtype)
    n_q, n_k = _cdiv(T, bs.block_q), _cdiv(S, bs.block_k)
    rev = lambda i: n_q - 1 - i  # noqa: E731  (heaviest query blocks first)
    T_pad, S_pad = n_q * bs.block_q, n_k * bs.block_k
    if T_pad != T:  # padded queries score zeros and are sliced off by the caller
        q_idx = jnp.pad(q_idx, ((0, 0), (0, T_pad - T), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, T_pad - T), (0, 0)))
    if S_pad != S:  # padded keys are masked invisible (s >= S)
        k_idx = jnp.pad(k_idx, ((0, 0), (0, S_pad - S), (0, 0)))
    if k_scale is not None:
        k_scale = jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, S_pad - S)), constant_values=1)
    DI_pad = max(16, _next_pow2(DI))  # Triton dots want power-of-two K >= 16; zeros add nothing
    if DI_pad != DI:
        q_idx = jnp.pad(q_idx, ((0, 0), (0, 0), (0, 0), (0, DI_pad - DI)))
        k_idx = jnp.pad(k_idx, ((0, 0), (0, 0), (0, DI_pad - DI)))
        DI = DI_pad
    bq = bs.block_q
    w_in = jnp.swapaxes(w.astype(jnp.float32), 1, 2)  # [B, HI, T_pad]: contiguous per head
    q_spec = pl.BlockSpec((None, bq, HI, DI), lambda b, i: (b, rev(i), 0, 0))
    w_spec = pl.BlockSpec((None, HI, bq), lambda b, i: (b, 0, rev(i)))

    resident_heads = _resident_heads(bs, HI, DI, q_idx.dtype)
    kernel = functools.partial(
        _hytopk_kernel,
        T=T,
        S=S,
        causal=causal,
        k=k,
        bs=bs,
        sync=not interpret,
        resident_heads=resident_heads,
    )
    # With scales the kernel takes them as a fourth input, [S_pad] per batch row; without, its
    # inputs (and so its Triton IR) are the unscaled kernel's alone.
    inputs = [q_idx, w_in, k_idx]
    body = kernel
    if k_scale is not None:
        inputs.append(k_scale)

        def body(q_ref, w_ref, k_ref, scale_ref, key_ref, idx_ref, cnt_ref):
            kernel(q_ref, w_ref, k_ref, key_ref, idx_ref, cnt_ref, scale_ref=scale_ref)

    out_shape = (
        jax.ShapeDtypeStruct((B, T_pad, cap), jnp.int32),
        jax.ShapeDtypeStruct((B, T_pad, cap), jnp.int32),
        jax.ShapeDtypeStruct((B, T_pad), jnp.int32),
    )
    out_specs = [
        pl.BlockSpec((None, bs.block_q, cap), lambda b, i: (b, rev(i), 0)),
        pl.BlockSpec((None, bs.block_q, cap), lambda b, i: (b, rev(i), 0)),
        pl.BlockSpec((None, bs.block_q), lambda b, i: (b, rev(i))),
    ]
    in_specs = [q_spec, w_spec, pl.BlockSpec((None, S_pad, DI), lambda b, i: (b, 0, 0))]
    if k_scale is not None:
        in_specs.append(pl.BlockSpec((None, S_pad), lambda b, i: (b, 0)))
    stages = bs.num_stages or (2 if resident_heads == HI else 1)
    params = pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=stages)
    out = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(B, n_q),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name="hytopk_fused_select",
    )(*inputs)
    if not bs.seed_rate:
        return out
    # Programs with a row whose seed failed (cnt = -1) run again unseeded; the buffers are
    # aliased, so the others keep what the first call wrote. With no failed row every program
    # of this call only reads its flags.
    keys, idx, cnt = out

    def rerun_body(*refs):
        # refs: the inputs (q, w, k[, scales]), the failed flags, the aliased buffers (unread),
        # then the output buffers.
        n = len(inputs)
        q_ref, w_ref, k_ref = refs[:3]
        scale_ref = refs[3] if n == 4 else None
        key_ref, idx_ref, cnt_ref = refs[n + 4 :]
        kernel(
            q_ref,
            w_ref,
            k_ref,
            key_ref,
            idx_ref,
            cnt_ref,
            failed_ref=refs[n],
            scale_ref=scale_ref,
        )

    first = len(inputs) + 1  # the aliased buffers' operand positions
    return pl.pallas_call(
        rerun_body,
        out_shape=out_shape,
        grid=(B, n_q),
        in_specs=in_specs + [out_specs[2]] + out_specs,
        out_specs=out_specs,
        input_output_aliases={first: 0, first + 1: 1, first + 2: 2},
        compiler_params=params,
        interpret=interpret,
        name="hytopk_seed_rerun",
    )(*inputs, (cnt < 0).astype(jnp.int32), keys, idx, cnt)


def order_candidates(keys, idx, cnt, *, T: int, k: int):
    """The epilogue: [B, T, k] key indices in the selection order from hytopk_candidates'
    buffers (keys, idx [B, T_pad, cap] int32; cnt [B, T_pad] int32, <= k valid per row).

    XLA sorts each row's (~key, buffer position) pairs as two keys (~ makes ascending order
    key-descending; entries past cnt sort last), positions in int16 where they fit, then
    gathers the key indices. The buffer is in index order, so position order is the tie rule;
    positions are distinct, so the sort needs no stability (which would add an iota operand).
    """
    nkeys = ~jnp.where(jnp.arange(k) < cnt[:, :T, None], keys[:, :T, :k], INVALID_KEY)
    narrow = k <= jnp.iinfo(jnp.int16).max + 1
    position = lax.broadcasted_iota(jnp.int16 if narrow else jnp.int32, nkeys.shape, 2)
    nkeys, position = lax.sort((nkeys, position), dimension=2, num_keys=2, is_stable=False)
    top = jnp.take_along_axis(idx[:, :T, :k], position[..., :k].astype(jnp.int32), axis=2)
    return jnp.where(nkeys[..., :k] == ~INVALID_KEY, -1, top).astype(jnp.int32)


def _valid_entries(keys, cnt, *, T: int, k: int):
    """[B, T, k] bool: the buffer slots that hold a selected key (inside cnt, not a placeholder)."""
    return (jnp.arange(k) < cnt[:, :T, None]) & (keys[:, :T, :k] != INVALID_KEY)


def placeholders_interrupt(keys, cnt, *, T: int, k: int):
    """Whether some row's selected keys are not a prefix of its buffer: a row streamed unseeded
    (re-run, or `seed_rate=0`; its first run stores whole key blocks, invalid keys as
    placeholders) with fewer than k real keys and a NaN score before one of them."""
    valid = _valid_entries(keys, cnt, T=T, k=k)
    return jnp.any(~valid[..., :-1] & valid[..., 1:])


def candidates_in_key_order(keys, idx, cnt, *, T: int, k: int):
    """The epilogue of `order="index"`: [B, T, k] the selected key indices in ascending order,
    -1 after them, from hytopk_candidates' buffers (as in `order_candidates`).

    The buffer is already in index order, so where each row's selected keys are a prefix of it
    the result is that prefix, with no sort. Only where `placeholders_interrupt` does XLA sort
    the call's rows by index (one `lax.cond`; under `jax.vmap` the cond becomes a select and
    the sort always runs).
    """
    selected = jnp.where(_valid_entries(keys, cnt, T=T, k=k), idx[:, :T, :k], -1)
    interrupted = placeholders_interrupt(keys, cnt, T=T, k=k)
    return lax.cond(interrupted, in_key_order, lambda x: x, selected).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "causal", "interpret", "block_sizes", "order"))
def _hytopk(q_idx, k_idx, w, *, k, causal, interpret, block_sizes, k_scale=None, order="score"):
    """Selection over query chunks of block_sizes.rows_per_call rows, one after the other.

    Query rows [lo, hi) under end-aligned causality see keys s <= t + S - T, all inside the
    prefix [0, hi + S - T); on that prefix the chunk (T' = hi - lo, S' = hi + S - T) has
    S' - T' = lo + S - T, so the kernel's own end-aligned mask is the whole sequence's. Each
    chunk's queries pass through an optimization barrier with the previous chunk's result, so
    its kernel cannot start (and allocate its buffers) before the previous chunk is done.
    """
    T, S = q_idx.shape[1], k_idx.shape[1]
    rows = block_sizes.rows_per_call
    parts = []
    for lo in range(0, T, rows):
        hi = min(lo + rows, T)
        q_chunk, w_chunk = q_idx[:, lo:hi], w[:, lo:hi]
        if parts:
            parts[-1], q_chunk, w_chunk = lax.optimization_barrier((parts[-1], q_chunk, w_chunk))
        keys_chunk = k_idx[:, : hi + S - T] if causal else k_idx
        scale_chunk = k_scale
        if k_scale is not None and causal:
            scale_chunk = k_scale[:, : hi + S - T]
        keys, idx, cnt = hytopk_candidates(
            q_chunk,
            keys_chunk,
            w_chunk,
            k=k,
            causal=causal,
            interpret=interpret,
            block_sizes=block_sizes,
            k_scale=scale_chunk,
        )
        epilogue = order_candidates if order == "score" else candidates_in_key_order
        parts.append(epilogue(keys, idx, cnt, T=hi - lo, k=k))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def hytopk(
    q_idx,
    k_idx,
    w,
    *,
    k: int,
    causal: bool,
    k_scale=None,
    interpret=False,
    block_sizes=None,
    order="score",
):
    """Exact top-k keys per query (docs/design.md, 'HyTopK kernel') with the fused Pallas kernel.

    Args:
      q_idx: [B, T, HI, DI] indexer queries (bf16, f16, f32 or float8_e4m3fn).
      k_idx: [B, S, DI] indexer keys (same dtypes).
      w: [B, T, HI] indexer head weights.
      k_scale: [B, S] f32 per-key scales multiplying the f32 head sums, or None (all ones).
      k: slots per query, >= 1.
      causal: end-aligned causal visibility (key s visible to query t iff s <= t + S - T).
      interpret: run the kernel in Pallas interpret mode (CPU tests).
      block_sizes: tile sizes; default BlockSizes().
      order: "score" (by score descending, ties to the smaller index) or "index" (the same
        keys by ascending key index, without the ordering sort).
    Returns:
      int32 [B, T, k]: the selected key indices in `order`, NaN scores and invisible keys never
      chosen, -1 in the slots left empty (after the selected ones).
    """
    check_order(order)
    block_sizes = block_sizes or BlockSizes()
    T, S = q_idx.shape[1], k_idx.shape[1]
    if causal and T > S:  # end-aligned causality needs T <= S (a query chunk's key prefix too)
        raise ValueError(
            f"causal selection needs T <= S; got q_idx {q_idx.shape}, "
            f"k_idx {k_idx.shape} ({T=} > {S=})"
        )
    if not _is_pow2(block_sizes.rows_per_call) or block_sizes.rows_per_call < block_sizes.block_q:
        raise ValueError(
            f"rows_per_call must be a power of two >= block_q; got "
            f"rows_per_call={block_sizes.rows_per_call} block_q={block_sizes.block_q}"
        )
    return _hytopk(
        q_idx,
        k_idx,
        w,
        k=k,
        causal=causal,
        interpret=interpret,
        block_sizes=block_sizes,
        k_scale=k_scale,
        order=order,
    )
