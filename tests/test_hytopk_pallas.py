"""The fused Pallas HyTopK kernel (pallas_kernels/hytopk.py) against the SPEC selection rule.

On CPU the kernel runs in Pallas interpret mode with small tiles, so short sequences already
span many key blocks and force many candidate-buffer compactions (the part of the algorithm
that handles ties and overflow). Inputs are small integers: every score is exactly
representable, so the kernel must agree index for index with the float64 numpy oracle and with
`hs.topk_reference`. `TestCompiledGPU` runs the compiled Triton kernel on production-like
shapes and skips itself elsewhere.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs
from hyscale_jax.reference import indexer_score_table
from pallas_kernels import hytopk as phk
from pallas_kernels.order_keys import INVALID_KEY
from tests.helpers import count_named_eqns, topk_oracle

ON_GPU = jax.default_backend() == "gpu"
# Interpret-mode tiles: 32-key blocks and 32-entry compaction chunks. min_steps=4 keeps the
# buffers small (capacity next_pow2(2k + 128): 256 for k <= 64), so short sequences already
# compact mid-stream, as with the defaults before 2026-12-03's larger buffers.
# Both stream from the floor (seed_rate=0): the tests written for them count on its appends
# and compactions; the seeded stream (the default) has its own tests below, on SMALL's tiles.
SMALL = phk.BlockSizes(block_q=16, block_k=32, chunk=32, min_steps=4, seed_rate=0)
# The phased schedule with the smallest room (one block per run), so runs are short and
# compactions frequent.
PHASED = phk.BlockSizes(
    block_q=16, block_k=32, chunk=32, schedule="phased", min_steps=1, seed_rate=0
)


def int_inputs(seed, B, T, S, HI, DI, dtype, lo=-2, hi=2, wlo=-1, whi=2):
    """q [B,T,HI,DI], k [B,S,DI], w [B,T,HI] with small integer values: exact scores, many ties."""
    rng = np.random.default_rng(seed)
    q = rng.integers(lo, hi + 1, (B, T, HI, DI))
    k = rng.integers(lo, hi + 1, (B, S, DI))
    w = rng.integers(wlo, whi + 1, (B, T, HI))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


def pallas(q, k, w, topk, causal, bs=SMALL, interpret=not ON_GPU):
    return np.asarray(
        phk.hytopk(q, k, w, k=topk, causal=causal, interpret=interpret, block_sizes=bs)
    )


# (B, T, S, HI, DI, k, causal, dtype): awkward T and S, T < S end-aligned, k from 1 to > S.
CASES = [
    (1, 37, 300, 8, 64, 16, True, jnp.bfloat16),
    (2, 33, 70, 8, 64, 100, True, jnp.float32),  # k > visible keys: -1 padding
    (1, 16, 333, 16, 64, 5, False, jnp.float16),
    (1, 20, 517, 4, 128, 64, True, jnp.bfloat16),
    (1, 50, 50, 8, 64, 1, True, jnp.bfloat16),  # k = 1, T == S
    (1, 5, 200, 3, 5, 40, False, jnp.float32),  # HI, DI not powers of two (DI padded)
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: "B{}T{}S{}H{}D{}k{}{}{}".format(
        *c[:6], "c" if c[6] else "n", jnp.dtype(c[7]).name
    ),
)
def test_matches_oracle_and_reference(case):
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, dtype)
    got = pallas(q, k, w, topk, causal)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))
    np.testing.assert_array_equal(
        got, np.asarray(hs.topk_reference(q, k, w, k=topk, causal=causal))
    )


def _adversarial_inputs():
    B, T, S, HI, DI = 2, 21, 90, 4, 16
    q, k, w = (np.array(x, np.float32) for x in int_inputs(1, B, T, S, HI, DI, jnp.float32))
    q[0] = 0.0  # batch 0: every score is 0, pure tie-breaking by index
    # Huge logits and scores (~1e30). A power of two: they are small-integer multiples of
    # it, exact in f32 in any summation order (1e30's are not: a cancelling head's logit
    # comes out 0 or ~1e23 depending on the order the dot sums in).
    k[1, 3] = 2.0**100
    k[1, 40:44] = 3e4
    k[1, 7] = np.nan  # NaN key: never selected
    w[1, 2, :] = -np.inf  # -inf weights: scores of -inf or NaN in row 2
    q[1, 5, 0, 0] = np.nan  # NaN query: its whole row is unselectable -> all -1
    return q, k, w


def test_adversarial_values():
    """All-equal scores, huge and inf scores, NaN keys, -inf weights, a NaN query row."""
    topk = 24
    q, k, w = _adversarial_inputs()
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    for causal in (True, False):
        got = pallas(*args, topk, causal)
        want = topk_oracle(q, k, w, topk, causal)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(
            got, np.asarray(hs.topk_reference(*args, k=topk, causal=causal))
        )
    assert (want[1, 5] == -1).all() and not (want == 7)[1].any()
    assert (want[0, -1, :topk] == np.arange(topk)).all()  # ties -> smallest indices first


@pytest.mark.parametrize(
    "case", [CASES[0], CASES[3]], ids=lambda c: "T{}S{}k{}".format(c[1], c[2], c[5])
)
@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "masked"])
def test_phased_schedule_matches_oracle(case, bulk):
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, dtype)
    bs = PHASED if case is not CASES[3] else dataclasses.replace(PHASED, min_steps=2)
    bs = dataclasses.replace(bs, bulk_first_run=bulk)
    np.testing.assert_array_equal(
        pallas(q, k, w, topk, causal, bs=bs), topk_oracle(q, k, w, topk, causal)
    )


@pytest.mark.parametrize("schedule", ["fused", "phased"])
def test_bulk_placeholders_when_few_real_keys(schedule):
    """The bulk first run stores whole blocks, so rows with fewer than k real keys (causal
    masking, NaN scores) enter the final compaction with placeholders beyond k real entries:
    the threshold stays at the floor, placeholders fill the tie quota, and the epilogue must
    still give every real key in SPEC order, then -1."""
    B, T, S, HI, DI, topk = 1, 33, 70, 2, 16, 40  # rows see 38..70 keys; blocks hold 64, 96
    q, k, w = (np.array(x, np.float32) for x in int_inputs(5, B, T, S, HI, DI, jnp.float32))
    k[0, 10:30] = np.nan  # 20 NaN keys: rows t < 22 see < 40 real
    q[0, 4, 0, 0] = np.nan  # one row with no real key at all
    bs = dataclasses.replace(SMALL if schedule == "fused" else PHASED, diagnostic="stats")
    keys, idx, cnt, st = phk.hytopk_candidates(
        *(jnp.asarray(x) for x in (q, k, w)),
        k=topk,
        causal=True,
        interpret=not ON_GPU,
        block_sizes=bs,
    )
    final = np.asarray(st)[0, :T, phk.STAT_FIELDS.index("final_count")]
    real = [
        (np.asarray(keys)[0, t, :n] != INVALID_KEY).sum()
        for t, n in enumerate(np.asarray(cnt)[0, :T])
    ]
    assert ((final > topk) & (np.asarray(real) < topk)).any()  # the quota-on-placeholders path
    want = topk_oracle(q, k, w, topk, True)
    assert (want[0, 4] == -1).all() and (want == -1).any(axis=2)[0, 5:22].all()
    for order in phk.ORDERS:
        np.testing.assert_array_equal(
            phk.order_survivors(
                keys,
                idx,
                cnt,
                T=T,
                k=topk,
                interpret=not ON_GPU,
                block_sizes=dataclasses.replace(bs, order=order, diagnostic=""),
            ),
            want,
        )


@pytest.mark.parametrize("pivots", [3, 7])
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[3]], ids=lambda c: "T{}S{}k{}".format(c[1], c[2], c[5])
)
def test_multi_pivot_compaction_matches_oracle(case, pivots):
    """Several bisection pivots per count pass (BlockSizes.pivots): same exact selection."""
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + pivots, B, T, S, HI, DI, dtype)
    bs = dataclasses.replace(PHASED, pivots=pivots)
    np.testing.assert_array_equal(
        pallas(q, k, w, topk, causal, bs=bs), topk_oracle(q, k, w, topk, causal)
    )


@pytest.mark.parametrize(
    "schedule,sample,interpolate,lazy,tie_free,aims",
    [
        ("phased", 8, 0, False, False, (0.75, 0.25)),
        ("fused", 8, 8, False, True, (0.0, 0.0)),
        ("phased", 0, 0, False, False, (1.0, 1.0)),
        ("phased", 8, 1, True, True, (1.0, 0.0)),
        ("fused", 0, 1, True, False, (0.5, 0.125)),
        ("phased", 0, 8, True, True, (0.75, 0.25)),
        ("phased", 8, 8, True, True, (0.0, 0.0)),
    ],
)
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[3]], ids=lambda c: "T{}S{}k{}".format(c[1], c[2], c[5])
)
def test_compaction_pivots_match_oracle(case, schedule, sample, interpolate, lazy, tie_free, aims):
    """Every pivot rule: the first count pass from a stratified sample (BlockSizes.sample > 0)
    or not, then bisection only (interpolate=0), one interpolated pass, or the default eight;
    mid-stream aims anywhere in [k, target], the ends included; count passes and the runs'
    largest key reduced per chunk / key block or once per pass / run (lazy_reduce,
    lazy_run_max), queries loaded per key block or once (hoist_queries), tie ranks skipped
    when unneeded or always computed (tie_free_rewrite). Any pivots keep the selection exact,
    so this guards the loops around them: the same exact selection, on integer inputs with
    heavy ties (where the interpolation's even-spread assumption is wrong) and on the
    adversarial values."""
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + 11 + sample, B, T, S, HI, DI, dtype)
    bs = dataclasses.replace(
        PHASED,
        sample=sample,
        schedule=schedule,
        lazy_reduce=lazy,
        lazy_run_max=lazy,
        tie_free_rewrite=tie_free,
        interpolate=interpolate,
        stream_aims=aims,
        hoist_queries=lazy,
    )
    np.testing.assert_array_equal(
        pallas(q, k, w, topk, causal, bs=bs), topk_oracle(q, k, w, topk, causal)
    )
    adversarial = _adversarial_inputs()
    np.testing.assert_array_equal(
        pallas(*(jnp.asarray(x) for x in adversarial), 24, True, bs=bs),
        topk_oracle(*adversarial, 24, True),
    )


def _normal_inputs(seed, B, T, S, HI, DI):
    """f32 normal q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI]: distinct scores, no ties."""
    return tuple(
        jax.random.normal(kk, shape, jnp.float32)
        for kk, shape in zip(
            jax.random.split(jax.random.key(seed), 3), ((B, T, HI, DI), (B, S, DI), (B, T, HI))
        )
    )


def _selection_and_passes(q, k, w, topk, causal, bs):
    """(the exact selection [B, T, topk], the first program's count passes) of one kernel
    run with the work counters on."""
    keys, idx, cnt, st = phk.hytopk_candidates(
        q,
        k,
        w,
        k=topk,
        causal=causal,
        interpret=not ON_GPU,
        block_sizes=dataclasses.replace(bs, diagnostic="stats"),
    )
    selection = np.asarray(phk.order_candidates(keys, idx, cnt, T=q.shape[1], k=topk))
    return selection, int(np.asarray(st)[0, 0, phk.STAT_FIELDS.index("bisect_passes")])


def test_sampled_pivots_need_fewer_passes():
    """On distinct random scores the sampled first pass lands inside [k, target] for most
    mid-stream compactions and brackets the final k-th key, so the bisection takes fewer
    count passes than from the full [tau, max] interval (interpolation off: this measures
    the sample alone). Capacity 2k: frequent mid-stream compactions."""
    q, k, w = _normal_inputs(3, 1, 16, 2048, 2, 16)
    bisect, sampled = (
        _selection_and_passes(
            q,
            k,
            w,
            64,
            False,
            dataclasses.replace(PHASED, capacity=128, sample=sample, interpolate=0),
        )
        for sample in (0, 32)
    )
    np.testing.assert_array_equal(sampled[0], bisect[0])
    assert sampled[1] < 0.7 * bisect[1], (bisect[1], sampled[1])


def test_interpolated_pivots_need_fewer_passes():
    """On random floats the interpolated pivots close the bracket around the k-th key in
    fewer count passes than bisection on the key values (14 -> 9 here, of which 4 are the
    compactions' first, sampled passes), with the same selection."""
    q, k, w = _normal_inputs(4, 1, 16, 4096, 2, 16)
    bisect, interpolated = (
        _selection_and_passes(
            q, k, w, 256, False, dataclasses.replace(PHASED, interpolate=interpolate)
        )
        for interpolate in (0, 8)
    )
    np.testing.assert_array_equal(interpolated[0], bisect[0])
    assert interpolated[1] < 0.75 * bisect[1], (bisect[1], interpolated[1])


def test_interpolated_pivots_exact_in_narrow_brackets():
    """The interpolated pivot is lo + round_down(frac * (hi - lo)) to within 2 key values
    however large |lo| is (the offset is taken on the exact span, not on lo rounded to f32,
    whose spacing near 2**30 is 128), stays inside [lo + 1, hi - 1], and is non-decreasing in
    the wanted count's rank; also at the extremes of the int32 key space."""
    rng = np.random.default_rng(21)
    n = 4096
    lo = rng.integers(-(2**31), 2**31 - 2**24, n, dtype=np.int64)
    width = np.where(rng.random(n) < 0.5, rng.integers(2, 1000, n), rng.integers(2, 2**24, n))
    lo[:4] = [-(2**31), -(2**31), 1_077_936_128, 0x7F800001 - 300]
    width[:4] = [0x7F800001 + 2**31, 300, 300, 300]
    hi = lo + width
    c_lo = rng.integers(2, 5000, n)
    c_hi = (c_lo * rng.random(n)).astype(np.int64)
    wants = [c_hi + (c_lo - c_hi) * f // 8 for f in (6, 3, 1)]  # descending counts

    def as32(x):
        return jnp.asarray(x, jnp.int32)

    got = [
        np.asarray(p, np.int64)
        for p in phk._interpolated_pivots(
            as32(lo), as32(hi), as32(c_lo), as32(c_hi), [as32(c) for c in wants]
        )
    ]
    for c, pivot in zip(wants, got):
        ideal = lo + np.floor((hi - lo) * (c_lo - c) / np.maximum(c_lo - c_hi, 1))
        want = np.clip(ideal, lo + 1, hi - 1)
        err = np.abs(pivot - want)
        assert (err <= np.maximum(2, (hi - lo) * 2.0**-22)).all(), err.max()
        assert ((pivot >= lo + 1) & (pivot <= hi - 1)).all()
    assert (got[0] <= got[1]).all() and (got[1] <= got[2]).all()


def test_multi_pivot_needs_fewer_passes():
    """7 pivots per pass resolve 3 bits of the threshold per buffer read instead of 1: on
    random floats (many distinct keys) the bisection takes fewer passes, same selection
    (sampling and interpolation off: this measures the bisection alone)."""
    rng = np.random.default_rng(5)
    q, k, w = (
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in ((1, 16, 2, 16), (1, 400, 16), (1, 16, 2))
    )
    one, seven = (
        _selection_and_passes(
            q, k, w, 16, True, dataclasses.replace(PHASED, pivots=pivots, sample=0, interpolate=0)
        )
        for pivots in (1, 7)
    )
    np.testing.assert_array_equal(seven[0], one[0])
    assert seven[1] < one[1], (one[1], seven[1])


def test_multi_pivot_adversarial_values():
    q, k, w = _adversarial_inputs()
    for schedule in ("phased", "fused"):
        bs = dataclasses.replace(PHASED, pivots=7, schedule=schedule)
        np.testing.assert_array_equal(
            pallas(*(jnp.asarray(x) for x in (q, k, w)), 24, True, bs=bs),
            topk_oracle(q, k, w, 24, True),
        )


def test_phased_adversarial_values():
    q, k, w = _adversarial_inputs()
    np.testing.assert_array_equal(
        pallas(*(jnp.asarray(x) for x in (q, k, w)), 24, True, bs=PHASED),
        topk_oracle(q, k, w, 24, True),
    )


def test_stats_counters_and_diagnostics():
    """ "stats" is the exact kernel plus consistent work counters; the diagnostic modes run,
    and the append modes append every visible key (tau never rises). Without the bulk first
    run only visible keys are appended; with it, the first run's blocks go in whole (so
    placeholders count as appended) and each final buffer holds exactly min(visible, k) real
    keys."""
    B, T, S, HI, DI, topk = 1, 37, 200, 2, 16, 16
    q, k, w = int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, jnp.bfloat16)
    for sched, bulk in (("fused", True), ("phased", True), ("phased", False)):
        bs = dataclasses.replace(
            SMALL if sched == "fused" else PHASED, diagnostic="stats", bulk_first_run=bulk
        )
        keys, idx, cnt, st = phk.hytopk_candidates(
            q, k, w, k=topk, causal=True, interpret=not ON_GPU, block_sizes=bs
        )
        np.testing.assert_array_equal(
            phk.order_candidates(keys, idx, cnt, T=T, k=topk), topk_oracle(q, k, w, topk, True)
        )
        st = dict(zip(phk.STAT_FIELDS, np.moveaxis(np.asarray(st)[0, :T], 1, 0)))
        visible = np.arange(T) + (S - T) + 1
        assert (st["key_blocks"] == -(-(np.arange(T) // 16 * 16 + 16 + S - T) // 32)).all()
        assert (st["appended"] >= np.minimum(visible, topk)).all()
        assert (st["appended"] <= (st["key_blocks"] * 32 if bulk else visible)).all()
        assert (st["final_count"] <= st["appended"]).all()
        assert (st["row_compactions"] <= st["compactions"]).all()
        assert (st["row_compactions"] >= 1).all() and (st["bisect_passes"] >= 1).all()
        cnt, keys = np.asarray(cnt)[0, :T], np.asarray(keys)[0, :T]
        real = [(keys[t, : cnt[t]] != phk.INVALID_KEY).sum() for t in range(T)]
        np.testing.assert_array_equal(real, np.minimum(visible, topk))
        if not bulk:
            assert (st["appended"] <= visible).all() and (cnt == real).all()
    visible = np.arange(T) + (S - T) + 1
    for mode in ("append_only", "append_nested", "score_only"):
        bs = dataclasses.replace(SMALL, diagnostic=mode)
        if mode != "score_only":  # (score_only: test_variants_lower_to_triton)
            cnt = phk.hytopk_candidates(
                q, k, w, k=topk, causal=True, interpret=not ON_GPU, block_sizes=bs
            )[2]
            np.testing.assert_array_equal(np.asarray(cnt)[0, :T], visible)
        with pytest.raises(ValueError, match="diagnostic"):
            phk.hytopk(q, k, w, k=topk, causal=True, interpret=True, block_sizes=bs)


# Seeded thresholds (BlockSizes.seed_rate) in interpret mode: SMALL's 256-slot buffers still
# compact mid-stream, capacity 1024 leaves the seeded stream without compactions.
@pytest.mark.parametrize(
    "case",
    [CASES[0], CASES[1], CASES[2], CASES[3]],
    ids=lambda c: "T{}S{}k{}{}".format(c[1], c[2], c[5], "c" if c[6] else "n"),
)
@pytest.mark.parametrize("schedule,capacity", [("phased", None), ("phased", 1024), ("fused", None)])
def test_seeded_threshold_matches_oracle(case, schedule, capacity):
    """The stream starts at a sampled threshold instead of the floor: the same selection,
    and (checked in the stats where no compaction interferes) fewer appends than from the
    floor in a row long enough for its sample to seed it."""
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + HI + DI + topk + 1, B, T, S, HI, DI, dtype, lo=-4, hi=4)
    base = dataclasses.replace(SMALL, schedule=schedule, capacity=capacity, diagnostic="stats")
    seeded = dataclasses.replace(base, seed_rate=4)
    appended = {}
    for name, bs in (("floor", base), ("seeded", seeded)):
        keys, idx, cnt, st = phk.hytopk_candidates(
            q, k, w, k=topk, causal=causal, interpret=not ON_GPU, block_sizes=bs
        )
        np.testing.assert_array_equal(
            phk.order_candidates(keys, idx, cnt, T=T, k=topk), topk_oracle(q, k, w, topk, causal)
        )
        appended[name] = np.asarray(st)[:, :T, phk.STAT_FIELDS.index("appended")]
    m_lo, m_hi = phk.seed_counts(topk, seeded.resolve_seed_rate(S, topk), seeded.seed_sigmas)
    # With room for every key (capacity 1024) an unseeded row appends every visible key (the
    # floor's bulk run even its placeholders), a seeded row only those above its seed. The
    # last row (S visible keys) has > m_hi valid keys in its sample (but in CASES[1], too
    # short to seed any row), so it is seeded.
    if capacity == 1024 and S // 4 > m_hi + 8:
        assert (appended["floor"][:, -1] >= S).all() and (appended["seeded"][:, -1] < S).all()


def test_seeded_threshold_failure_reruns():
    """Batch 1 puts the sampled keys far above all others, so each seed (with no margin,
    seed_sigmas=0) leaves fewer than k keys above it: those rows are flagged (their count
    before the final compaction is below k) and their programs run again unseeded, while
    batch 0's programs keep their seeded results (the aliased buffers of the re-run). Row 5
    of batch 1 scores all keys equal."""
    B, T, S, HI, DI, topk, rate = 2, 40, 1200, 2, 16, 64, 4
    rng = np.random.default_rng(11)
    q = rng.integers(1, 3, (B, T, HI, DI)).astype(np.float32)
    w = np.ones((B, T, HI), np.float32)
    k = rng.integers(0, 2, (B, S, DI)).astype(np.float32)
    sampled = np.asarray(phk.seed_positions(jnp.arange(S // rate + 1, dtype=jnp.int32), rate))
    k[1, sampled[sampled < S]] += 4.0
    q[1, 5] = 0.0
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    bs = dataclasses.replace(
        SMALL, seed_rate=rate, seed_sigmas=0.0, capacity=512, diagnostic="stats"
    )
    keys, idx, cnt, st = phk.hytopk_candidates(
        *args, k=topk, causal=True, interpret=not ON_GPU, block_sizes=bs
    )
    np.testing.assert_array_equal(
        phk.order_candidates(keys, idx, cnt, T=T, k=topk), topk_oracle(q, k, w, topk, True)
    )
    before_final = np.asarray(st)[:, :T, phk.STAT_FIELDS.index("final_count")]
    # Every batch-1 row but 5 failed its seed; row 5's keys all tie with its sampled one, so
    # all of them stay above the seed (one below that key). No batch-0 row failed.
    assert (np.delete(before_final[1], 5) < topk).all() and before_final[1, 5] >= topk
    assert (before_final[0] >= topk).all()
    assert (np.asarray(cnt)[:, :T] == topk).all()


@pytest.mark.parametrize("pattern", ["all_equal", "rising", "falling", "two_levels"])
def test_compaction_tie_patterns(pattern):
    """Score patterns aimed at the candidate buffer: all keys tied with the k-th (the exact
    tie-trim path), ascending scores (every key passes the threshold, one compaction per
    block), descending scores (the threshold never rises after the first compaction), and two
    levels where the k-th key sits inside a huge tie block."""
    B, T, S, HI, DI, topk = 1, 16, 400, 2, 16, 48
    s = np.arange(S, dtype=np.float32)
    vals = {
        "all_equal": np.ones(S),
        "rising": 1.0 + s,
        "falling": 1.0 + s[::-1],
        "two_levels": np.where(s % 7 == 0, 2.0, 1.0),
    }[pattern]
    k = np.zeros((B, S, DI), np.float32)
    k[0, :, 0] = vals
    q = np.zeros((B, T, HI, DI), np.float32)
    q[..., 0] = 1.0
    w = np.ones((B, T, HI), np.float32)
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    for causal in (True, False):
        for tie_free in (True, False):
            got = pallas(
                *args,
                topk,
                causal,
                bs=phk.BlockSizes(block_q=16, block_k=16, chunk=16, tie_free_rewrite=tie_free),
            )
            np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))
    for tie_free in (True, False):
        got = pallas(
            *args,
            topk,
            True,
            bs=phk.BlockSizes(
                block_q=16,
                block_k=16,
                chunk=16,
                schedule="phased",
                min_steps=1,
                tie_free_rewrite=tie_free,
            ),
        )
        np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, True))


def test_public_dispatch_name_and_determinism():
    q, k, w = int_inputs(3, 1, 37, 300, 8, 64, jnp.bfloat16)
    impl = "pallas" if ON_GPU else "interpret"
    a = np.asarray(hs.hytopk(q, k, w, k=16, causal=True, impl=impl))
    b = np.asarray(hs.hytopk(q, k, w, k=16, causal=True, impl=impl))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, topk_oracle(q, k, w, 16, True))
    jaxpr = jax.make_jaxpr(lambda *x: hs.hytopk(*x, k=16, causal=True, impl=impl))(q, k, w)
    assert count_named_eqns(jaxpr, prefixes=("hytopk",)) >= 1
    n_calls = 0
    for eqn in _all_eqns(jaxpr.jaxpr):
        if eqn.primitive.name == "pallas_call":
            n_calls += 1
            assert _pallas_name(eqn).startswith("hytopk"), _pallas_name(eqn)
    default = phk.BlockSizes()  # kernel (+ the seed re-run) (+ the epilogue)
    assert n_calls == 1 + bool(default.seed_rate) + (default.order == "pallas")


@pytest.mark.parametrize(
    "T,S,causal,rows", [(37, 300, True, 16), (50, 50, True, 32), (33, 120, False, 16)]
)
def test_query_chunks_match_oracle(T, S, causal, rows):
    """rows_per_call < T: consecutive calls over query chunks, each on its causal key prefix
    (with PHASED's small buffers, so the chunks compact mid-stream)."""
    q, k, w = int_inputs(T + S + rows, 2, T, S, 8, 64, jnp.bfloat16)
    bs = dataclasses.replace(PHASED, rows_per_call=rows)
    got = pallas(q, k, w, 16, causal, bs=bs)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, 16, causal))
    jaxpr = jax.make_jaxpr(
        lambda *x: phk.hytopk(*x, k=16, causal=causal, interpret=True, block_sizes=bs)
    )(q, k, w)
    n_chunks = -(-T // rows)
    assert count_named_eqns(jaxpr, prefixes=("hytopk_fused_select",)) == n_chunks
    # Each chunk after the first waits for the previous chunk's result (bounded buffers).
    barriers = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == n_chunks - 1


def _candidate_buffers(seed, B, T_pad, cap, k, ascending=False):
    """Buffers like hytopk_candidates' outputs: keys with many ties (and INVALID_KEY + 1, the
    smallest valid key, and one row of keys spread over the int32 range), distinct indices
    per row (ascending along the row, as the kernel leaves them, if `ascending`), cnt <= k
    with empty and full rows, and garbage past cnt."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-3, 4, (B, T_pad, cap)).astype(np.int32)
    keys[0, 1, :] = INVALID_KEY + 1
    # One row over the whole int32 range, both ends included: the epilogues' sign handling.
    keys[0, 2, :] = rng.integers(INVALID_KEY + 1, 2**31, cap)
    keys[0, 2, :2] = INVALID_KEY + 1, 2**31 - 1
    idx = np.stack(
        [rng.permutation(B * T_pad * cap)[: T_pad * cap].reshape(T_pad, cap) for _ in range(B)]
    ).astype(np.int32)
    if ascending:
        idx = np.sort(idx, axis=-1)
    cnt = rng.integers(0, k + 1, (B, T_pad)).astype(np.int32)
    cnt[0, :3], cnt[-1, 0] = k, 0
    return jnp.asarray(keys), jnp.asarray(idx), jnp.asarray(cnt)


@pytest.mark.parametrize(
    "k,cap,rows", [(37, 64, 2), (64, 64, 16), (1, 32, 1), (2, 32, 8), (100, 256, 4)]
)
def test_pallas_order_matches_xla_sort(k, cap, rows):
    """The bitonic epilogue gives the XLA sort's order: key descending, index ascending, -1
    past cnt (k not a power of two, ties, empty rows)."""
    keys, idx, cnt = _candidate_buffers(k + cap + rows, 2, 32, cap, k)
    want = np.asarray(phk.order_candidates(keys, idx, cnt, T=29, k=k))
    got = np.asarray(
        phk.order_candidates_pallas(keys, idx, cnt, T=29, k=k, rows=rows, interpret=True)
    )
    np.testing.assert_array_equal(got, want)


def _order_oracle(keys, idx, cnt, T, k):
    """numpy: each row's first cnt entries by key descending, index ascending; k slots, -1."""
    keys, idx, cnt = (np.asarray(x) for x in (keys, idx, cnt))
    out = np.full(keys.shape[:1] + (T, k), -1, np.int64)
    for b in range(keys.shape[0]):
        for t in range(T):
            n = cnt[b, t]
            order = sorted(range(n), key=lambda i: (-int(keys[b, t, i]), idx[b, t, i]))[:k]
            out[b, t, : len(order)] = idx[b, t, order]
    return out


@pytest.mark.parametrize(
    "k,width,cap", [(37, 37, 64), (37, 64, 64), (1, 32, 32), (2, 2, 32), (100, 200, 256)]
)
def test_order_epilogues_agree(k, width, cap):
    """Every epilogue orders buffers in ascending index order (as the kernel leaves them) by
    key descending, index ascending, -1 past cnt, keeping the first k of up to `width`
    entries per row; the stable one-key sort relies on that index order for its ties."""
    keys, idx, cnt = _candidate_buffers(k + width + cap, 2, 32, cap, width, ascending=True)
    want = _order_oracle(keys, idx, cnt, 29, k)
    for name, fn in [
        ("xla", phk.order_candidates),
        ("xla_stable", phk.order_candidates_stable),
        ("xla_position", phk.order_candidates_position),
        ("pallas", functools.partial(phk.order_candidates_pallas, rows=2, interpret=True)),
    ]:
        got = np.asarray(fn(keys, idx, cnt, T=29, k=k, width=width))
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_position_epilogue_wider_than_int16():
    """Past 32768 entries per row the position sort key falls back to int32 (int16 would wrap
    and misorder ties): still the SPEC order over the whole row, ties at both ends of it."""
    width = 2**15 + 40
    keys, idx, cnt = _candidate_buffers(7, 1, 3, width, width, ascending=True)
    got = np.asarray(phk.order_candidates_position(keys, idx, cnt, T=3, k=50, width=width))
    np.testing.assert_array_equal(got, _order_oracle(keys, idx, cnt, 3, 50))


@pytest.mark.parametrize("fn", [phk.order_candidates, phk.order_candidates_position])
def test_two_key_epilogues_sort_unflagged_stable(fn):
    """Their sort keys are distinct per row, so they ask for no stability: a stable sort would
    make XLA add an int32 iota as a third operand (the H200 ran the int16-position form so at
    4.82 ms against 3.18 without it; results/hytopk_position/gpu_epilogue/)."""
    keys, idx, cnt = _candidate_buffers(0, 1, 16, 64, 32, ascending=True)
    text = jax.jit(lambda a, b, c: fn(a, b, c, T=16, k=32)).lower(keys, idx, cnt).as_text()
    sorts = [line for line in text.splitlines() if "stablehlo.sort" in line]
    assert len(sorts) == 1 and "is_stable = true" not in text, sorts


# Epilogue and final-compaction width combinations (the default is xla_position at width k);
# "9k/8" is a width that is not a power of two.
WIDE_ORDERS = [
    ("xla_stable", "k"),
    ("xla_stable", "9k/8"),
    ("xla_stable", "2k"),
    ("xla_stable", "cap"),
    ("xla_position", "k"),
    ("xla_position", "9k/8"),
    ("xla", "2k"),
    ("pallas", "2k"),
]


def _order_sizes(bs, topk, order, width):
    width = {"k": None, "9k/8": topk + topk // 8, "2k": 2 * topk, "cap": bs.resolve_capacity(topk)}[
        width
    ]
    return dataclasses.replace(bs, order=order, sort_width=width)


@pytest.mark.parametrize("order,width", WIDE_ORDERS)
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[1], CASES[3]], ids=lambda c: "T{}S{}k{}".format(c[1], c[2], c[5])
)
def test_order_and_sort_width_end_to_end(case, order, width):
    """A wider final buffer (sort_width) leaves extra survivors; the epilogue still returns
    exactly the top-k. SMALL's buffers compact mid-stream, so rows reach the final
    compaction with more than 2k entries."""
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + 2, B, T, S, HI, DI, dtype)
    got = pallas(q, k, w, topk, causal, bs=_order_sizes(SMALL, topk, order, width))
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))


@pytest.mark.parametrize(
    "order,width",
    [
        ("xla_stable", "cap"),
        ("xla_stable", "2k"),
        ("xla_stable", "9k/8"),
        ("xla_position", "k"),
        ("xla_position", "2k"),
    ],
)
def test_sort_width_adversarial_values(order, width):
    """All-equal, huge, inf and NaN scores through the stable epilogue at wider final buffers
    and through the position epilogue (the default) at widths k and 2k; 64 slots (trigger 32
    of 90 keys) make the buffers compact mid-stream."""
    topk = 24
    q, k, w = _adversarial_inputs()
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    bs = dataclasses.replace(PHASED, capacity=64)
    for causal in (True, False):
        got = pallas(*args, topk, causal, bs=_order_sizes(bs, topk, order, width))
        np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))


@pytest.mark.parametrize("schedule", ["fused", "phased"])
def test_buffers_in_index_order_and_sort_width(schedule):
    """The stable epilogue's premise: every row's valid buffer prefix is in ascending key-index
    order, after mid-stream and final compactions. And sort_width is the final compaction's
    bound: at 2k some rows keep more than k entries, none more than 2k."""
    B, T, S, HI, DI, topk = 1, 37, 300, 4, 16, 16
    q, k, w = int_inputs(3, B, T, S, HI, DI, jnp.bfloat16)
    base = SMALL if schedule == "fused" else PHASED
    for width in (topk, 2 * topk):
        bs = dataclasses.replace(base, sort_width=width, diagnostic="stats")
        keys, idx, cnt, st = phk.hytopk_candidates(
            q, k, w, k=topk, causal=True, interpret=not ON_GPU, block_sizes=bs
        )
        cnt, idx = np.asarray(cnt)[0, :T], np.asarray(idx)[0, :T]
        assert all((np.diff(idx[t, : cnt[t]]) > 0).all() for t in range(T))
        assert (np.asarray(st)[0, :T, phk.STAT_FIELDS.index("final_count")] > 2 * topk).any()
        assert cnt.max() <= width and (cnt.max() > topk) == (width > topk)
        np.testing.assert_array_equal(
            phk.order_candidates_stable(keys, idx[None], cnt[None], T=T, k=topk, width=width),
            topk_oracle(q, k, w, topk, True),
        )


@pytest.mark.parametrize("case", CASES[:2], ids=["bf16", "f32-padding"])
def test_pallas_order_end_to_end(case):
    B, T, S, HI, DI, topk, causal, dtype = case
    q, k, w = int_inputs(B * T + S + 1, B, T, S, HI, DI, dtype)
    got = pallas(q, k, w, topk, causal, bs=dataclasses.replace(SMALL, order="pallas", order_rows=2))
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))


@pytest.mark.parametrize("k,rows,warps", [(2048, 1, 4), (2048, 4, 8), (37, 2, 4)])
def test_order_lowers_to_triton(k, rows, warps):
    args = (jax.ShapeDtypeStruct((2, 1008, 4096), jnp.int32),) * 2 + (
        jax.ShapeDtypeStruct((2, 1008), jnp.int32),
    )
    f = jax.jit(
        lambda a, b, c: phk.order_candidates_pallas(
            a, b, c, T=1000, k=k, rows=rows, num_warps=warps
        )
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1 and "hytopk_order" in text


def test_no_score_table_anywhere():
    """Nothing in the traced computation (kernel body included) is T x S sized."""
    B, T, S, HI, DI, topk = 1, 64, 8192, 8, 64, 8
    q, k, w = int_inputs(4, B, T, S, HI, DI, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(
        lambda *x: phk.hytopk(*x, k=topk, causal=True, interpret=True, block_sizes=SMALL)
    )(q, k, w)
    biggest = max(
        int(np.prod(v.aval.shape))
        for eqn in _all_eqns(jaxpr.jaxpr)
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    )
    assert biggest < T * S // 8, biggest  # the largest arrays are k_idx and the buffers


def test_random_floats_up_to_near_ties():
    """Arbitrary floats: f32 summation order may flip near-ties, so compare selected scores."""
    rng = np.random.default_rng(5)
    B, T, S, HI, DI, topk = 1, 24, 260, 8, 64, 40
    q = jnp.asarray(rng.normal(size=(B, T, HI, DI)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, S, DI)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(B, T, HI)), jnp.bfloat16)
    got = pallas(q, k, w, topk, True)
    want = np.asarray(hs.topk_reference(q, k, w, k=topk, causal=True))
    _assert_same_up_to_near_ties(q, k, w, got, want)


@pytest.mark.parametrize(
    "HI,DI,dtype,topk",
    [(32, 128, jnp.bfloat16, 2048), (64, 64, jnp.float16, 1), (8, 128, jnp.float32, 300)],
)
def test_lowers_to_triton(HI, DI, dtype, topk):
    """The kernel body lowers to Triton IR for CUDA on any host (no GPU needed): every primitive
    it uses has a Pallas-Triton lowering rule. (Triton's own compiler runs only on the GPU.)"""
    _assert_lowers(HI, DI, dtype, topk, phk.BlockSizes())


# Every schedule, diagnostic and the benchmark's candidate tiles (experiments/hytopk_notes.md).
LOWERING_VARIANTS = [
    dict(schedule="phased"),
    dict(schedule="phased", capacity=8192),
    dict(schedule="phased", block_k=256, capacity=8192),
    dict(schedule="fused", num_warps=4),
    dict(schedule="phased", chunk=512),
    dict(schedule="phased", num_stages=1),
    dict(schedule="fused", block_k=256),
    dict(diagnostic="score_only"),
    dict(diagnostic="append_only"),
    dict(diagnostic="append_nested"),
    dict(diagnostic="stats"),
    dict(pivots=3),
    dict(pivots=7, diagnostic="stats"),
    dict(sample=32),
    dict(sample=64, schedule="fused"),
    dict(sample=32, diagnostic="stats"),
    dict(schedule="phased", diagnostic="stats"),
    dict(lazy_reduce=False),
    dict(diagnostic="clocks"),
    dict(diagnostic="clocks", lazy_reduce=False, sample=0),
    dict(lazy_reduce=False, tie_free_rewrite=False),
    dict(pivots=3, chunk=128),
    dict(block_k=128),
    dict(block_k=512, num_stages=1),
    dict(interpolate=0),
    dict(interpolate=1, diagnostic="clocks"),
    dict(lazy_run_max=True),
    dict(lazy_run_max=True, diagnostic="clocks"),
    dict(stream_aims=(0.5, 0.125)),
    dict(bulk_first_run=False),
    dict(bulk_first_run=False, diagnostic="clocks"),
    dict(capacity=16384),
    dict(hoist_queries=False),
    dict(hoist_queries=False, diagnostic="score_only"),
    dict(seed_rate=16),
    dict(seed_rate=32, diagnostic="clocks"),
    dict(seed_rate=8, schedule="fused"),
    dict(seed_rate=16, diagnostic="stats"),
]


@pytest.mark.parametrize("kw", LOWERING_VARIANTS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_variants_lower_to_triton(kw):
    _assert_lowers(32, 128, jnp.bfloat16, 2048, phk.BlockSizes(**kw))


def _assert_lowers(HI, DI, dtype, topk, bs):
    args = (
        jax.ShapeDtypeStruct((2, 1000, HI, DI), dtype),
        jax.ShapeDtypeStruct((2, 3001, DI), dtype),
        jax.ShapeDtypeStruct((2, 1000, HI), dtype),
    )
    f = jax.jit(
        lambda q, k, w: phk.hytopk_candidates(
            q, k, w, k=topk, causal=True, interpret=False, block_sizes=bs
        )
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "hytopk_fused_select" in text
    # A seeded selection adds its re-run call (the diagnostics that select nothing do not).
    rerun = bool(bs.seed_rate) and bs.diagnostic in ("",) + tuple(phk.COUNTER_FIELDS)
    assert text.count("xla.gpu.triton") == 1 + rerun
    assert ("hytopk_seed_rerun" in text) == rerun


def test_bad_block_sizes():
    q, k, w = int_inputs(0, 1, 16, 64, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_k"):
        phk.hytopk(
            q, k, w, k=4, causal=True, interpret=True, block_sizes=phk.BlockSizes(block_k=48)
        )
    with pytest.raises(ValueError, match="capacity"):
        phk.hytopk(
            q,
            k,
            w,
            k=100,
            causal=True,
            interpret=True,
            block_sizes=phk.BlockSizes(block_k=32, chunk=32, capacity=128),
        )
    with pytest.raises(ValueError, match="min_steps"):  # 100 + 4 * 32 > 128
        phk.hytopk(
            q,
            k,
            w,
            k=100,
            causal=True,
            interpret=True,
            block_sizes=phk.BlockSizes(
                block_k=32, chunk=32, capacity=256, schedule="phased", min_steps=8
            ),
        )
    for bad in (
        dict(schedule="eager"),
        dict(diagnostic="nope"),
        dict(schedule="phased", min_steps=0),
        dict(pivots=2),
        dict(sample=3),
        dict(sample=128),
        dict(stream_aims=(0.2, 0.4)),
        dict(stream_aims=(1.5, 0.5)),
        dict(stream_aims=(0.5,)),
        dict(seed_rate=1),
        dict(seed_rate=12),
        dict(seed_sigmas=-1.0),
    ):
        with pytest.raises(
            ValueError, match=next(iter(bad)) if "min_steps" not in bad else "min_steps"
        ):
            phk.hytopk_candidates(
                q, k, w, k=4, causal=True, interpret=True, block_sizes=phk.BlockSizes(**bad)
            )
    # A list of aims is stored as a tuple, so jit can hash the BlockSizes.
    as_list = phk.BlockSizes(stream_aims=[0.5, 0.125])
    as_tuple = phk.BlockSizes(stream_aims=(0.5, 0.125))
    assert as_list == as_tuple and hash(as_list) == hash(as_tuple)
    with pytest.raises(ValueError, match="order"):
        phk.hytopk(
            q, k, w, k=4, causal=True, interpret=True, block_sizes=phk.BlockSizes(order="bitonic")
        )
    with pytest.raises(ValueError, match="order_rows"):
        phk.hytopk(
            q,
            k,
            w,
            k=4,
            causal=True,
            interpret=True,
            block_sizes=phk.BlockSizes(order="pallas", order_rows=32),
        )
    with pytest.raises(ValueError, match="T_pad"):
        phk.order_candidates_pallas(*_candidate_buffers(0, 1, 16, 32, 4), T=17, k=4)
    with pytest.raises(ValueError, match="rows"):
        phk.order_candidates_pallas(*_candidate_buffers(0, 1, 16, 32, 4), T=16, k=4, rows=3)
    with pytest.raises(ValueError, match="rows"):
        phk.order_candidates_pallas(*_candidate_buffers(0, 1, 16, 32, 4), T=16, k=4, rows=32)
    with pytest.raises(ValueError, match="capacity"):
        phk.order_candidates_pallas(*_candidate_buffers(0, 1, 16, 32, 4), T=16, k=33)
    with pytest.raises(ValueError, match="T <= S"):
        phk.hytopk(q[:, :16], k[:, :8], w[:, :16], k=4, causal=True, interpret=True)
    for width in (3, 1 << 20):  # below k; above the capacity
        with pytest.raises(ValueError, match="sort_width"):
            phk.hytopk(
                q,
                k,
                w,
                k=4,
                causal=True,
                interpret=True,
                block_sizes=phk.BlockSizes(sort_width=width),
            )
    for rows in (24, 8):  # not a power of two; fewer than block_q
        with pytest.raises(ValueError, match="rows_per_call"):
            phk.hytopk(
                q,
                k,
                w,
                k=4,
                causal=True,
                interpret=True,
                block_sizes=phk.BlockSizes(rows_per_call=rows),
            )
    with pytest.raises(ValueError, match="clocks"):  # %clock: compiled GPU kernels only
        phk.hytopk_candidates(
            q,
            k,
            w,
            k=4,
            causal=True,
            interpret=True,
            block_sizes=phk.BlockSizes(diagnostic="clocks"),
        )


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel: GPU only")
class TestCompiledGPU:
    """The compiled kernel at production-like shapes (default BlockSizes)."""

    @pytest.mark.parametrize(
        "T,S,HI,DI,topk,causal,dtype",
        [
            (2048, 2048, 32, 128, 2048, True, jnp.bfloat16),
            (1000, 3001, 32, 128, 512, True, jnp.bfloat16),
            (777, 1500, 64, 64, 100, False, jnp.float16),
            (512, 4096, 8, 128, 1, True, jnp.float32),
            (300, 5000, 16, 64, 2048, False, jnp.bfloat16),
        ],
    )
    def test_exact_vs_reference(self, T, S, HI, DI, topk, causal, dtype):
        _assert_compiled_exact(T + S, 2, T, S, HI, DI, topk, causal, dtype, phk.BlockSizes())

    @pytest.mark.parametrize("sample", [32, 64])
    @pytest.mark.parametrize("T,S,topk", [(4096, 4096, 2048), (1000, 3001, 512)])
    def test_sampled_pivots_exact_vs_reference(self, T, S, topk, sample):
        q, k, w = int_inputs(T + S + sample, 1, T, S, 32, 128, jnp.bfloat16)
        got = pallas(q, k, w, topk, True, bs=phk.BlockSizes(sample=sample), interpret=False)
        np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(q, k, w, k=topk)))

    @pytest.mark.parametrize("schedule,sample", [("fused", 0), ("phased", 0), ("phased", 32)])
    def test_all_equal_and_nan_at_scale(self, schedule, sample):
        T = S = 4096
        q, k, w = (np.array(x, np.float32) for x in int_inputs(7, 2, T, S, 32, 128, jnp.float32))
        q[0] = 0.0  # all scores equal in batch 0
        k[1, 100:200] = np.nan  # NaN keys in batch 1
        q[1, 3000, 5, 0] = np.nan  # one NaN query row
        args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, w))
        got = pallas(
            *args, 2048, True, bs=phk.BlockSizes(schedule=schedule, sample=sample), interpret=False
        )
        want = np.asarray(hs.topk_reference(*args, k=2048, causal=True))
        np.testing.assert_array_equal(got, want)
        assert (got[1, 3000] == -1).all()

    @pytest.mark.parametrize(
        "T,S,HI,DI,topk,causal,dtype",
        [
            (4096, 4096, 32, 128, 2048, True, jnp.bfloat16),
            (1000, 3001, 32, 128, 512, True, jnp.bfloat16),
            (777, 1500, 64, 64, 100, False, jnp.float16),
            (300, 20000, 16, 64, 2048, False, jnp.bfloat16),
            (2000, 9000, 8, 128, 1, True, jnp.float32),
        ],
    )
    @pytest.mark.parametrize("rate", [0, 32])  # unseeded, and sparser than the default 16
    def test_seed_rates_exact_vs_reference(self, T, S, HI, DI, topk, causal, dtype, rate):
        _assert_compiled_exact(
            T + S + rate, 1, T, S, HI, DI, topk, causal, dtype, phk.BlockSizes(seed_rate=rate)
        )

    def test_seeded_all_equal_nan_and_failure_at_scale(self):
        """All-equal scores (batch 0), NaN keys and a NaN query row (batch 1), and batch 2
        with its sampled keys far above the rest and no margin (seed_sigmas=0), so its seeds
        fail and its programs re-run unseeded."""
        T = S = 4096
        q, k, w = (np.array(x, np.float32) for x in int_inputs(9, 3, T, S, 32, 128, jnp.float32))
        q[0] = 0.0
        k[1, 100:200] = np.nan
        q[1, 3000, 5, 0] = np.nan
        q[2], w[2] = np.abs(q[2]) + 1.0, 1.0
        k[2] = np.abs(k[2])
        sampled = np.asarray(phk.seed_positions(jnp.arange(S // 16, dtype=jnp.int32), 16))
        k[2, sampled] += 8.0
        args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, w))
        bs = phk.BlockSizes(seed_rate=16, seed_sigmas=0.0, diagnostic="stats")
        keys, idx, cnt, st = phk.hytopk_candidates(*args, k=2048, causal=True, block_sizes=bs)
        got = np.asarray(phk.order_survivors(keys, idx, cnt, T=T, k=2048, block_sizes=bs))
        np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(*args, k=2048)))
        assert (got[1, 3000] == -1).all()
        before_final = np.asarray(st)[2, 3000:, phk.STAT_FIELDS.index("final_count")]
        assert (before_final < 2048).all()  # the long rows of batch 2 did fail their seeds

    @pytest.mark.parametrize(
        "lazy,tie_free,interpolate",
        [(False, False, 8), (True, False, 8), (False, True, 8), (True, True, 0)],
    )
    @pytest.mark.parametrize("T,S,topk", [(4096, 4096, 2048), (1000, 3001, 512)])
    def test_compaction_options_exact_vs_reference(self, T, S, topk, lazy, tie_free, interpolate):
        """The count-pass and rewrite options the default does not use (it is tested above)."""
        q, k, w = int_inputs(T + S + 5, 1, T, S, 32, 128, jnp.bfloat16)
        bs = phk.BlockSizes(lazy_reduce=lazy, tie_free_rewrite=tie_free, interpolate=interpolate)
        got = pallas(q, k, w, topk, True, bs=bs, interpret=False)
        np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(q, k, w, k=topk)))

    @pytest.mark.parametrize(
        "lazy_run_max,aims,bulk,hoist",
        [
            (True, (0.5, 0.125), True, False),
            (True, (0.0, 0.0), False, False),
            (False, (0.75, 0.25), False, False),
            (False, (0.75, 0.25), True, True),
        ],
    )
    @pytest.mark.parametrize("T,S,topk", [(4096, 4096, 2048), (1000, 3001, 512)])
    def test_run_options_exact_vs_reference(self, T, S, topk, lazy_run_max, aims, bulk, hoist):
        """The runs' largest key as per-lane maxima (the bulk first run's too), mid-stream
        compactions aimed low in [k, target] or at exactly k, the first run masked and
        cumsum-compacted like the others (bulk_first_run=False), and the queries loaded per
        key block (hoist_queries=False) or once per program (the default)."""
        q, k, w = int_inputs(T + S + 6, 1, T, S, 32, 128, jnp.bfloat16)
        bs = phk.BlockSizes(
            lazy_run_max=lazy_run_max, stream_aims=aims, bulk_first_run=bulk, hoist_queries=hoist
        )
        got = pallas(q, k, w, topk, True, bs=bs, interpret=False)
        np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(q, k, w, k=topk)))

    def test_clocks_diagnostic(self):
        """ "clocks" is the exact kernel; its phase cycles are positive and add up."""
        T = S = 4096
        q, k, w = int_inputs(13, 1, T, S, 32, 128, jnp.bfloat16)
        bs = phk.BlockSizes(diagnostic="clocks")
        keys, idx, cnt, clk = phk.hytopk_candidates(q, k, w, k=2048, causal=True, block_sizes=bs)
        np.testing.assert_array_equal(
            np.asarray(phk.order_candidates(keys, idx, cnt, T=T, k=2048)),
            np.asarray(hs.topk_reference(q, k, w, k=2048)),
        )
        c = dict(zip(phk.CLOCK_FIELDS, np.moveaxis(np.asarray(clk)[0].astype(np.int64), 1, 0)))
        assert (c["runs"] > 0).all() and (c["total"] > 0).all()
        assert (c["compact_count"] <= c["compact"]).all()
        assert (c["final_count"] <= c["final"]).all()
        assert (c["runs"] + c["compact"] + c["final"] <= c["total"]).all()
        last_visible = np.arange(T // bs.block_q) * bs.block_q + bs.block_q - 1  # T == S
        assert (c["key_blocks"] == np.repeat(last_visible // bs.block_k + 1, bs.block_q)).all()

    @pytest.mark.parametrize("rows,warps", [(1, 4), (2, 8)])
    @pytest.mark.parametrize(
        "T,S,topk,causal",
        [
            (2048, 2048, 2048, True),
            (1000, 3001, 512, True),
            (777, 1500, 100, False),
            (512, 1024, 1, True),
            (300, 700, 2, False),
        ],
    )
    def test_pallas_order_exact_vs_reference(self, T, S, topk, causal, rows, warps):
        q, k, w = int_inputs(T + S + rows, 2, T, S, 32, 128, jnp.bfloat16)
        bs = phk.BlockSizes(order="pallas", order_rows=rows, order_warps=warps)
        got = pallas(q, k, w, topk, causal, bs=bs, interpret=False)
        np.testing.assert_array_equal(
            got, np.asarray(hs.topk_reference(q, k, w, k=topk, causal=causal))
        )

    @pytest.mark.parametrize(
        "T,S,topk,causal",
        [(1000, 3001, 512, True), (1500, 1500, 2048, True), (777, 1500, 100, False)],
    )
    def test_query_chunks_exact_vs_reference(self, T, S, topk, causal):
        q, k, w = int_inputs(T + S + 3, 1, T, S, 32, 128, jnp.bfloat16)
        got = pallas(q, k, w, topk, causal, bs=phk.BlockSizes(rows_per_call=256), interpret=False)
        np.testing.assert_array_equal(
            got, np.asarray(hs.topk_reference(q, k, w, k=topk, causal=causal))
        )

    @pytest.mark.parametrize("order,width", WIDE_ORDERS)
    @pytest.mark.parametrize(
        "T,S,topk,causal",
        [(2048, 2048, 2048, True), (1000, 3001, 512, True), (777, 1500, 100, False)],
    )
    def test_order_and_sort_width_exact_vs_reference(self, T, S, topk, causal, order, width):
        q, k, w = int_inputs(T + S + 4, 2, T, S, 32, 128, jnp.bfloat16)
        bs = _order_sizes(phk.BlockSizes(), topk, order, width)
        got = pallas(q, k, w, topk, causal, bs=bs, interpret=False)
        np.testing.assert_array_equal(
            got, np.asarray(hs.topk_reference(q, k, w, k=topk, causal=causal))
        )

    @pytest.mark.parametrize("order", ["xla_stable", "xla_position"])
    def test_sort_width_all_equal_and_nan_at_scale(self, order):
        T = S = 4096
        q, k, w = (np.array(x, np.float32) for x in int_inputs(8, 2, T, S, 32, 128, jnp.float32))
        q[0] = 0.0
        k[1, 100:200] = np.nan
        args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, w))
        for width, interpolate in (("2k", 8), ("cap", 8), ("k", 0)):
            bs = _order_sizes(phk.BlockSizes(interpolate=interpolate), 2048, order, width)
            got = pallas(*args, 2048, True, bs=bs, interpret=False)
            np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(*args, k=2048)))

    def test_deterministic_and_matches_xla(self):
        q, k, w = int_inputs(9, 1, 4096, 4096, 32, 128, jnp.bfloat16)
        a = pallas(q, k, w, 2048, True, bs=phk.BlockSizes(), interpret=False)
        b = pallas(q, k, w, 2048, True, bs=phk.BlockSizes(), interpret=False)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, np.asarray(hs.hytopk(q, k, w, k=2048, impl="xla")))

    def test_random_floats_up_to_near_ties(self):
        rng = np.random.default_rng(11)
        T = S = 4096
        q = jnp.asarray(rng.normal(size=(1, T, 32, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.normal(size=(1, S, 128)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(size=(1, T, 32)), jnp.bfloat16)
        got = pallas(q, k, w, 2048, True, bs=phk.BlockSizes(), interpret=False)
        want = np.asarray(hs.topk_reference(q, k, w, k=2048, causal=True))
        _assert_same_up_to_near_ties(q, k, w, got, want)


# --- helpers -------------------------------------------------------------------------------


def _assert_compiled_exact(seed, B, T, S, HI, DI, topk, causal, dtype, bs):
    """The compiled kernel with `bs` on integer inputs selects what topk_reference does."""
    q, k, w = int_inputs(seed, B, T, S, HI, DI, dtype)
    got = pallas(q, k, w, topk, causal, bs=bs, interpret=False)
    np.testing.assert_array_equal(
        got, np.asarray(hs.topk_reference(q, k, w, k=topk, causal=causal))
    )


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            subs = value if isinstance(value, (list, tuple)) else [value]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                inner = getattr(inner, "jaxpr", inner) if not hasattr(inner, "eqns") else inner
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _pallas_name(eqn):
    name = eqn.params.get("name")
    if name is None and "name_and_src_info" in eqn.params:
        name = eqn.params["name_and_src_info"].name
    return str(name)


def _assert_same_up_to_near_ties(q, k, w, got, want, rtol=1e-5):
    """Both selections hold the same number of keys per row, and their scores (f64 from the
    same inputs), sorted, agree to rtol: any difference is a near-tie swap."""
    scores, _ = indexer_score_table(q, k, w, causal=True)
    scores = np.asarray(scores, np.float64)
    for idx_a, idx_b in ((got, want),):
        assert ((idx_a >= 0) == (idx_b >= 0)).all()
        sa = np.take_along_axis(scores, np.maximum(idx_a, 0), axis=-1)
        sb = np.take_along_axis(scores, np.maximum(idx_b, 0), axis=-1)
        sa, sb = np.where(idx_a >= 0, sa, 0.0), np.where(idx_b >= 0, sb, 0.0)
        np.testing.assert_allclose(np.sort(sa, -1), np.sort(sb, -1), rtol=rtol, atol=1e-5)
    agree = np.mean(got == want)
    assert agree > 0.98, agree
