"""HyTopK as one fused Pallas (Triton) kernel: indexer scoring + exact streaming top-k.

    score[b,t,s] = sum_h w[b,t,h] * relu(q_idx[b,t,h,:] . k_idx[b,s,:])        (SPEC section 2)

The selection is the paper's on-the-fly exact top-k (HyScale section 3): one scoring pass over
the keys, no T x S table. Every program owns `block_q` queries and streams their visible key
blocks in ascending key order. Per query row it keeps, in HBM, a *candidate buffer* of
(order key, key index) pairs in ascending key-index order, plus a per-row threshold `tau`:

  * Invariant: the buffer holds the exact top-k (by order key descending, key index ascending)
    of every key seen so far, possibly with extra entries; all its entries are > the previous
    threshold, and once a threshold has been raised the buffer holds >= k entries >= tau.
  * Append: a new key is kept iff its order key is > tau (strictly). A key equal to tau comes
    after >= k buffered entries that are >= tau and have smaller indices, so under the tie rule
    it can never make the top-k; this is what keeps all-equal scores and other adversarial ties
    from overflowing the buffer. Kept keys are compacted with a row-wise cumsum and written with
    a scatter store at `count + rank` (no atomics, deterministic).
  * Bulk first run (BlockSizes.bulk_first_run, the default): until the first compaction tau
    is at its floor and every visible key is kept, so the first cap / block_k key blocks are
    stored whole at slots j * block_k, without the cumsum. Their invisible, padding and NaN
    keys enter the buffer as INVALID_KEY placeholders. A placeholder ranks below every real
    key, so the invariant holds with placeholders counted as the lowest keys: a compaction
    drops them as soon as its threshold is a real key, and only a row with fewer than k real
    keys keeps some, after all its real ones; every epilogue maps them to -1.
  * Seeded start (BlockSizes.seed_rate, the default): before its stream each program scores
    a 1/rate sample of its keys (one pseudo-random key per window of `rate`), finds per row
    the sampled key that a fixed m of the sample reach (the same threshold search as a
    compaction), and starts the stream with tau one below it, so about m * rate keys of the
    row beat tau: a few k, where the floor keeps all of them until the first compaction. m
    (`seed_counts`) leaves at least k keys above tau unless the sample is off by seed_sigmas
    standard deviations. The invariant needs tau below the row's k-th key; the kernel cannot
    know that in advance, but it can tell afterwards: no compaction runs while a row holds
    fewer than k entries, so a seeded row that ends its stream with fewer than k had a seed
    above its k-th key (or fewer than k selectable keys). Such rows are flagged, and their
    programs run again from the floor in a second kernel call over the same (aliased)
    buffers; the others keep their results. Exactness therefore never rests on the sample.
  * Compaction: before a block would overflow a row (count + kept > capacity), the rows that
    are full enough raise tau by bisection on the int32 key space (each step is one pass over
    the row's buffer counting entries >= mid, snapping the interval to the data's min/max on
    either side so it converges in ~log2(#distinct keys) passes). Bisection stops as soon as the
    count of entries >= lo falls inside [k, target]; it keeps all of them. If ties make that
    impossible it ends with lo = the exact k-th key and keeps the entries > lo plus the first
    (k - #entries > lo) entries == lo, in index order: exactly the top-k. With
    BlockSizes.sample, the first count pass uses two pivots taken from a stratified sample of
    each row's buffer (ranked in registers), aimed inside [k, target] or around the k-th key.
    With BlockSizes.interpolate (the default), the next passes place two pivots by linear
    interpolation between the bracket's ends and their counts, as if the bracketed entries
    were spread evenly over the key values, just above and below the wanted count; near the
    k-th key the entries are dense and smooth enough that this closes the bracket in a few
    passes where value bisection needs ~log2 of the key range. Then bisection finishes, so
    exactness depends on neither the sample nor the interpolation. The buffer is then
    rewritten in place, in index order (new position <= old position). CTA barriers
    (bar.sync) separate each rewrite chunk's stores from the previous chunk's loads, and every
    block's appends from the next compaction's loads: the buffer is shared by all threads.
  * Finish: one last compaction with target = BlockSizes.sort_width (default k: exactly the
    top-k *set* of each row) leaves <= sort_width entries in index order that contain the
    top-k; an epilogue then orders them by (key descending, index ascending) and keeps the
    first k: an XLA sort of (key, buffer position) pairs (the default), a stable one-key
    XLA sort, XLA's (key, index) sort, or a bitonic network in a second Pallas kernel
    (BlockSizes.order, `order_survivors`).

Order keys (hyscale_jax.scores): a monotone int32 image of the f32 score; NaN, invisible and
padding keys get INVALID_KEY (int32 min), which no valid key equals, so they are never kept
(except as placeholders of the bulk first run, above).

Triton constraints honoured (SPEC section 4): no sort/top_k, no static value slicing, no integer
atomics (no atomics at all), every in-kernel tensor has power-of-two dimensions; heads are
unrolled with one f32-accumulated dot per head (HIGHEST precision: f32 inputs use IEEE products,
never TF32), relu written as `where(x < 0, 0, x)` so NaN propagates like XLA's relu (Triton's
max is maxnum, which would turn NaN into 0).

Schedules (BlockSizes.schedule):
  * "fused": every key block first runs the compaction check (a no-op unless some row would
    overflow), then appends, then a barrier. Nested data-dependent loops inside the key loop
    stop Triton from pipelining it: 80 ms at T=S=32K on the H200 against 50 ms phased.
  * "phased" (default): an outer loop compacts (rows past stream_target, when the fullest
    row has fewer than min_steps * block_k free slots), then runs m = free_slots // block_k
    key blocks that only score and append. A run of m blocks adds at most m * block_k entries
    per row, so it cannot overflow: the same invariant with the check hoisted out. The run's
    loop has no nested loop, barrier or cross-warp reduction, which is what Triton's software
    pipeliner needs (it only pipelines innermost loops). Measurements:
    experiments/hytopk_notes.md.

Diagnostics (BlockSizes.diagnostic, timing attribution only; experiments/hytopk_notes.md):
"score_only", "append_only" and "append_nested" leave stages out and return no selection;
"stats" is the exact kernel plus per-row work counters (STAT_FIELDS); "clocks" the exact phased
kernel plus per-program SM cycles per phase (CLOCK_FIELDS; compiled GPU kernels only).

Extra device memory: the candidate buffers, 2 * B * T * capacity int32, capacity =
next_pow2(2 * k + block_k) by default (next_pow2(2 * k + min_steps * block_k) when phased):
O(T * k), never O(T * S). `hytopk` bounds them further: it runs query chunks of
BlockSizes.rows_per_call rows one after the other, so at most 2 * B * rows_per_call * capacity
int32 exist at once (per `hytopk` call).
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

from pallas_kernels.order_keys import INVALID_KEY

_INT32_MAX = jnp.iinfo(jnp.int32).max
_SIGN_FLIP = 0x7FFFFFFF


DIAGNOSTICS = ("", "score_only", "append_only", "append_nested", "stats", "clocks")
ORDERS = ("xla", "xla_stable", "xla_position", "pallas")
SCHEDULES = ("fused", "phased")
PIVOTS = (1, 3, 7)  # 2**bits - 1: dyadic pivots, computed without int32 overflow


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and schedule of the fused selection kernel (all sizes powers of two).

    schedule (see the module docstring, "Schedules"):
      "fused"   every key block: compaction check, then append (slower on the H200).
      "phased"  (default) runs of >= min_steps key blocks with append only (no nested loop,
                no barrier, so Triton can software-pipeline the scoring loads), compaction
                between runs.
    diagnostic (timing attribution only; see "Diagnostics" in the module docstring):
      ""              the real kernel.
      "score_only"    scoring + order keys + per-row max/count; no buffer, no compaction.
                      RESULTS ARE NOT A SELECTION.
      "append_only"   scoring + append of every valid key (tau never rises), positions wrapped
                      modulo capacity; no compaction, no barrier. RESULTS ARE GARBAGE.
      "append_nested" "append_only" plus the fused schedule's per-step compaction check and
                      barriers, never active: the cost of nested data-dependent loops in the
                      key loop when they do no work. RESULTS ARE GARBAGE.
      "stats"         the real (exact) kernel plus a 4th output of work counters
                      [B, T_pad, 8] int32 (STAT_FIELDS).
      "clocks"        the real (exact) phased kernel plus a 4th output of SM clock cycles
                      spent per program in each phase, [B, T_pad, 8] int32 (CLOCK_FIELDS);
                      compiled GPU kernel only (it reads %clock with inline PTX).
    """

    block_q: int = 16  # queries per program (the M of each per-head dot; Triton needs >= 16)
    # Keys scored per step of the streaming loop. H200, T=S=32K, k=2048, same run: 34.78 ms
    # full with 256, 39.70 ms with 128 (results/hytopk_bk256/). The default capacity
    # next_pow2(2k + min_steps * block_k) grows with it; only k=2048 was timed.
    block_k: int = 256
    chunk: int = 256  # buffer entries per row handled per step of a compaction pass
    # Candidate slots per query row; None: next_pow2(2 * k + min_room), which leaves the stream
    # target (k + cap - min_room) / 2 at least k / 2 above k, so compactions stay rare.
    # H200, T=S=32K, k=2048 (8192 slots with min_steps 8): 32.92 ms full against 34.63 with
    # the earlier next_pow2(k + min_room) = 4096, min_steps 4 (results/hytopk_ms8/).
    capacity: int | None = None
    num_warps: int = 8  # H200, T=S=32K: 39 ms kernel with 8 warps, 50 ms with 4 (phased)
    num_stages: int = 2
    schedule: str = "phased"  # "phased" | "fused"
    min_steps: int = 8  # phased: key blocks a compaction leaves room for (>= 1)
    pivots: int = 1  # compaction: bisection pivots per count pass (1, 3 or 7)
    # Compaction count passes after the sampled first one (from the first if sample=0): two
    # pivots interpolated from the counts at the bracket [lo, hi) instead of value bisection,
    # aimed just above and below k at an exact final compaction, inside [k, target]
    # otherwise, for up to this many passes; then bisection. 0: bisection only. H200,
    # T=S=32K, same run: 29.82 ms full with 8, 30.20 with 4, 31.37 with 0; count passes per
    # program 10.3 against 15.5 (results/hytopk_interp/).
    interpolate: int = 8
    # Compaction: entries per row sampled to seed the first count pass (0: plain bisection).
    # H200, T=S=32K: 42.6 ms with 32, 44.6 ms with 0, 45.6 ms with 64 (results/hytopk_sample/).
    sample: int = 32
    # Compaction count passes: per-lane accumulators reduced once per pass (True) or row
    # reductions of every [block_q, chunk] chunk (False). H200, T=S=32K, same run: kernel
    # 34.2 ms against 36.7 ms (results/hytopk_clocks/).
    lazy_reduce: bool = True
    # Phased runs: the buffer's largest key (the compaction's upper bracket end) as per-lane
    # maxima reduced once per run (True), or a row max per key block (False). One cross-warp
    # reduction fewer per key block, yet not faster: H200, T=S=32K, same run, 29.94 ms full
    # against 29.65 (runs 16.8 ms of cycles against 17.0 in an earlier run; the extra
    # [block_q, block_k] carry costs registers) (results/hytopk_runmax_aims/).
    lazy_run_max: bool = False
    # Mid-stream compactions: where the sampled and interpolated pivots aim, as fractions of
    # the window [k, stream target] above k, higher count first. The lower aim is where a
    # compaction usually lands: lower leaves more room and a higher threshold, but needs more
    # count passes to land. H200, T=S=32K, same run: 29.65 ms full at (0.75, 0.25), 30.08 at
    # (0.5, 0.125), 30.71 at (0.25, 0.0625); at (0.5, 0.125) 2.5 compactions per program as
    # before and 1% fewer appends, count passes 10.7 against 10.3 (results/hytopk_runmax_aims/).
    stream_aims: tuple[float, float] = (0.75, 0.25)
    # The first run (every row's tau still at its floor, so every visible key would be kept)
    # stores whole key blocks at fixed offsets j * block_k: no cumsum, no keep mask, no
    # per-row counts. Invisible, padding and NaN keys go in as INVALID_KEY placeholders, which
    # rank below every real key: compactions drop them (or keep them last when a row has fewer
    # than k real keys) and the epilogues turn them into -1. Before any compaction the first
    # run appends (at the default capacity) each row's first 8192 keys, ~3/4 of all appends at
    # T=S=32K. H200, T=S=32K, same run: 28.07 ms full against 29.71 masked (runs 15.1 ms of
    # cycles against 17.0 in an earlier run); with capacity 16384 (a first run twice as long)
    # 30.80 ms (results/hytopk_bulk/).
    bulk_first_run: bool = True
    # Compaction rewrite: skip the per-chunk tie ranks when no active row keeps only part of
    # the entries tied with its threshold (the usual case); False always ranks ties.
    tie_free_rewrite: bool = True
    # Scoring: each head's queries [block_q, DI] and weights loaded once per program, before
    # the key loops (True), instead of once per key block inside them (False). Scoring alone
    # (score_only, no stores in its loop) does not change, so Triton probably hoists the
    # loads there itself, but not out of the real kernel's runs, which store. H200, T=S=32K,
    # same run: 26.35 ms full against 27.92; scoring alone 11.63 against 11.48
    # (results/hytopk_hoist/).
    hoist_queries: bool = True
    # Seeded threshold (0: off; else a power of two >= 2). Before its stream each program
    # scores one pseudo-random key in every window of `seed_rate` keys (`seed_positions`;
    # the rate rises to S / capacity where S is longer), and sets each row's starting tau
    # just below a sampled key that m sampled keys reach, m the least count with
    # m - seed_sigmas * sqrt(m) >= k / rate: about m * rate keys then beat tau, at least k
    # unless the sample is off by more than seed_sigmas standard deviations. The stream starts
    # at that tau instead of at its floor (no bulk first run), so on typical scores the buffer
    # holds a few k entries and needs no mid-stream compaction. Exactness does not rest on the
    # sample: a seeded row that ends the stream with fewer than k entries (a threshold above
    # its k-th key) is flagged, and every program with a flagged row runs again unseeded in a
    # second kernel call (`hytopk_seed_rerun`), which leaves the other programs'
    # buffers untouched. Rows whose sample holds at most m_hi (`seed_counts`) valid keys stay
    # unseeded. H200, T=S=32K, full selection, every row checked, same run: 24.15 / 23.87 ms
    # at rate 16 against 26.05 unseeded, 24.64 at rate 32, 23.70 at rate 16 with 4 sigmas;
    # clocks at 16: runs 14.8 ms of cycles, the seed 1.8, in-stream compaction 0.2, final
    # compaction 3.3 (results/hytopk_seed/).
    seed_rate: int = 16
    seed_sigmas: float = 6.0
    diagnostic: str = ""  # "" | score_only | append_only | append_nested | stats | clocks
    # The epilogue that orders each row's <= sort_width survivors (hytopk only):
    #   "xla_position" a lax.sort of (key, buffer position) as two keys, the position in int16
    #                 where the width allows, then a gather of the key indices
    #                 (`order_candidates_position`). The buffer is in index order, so position
    #                 order is the tie rule; the positions are distinct, so the sort asks for
    #                 no stability (a stable sort would make XLA add a third, int32 operand);
    #   "xla_stable"  a stable one-key lax.sort of the keys with int32 positions, then the
    #                 same gather (`order_candidates_stable`);
    #   "xla"         lax.sort on (key, index) pairs (`order_candidates`);
    #   "pallas"      a bitonic network (`order_candidates_pallas`, with `order_rows` rows per
    #                 program, a power of two <= block_q, and `order_warps` warps).
    # H200, T=S=32K, full selection, same run: xla_position 25.97 / 26.10 ms, xla_stable
    # 26.52 / 26.90, xla 26.64 (results/hytopk_position/gpu_position2/). Earlier:
    # xla_stable 31.35 / 31.23 ms against pallas 32.38 / 32.18 (results/hytopk_stable/). At
    # these widths XLA sorts with its own kernel, not CUB's radix sort (probe_sort.py: CUB at
    # 16384 entries per row). A one-operand sort of uint64 (key, index) words
    # (experiments/patches/packed_epilogue.patch) took 3.96 ms alone against 4.41, yet
    # 26.43 ms full against 26.41 (results/hytopk_packed/).
    order: str = "xla_position"
    order_rows: int = 1
    order_warps: int = 4
    # Entries per row the final compaction leaves at most (None: k, exactly the top-k set; at
    # most the capacity). Wider leaves the final compaction less to do (none at all at the
    # capacity) and the epilogue more to order; either way the survivors contain the top-k
    # and the epilogue keeps the first k in SPEC order. H200, T=S=32K, xla_stable, same run:
    # 31.35 ms at k, 31.94 at 4096 (final compaction 1.5 ms of cycles instead of 5.2, the
    # sort ~4.5 ms dearer), 40.67 at 8192 (results/hytopk_stable/).
    sort_width: int | None = None
    # hytopk only: query rows per kernel call (a power of two >= block_q). Longer sequences run
    # as consecutive calls over query chunks, each on the key prefix its causal rows can see, so
    # the candidate buffers never exceed 2 * B * rows_per_call * capacity int32 at once (4 GiB
    # at B=1, k=2048) however long T is. (The sequence-parallel zig-zag path makes two such
    # calls per shard with no ordering between them, so twice that there.)
    rows_per_call: int = 65536

    def __post_init__(self):
        # Any pair is accepted (a list too): stored as a tuple, since jit hashes BlockSizes.
        aims = tuple(self.stream_aims)
        if len(aims) != 2:
            raise ValueError(f"stream_aims must be (high, low); got stream_aims={aims}")
        object.__setattr__(self, "stream_aims", aims)
        hi, lo = aims
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(
                f"stream_aims must be (high, low) fractions with 0 <= low <= high "
                f"<= 1; got stream_aims={self.stream_aims}"
            )

    def min_room(self) -> int:
        """Free slots per row the stream needs after a compaction."""
        return self.block_k * (self.min_steps if self.schedule == "phased" else 1)

    def resolve_sort_width(self, k: int) -> int:
        """Entries per row the final compaction leaves at most, checked against k and the
        capacity."""
        width = k if self.sort_width is None else self.sort_width
        if not k <= width <= self.resolve_capacity(k):
            raise ValueError(
                f"sort_width must be in [k, capacity]; got sort_width={width} for "
                f"{k=} capacity={self.resolve_capacity(k)}"
            )
        return width

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
                f"capacity must be a power of two >= k + block_k"
                f"{' * min_steps' if self.schedule == 'phased' else ''}; got "
                f"capacity={cap} for {k=} block_k={self.block_k} "
                f"min_steps={self.min_steps}"
            )
        return cap


STAT_FIELDS = (
    "appended",  # per row: entries appended over the stream (bulk placeholders too)
    "row_compactions",  # per row: compactions (in-stream + final) in which the row was active
    "compactions",  # per program: compaction calls that did work (in-stream + final)
    "bisect_passes",  # per program: bisection count passes (each reads cnt entries per row)
    "chunk_loads",  # per program: [block_q, chunk] buffer chunks loaded (count + rewrite)
    "outer_iters",  # per program: phased runs (fused: key blocks)
    "key_blocks",  # per program: key blocks scored
    "final_count",  # per row: entries before the final compaction
)


# Diagnostic "clocks": SM cycles (%clock) per program, the same value in each of its rows.
CLOCK_FIELDS = (
    "total",  # kernel body, first key block to the end of the final compaction
    "runs",  # phased runs: scoring + appends
    "compact",  # in-stream compactions (each outer iteration's, idle ones included)
    "compact_count",  # ... of which sampling + bisection count passes (the rest: rewrite)
    "final",  # the final compaction
    "final_count",  # ... of which sampling + bisection count passes
    "outer_iters",  # phased runs (a count, not cycles)
    "key_blocks",  # key blocks scored (a count)
)


# The diagnostics that run the exact kernel and add a 4th output: its columns.
COUNTER_FIELDS = {"stats": STAT_FIELDS, "clocks": CLOCK_FIELDS}


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

    Same map as hyscale_jax.scores.order_key, written so Triton cannot fold the -0.0 fix away.
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


def _clock(*deps):
    """Read the SM cycle counter once every `deps` ([bq] int32 each) exists, and pass `deps`
    through opaque copies that take the reading as an operand, so code consuming the returned
    copies depends on the read. The ordering is by data dependence only: jax lowers inline
    asm as pure, so memory operations independent of `deps` may still move across the read,
    and phase boundaries are approximate. (One inline-asm result per call: jax's Triton
    lowering returns a single result.)

    Returns (cycles [bq] int32, *deps). Compiled GPU kernels only (inline PTX)."""
    like = [jax.ShapeDtypeStruct(deps[0].shape, jnp.int32)]
    (cycles,) = pltriton.elementwise_inline_asm(
        "mov.u32 $0, %clock;",
        args=list(deps),
        constraints=",".join(["=r"] + ["r"] * len(deps)),
        pack=1,
        result_shape_dtypes=like,
    )
    copies = [
        pltriton.elementwise_inline_asm(
            "mov.b32 $0, $1;",
            args=[d, cycles],
            constraints="=r,r,r",
            pack=1,
            result_shape_dtypes=like,
        )[0]
        for d in deps
    ]
    return (cycles, *copies)


def _barrier(enabled: bool):
    """CTA-wide barrier (bar.sync): orders one thread's global stores to the candidate buffer
    before other threads' later loads of it. Interpret mode runs sequentially and has no rule."""
    if enabled:
        pltriton.debug_barrier()


def _sample_pivots(key_ref, cnt, counts, *, sample: int):
    """Per row, buffer entries expected to have about `counts[i]` entries >= them.

    key_ref: [bq, cap] buffers (first cnt [bq] entries valid); counts: descending ints or [bq]
    int32 vectors. Reads `sample` entries per row at stratified positions, ranks them among
    themselves (descending, ties by position: a permutation of 0..sample-1), and returns, for
    each count c, the sample entry of rank floor(c * sample / cnt), clipped to the sample:
    a list of [bq] int32 pivots, ascending. Rows with cnt == 0 get entries of an empty buffer,
    which `_compact` never uses (such rows are never active).
    """
    bq = cnt.shape[0]
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
    """Per row, non-decreasing pivots where about counts[i] entries would be >= them.

    The entries of [lo, hi) (c_lo - c_hi of them, by the bracket invariant) are assumed spread
    evenly over the order-key values, so the pivot leaving c entries at or above it sits a
    fraction (c_lo - c) / (c_lo - c_hi) of the way from lo to hi. The offset from lo is taken
    on the exact span: half of it, (hi >> 1) - (lo >> 1), fits int32 and is exact in f32 below
    2**24, so a narrow bracket (many near-tied entries) gets pivots at the key value it asks
    for rather than at lo rounded to f32 (spacing 64-128 key values for ordinary scores). The
    scaled half-offset is added twice, so no intermediate leaves [lo, hi]. Pivots are clamped
    into [lo + 1, hi - 1]: for every row not yet done (hi >= lo + 2) each pivot splits the
    bracket, so each pass shrinks it, if only by one key value.
    lo, hi, c_lo, c_hi: [bq] int32; counts: ints or [bq] int32 vectors, descending.
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


def _compact(
    key_ref,
    idx_ref,
    tau,
    cnt,
    kmax,
    active,
    *,
    k: int,
    target: int,
    chunk: int,
    cap: int,
    sync: bool,
    pivots: int,
    sample: int,
    lazy_reduce: bool,
    tie_free_rewrite: bool,
    interpolate: int = 0,
    stream_aims: tuple[float, float] = (0.75, 0.25),
    clocks: bool = False,
):
    """Raise `tau` for the `active` rows and rewrite their buffers to <= target entries (or
    exactly the top-k when ties leave no threshold with k <= count <= target).

    sample > 0: the first count pass uses two pivots read off a stratified sample of `sample`
    buffer entries per row (`_sample_pivots`) instead of bisecting; the bisection then goes on
    from wherever that pass left [lo, hi). Any pivots keep the bisection exact, so the sample
    only changes how many passes it takes. interpolate > 0: the next `interpolate` passes use
    two pivots interpolated inside [lo, hi) (`_interpolated_pivots`), the rest bisect; exact
    for the same reason. stream_aims (target > k only): where in [k, target] the sampled and
    interpolated pivots aim, as fractions of target - k, higher count first. lazy_reduce and
    tie_free_rewrite: see BlockSizes. None of these options changes the result.

    key_ref, idx_ref: [bq, cap] int32 candidate buffers (valid prefix of length cnt per row,
      ascending key index). tau, cnt, kmax, active: [bq] (threshold, count, max buffered key,
      rows to compact). Returns the new (tau, cnt) and two work counters (scalars): bisection
      passes and [bq, chunk] chunk loads (count passes + rewrite). With clocks=True a fifth
      result: [bq] SM cycles spent before the rewrite (sampling + count passes).
    """
    bq = tau.shape[0]
    if clocks:
        t_start, cnt = _clock(cnt)
    cols0 = lax.broadcasted_iota(jnp.int32, (bq, chunk), 1)
    rows = lax.broadcasted_iota(jnp.int32, (bq, chunk), 0)
    n_chunks = _cdiv(jnp.max(jnp.where(active, cnt, 0)), chunk)

    def count_pass(mids):
        """Per row and pivot m in `mids`: #entries >= m, min entry >= m, max entry < m.
        One read of the buffer serves every pivot. lazy_reduce: per-lane [bq, chunk]
        accumulators, reduced across lanes once per pass instead of once per chunk."""

        def body(c, carry):
            keys = key_ref[:, pl.ds(c * chunk, chunk)]
            inb = (cols0 + c * chunk) < cnt[:, None]
            out = []
            for mid, (n_ge, min_ge, max_lt) in zip(mids, carry):
                ge = inb & (keys >= mid[:, None])
                lt = inb & (keys < mid[:, None])
                if lazy_reduce:
                    out.append(
                        (
                            n_ge + ge.astype(jnp.int32),
                            jnp.minimum(min_ge, jnp.where(ge, keys, _INT32_MAX)),
                            jnp.maximum(max_lt, jnp.where(lt, keys, INVALID_KEY)),
                        )
                    )
                else:
                    out.append(
                        (
                            n_ge + jnp.sum(ge.astype(jnp.int32), axis=1),
                            jnp.minimum(min_ge, jnp.min(jnp.where(ge, keys, _INT32_MAX), axis=1)),
                            jnp.maximum(max_lt, jnp.max(jnp.where(lt, keys, INVALID_KEY), axis=1)),
                        )
                    )
            return tuple(out)

        shape = (bq, chunk) if lazy_reduce else (bq,)
        init = tuple(
            (
                jnp.zeros(shape, jnp.int32),
                jnp.full(shape, _INT32_MAX, jnp.int32),
                jnp.full(shape, INVALID_KEY, jnp.int32),
            )
            for _ in mids
        )
        counts = lax.fori_loop(0, n_chunks, body, init)
        if lazy_reduce:
            counts = tuple(
                (jnp.sum(n, axis=1), jnp.min(mn, axis=1), jnp.max(mx, axis=1))
                for n, mn, mx in counts
            )
        return counts

    def dyadic_pivots(lo, hi):
        """`pivots` ascending points splitting [lo, hi) into pivots + 1 near-equal parts."""
        points = [(lo, hi)]
        for _ in range(pivots.bit_length()):
            nxt = []
            for a, b in points:
                m = _floor_mid(a, b)
                nxt += [(a, m), (m, b)]
            points = nxt
        return [b for _, b in points[:-1]]  # the split points, ascending

    # Bisection state per row: count_ge(lo) = c_lo >= k, count_ge(hi) = c_hi < k, lo < hi.
    # Entries are all > tau_old >= lo at the start, and kmax + 1 has none at or above it.
    lo, c_lo = tau, cnt
    hi, c_hi = kmax + 1, jnp.zeros_like(cnt)

    def is_done(lo, hi, c_lo):
        return (~active) | (c_lo <= target) | (hi == lo + 1)

    def bisect_cond(state):
        lo, hi, c_lo, _, it = state
        # The sampled pass, the interpolated ones, then at most 32 bisection steps (each
        # halves [lo, hi), narrower than 2**32) always suffice; the cap only guards against an
        # infinite loop if an invariant were ever broken.
        return _any(~is_done(lo, hi, c_lo)) & (it < 40 + interpolate)

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
        return refine(state, dyadic_pivots(state[0], state[1]))

    # Mid-stream, both pivots aim inside [k, target] (stream_aims); the lower count is the
    # one that usually lands (a bracket end with count >= k), the higher a fallback when the
    # lower undershoots k.
    stream_counts = tuple(k + int(a * (target - k)) for a in stream_aims)

    # Interpolation aims two pivots just inside the wanted counts: around the k-th key when
    # the target is exactly k (the final compaction at the default sort_width; a window of
    # 1/16 of the bracket's entries on each side, so a pass that lands within it shrinks the
    # bracket ~8x), or at stream_counts otherwise.
    def interpolate_body(state):
        lo, hi, c_lo, c_hi, _ = state
        if target > k:
            counts = stream_counts
        else:
            margin = jnp.maximum((c_lo - c_hi) // 16, 1)
            counts = (k + margin, k - margin)
        return refine(state, _interpolated_pivots(lo, hi, c_lo, c_hi, counts))

    state = (lo, hi, c_lo, c_hi, jnp.int32(0))
    if sample:
        # Aim both pivots inside [k, target] (mid-stream), or around the k-th key (final).
        if target > k:
            counts = stream_counts
        else:
            margin = jnp.maximum(cnt // 8, 8)
            counts = (k + margin, k - margin)
        state = refine(state, _sample_pivots(key_ref, cnt, counts, sample=sample))
    if interpolate:
        last = state[4] + interpolate
        state = lax.while_loop(lambda st: bisect_cond(st) & (st[4] < last), interpolate_body, state)
    lo, hi, c_lo, c_hi, passes = lax.while_loop(bisect_cond, bisect_body, state)
    if clocks:
        t_counted, lo, c_lo, c_hi = _clock(lo, c_lo, c_hi)

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

    if tie_free_rewrite:
        kept = lax.cond(
            _any(active & (quota < _INT32_MAX)),
            lambda: rewrite_loop(True),
            lambda: rewrite_loop(False),
        )
    else:
        kept = rewrite_loop(True)
    _barrier(sync)
    chunk_loads = (passes + 1) * n_chunks
    out = (jnp.where(active, lo, tau), jnp.where(active, kept, cnt), passes, chunk_loads)
    return out + (t_counted - t_start,) if clocks else out


def _hytopk_kernel(
    q_ref,
    w_ref,
    k_ref,
    key_ref,
    idx_ref,
    cnt_ref,
    *maybe_stats_ref,
    T: int,
    S: int,
    causal: bool,
    k: int,
    n_q: int,
    bs: BlockSizes,
    cap: int,
    sync: bool,
    failed_ref=None,
):
    """One program: `block_q` queries of one batch row against all their visible keys.

    q_ref: [bq, HI, DI] indexer queries; w_ref: [HI, bq] f32 head weights (transposed);
    k_ref: [S_pad, DI] all keys of the batch row.
    key_ref, idx_ref: [bq, cap] int32 candidate buffers (out); cnt_ref: [bq] int32 (out; -1
      flags a row whose seed failed, BlockSizes.seed_rate);
    maybe_stats_ref: diagnostics "stats" and "clocks" only, [bq, 8] int32 counters (out).
    failed_ref: the re-run call only, [bq] int32, nonzero for rows flagged by the first call.
    """
    bq, bk, HI = bs.block_q, bs.block_k, q_ref.shape[1]
    mode = bs.diagnostic
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
    # Compaction leaves >= min_room free slots: 1 block (fused), min_steps blocks (phased).
    stream_target = k + (cap - bs.min_room() - k) // 2
    compact_opts = dict(
        chunk=bs.chunk,
        cap=cap,
        sync=sync,
        pivots=bs.pivots,
        sample=bs.sample,
        lazy_reduce=bs.lazy_reduce,
        tie_free_rewrite=bs.tie_free_rewrite,
        interpolate=bs.interpolate,
        stream_aims=bs.stream_aims,
    )
    zeros = jnp.zeros((bq,), jnp.int32)
    zero = jnp.int32(0)

    def head_query(h):
        return q_ref[:, h, :]  # [bq, DI]

    def head_weight(h):
        return w_ref[h, :][:, None]  # [bq, 1] f32

    # Loaded once per program (bs.hoist_queries), or per key block inside scores_block.
    hoisted_q = [head_query(h) for h in range(HI)] if bs.hoist_queries else None
    hoisted_w = [head_weight(h) for h in range(HI)] if bs.hoist_queries else None

    def scores_block(j):
        """f32 scores [bq, bk] of this program's queries against key block j."""
        return score_keys(k_ref[pl.ds(j * bk, bk), :])

    def score_keys(kblk):
        """f32 scores [bq, bk] of this program's queries against keys kblk [bk, DI]."""
        acc = jnp.zeros((bq, bk), jnp.float32)
        for h in range(HI):  # unrolled: one f32-accumulated dot per head, f32 head sum
            q_h = head_query(h) if hoisted_q is None else hoisted_q[h]
            logits = lax.dot_general(
                q_h,
                kblk,
                (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
            relu = jnp.where(logits < 0.0, 0.0, logits)  # NaN stays NaN, as in XLA's relu
            acc = acc + (head_weight(h) if hoisted_w is None else hoisted_w[h]) * relu
        return acc

    def block_keys(j):
        """Order keys [bq, bk] of key block j and their key indices."""
        s_pos = j * bk + s_off
        valid = s_pos < S
        if causal:
            valid = valid & (s_pos <= t_pos + (S - T))
        return _order_key(scores_block(j), valid), s_pos

    def raise_max(kmax, keys):
        """kmax [bq] (row maxima) or [bq, bk] (per-lane maxima) raised by keys [bq, bk]."""
        return jnp.maximum(kmax, keys if kmax.ndim == 2 else jnp.max(keys, axis=1))

    def append(keys, s_pos, tau, cnt, kmax):
        """Store the keys > tau at count + rank (row-wise stream compaction, no atomics).

        kmax: [bq], or [bq, bk] per-lane maxima (reduced by the caller once per run). Either
        bounds every buffered key from above; the max runs over all keys, kept or not: a key
        above the running max is > tau, hence kept, so the bound is as tight."""
        keep = keys > tau[:, None]
        pos, n_keep = _scatter_positions(keep, cnt, cap)
        pltriton.store(key_ref.at[rows, pos], keys, mask=keep)
        pltriton.store(idx_ref.at[rows, pos], s_pos, mask=keep)
        kmax = raise_max(kmax, keys)
        return cnt + n_keep, kmax, n_keep

    invalid = jnp.full((bq,), INVALID_KEY, jnp.int32)

    def seed_threshold():
        """[bq] int32: each row's starting tau (BlockSizes.seed_rate), one below the sampled
        key that m in [m_lo, m_hi] sampled keys reach (`seed_counts`); INVALID_KEY (the
        floor) for rows whose sample has at most m_hi valid keys. The sample goes through the
        candidate buffers (whole blocks at slots b * block_k, invisible and NaN keys as
        placeholders, as in the bulk first run), and one compaction's threshold search with
        target m_hi finds the key; the stream then overwrites the buffers from slot 0."""
        rate = bs.resolve_seed_rate(S, k)
        m_lo, m_hi = seed_counts(k, rate, bs.seed_sigmas)
        last_key = jnp.minimum(last_visible + 1, S) if causal else S
        n_blocks = _cdiv(_cdiv(last_key, rate), bk)
        lanes = lax.broadcasted_iota(jnp.int32, (bk,), 0)

        def sample_step(b, carry):
            n_valid, kmax = carry
            s_pos = seed_positions(b * bk + lanes, rate)  # [bk]
            kblk = k_ref[jnp.minimum(s_pos, k_ref.shape[0] - 1), :]  # [bk, DI]
            s_pos = jnp.broadcast_to(s_pos[None, :], (bq, bk))
            valid = s_pos < S
            if causal:
                valid = valid & (s_pos <= t_pos + (S - T))
            keys = _order_key(score_keys(kblk), valid)
            slots = pl.ds(pl.multiple_of(b * bk, bk), bk)
            key_ref[:, slots] = keys
            idx_ref[:, slots] = s_pos
            n_valid = n_valid + jnp.sum((keys != INVALID_KEY).astype(jnp.int32), axis=1)
            return n_valid, jnp.maximum(kmax, jnp.max(keys, axis=1))

        n_valid, kmax = lax.fori_loop(0, n_blocks, sample_step, (zeros, invalid))
        _barrier(sync)  # the sample's stores are visible to the search's loads
        tau = _compact(
            key_ref,
            idx_ref,
            invalid,
            zeros + n_blocks * bk,
            kmax,
            n_valid > m_hi,
            k=m_lo,
            target=m_hi,
            **compact_opts,
        )[0]
        # One below: the stream keeps keys > tau, so keys tied with the sampled one stay in.
        return jnp.where(tau != INVALID_KEY, tau - 1, INVALID_KEY)

    def bulk_step(j, kmax):
        """One key block of the first run: stored whole at slots [j * bk, (j + 1) * bk)."""
        keys, s_pos = block_keys(j)
        slots = pl.ds(pl.multiple_of(j * bk, bk), bk)
        key_ref[:, slots] = keys
        idx_ref[:, slots] = s_pos
        return raise_max(kmax, keys)

    def bulk_first_run():
        """The first run's key blocks [0, m0): returns (m0, cnt, kmax)."""
        m0 = jnp.minimum(cap // bk, n_kb)
        if bs.lazy_run_max:
            lane_max = lax.fori_loop(0, m0, bulk_step, jnp.full((bq, bk), INVALID_KEY, jnp.int32))
            kmax = jnp.max(lane_max, axis=1)
        else:
            kmax = lax.fori_loop(0, m0, bulk_step, invalid)
        return m0, zeros + m0 * bk, kmax

    if mode == "score_only":
        # Scores and order keys of every visible pair; per row the running max and the number
        # of keys that beat it (so nothing is dead code); no buffer traffic at all.
        def score_step(j, carry):
            n, kmax = carry
            keys, _ = block_keys(j)
            n = n + jnp.sum((keys > kmax[:, None]).astype(jnp.int32), axis=1)
            return n, jnp.maximum(kmax, jnp.max(keys, axis=1))

        n, kmax = lax.fori_loop(0, n_kb, score_step, (zeros, invalid))
        cnt_ref[:] = n + (kmax & 1)
        return

    if mode in ("append_only", "append_nested"):
        # Every valid key is appended (tau stays INVALID_KEY); positions wrap modulo cap.
        def append_step(j, carry):
            tau, cnt, kmax = carry
            keys, s_pos = block_keys(j)
            if mode == "append_nested":  # the fused schedule's check, never active (cnt >= 0)
                active = (cnt < 0) & _any(keys > tau[:, None])
                tau, cnt, _, _ = _compact(
                    key_ref,
                    idx_ref,
                    tau,
                    cnt,
                    kmax,
                    active,
                    k=k,
                    target=stream_target,
                    **compact_opts,
                )
            cnt, kmax, _ = append(keys, s_pos, tau, cnt, kmax)
            if mode == "append_nested":
                _barrier(sync)
            return tau, cnt, kmax

        _, cnt, _ = lax.fori_loop(0, n_kb, append_step, (invalid, zeros, invalid))
        cnt_ref[:] = cnt
        return

    def select(seeded: bool):
        """The exact kernel, its stream started at a seeded threshold (`seed_threshold`) or
        at the floor."""
        zeros = jnp.zeros((bq,), jnp.int32)  # (rebound below, under "clocks")
        # Work counters (only written in "stats" mode; otherwise dead code).
        # st = (appended [bq], row_compactions [bq], compactions, passes, chunk_loads, outer_iters)
        st0 = (zeros, zeros, zero, zero, zero, zero)
        if mode == "clocks":
            if bs.schedule != "phased":
                raise ValueError("diagnostic='clocks' times the phased schedule only")
            t_begin, zeros = _clock(zeros)
        # Where the stream starts: after the bulk first run, or at key block 0 with empty
        # buffers and tau at the floor or at the seed.
        bulk = bs.bulk_first_run and not seeded
        tau0 = seed_threshold() if seeded else invalid
        if bulk:
            j0, cnt0, kmax0 = bulk_first_run()
            # (fused: outer_iters counts key blocks; phased: runs, and the bulk run is one)
            st0 = (cnt0, zeros, zero, zero, zero, j0 if bs.schedule == "fused" else jnp.int32(1))
            _barrier(sync)  # the bulk run's stores are visible to the first compaction's loads
        else:
            j0, cnt0, kmax0 = zero, zeros, invalid

        def count(st, active, passes, loads, n_keep=None, outer=0):
            app, rc, nc, npass, nload, nouter = st
            if n_keep is not None:
                app = app + n_keep
            return (
                app,
                rc + active.astype(jnp.int32),
                nc + _any(active).astype(jnp.int32),
                npass + passes,
                nload + loads,
                nouter + outer,
            )

        if bs.schedule == "fused":

            def step(j, carry):
                tau, cnt, kmax, st = carry
                keys, s_pos = block_keys(j)
                n_new = jnp.sum((keys > tau[:, None]).astype(jnp.int32), axis=1)
                overflow = cnt + n_new > cap
                # When some row would overflow, compact every row past the streaming target.
                active = overflow | (_any(overflow) & (cnt > stream_target))
                tau, cnt, passes, loads = _compact(
                    key_ref,
                    idx_ref,
                    tau,
                    cnt,
                    kmax,
                    active,
                    k=k,
                    target=stream_target,
                    **compact_opts,
                )
                cnt, kmax, n_keep = append(keys, s_pos, tau, cnt, kmax)
                _barrier(sync)  # appended entries are visible to the next compaction's loads
                if mode == "stats":
                    st = count(st, active, passes, loads, n_keep, 1)
                return tau, cnt, kmax, st

            tau, cnt, kmax, st = lax.fori_loop(j0, n_kb, step, (tau0, cnt0, kmax0, st0))
        elif bs.schedule == "phased":
            # Runs of m >= min_steps key blocks that only append: a compaction before each run
            # leaves every row >= m * block_k free slots, so no row can overflow inside the run,
            # and the run's loop has no nested loop and no barrier (Triton pipelines only
            # innermost loops). One barrier per run orders its appends before the next
            # compaction's loads.
            trigger = cap - bs.min_room()

            def run_step(j, carry):
                cnt, kmax, app, tau = carry
                keys, s_pos = block_keys(j)
                cnt, kmax, n_keep = append(keys, s_pos, tau, cnt, kmax)
                return cnt, kmax, app + n_keep, tau

            def outer_cond(carry):
                return carry[0] < n_kb

            clocks = mode == "clocks"

            def outer_body(carry):
                j, tau, cnt, kmax, st, ck = carry
                _barrier(sync)  # the previous run's appends are visible to the compaction
                if clocks:
                    t0, cnt = _clock(cnt)
                active = (jnp.max(cnt) > trigger) & (cnt > stream_target)
                tau, cnt, passes, loads, *counted = _compact(
                    key_ref,
                    idx_ref,
                    tau,
                    cnt,
                    kmax,
                    active,
                    k=k,
                    target=stream_target,
                    **compact_opts,
                    clocks=clocks,
                )
                if clocks:
                    t1, cnt = _clock(cnt)
                m = jnp.minimum((cap - jnp.max(cnt)) // bk, n_kb - j)
                if bs.lazy_run_max:  # per-lane maxima: no cross-warp reduction per key block
                    lane_max = jnp.full((bq, bk), INVALID_KEY, jnp.int32)
                    cnt, lane_max, app, _ = lax.fori_loop(
                        j, j + m, run_step, (cnt, lane_max, zeros, tau)
                    )
                    kmax = jnp.maximum(kmax, jnp.max(lane_max, axis=1))
                else:
                    cnt, kmax, app, _ = lax.fori_loop(j, j + m, run_step, (cnt, kmax, zeros, tau))
                if mode == "stats":
                    st = count(st, active, passes, loads, app, 1)
                if clocks:
                    t2, cnt, kmax = _clock(cnt, kmax)
                    runs, comp, comp_count, n_outer = ck
                    ck = (runs + (t2 - t1), comp + (t1 - t0), comp_count + counted[0], n_outer + 1)
                return j + m, tau, cnt, kmax, st, ck

            ck0 = ()
            if clocks:  # the bulk run counts as a run
                t_bulk, cnt0, kmax0 = _clock(cnt0, kmax0)
                ck0 = (
                    (t_bulk - t_begin, zeros, zeros, zeros + 1)
                    if bulk
                    else (zeros, zeros, zeros, zeros)
                )
            _, tau, cnt, kmax, st, ck = lax.while_loop(
                outer_cond, outer_body, (j0, tau0, cnt0, kmax0, st0, ck0)
            )
            _barrier(sync)
        else:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {bs.schedule!r}")

        # Final compaction: <= sort_width entries per row holding its top-k, in index order
        # (exactly the top-k set when sort_width == k).
        final_count = cnt
        width = bs.resolve_sort_width(k)
        active = cnt > width
        if mode == "clocks":
            t_final, cnt = _clock(cnt)
        _, cnt, passes, loads, *counted = _compact(
            key_ref,
            idx_ref,
            tau,
            cnt,
            kmax,
            active,
            k=k,
            target=width,
            **compact_opts,
            clocks=mode == "clocks",
        )
        if mode == "clocks":
            t_end, cnt = _clock(cnt)
        if seeded:
            # No compaction runs while a row holds fewer than k entries, so a seeded row ends
            # the stream below k only if fewer than k of its keys beat the seed: then the seed
            # was above its k-th key and the row's buffer may lack some of its top-k.
            # cnt = -1 flags it for the re-run.
            cnt = jnp.where((tau0 != INVALID_KEY) & (final_count < k), -1, cnt)
        cnt_ref[:] = cnt
        if mode == "stats":
            app, rc, nc, npass, nload, nouter = count(st, active, passes, loads)
            fields = (
                app,
                rc,
                nc + zeros,
                npass + zeros,
                nload + zeros,
                nouter + zeros,
                n_kb + zeros,
                final_count,
            )
        elif mode == "clocks":
            runs, comp, comp_count, n_outer = ck
            fields = (
                t_end - t_begin,
                runs,
                comp,
                comp_count,
                t_end - t_final,
                counted[0],
                n_outer,
                n_kb + zeros,
            )
        if mode in COUNTER_FIELDS:
            col = lax.broadcasted_iota(jnp.int32, (bq, len(fields)), 1)
            out = jnp.zeros((bq, len(fields)), jnp.int32)
            for i, f in enumerate(fields):
                out = jnp.where(col == i, f[:, None], out)
            maybe_stats_ref[0][...] = out

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
    block_sizes: BlockSizes = BlockSizes(),
):
    """Run the fused kernel: per row at most block_sizes.sort_width entries (exactly the top-k
    set at the default width k) that hold its top-k, in ascending key-index order.

    Args:
      q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI].
    Returns:
      keys [B, T_pad, cap] int32 order keys, idx [B, T_pad, cap] int32 key indices (the first
      cnt entries of each row are candidates; with block_sizes.bulk_first_run some may be
      INVALID_KEY placeholders for invisible or NaN keys, which rank last and mean "no key"),
      cnt [B, T_pad] int32 (<= block_sizes.sort_width, by default k). T_pad = T rounded up to
      block_q. With block_sizes.diagnostic == "stats" a 4th output, stats [B, T_pad, 8]
      int32 (columns STAT_FIELDS); with "clocks" likewise SM cycles (columns CLOCK_FIELDS);
      with the other diagnostics the outputs are meaningless. Seeded (seed_rate > 0), the
      counters describe the first call: a program re-run after a failed seed keeps the
      failed attempt's counters (its rows' final_count below k shows the failure).
    """
    bs = block_sizes
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    for name, v in (("block_q", bs.block_q), ("block_k", bs.block_k), ("chunk", bs.chunk)):
        if not _is_pow2(v):
            raise ValueError(f"{name} must be a power of two; got {name}={v}")
    if bs.block_q < 16:
        raise ValueError(f"block_q must be >= 16 (Triton dot); got block_q={bs.block_q}")
    if bs.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got schedule={bs.schedule!r}")
    if bs.diagnostic not in DIAGNOSTICS:
        raise ValueError(
            f"diagnostic must be one of {DIAGNOSTICS}; got diagnostic={bs.diagnostic!r}"
        )
    if bs.min_steps < 1:
        raise ValueError(f"min_steps must be >= 1; got min_steps={bs.min_steps}")
    if bs.pivots not in PIVOTS:
        raise ValueError(f"pivots must be one of {PIVOTS}; got pivots={bs.pivots}")
    if bs.interpolate < 0:
        raise ValueError(f"interpolate must be >= 0; got interpolate={bs.interpolate}")
    if bs.sample and (not _is_pow2(bs.sample) or not 2 <= bs.sample <= 64):
        raise ValueError(f"sample must be 0 or a power of two in [2, 64]; got sample={bs.sample}")
    if bs.seed_rate and (not _is_pow2(bs.seed_rate) or bs.seed_rate < 2):
        raise ValueError(
            f"seed_rate must be 0 or a power of two >= 2; got seed_rate={bs.seed_rate}"
        )
    if not bs.seed_sigmas >= 0.0:
        raise ValueError(f"seed_sigmas must be >= 0; got seed_sigmas={bs.seed_sigmas}")
    if bs.diagnostic == "clocks" and interpret:
        raise ValueError(
            "diagnostic='clocks' reads the GPU's %clock: compiled kernels only (interpret=False)"
        )
    if bs.diagnostic == "append_nested" and bs.sample:
        # That diagnostic lets cnt grow past capacity (its compaction is never active), where a
        # sampled read would leave the row; it times the plain-bisection kernel's loop shape.
        bs = dataclasses.replace(bs, sample=0)
    cap = bs.resolve_capacity(k)
    bs.resolve_sort_width(k)  # raises before any kernel if out of range
    if cap % bs.chunk:
        raise ValueError(f"capacity={cap} must be a multiple of chunk={bs.chunk}")
    dtype = jnp.result_type(q_idx.dtype, k_idx.dtype)
    q_idx, k_idx = q_idx.astype(dtype), k_idx.astype(dtype)
    n_q, n_k = _cdiv(T, bs.block_q), _cdiv(S, bs.block_k)
    T_pad, S_pad = n_q * bs.block_q, n_k * bs.block_k
    if T_pad != T:  # padded queries score zeros and are sliced off by the caller
        q_idx = jnp.pad(q_idx, ((0, 0), (0, T_pad - T), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, T_pad - T), (0, 0)))
    if S_pad != S:  # padded keys are masked invisible (s >= S)
        k_idx = jnp.pad(k_idx, ((0, 0), (0, S_pad - S), (0, 0)))
    DI_pad = max(16, _next_pow2(DI))  # Triton dots want power-of-two K >= 16; zeros add nothing
    if DI_pad != DI:
        q_idx = jnp.pad(q_idx, ((0, 0), (0, 0), (0, 0), (0, DI_pad - DI)))
        k_idx = jnp.pad(k_idx, ((0, 0), (0, 0), (0, DI_pad - DI)))
        DI = DI_pad
    w_t = jnp.swapaxes(w.astype(jnp.float32), 1, 2)  # [B, HI, T_pad]: contiguous per head

    kernel = functools.partial(
        _hytopk_kernel, T=T, S=S, causal=causal, k=k, n_q=n_q, bs=bs, cap=cap, sync=not interpret
    )
    rev = lambda i: n_q - 1 - i  # noqa: E731  (heaviest query blocks first)
    out_shape = [
        jax.ShapeDtypeStruct((B, T_pad, cap), jnp.int32),
        jax.ShapeDtypeStruct((B, T_pad, cap), jnp.int32),
        jax.ShapeDtypeStruct((B, T_pad), jnp.int32),
    ]
    out_specs = [
        pl.BlockSpec((None, bs.block_q, cap), lambda b, i: (b, rev(i), 0)),
        pl.BlockSpec((None, bs.block_q, cap), lambda b, i: (b, rev(i), 0)),
        pl.BlockSpec((None, bs.block_q), lambda b, i: (b, rev(i))),
    ]
    if bs.diagnostic in COUNTER_FIELDS:
        n_st = len(COUNTER_FIELDS[bs.diagnostic])
        out_shape.append(jax.ShapeDtypeStruct((B, T_pad, n_st), jnp.int32))
        out_specs.append(pl.BlockSpec((None, bs.block_q, n_st), lambda b, i: (b, rev(i), 0)))
    in_specs = [
        pl.BlockSpec((None, bs.block_q, HI, DI), lambda b, i: (b, rev(i), 0, 0)),
        pl.BlockSpec((None, HI, bs.block_q), lambda b, i: (b, 0, rev(i))),
        pl.BlockSpec((None, S_pad, DI), lambda b, i: (b, 0, 0)),
    ]
    params = pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(B, n_q),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name="hytopk_fused_select",
    )(q_idx, w_t, k_idx)
    if not bs.seed_rate or bs.diagnostic not in ("",) + tuple(COUNTER_FIELDS):
        return out  # (the other diagnostics select nothing: nothing to re-run)
    # Programs with a row whose seed failed (cnt = -1) run again unseeded; the buffers are
    # aliased, so the others keep what the first call wrote. With no failed row every program
    # of this call only reads its flags.
    keys, idx, cnt = out[:3]
    rerun_kernel = functools.partial(kernel, bs=dataclasses.replace(bs, diagnostic=""))

    def rerun_body(q_ref, w_ref, k_ref, failed_ref, _keys, _idx, _cnt, key_ref, idx_ref, cnt_ref):
        rerun_kernel(q_ref, w_ref, k_ref, key_ref, idx_ref, cnt_ref, failed_ref=failed_ref)

    rerun = pl.pallas_call(
        rerun_body,
        out_shape=tuple(out_shape[:3]),
        grid=(B, n_q),
        in_specs=in_specs + [out_specs[2]] + out_specs[:3],
        out_specs=out_specs[:3],
        input_output_aliases={4: 0, 5: 1, 6: 2},
        compiler_params=params,
        interpret=interpret,
        name="hytopk_seed_rerun",
    )(q_idx, w_t, k_idx, (cnt < 0).astype(jnp.int32), keys, idx, cnt)
    return tuple(rerun) + tuple(out[3:])


@functools.partial(jax.jit, static_argnames=("k", "causal", "interpret", "block_sizes"))
def _hytopk(q_idx, k_idx, w, *, k, causal, interpret, block_sizes):
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
        keys, idx, cnt = hytopk_candidates(
            q_chunk,
            keys_chunk,
            w_chunk,
            k=k,
            causal=causal,
            interpret=interpret,
            block_sizes=block_sizes,
        )[:3]
        parts.append(
            order_survivors(
                keys, idx, cnt, T=hi - lo, k=k, block_sizes=block_sizes, interpret=interpret
            )
        )
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def order_survivors(
    keys, idx, cnt, *, T: int, k: int, block_sizes: BlockSizes, interpret: bool = False
):
    """The epilogue `block_sizes.order` picks: [B, T, k] indices in SPEC order from
    hytopk_candidates' buffers (keys, idx [B, T_pad, cap]; cnt [B, T_pad], <= sort_width)."""
    bs = block_sizes
    width = bs.resolve_sort_width(k)
    if bs.order == "pallas":
        return order_candidates_pallas(
            keys,
            idx,
            cnt,
            T=T,
            k=k,
            width=width,
            rows=bs.order_rows,
            num_warps=bs.order_warps,
            interpret=interpret,
        )
    if bs.order == "xla_stable":
        return order_candidates_stable(keys, idx, cnt, T=T, k=k, width=width)
    if bs.order == "xla_position":
        return order_candidates_position(keys, idx, cnt, T=T, k=k, width=width)
    if bs.order == "xla":
        return order_candidates(keys, idx, cnt, T=T, k=k, width=width)
    raise ValueError(f"order must be one of {ORDERS}; got order={bs.order!r}")


def _precedes(key_a, idx_a, key_b, idx_b):
    """a comes before b in the SPEC order: larger order key first, then smaller key index."""
    return (key_a > key_b) | ((key_a == key_b) & (idx_a < idx_b))


def _bitonic_order(keys, idxs):
    """Sort each row of (keys, idxs) [R, n] (n a power of two) into the SPEC order.

    A bitonic sorting network (log2(n) * (log2(n) + 1) / 2 compare-exchange stages). Triton
    has no sort and no value slicing, so each stage pairs element i with i ^ 2**q by reshaping
    a row to [n / 2**(q+1), 2, 2**q] and splitting the size-2 axis with masked sums, as
    Triton's own `tl.sort` does; both halves then go back through a `where` on that axis.
    Merging blocks of 2**p elements, pairs whose bit p of the position is 0 are put in SPEC
    order, the others in reverse, which makes every block of 2**(p+1) bitonic; at p = log2(n)
    every bit p is 0, so the whole row ends in SPEC order. The (key, index) pairs of a row are
    distinct wherever it matters (valid entries have distinct indices), so the order is total
    and the result does not depend on the network.
    """
    R, n = keys.shape
    log_n = n.bit_length() - 1
    for p in range(1, log_n + 1):
        for q in range(p - 1, -1, -1):
            shape = (R, n >> (q + 1), 2, 1 << q)
            key4, idx4 = keys.reshape(shape), idxs.reshape(shape)
            first = lax.broadcasted_iota(jnp.int32, shape, 2) == 0

            def halves(x4):  # the partners a (position bit q = 0) and b, [R, n / 2**(q+1), 2**q]
                return (
                    jnp.sum(jnp.where(first, x4, 0), axis=2),
                    jnp.sum(jnp.where(first, 0, x4), axis=2),
                )

            def join(a, b):  # inverse of halves, back to [R, n]
                return jnp.where(first, a[:, :, None, :], b[:, :, None, :]).reshape(R, n)

            (key_a, key_b), (idx_a, idx_b) = halves(key4), halves(idx4)
            outer = lax.broadcasted_iota(jnp.int32, key_a.shape, 1)
            spec_order = ((outer >> (p - q - 1)) & 1) == 0  # bit p of the position of a
            swap = _precedes(key_a, idx_a, key_b, idx_b) != spec_order
            key_a, key_b = jnp.where(swap, key_b, key_a), jnp.where(swap, key_a, key_b)
            idx_a, idx_b = jnp.where(swap, idx_b, idx_a), jnp.where(swap, idx_a, idx_b)
            keys, idxs = join(key_a, key_b), join(idx_a, idx_b)
    return keys, idxs


def _order_kernel(key_ref, idx_ref, cnt_ref, out_ref):
    """One program: `rows` candidate rows, sorted in registers, -1 where no entry.

    key_ref, idx_ref: [rows, n] the first n = next_pow2(max(k, sort width)) buffer slots of
    each row; cnt_ref: [rows] valid entries per row (<= n); out_ref: [rows, n] int32 key
    indices in SPEC order.
    """
    keys, idxs = key_ref[...], idx_ref[...]
    col = lax.broadcasted_iota(jnp.int32, keys.shape, 1)
    keys = jnp.where(col < cnt_ref[...][:, None], keys, INVALID_KEY)
    keys, idxs = _bitonic_order(keys, idxs)
    out_ref[...] = jnp.where(keys == INVALID_KEY, -1, idxs)


@functools.partial(jax.jit, static_argnames=("T", "k", "width", "rows", "num_warps", "interpret"))
def order_candidates_pallas(
    keys,
    idx,
    cnt,
    *,
    T: int,
    k: int,
    width: int | None = None,
    rows: int = 1,
    num_warps: int = 4,
    interpret: bool = False,
):
    """`order_candidates` as a Pallas kernel (a bitonic network per row, `_bitonic_order`).

    keys, idx: [B, T_pad, cap] int32 buffers of hytopk_candidates, the first cnt [B, T_pad]
    entries of each row valid (cnt <= width <= cap; width defaults to k). rows: buffer rows per
    program (a power of two dividing T_pad). Returns int32 [B, T, k], the same as
    `order_candidates`.
    """
    B, T_pad, cap = keys.shape
    n = _next_pow2(max(k, width or k))
    if idx.shape != keys.shape or cnt.shape != (B, T_pad) or T > T_pad:
        raise ValueError(
            f"expected keys and idx [B, T_pad, cap], cnt [B, T_pad], T <= T_pad; "
            f"got keys {keys.shape}, idx {idx.shape}, cnt {cnt.shape}, {T=}"
        )
    if not _is_pow2(rows) or T_pad % rows:
        raise ValueError(f"rows must be a power of two dividing T_pad; got {rows=} {T_pad=}")
    if n > cap:
        raise ValueError(f"next_pow2(max(k, width))={n} exceeds the buffer capacity {cap=}")
    out = pl.pallas_call(
        _order_kernel,
        out_shape=jax.ShapeDtypeStruct((B, T_pad, n), jnp.int32),
        grid=(B, T_pad // rows),
        in_specs=[
            pl.BlockSpec((None, rows, n), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, rows, n), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, rows), lambda b, i: (b, i)),
        ],
        out_specs=pl.BlockSpec((None, rows, n), lambda b, i: (b, i, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="hytopk_order",
    )(keys, idx, cnt)
    return out[:, :T, :k]


def _survivor_keys(keys, cnt, *, T: int, width: int):
    """~key of the first `width` buffer slots [B, T, width] (~ reverses int32 order, so an
    ascending sort is by key descending); ~INVALID_KEY (int32 max, last) past cnt [B, T_pad]."""
    keys = jnp.where(jnp.arange(width) < cnt[:, :T, None], keys[:, :T, :width], INVALID_KEY)
    return ~keys


def order_candidates(keys, idx, cnt, *, T: int, k: int, width: int | None = None):
    """The XLA epilogue: [B, T, k] indices from hytopk_candidates' outputs (also timed alone by
    experiments/bench_selection.py). keys, idx: [B, T_pad, cap] int32; cnt [B, T_pad] int32
    valid entries per row, <= width (default k) <= cap."""
    width = width or k
    nkeys = _survivor_keys(keys, cnt, T=T, width=width)
    # By key descending then index ascending: the indices are distinct, so this is a total
    # order and the sort is deterministic.
    nkeys, idx = lax.sort((nkeys, idx[:, :T, :width]), dimension=2, num_keys=2, is_stable=False)
    return jnp.where(nkeys[..., :k] == ~INVALID_KEY, -1, idx[..., :k]).astype(jnp.int32)


def order_candidates_stable(keys, idx, cnt, *, T: int, k: int, width: int | None = None):
    """`order_candidates` as a stable sort on the key alone, then a gather; same arguments.

    The valid prefix of each buffer row is in ascending key-index order, so a stable sort by
    key descending leaves ties in index order: the SPEC order. The sorted payload is each
    entry's buffer position (an iota); the key indices are then gathered at the first k
    positions. On the H200 XLA ran this form with its own sort kernel at 2048 and 4096 entries
    per row (faster with one key than with two) and with CUB's radix sort at 16384
    (experiments/probe_sort.py).
    """
    width = width or k
    nkeys = _survivor_keys(keys, cnt, T=T, width=width)
    position = lax.broadcasted_iota(jnp.int32, nkeys.shape, 2)
    nkeys, position = lax.sort((nkeys, position), dimension=2, num_keys=1, is_stable=True)
    return _first_k_by_position(nkeys, position, idx, T=T, k=k, width=width)


def order_candidates_position(keys, idx, cnt, *, T: int, k: int, width: int | None = None):
    """`order_candidates_stable` with the buffer position as a second sort key, stored in
    int16 where the width allows; same arguments and result.

    Positions are distinct, so (key, position) is a total order: the sort needs no stability,
    and in index-ordered buffers position order is index order, the tie rule. Each entry moves
    6 bytes through XLA's sort kernel instead of 8. H200, 32768 rows x 2048 (probe_sort.py,
    one run): 3.44 ms against 3.94 for the stable one-key form; 2.11 for the keys alone.
    """
    width = width or k
    nkeys = _survivor_keys(keys, cnt, T=T, width=width)
    narrow = width <= jnp.iinfo(jnp.int16).max + 1
    position = lax.broadcasted_iota(jnp.int16 if narrow else jnp.int32, nkeys.shape, 2)
    nkeys, position = lax.sort((nkeys, position), dimension=2, num_keys=2, is_stable=False)
    return _first_k_by_position(nkeys, position, idx, T=T, k=k, width=width)


def _first_k_by_position(nkeys, position, idx, *, T: int, k: int, width: int):
    """[B, T, k] key indices of the first k sorted entries: the buffer idx [B, T_pad, cap]
    gathered at their positions [B, T, width] (sorted alongside nkeys [B, T, width]), -1 where
    the entry is past the row's count."""
    top = jnp.take_along_axis(idx[:, :T, :width], position[..., :k].astype(jnp.int32), axis=2)
    return jnp.where(nkeys[..., :k] == ~INVALID_KEY, -1, top).astype(jnp.int32)


def hytopk(
    q_idx,
    k_idx,
    w,
    *,
    k: int,
    causal: bool,
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
):
    """Exact top-k keys per query (SPEC section 2) with the fused Pallas kernel.

    Args:
      q_idx: [B, T, HI, DI] indexer queries (bf16, f16 or f32), DI a power of two.
      k_idx: [B, S, DI] indexer keys.
      w: [B, T, HI] indexer head weights.
      k: slots per query, >= 1.
      causal: end-aligned causal visibility (key s visible to query t iff s <= t + S - T).
      interpret: run the kernel in Pallas interpret mode (CPU tests).
      block_sizes: tile sizes; default BlockSizes().
    Returns:
      int32 [B, T, k]: key indices by score descending, ties to the smaller index, NaN scores
      and invisible keys never chosen, -1 in the slots left empty.
    """
    block_sizes = block_sizes or BlockSizes()
    if block_sizes.order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got order={block_sizes.order!r}")
    if block_sizes.order == "pallas" and (
        not _is_pow2(block_sizes.order_rows)
        or block_sizes.order_rows > block_sizes.block_q
        or not _is_pow2(block_sizes.order_warps)
    ):
        # Buffer rows come in multiples of block_q, so rows per program must divide it.
        raise ValueError(
            f"order_rows must be a power of two <= block_q and order_warps a "
            f"power of two; got order_rows={block_sizes.order_rows} "
            f"block_q={block_sizes.block_q} order_warps={block_sizes.order_warps}"
        )
    T, S = q_idx.shape[1], k_idx.shape[1]
    if causal and T > S:  # end-aligned causality needs T <= S (a query chunk's key prefix too)
        raise ValueError(
            f"causal selection needs T <= S; got q_idx {q_idx.shape}, "
            f"k_idx {k_idx.shape} ({T=} > {S=})"
        )
    if not _is_pow2(block_sizes.rows_per_call) or block_sizes.rows_per_call < block_sizes.block_q:
        raise ValueError(
            f"rows_per_call must be a power of two >= block_q; got "
            f"rows_per_call={block_sizes.rows_per_call} "
            f"block_q={block_sizes.block_q}"
        )
    if block_sizes.diagnostic and block_sizes.diagnostic not in COUNTER_FIELDS:
        raise ValueError(
            f"diagnostic={block_sizes.diagnostic!r} computes no selection (timing "
            "only): call hytopk_candidates"
        )
    return _hytopk(
        q_idx, k_idx, w, k=k, causal=causal, interpret=interpret, block_sizes=block_sizes
    )
