"""The fused Pallas HyTopK kernel (pallas_kernels/hytopk.py) against the selection rule.

On CPU the kernel runs in Pallas interpret mode with small tiles, so short sequences already
span many key blocks and force candidate-buffer compactions (the part of the algorithm that
handles ties and overflow). Inputs are small integers: every score is exactly representable,
so the kernel must agree index for index with the float64 numpy oracle and with
`hs.topk_reference`. An interpret-mode kernel is a large XLA CPU program that runs in
milliseconds, so it is compiled with LLVM's expensive passes off (`run`): ~3x faster to
compile. `TestCompiledGPU` runs the compiled Triton kernel at production-like shapes and skips
itself elsewhere.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hyscale_jax as hs
from hyscale_jax.reference import indexer_score_table
from pallas_kernels import hytopk as phk
from pallas_kernels.order_keys import INVALID_KEY
from tests.helpers import all_eqns, count_named_eqns, key_ordered, lower_for_cuda, topk_oracle

ON_GPU = jax.default_backend() == "gpu"
# Interpret-mode tiles: 32-key blocks, 32-entry compaction chunks, runs of >= 4 blocks, so the
# buffers hold next_pow2(2k + 128) slots (256 for k <= 64) and short sequences compact
# mid-stream. UNSEEDED streams from the floor (its first run stores whole blocks); SEEDED
# samples one key in 4, so rows of a few hundred keys already start at a seeded threshold.
UNSEEDED = phk.BlockSizes(block_q=16, block_k=32, chunk=32, min_steps=4, seed_rate=0)
SEEDED = dataclasses.replace(UNSEEDED, seed_rate=4)
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run(f, *args):
    """jax.jit(f)(*args); on CPU compiled with the options above, on GPU as usual."""
    lowered = jax.jit(f).lower(*args)
    return lowered.compile(None if ON_GPU else _FAST_CPU_COMPILE)(*args)


def int_inputs(seed, B, T, S, HI, DI, dtype, lo=-2, hi=2, wlo=-1, whi=2):
    """q [B,T,HI,DI], k [B,S,DI], w [B,T,HI] with small integer values: exact scores, many ties."""
    rng = np.random.default_rng(seed)
    q = rng.integers(lo, hi + 1, (B, T, HI, DI))
    k = rng.integers(lo, hi + 1, (B, S, DI))
    w = rng.integers(wlo, whi + 1, (B, T, HI))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


def pallas(q, k, w, topk, causal, bs=UNSEEDED, order="score"):
    """The selection [B, T, topk] of phk.hytopk with block sizes `bs`, in `order`."""
    return np.asarray(
        run(
            lambda *x: phk.hytopk(
                *x, k=topk, causal=causal, interpret=not ON_GPU, block_sizes=bs, order=order
            ),
            q,
            k,
            w,
        )
    )


def candidates(q, k, w, topk, causal, bs):
    """phk.hytopk_candidates' buffers (keys, idx, cnt) with block sizes `bs`."""
    return run(
        lambda *x: phk.hytopk_candidates(
            *x, k=topk, causal=causal, interpret=not ON_GPU, block_sizes=bs
        ),
        q,
        k,
        w,
    )


def assert_exact(q, k, w, topk, causal, bs):
    """The kernel with `bs` selects exactly what the oracle and topk_reference select."""
    got = pallas(q, k, w, topk, causal, bs=bs)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, causal))
    want = hs.topk_reference(q, k, w, k=topk, causal=causal)
    np.testing.assert_array_equal(got, np.asarray(want))
    return got


# (B, T, S, HI, DI, k, causal, dtype, block sizes): awkward T and S (not multiples of the
# blocks), T < S end-aligned, k from 1 to more than the visible keys, seeded and not.
CASES = [
    (1, 37, 300, 4, 64, 16, True, jnp.bfloat16, UNSEEDED),
    (1, 37, 300, 4, 64, 16, True, jnp.bfloat16, SEEDED),
    (2, 33, 70, 2, 16, 100, True, jnp.float32, SEEDED),  # k > visible keys: -1 padding
    (1, 16, 333, 4, 32, 5, False, jnp.float16, SEEDED),
    (1, 20, 517, 4, 128, 64, True, jnp.bfloat16, SEEDED),
    (1, 50, 50, 3, 16, 1, True, jnp.bfloat16, UNSEEDED),  # k = 1, T == S
    (1, 5, 200, 3, 5, 40, False, jnp.float32, UNSEEDED),  # HI, DI not powers of two
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: "B{}T{}S{}H{}D{}k{}{}{}-seed{}".format(
        *c[:6], "c" if c[6] else "n", jnp.dtype(c[7]).name, c[8].seed_rate
    ),
)
def test_matches_oracle_and_reference(case):
    B, T, S, HI, DI, topk, causal, dtype, bs = case
    assert_exact(*int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, dtype), topk, causal, bs)


def _adversarial_inputs():
    B, T, S, HI, DI = 2, 21, 290, 4, 16
    q, k, w = (np.array(x, np.float32) for x in int_inputs(1, B, T, S, HI, DI, jnp.float32))
    q[0] = 0.0  # batch 0: every score is 0, pure tie-breaking by index
    # Huge scores (~1e30). A power of two: they are small-integer multiples of it, exact in
    # f32 in any summation order (1e30's are not).
    k[1, 3] = 2.0**100
    k[1, 40:44] = 3e4
    q[1, :, :, 0], k[1, 60], k[1, 60, 0] = 1.0, 0.0, np.inf  # key 60: every logit is inf,
    w[1, 10:15] = 1.0  # its score +inf in rows 10-14, NaN (inf - inf, inf * 0) elsewhere
    k[1, 7] = np.nan  # NaN key: never selected
    w[1, 2, :] = -np.inf  # -inf weights: scores of -inf or NaN in row 2
    q[1, 5, 0, 0] = np.nan  # NaN query: its whole row is unselectable -> all -1
    return q, k, w


@pytest.mark.parametrize(
    "causal,bs",
    [
        (True, UNSEEDED),
        (False, SEEDED),
    ],
    ids=["c", "n-seed"],
)
def test_adversarial_values(causal, bs):
    """All-equal scores, huge, inf and -inf scores, NaN keys and a NaN query row."""
    topk = 24
    q, k, w = _adversarial_inputs()
    got = assert_exact(*(jnp.asarray(x) for x in (q, k, w)), topk, causal, bs)
    assert (got[1, 5] == -1).all() and not (got == 7)[1].any()
    assert (got[0, -1, :topk] == np.arange(topk)).all()  # ties -> smallest indices first
    assert (got[1, 10:15, 0] == 60).all()  # +inf first


def test_few_real_keys():
    """Rows with fewer than k selectable keys (causal masking, NaN keys, a NaN query row): the
    unseeded first run stores whole blocks, so such rows reach the final compaction with
    INVALID_KEY placeholders past their real keys, which the tie quota at the floor keeps; the
    selection must still be every real key in order, then -1. The final buffers hold at most
    k entries, in ascending key-index order (the epilogue's premise). (Seeded streams append
    only keys above the floor: test_matches_oracle_and_reference's k=100 case.)"""
    bs = UNSEEDED
    B, T, S, HI, DI, topk = 1, 33, 300, 2, 16, 40  # rows see 268..300 keys
    q, k, w = (np.array(x, np.float32) for x in int_inputs(5, B, T, S, HI, DI, jnp.float32))
    k[0, 10:250] = np.nan  # rows t < 12 see fewer than 40 real keys
    q[0, 4, 0, 0] = np.nan  # one row with no real key at all
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    buffers = candidates(*args, topk, True, bs)
    keys, idx, cnt = (np.asarray(x)[0, :T] for x in buffers)
    real = np.array([(keys[t, : cnt[t]] != INVALID_KEY).sum() for t in range(T)])
    assert ((cnt == topk) & (real < topk)).any()  # the quota-on-placeholders path
    assert (cnt <= topk).all()
    assert all((np.diff(idx[t, : cnt[t]]) > 0).all() for t in range(T))
    want = topk_oracle(q, k, w, topk, True)
    np.testing.assert_array_equal(real, (want[0] >= 0).sum(axis=1))
    assert (want[0, 4] == -1).all() and (want[0, :12] == -1).any(axis=1).all()
    np.testing.assert_array_equal(phk.order_candidates(*buffers, T=T, k=topk), want)
    # NaN keys 10-249 lie between real keys: placeholders interrupt the buffers' real entries,
    # so the index-order epilogue takes its sorting branch.
    real_entries = [keys[t, : cnt[t]] != INVALID_KEY for t in range(T)]
    assert any((~r[:-1] & r[1:]).any() for r in real_entries)
    assert phk.placeholders_interrupt(*buffers[::2], T=T, k=topk)
    np.testing.assert_array_equal(
        phk.candidates_in_key_order(*buffers, T=T, k=topk), key_ordered(want)
    )


@pytest.mark.parametrize(
    "case",
    [(*CASES[2][:8], UNSEEDED), CASES[5]],
    ids=["unseeded-k>keys", "k1"],
)
def test_index_order_epilogue(case):
    """The index-order epilogue returns the buffers' selected entries as they stand, with no
    sort: the score-order result by ascending key index, the -1 slots after them. Unseeded, the
    rows that see fewer than k keys hold placeholders after their real keys, which become -1."""
    B, T, S, HI, DI, topk, causal, dtype, bs = case
    args = int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, dtype)
    buffers = candidates(*args, topk, causal, bs)
    keys, _, cnt = buffers
    if bs.seed_rate == 0 and topk > 1:
        assert (np.asarray(keys)[:, :T, :topk] == INVALID_KEY).any()  # the case's premise
    want = topk_oracle(*args, topk, causal)
    np.testing.assert_array_equal(phk.order_candidates(*buffers, T=T, k=topk), want)
    assert not phk.placeholders_interrupt(keys, cnt, T=T, k=topk)  # so no sort runs
    got = phk.candidates_in_key_order(*buffers, T=T, k=topk)
    np.testing.assert_array_equal(got, key_ordered(want))


def test_failed_seeds_rerun(monkeypatch):
    """Batch 1 puts the sampled keys far above all others, so each seed (no margin,
    seed_sigmas=0) leaves fewer than k keys above it: the first kernel call flags those rows
    (cnt = -1) and the re-run call selects them again from the floor, while batch 0 keeps its
    seeded results (the re-run's aliased buffers). Row 5 of batch 1 scores all keys equal, so
    its keys all tie with the sampled one and stay above the seed (one below that key)."""
    B, T, S, HI, DI, topk, rate = 2, 40, 1200, 2, 16, 64, 4
    rng = np.random.default_rng(11)
    q = rng.integers(1, 3, (B, T, HI, DI)).astype(np.float32)
    w = np.ones((B, T, HI), np.float32)
    k = rng.integers(0, 2, (B, S, DI)).astype(np.float32)
    sampled = np.asarray(phk.seed_positions(jnp.arange(S // rate + 1, dtype=jnp.int32), rate))
    k[1, sampled[sampled < S]] += 4.0
    q[1, 5] = 0.0
    args = tuple(jnp.asarray(x) for x in (q, k, w))
    bs = dataclasses.replace(UNSEEDED, seed_rate=rate, seed_sigmas=0.0, capacity=512)

    # Record the first call's row counts: wrap pallas_call while hytopk_candidates traces
    # (these block sizes appear in no other test, so it traces here).
    first = {}
    pallas_call = phk.pl.pallas_call

    def spy(kernel, *, name, **kwargs):
        call = pallas_call(kernel, name=name, **kwargs)

        def run(*operands):
            out = call(*operands)
            if name == "hytopk_fused_select":
                jax.debug.callback(lambda c: first.setdefault("cnt", np.asarray(c)), out[2])
            return out

        return run

    monkeypatch.setattr(phk.pl, "pallas_call", spy)
    keys, idx, cnt = candidates(*args, topk, True, bs)
    monkeypatch.undo()
    flagged = first["cnt"][:, :T] < 0
    assert not flagged[0].any() and flagged[1].sum() == T - 1 and not flagged[1, 5]
    assert (np.asarray(cnt)[:, :T] == topk).all()
    want = topk_oracle(q, k, w, topk, True)
    np.testing.assert_array_equal(phk.order_candidates(keys, idx, cnt, T=T, k=topk), want)
    np.testing.assert_array_equal(
        phk.candidates_in_key_order(keys, idx, cnt, T=T, k=topk), key_ordered(want)
    )


def test_compaction_tie_patterns():
    """Score patterns aimed at the candidate buffer, one per batch row: all keys tied with
    the k-th (the exact tie-trim rewrite), ascending scores (every key passes the threshold, a
    compaction per run), descending scores (the threshold never rises after the first
    compaction), and two levels where the k-th key sits inside a huge tie block. Runs of one
    16-key block."""
    B, T, S, HI, DI, topk = 4, 16, 400, 2, 16, 48
    bs = dataclasses.replace(UNSEEDED, block_k=16, chunk=16, min_steps=1)
    s = np.arange(S, dtype=np.float32)
    k = np.zeros((B, S, DI), np.float32)
    k[:, :, 0] = np.ones(S), 1.0 + s, 1.0 + s[::-1], np.where(s % 7 == 0, 2.0, 1.0)
    q = np.zeros((B, T, HI, DI), np.float32)
    q[..., 0] = 1.0
    w = np.ones((B, T, HI), np.float32)
    got = pallas(*(jnp.asarray(x) for x in (q, k, w)), topk, True, bs=bs)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, topk, True))


def test_public_dispatch_default_block_sizes():
    """hs.hytopk's kernel path at the default BlockSizes (seeded: two pallas_calls, both named
    hytopk...), exact on ties."""
    q, k, w = int_inputs(3, 1, 37, 300, 8, 64, jnp.bfloat16)
    impl = "pallas" if ON_GPU else "interpret"
    got = run(lambda *x: hs.hytopk(*x, k=16, causal=True, impl=impl), q, k, w)
    np.testing.assert_array_equal(got, topk_oracle(q, k, w, 16, True))
    jaxpr = jax.make_jaxpr(lambda *x: hs.hytopk(*x, k=16, causal=True, impl=impl))(q, k, w)
    names = [
        str(eqn.params.get("name") or eqn.params["name_and_src_info"].name)
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name == "pallas_call"
    ]
    assert names == ["hytopk_fused_select", "hytopk_seed_rerun"], names


def test_query_chunks_match_oracle():
    """rows_per_call < T: consecutive calls over query chunks, each on its causal key prefix
    (284 and 300 keys here), each after the previous one (an optimization barrier)."""
    T, S, causal, rows = 32, 300, True, 16
    q, k, w = int_inputs(T + S + rows, 2, T, S, 4, 32, jnp.bfloat16)
    bs = dataclasses.replace(UNSEEDED, rows_per_call=rows)
    np.testing.assert_array_equal(
        pallas(q, k, w, 16, causal, bs=bs), topk_oracle(q, k, w, 16, causal)
    )
    jaxpr = jax.make_jaxpr(
        lambda *x: phk.hytopk(*x, k=16, causal=causal, interpret=True, block_sizes=bs)
    )(q, k, w)
    n_chunks = -(-T // rows)
    assert count_named_eqns(jaxpr, prefixes=("hytopk_fused_select",)) == n_chunks
    barriers = [e for e in all_eqns(jaxpr) if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == n_chunks - 1


def test_random_floats_up_to_near_ties():
    """Arbitrary floats: f32 summation order may flip near-ties, so compare selected scores."""
    rng = np.random.default_rng(5)
    B, T, S, HI, DI, topk = 1, 24, 260, 4, 64, 40
    q = jnp.asarray(rng.normal(size=(B, T, HI, DI)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, S, DI)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(B, T, HI)), jnp.bfloat16)
    got = pallas(q, k, w, topk, True)
    want = np.asarray(hs.topk_reference(q, k, w, k=topk, causal=True))
    _assert_same_up_to_near_ties(q, k, w, got, want)


def test_no_score_table_anywhere():
    """Nothing in the traced computation (kernel body included) is T x S sized."""
    B, T, S, HI, DI, topk = 1, 64, 8192, 8, 64, 8
    q, k, w = int_inputs(4, B, T, S, HI, DI, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(
        lambda *x: phk.hytopk(*x, k=topk, causal=True, interpret=True, block_sizes=SEEDED)
    )(q, k, w)
    biggest = max(
        int(np.prod(v.aval.shape))
        for eqn in all_eqns(jaxpr)
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    )
    assert biggest < T * S // 8, biggest  # the largest arrays are k_idx and the buffers


def _candidate_buffers(seed, B, T_pad, cap, k):
    """Buffers like hytopk_candidates' outputs: keys with many ties (and INVALID_KEY + 1, the
    smallest valid key, and one row of keys over the whole int32 range), distinct indices in
    ascending order along each row, cnt <= k with empty and full rows, garbage past cnt."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-3, 4, (B, T_pad, cap)).astype(np.int32)
    keys[0, 1, :] = INVALID_KEY + 1
    keys[0, 2, :] = rng.integers(INVALID_KEY + 1, 2**31, cap)
    keys[0, 2, :2] = INVALID_KEY + 1, 2**31 - 1
    idx = np.sort(
        np.stack([rng.permutation(T_pad * cap * 2)[: T_pad * cap].reshape(T_pad, cap)] * B),
        axis=-1,
    ).astype(np.int32)
    cnt = rng.integers(0, k + 1, (B, T_pad)).astype(np.int32)
    cnt[0, :3], cnt[-1, 0] = k, 0
    return jnp.asarray(keys), jnp.asarray(idx), jnp.asarray(cnt)


def _order_oracle(keys, idx, cnt, T, k):
    """numpy: each row's first cnt entries by key descending, index ascending; k slots, -1."""
    keys, idx, cnt = (np.asarray(x) for x in (keys, idx, cnt))
    out = np.full(keys.shape[:1] + (T, k), -1, np.int64)
    for b in range(keys.shape[0]):
        for t in range(T):
            order = sorted(range(cnt[b, t]), key=lambda i: (-int(keys[b, t, i]), idx[b, t, i]))
            out[b, t, : len(order)] = idx[b, t, order]
    return out


@pytest.mark.parametrize("k,cap", [(37, 64), (1, 32), (2, 32), (100, 256), (2**15 + 40, 2**16)])
def test_order_candidates(k, cap):
    """The epilogue orders each row's first cnt entries by key descending, index ascending,
    -1 past cnt; past 32768 entries per row its position key is int32 (int16 would wrap)."""
    T_pad, T = (32, 29) if k < 1000 else (3, 3)
    keys, idx, cnt = _candidate_buffers(k + cap, 2 if k < 1000 else 1, T_pad, cap, k)
    got = np.asarray(phk.order_candidates(keys, idx, cnt, T=T, k=k))
    np.testing.assert_array_equal(got, _order_oracle(keys, idx, cnt, T, k))


def test_order_candidates_sort_is_unflagged():
    """The epilogue's sort keys are distinct per row, so it asks for no stability: a stable
    sort makes XLA add an int32 iota as a third operand (slower on the H200)."""
    keys, idx, cnt = _candidate_buffers(0, 1, 16, 64, 32)
    f = jax.jit(lambda a, b, c: phk.order_candidates(a, b, c, T=16, k=32))
    text = f.lower(keys, idx, cnt).as_text()
    sorts = [line for line in text.splitlines() if "stablehlo.sort" in line]
    assert len(sorts) == 1 and "is_stable = true" not in text, sorts


def test_interpolated_pivots_exact_in_narrow_brackets():
    """The interpolated pivot is lo + floor(frac * (hi - lo)) to within 2 key values however
    large |lo| is (the offset is taken on the exact span, not on lo rounded to f32, whose
    spacing near 2**30 is 128), stays inside [lo + 1, hi - 1], and is non-decreasing in the
    wanted count's rank; also at the extremes of the int32 key space."""
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


@pytest.mark.parametrize(
    "HI,DI,dtype,topk,seed_rate,stages",
    [
        (32, 128, jnp.bfloat16, 2048, 16, 2),
        (64, 128, jnp.bfloat16, 2048, 16, 1),  # half the query tiles read per key block
        (8, 64, jnp.float16, 1, 16, 2),
        (4, 16, jnp.float32, 300, 0, 2),
    ],
)
def test_lowers_to_triton(HI, DI, dtype, topk, seed_rate, stages):
    """The default kernels (and the unseeded one) lower to Triton IR for CUDA on any host: every
    primitive they use has a Pallas-Triton lowering rule. (Triton compiles only on the GPU.)
    Query tiles past 128 KiB (the second half of HI = 64 x DI = 128 in bf16) are read at every
    key block, at one pipelining stage, so the kernel fits shared memory."""
    args = (
        jax.ShapeDtypeStruct((2, 1000, HI, DI), dtype),
        jax.ShapeDtypeStruct((2, 3001, DI), dtype),
        jax.ShapeDtypeStruct((2, 1000, HI), dtype),
    )
    bs = phk.BlockSizes(seed_rate=seed_rate)

    def f(q, k, w):
        return phk.hytopk(q, k, w, k=topk, causal=True, block_sizes=bs)

    text = lower_for_cuda(f, *args).as_text()
    assert text.count("xla.gpu.triton") == 1 + bool(seed_rate)
    assert "hytopk_fused_select" in text and ("hytopk_seed_rerun" in text) == bool(seed_rate)
    assert re.findall(r"num_stages = (\d+)", text) == [str(stages)] * (1 + bool(seed_rate))


@pytest.mark.parametrize("resident_heads,case", [(0, 1), (0, 2), (None, 1)])
def test_queries_read_per_key_block_are_exact(monkeypatch, resident_heads, case):
    """The paths for query tiles too large to stay in shared memory (none of the heads'
    tiles kept, or, by the byte budget, only the first two of four, the others loaded at every
    key block) select the same keys: forced at small shapes."""
    monkeypatch.setattr(phk, "_RESIDENT_QUERY_BYTES", 2 * 16 * 64 * 2)
    bf16 = jnp.bfloat16
    assert phk._resident_heads(phk.BlockSizes(), 4, 64, bf16) == 2
    assert phk._resident_heads(phk.BlockSizes(resident_heads=0), 4, 64, bf16) == 0
    B, T, S, HI, DI, topk, causal, dtype, bs = CASES[case]
    bs = dataclasses.replace(bs, resident_heads=resident_heads)
    q, k, w = int_inputs(B * T + S + HI + DI + topk, B, T, S, HI, DI, dtype)
    assert_exact(q, k, w, topk, causal, bs)


def test_bad_block_sizes():
    q, k, w = int_inputs(0, 1, 16, 64, 2, 16, jnp.float32)

    for topk, kw, match in [
        (4, dict(block_k=48), "block_k"),
        (4, dict(block_q=8), "block_q"),
        (4, dict(chunk=24), "chunk"),
        (4, dict(min_steps=0), "min_steps"),
        (4, dict(seed_rate=1), "seed_rate"),
        (4, dict(seed_rate=12), "seed_rate"),
        (4, dict(seed_sigmas=-1.0), "seed_sigmas"),
        (4, dict(rows_per_call=24), "rows_per_call"),  # not a power of two
        (4, dict(rows_per_call=8), "rows_per_call"),  # fewer than block_q
        (4, dict(resident_heads=-1), "resident_heads"),
        (4, dict(block_k=32, chunk=32, min_steps=1, capacity=96), "capacity"),  # not 2**n
        (100, dict(block_k=32, chunk=32, capacity=256), "capacity"),  # < k + 8 * 32
    ]:
        bs = phk.BlockSizes(**kw)
        with pytest.raises(ValueError, match=match):
            phk.hytopk(q, k, w, k=topk, causal=True, interpret=True, block_sizes=bs)
    with pytest.raises(ValueError, match="T <= S"):
        phk.hytopk(q[:, :16], k[:, :8], w[:, :16], k=4, causal=True, interpret=True)


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel: GPU only")
class TestCompiledGPU:
    """The compiled kernel at production-like shapes (default BlockSizes unless named)."""

    @pytest.mark.parametrize(
        "T,S,HI,DI,topk,causal,dtype",
        [
            (2048, 2048, 32, 128, 2048, True, jnp.bfloat16),
            (1000, 3001, 32, 128, 512, True, jnp.bfloat16),
            (777, 1500, 64, 64, 100, False, jnp.float16),
            (512, 4096, 8, 128, 1, True, jnp.float32),
            (300, 20000, 16, 64, 2048, False, jnp.bfloat16),
            (1024, 4096, 64, 128, 2048, True, jnp.bfloat16),  # half the tiles per key block
        ],
    )
    @pytest.mark.parametrize("seed_rate", [16, 0])
    def test_exact_vs_reference(self, T, S, HI, DI, topk, causal, dtype, seed_rate):
        q, k, w = int_inputs(T + S + seed_rate, 1, T, S, HI, DI, dtype)
        bs = phk.BlockSizes(seed_rate=seed_rate)
        got = pallas(q, k, w, topk, causal, bs=bs)
        want = hs.topk_reference(q, k, w, k=topk, causal=causal)
        np.testing.assert_array_equal(got, np.asarray(want))

    @pytest.mark.parametrize("seed_rate", [16, 0])
    def test_index_order_vs_reference(self, seed_rate):
        """order="index" at the production tiles: batch 0 plain, batch 1 with NaN keys 100-199
        and a NaN query row. Unseeded (seed_rate=0), batch 1's rows that see fewer than k real
        keys hold placeholders before real keys, and the epilogue sorts."""
        T = S = 4096
        q, k, w = (np.array(x, np.float32) for x in int_inputs(8, 2, T, S, 32, 128, jnp.float32))
        k[1, 100:200] = np.nan
        q[1, 3000, 5, 0] = np.nan
        args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, w))
        got = pallas(*args, 2048, True, bs=phk.BlockSizes(seed_rate=seed_rate), order="index")
        want = hs.topk_reference(*args, k=2048, order="index")
        np.testing.assert_array_equal(got, np.asarray(want))

    def test_all_equal_nan_and_failed_seeds_at_scale(self):
        """All-equal scores (batch 0), NaN keys and a NaN query row (batch 1), and batch 2 with
        its sampled keys far above the rest and no margin (seed_sigmas=0), so its seeds fail
        and its programs re-run unseeded."""
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
        for bs in (phk.BlockSizes(), phk.BlockSizes(seed_sigmas=0.0)):
            got = pallas(*args, 2048, True, bs=bs)
            np.testing.assert_array_equal(got, np.asarray(hs.topk_reference(*args, k=2048)))
            assert (got[1, 3000] == -1).all()

    @pytest.mark.parametrize(
        "T,S,topk,causal",
        [(1000, 3001, 512, True), (1500, 1500, 2048, True), (777, 1500, 100, False)],
    )
    def test_query_chunks_exact_vs_reference(self, T, S, topk, causal):
        q, k, w = int_inputs(T + S + 3, 1, T, S, 32, 128, jnp.bfloat16)
        got = pallas(q, k, w, topk, causal, bs=phk.BlockSizes(rows_per_call=256))
        want = hs.topk_reference(q, k, w, k=topk, causal=causal)
        np.testing.assert_array_equal(got, np.asarray(want))

    def test_deterministic_and_matches_xla(self):
        q, k, w = int_inputs(9, 1, 4096, 4096, 32, 128, jnp.bfloat16)
        a = pallas(q, k, w, 2048, True, bs=phk.BlockSizes())
        np.testing.assert_array_equal(a, pallas(q, k, w, 2048, True, bs=phk.BlockSizes()))
        np.testing.assert_array_equal(a, np.asarray(hs.hytopk(q, k, w, k=2048, impl="xla")))

    def test_random_floats_up_to_near_ties(self):
        rng = np.random.default_rng(11)
        T = S = 4096
        q = jnp.asarray(rng.normal(size=(1, T, 32, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.normal(size=(1, S, 128)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(size=(1, T, 32)), jnp.bfloat16)
        got = pallas(q, k, w, 2048, True, bs=phk.BlockSizes())
        want = np.asarray(hs.topk_reference(q, k, w, k=2048, causal=True))
        _assert_same_up_to_near_ties(q, k, w, got, want)


# --- helpers -------------------------------------------------------------------------------


def _assert_same_up_to_near_ties(q, k, w, got, want, rtol=1e-5):
    """Both selections hold the same number of keys per row, and their scores (f64 from the
    same inputs), sorted, agree to rtol: any difference is a near-tie swap."""
    scores, _ = indexer_score_table(q, k, w, causal=True)
    scores = np.asarray(scores, np.float64)
    assert ((got >= 0) == (want >= 0)).all()
    sa = np.where(got >= 0, np.take_along_axis(scores, np.maximum(got, 0), axis=-1), 0.0)
    sb = np.where(want >= 0, np.take_along_axis(scores, np.maximum(want, 0), axis=-1), 0.0)
    np.testing.assert_allclose(np.sort(sa, -1), np.sort(sb, -1), rtol=rtol, atol=1e-5)
    assert np.mean(got == want) > 0.98
