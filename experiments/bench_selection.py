"""Benchmark of HyTopK selection (issue 3): fused Pallas kernel vs streaming xla vs the
materialized reference.

    PYTHONPATH=. python3 experiments/bench_selection.py [--quick] [--sizes 8192,32768]

Shape (the production DSA indexer): B=1, HI=32, DI=128, k=2048, causal, bf16, T = S in
{8K, 16K, 32K, 64K, 128K, 256K} (--quick: {8K, 32K}). Columns:
  reference       hs.topk_reference: [T, S] f32 table + lax.top_k (where it fits in memory)
  xla             hs.hytopk(impl="xla"), the portable streaming version (up to --xla-max)
  pallas          hs.hytopk(impl="pallas"): fused kernel + the epilogue that orders the <= k
                  survivors, in query chunks of BlockSizes.rows_per_call (65536) rows
  pallas_kernel   the fused kernel alone, one call over all query rows
                  (pallas_kernels.hytopk.hytopk_candidates): up to 64K the epilogue's share of
                  `pallas`; past that `pallas` runs several chunks, so the difference also
                  holds the chunking
FLOPs (SPEC section 5): selection 2 * HI * DI * P, P = T * (2S - T + 1) / 2 visible pairs.
Speedups are time ratios to the reference measured in the same run.

Before any timing, every impl is checked index for index on small-integer inputs of the timed
shape (exact scores, so every correct implementation agrees; heavy ties exercise the tie rule):
against the full reference where it fits, and always against an exact per-row reference on a
sample of rows (first, last and random rows scored against all keys). Timed inputs are
normal-distributed; two input sets alternate when q is smaller than 2x L2 (50 MiB).
Memory: argument + output + temp bytes of the compiled program (XLA memory analysis), and the
process peak from device memory stats. Results: experiments/results/bench_selection.{json,png}.
`--merge A.json B.json ...` combines runs that each cover some sizes (no timing).

Variant mode (kernel tuning and time attribution, experiments/hytopk_notes.md):

    PYTHONPATH=. python3 experiments/bench_selection.py --sizes 32768,8192 \
        --variants default,score_only,phased,'mine=schedule:phased/capacity:8192'

times the Pallas kernel under several BlockSizes instead of the impl columns. A variant is a
preset name (VARIANTS below) or NAME=field:value/field:value (BlockSizes fields). Exact variants
(diagnostic "", "stats" or "clocks") run the full selection (kernel + its epilogue), verified
index for index against topk_reference on integer inputs of the timed shape, then timed; their
kernel-only time is that minus the epilogue (each epilogue timed alone once per size: rows
`sort...` for the XLA sort, `epilogue:...` for the Pallas one). Diagnostic variants
(score_only, append_only, append_nested) time the kernel alone and are not verified (they
compute no selection). "stats" variants also record the kernel's work counters (STAT_FIELDS,
mean and max over rows) on the timed inputs; "clocks" variants record each phase's share of
the programs' SM cycles (phk.CLOCK_FIELDS; `clock_shares`). Counters and clocks come from one
kernel call over all query rows: the timed kernel itself up to rows_per_call rows, not past it.
Output: bench_selection_variants.json, written after every record, and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import hyscale_jax as hs
from hyscale_jax.reference import indexer_score_table
from pallas_kernels import hytopk as phk
from pallas_kernels.order_keys import INVALID_KEY, order_key

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ALL_SIZES = (8192, 16384, 32768, 65536, 131072, 262144)
QUICK_SIZES = (8192, 32768)
# The benchmark's columns: the materialized reference, the portable path, the full Pallas
# selection (kernel + epilogue) and the fused kernel alone.
IMPLS = ("reference", "xla", "pallas", "pallas_kernel")
L2_BYTES = 50 * 2**20


def log(*args):
    print(*args, flush=True)


def pairs(T, S, causal=True):
    return T * (2 * S - T + 1) // 2 if causal else T * S


def selection_flops(T, S, HI, DI, causal=True):
    return 2 * HI * DI * pairs(T, S, causal)


def normal_inputs(seed, B, T, S, HI, DI, dtype):
    key = jax.random.PRNGKey(seed)
    kq, kk, kw = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (B, T, HI, DI), dtype),
        jax.random.normal(kk, (B, S, DI), dtype),
        jax.random.normal(kw, (B, T, HI), dtype),
    )


def int_inputs(seed, B, T, S, HI, DI, dtype):
    """Small integers: exact scores, heavy ties."""
    key = jax.random.PRNGKey(seed)
    kq, kk, kw = jax.random.split(key, 3)
    return (
        jax.random.randint(kq, (B, T, HI, DI), -2, 3).astype(dtype),
        jax.random.randint(kk, (B, S, DI), -2, 3).astype(dtype),
        jax.random.randint(kw, (B, T, HI), -1, 3).astype(dtype),
    )


INTERPRET = False  # --interpret: CPU smoke runs of the kernel in Pallas interpret mode


def impl_fn(name, k):
    if name == "reference":
        return jax.jit(lambda q, kk, w: hs.topk_reference(q, kk, w, k=k, causal=True))
    if name == "xla":
        return jax.jit(lambda q, kk, w: hs.hytopk(q, kk, w, k=k, causal=True, impl="xla"))
    if name == "pallas":
        impl = "interpret" if INTERPRET else "pallas"
        return jax.jit(lambda q, kk, w: hs.hytopk(q, kk, w, k=k, causal=True, impl=impl))
    if name == "pallas_kernel":
        return jax.jit(
            lambda q, kk, w: phk.hytopk_candidates(q, kk, w, k=k, causal=True, interpret=INTERPRET)
        )
    raise ValueError(name)


# Presets for --variants (BlockSizes keyword arguments); see experiments/hytopk_notes.md.
# Every preset names its schedule, warps and sampling explicitly, so a name means the same
# kernel after BlockSizes' defaults move (they did: fused/4 warps until 2026-12, phased/8 warps
# since; plain bisection until 2026-12-03, sample=32 since; per-chunk count reductions and
# always-ranked ties until the second 2026-12-03 session). The presets up to "sample32" were
# measured with sample=0 (the records in results/hytopk_*), so _W4/_W8 pin it; _SAMPLED pins
# the sample=32 default of acd98f5 that results/hytopk_sample/ and results/hytopk_clocks/ ran.
_SAMPLED = dict(lazy_reduce=False, tie_free_rewrite=False)
_W4, _W8 = dict(_SAMPLED, num_warps=4, sample=0), dict(_SAMPLED, num_warps=8, sample=0)
_LAZY = dict(
    schedule="phased", num_warps=8, sample=32, lazy_reduce=True, tie_free_rewrite=True, block_k=128
)
VARIANTS = {
    "default": {},
    "score_only": dict(diagnostic="score_only", **_W4),
    "append_only": dict(diagnostic="append_only", **_W4),
    "append_nested": dict(diagnostic="append_nested", **_W4),
    "fused": dict(schedule="fused", **_W4),
    "stats": dict(schedule="fused", diagnostic="stats", **_W4),
    "phased": dict(schedule="phased", **_W4),
    "phased_stats": dict(schedule="phased", diagnostic="stats", **_W4),
    "phased_ns1": dict(schedule="phased", num_stages=1, **_W4),
    "phased_c8k": dict(schedule="phased", capacity=8192, **_W4),
    "phased_c8k_stats": dict(schedule="phased", capacity=8192, diagnostic="stats", **_W4),
    "phased_bk256_c8k": dict(schedule="phased", block_k=256, capacity=8192, **_W4),
    "phased_w8": dict(schedule="phased", **_W8),
    "fused_bk256": dict(schedule="fused", block_k=256, **_W4),
    "phased_w8_ns1": dict(schedule="phased", num_stages=1, **_W8),
    "phased_w8_ch512": dict(schedule="phased", chunk=512, **_W8),
    "phased_w8_ch512_ns1": dict(schedule="phased", chunk=512, num_stages=1, **_W8),
    "phased_w8_ms8": dict(schedule="phased", min_steps=8, **_W8),
    "phased_w8_stats": dict(schedule="phased", diagnostic="stats", **_W8),
    "phased_w8_p3": dict(schedule="phased", pivots=3, **_W8),
    "phased_w8_p7": dict(schedule="phased", pivots=7, **_W8),
    "phased_w8_p7_stats": dict(schedule="phased", pivots=7, diagnostic="stats", **_W8),
    "score_only_w8": dict(diagnostic="score_only", **_W8),
    "append_only_w8": dict(diagnostic="append_only", **_W8),
    # Compaction seeded by sampled pivots (BlockSizes.sample).
    "sample32": dict(_W8, schedule="phased", sample=32),
    "sample64": dict(_W8, schedule="phased", sample=64),
    "sample32_stats": dict(_W8, schedule="phased", sample=32, diagnostic="stats"),
    "sample64_c8k": dict(_W8, schedule="phased", sample=64, capacity=8192),
    "no_sample": dict(_W8, schedule="phased"),  # the default before 2026-12-03
    # Per-phase SM cycles (diagnostic "clocks") of the acd98f5 default and variants of it
    # (results/hytopk_clocks/).
    "sampled": dict(_SAMPLED),
    "clocks": dict(_SAMPLED, diagnostic="clocks"),
    "clocks_no_sample": dict(_SAMPLED, diagnostic="clocks", sample=0),
    "lazy": dict(_SAMPLED, lazy_reduce=True),
    "lazy_clocks": dict(_SAMPLED, lazy_reduce=True, diagnostic="clocks"),
    "c8k": dict(_SAMPLED, capacity=8192),
    "c8k_clocks": dict(_SAMPLED, capacity=8192, diagnostic="clocks"),
    # The default since (lazy_reduce + tie_free_rewrite) and probes around it.
    "lazy_tiefree": dict(lazy_reduce=True, tie_free_rewrite=True),
    "lazy_tiefree_clocks": dict(lazy_reduce=True, tie_free_rewrite=True, diagnostic="clocks"),
    "lazy_ranked": dict(lazy_reduce=True, tie_free_rewrite=False),
    "lazy_tiefree_p3": dict(lazy_reduce=True, tie_free_rewrite=True, pivots=3),
    "lazy_tiefree_ch128": dict(lazy_reduce=True, tie_free_rewrite=True, chunk=128),
    # The Pallas bitonic epilogue (BlockSizes.order) and scoring tiles around the e14ecb3
    # kernel (_LAZY pins it).
    "order_pallas": dict(_LAZY, order="pallas", order_rows=1, order_warps=4),
    "order_pallas_r2w8": dict(_LAZY, order="pallas", order_rows=2, order_warps=8),
    "xla_order": dict(_LAZY, order="xla"),
    "bk256": dict(_LAZY, block_k=256),
    "bq32": dict(_LAZY, block_q=32),
    "ns3": dict(_LAZY, num_stages=3),
    "score_only_bk256": dict(_LAZY, diagnostic="score_only", block_k=256),
    # Around block_k=256 (the default since this record: results/hytopk_bk256/).
    "bk128": dict(_LAZY, block_k=128),
    "bk256_order_pallas": dict(_LAZY, block_k=256, order="pallas", order_rows=1, order_warps=4),
    "bk256_clocks": dict(_LAZY, block_k=256, diagnostic="clocks"),
    "bk256_w4": dict(_LAZY, block_k=256, num_warps=4),
    "bk512": dict(_LAZY, block_k=512),
    "bk512_c8k": dict(_LAZY, block_k=512, capacity=8192),
    "score_only_bk512": dict(_LAZY, diagnostic="score_only", block_k=512),
    # block_k=512 without the K-block prefetch (the 2-stage pipeline exceeds shared memory),
    # and fewer in-stream compactions at block_k=256 (results/hytopk_ms8/).
    "bk512_ns1": dict(_LAZY, block_k=512, num_stages=1),
    "score_only_bk512_ns1": dict(_LAZY, diagnostic="score_only", block_k=512, num_stages=1),
    "bk256_c8k": dict(_LAZY, block_k=256, capacity=8192),
    "bk256_ms8": dict(_LAZY, block_k=256, min_steps=8, capacity=8192),
    "bk256_ms8_c4k": dict(_LAZY, block_k=256, min_steps=8),  # every compaction to exactly k
    "bk256_ms8_order_pallas": dict(
        _LAZY, block_k=256, min_steps=8, capacity=8192, order="pallas", order_rows=1, order_warps=4
    ),
    "bk256_c8k_ms16": dict(_LAZY, block_k=256, min_steps=16, capacity=8192),
    "bk256_c16k_ms8": dict(_LAZY, block_k=256, min_steps=8, capacity=16384),
    "bk256_c16k_ms16": dict(_LAZY, block_k=256, min_steps=16, capacity=16384),
    "bk256_ms2": dict(_LAZY, block_k=256, min_steps=2),  # block_k=128's target and trigger
}
# The fields every preset above was measured with unless it names them: until 2026-12-03's
# sixth session the defaults were block_k=128 (256 from ccbcc21, which the presets since
# name), min_steps=4, capacity next_pow2(k + min_room) (4096 at k=2048, the only k those
# records ran), the XLA sort, and one kernel call for all query rows.
_BEFORE_C8K = dict(
    block_k=128,
    min_steps=4,
    capacity=4096,
    order="xla",
    rows_per_call=1 << 30,
    sort_width=None,
    interpolate=0,
    lazy_run_max=False,
    stream_aims=(0.75, 0.25),
    bulk_first_run=False,
)
VARIANTS = {
    name: kw if name == "default" else {**_BEFORE_C8K, **kw} for name, kw in VARIANTS.items()
}
# Around the default since then (results/hytopk_c8k/), which _C8K pins: capacity 8192 at
# k=2048, min_steps 8, the Pallas epilogue, 65536 query rows per kernel call, and the ninth
# session's options at the values every earlier record ran with (they stayed the defaults):
# a row max of every key block in the runs, mid-stream pivots aimed at 3/4 and 1/4 of
# [k, target]. (The interpolated pivots' exact span, also from the ninth session, is not an
# option: presets with interpolate > 0 run it since.) And the first run masked and
# cumsum-compacted like every other run, as before the tenth session's bulk first run.
_C8K = dict(
    _LAZY,
    block_k=256,
    min_steps=8,
    capacity=None,
    order="pallas",
    order_rows=1,
    order_warps=4,
    rows_per_call=65536,
    sort_width=None,
    interpolate=0,
    lazy_run_max=False,
    stream_aims=(0.75, 0.25),
    bulk_first_run=False,
)
# The tenth session's default: interp8 with the bulk first run.
_BULK = dict(_C8K, order="xla_stable", interpolate=8, bulk_first_run=True)
VARIANTS.update(
    {
        "xla_sort": dict(_C8K, order="xla"),
        "one_call": dict(_C8K, rows_per_call=1 << 30),  # all query rows in one kernel call
        "rows32k": dict(_C8K, rows_per_call=32768),
        "stats_c8k": dict(_C8K, diagnostic="stats"),
        "clocks_c8k": dict(_C8K, diagnostic="clocks"),
        # The stable one-key XLA sort (the default since the seventh session), and wider final
        # buffers: the final compaction stops at sort_width entries per row (none at all at 8192,
        # the capacity) and the epilogue orders them all.
        "stable": dict(_C8K, order="xla_stable"),
        "stable_w4k": dict(_C8K, order="xla_stable", sort_width=4096),
        "stable_w8k": dict(_C8K, order="xla_stable", sort_width=8192),
        "xla_sort_w4k": dict(_C8K, order="xla", sort_width=4096),
        "pallas_w4k": dict(_C8K, sort_width=4096),
        "clocks_stable_w4k": dict(_C8K, order="xla_stable", sort_width=4096, diagnostic="clocks"),
        # Eighth session: final buffers a little wider than k. The final compaction can stop as
        # soon as a pivot leaves between k and sort_width entries (the sample aims inside that
        # window), instead of bisecting down to the exact k-th key; the sort gets the slack.
        "stable_w2176": dict(_C8K, order="xla_stable", sort_width=2176),
        "stable_w2304": dict(_C8K, order="xla_stable", sort_width=2304),
        "stable_w2560": dict(_C8K, order="xla_stable", sort_width=2560),
        "stable_w3072": dict(_C8K, order="xla_stable", sort_width=3072),
        "clocks_stable_w2304": dict(_C8K, order="xla_stable", sort_width=2304, diagnostic="clocks"),
        # Count passes with interpolated pivots (BlockSizes.interpolate) after the sampled first.
        "interp4": dict(_C8K, order="xla_stable", interpolate=4),
        "interp8": dict(_C8K, order="xla_stable", interpolate=8),
        "interp8_w2176": dict(_C8K, order="xla_stable", interpolate=8, sort_width=2176),
        "clocks_interp8": dict(_C8K, order="xla_stable", interpolate=8, diagnostic="clocks"),
        "stats_interp8": dict(_C8K, order="xla_stable", interpolate=8, diagnostic="stats"),
        "stats_stable": dict(_C8K, order="xla_stable", diagnostic="stats"),
        # Ninth session, from interp8 (the eighth session's default): the runs' largest key as
        # per-lane maxima, and mid-stream compactions aimed lower in [k, target].
        "lazy_max": dict(_C8K, order="xla_stable", interpolate=8, lazy_run_max=True),
        "aims_low": dict(_C8K, order="xla_stable", interpolate=8, stream_aims=(0.5, 0.125)),
        "aims_lower": dict(_C8K, order="xla_stable", interpolate=8, stream_aims=(0.25, 0.0625)),
        "lazy_aims_low": dict(
            _C8K, order="xla_stable", interpolate=8, lazy_run_max=True, stream_aims=(0.5, 0.125)
        ),
        "lazy_aims_lower": dict(
            _C8K, order="xla_stable", interpolate=8, lazy_run_max=True, stream_aims=(0.25, 0.0625)
        ),
        "clocks_lazy_aims_low": dict(
            _C8K,
            order="xla_stable",
            interpolate=8,
            lazy_run_max=True,
            stream_aims=(0.5, 0.125),
            diagnostic="clocks",
        ),
        "stats_lazy_aims_low": dict(
            _C8K,
            order="xla_stable",
            interpolate=8,
            lazy_run_max=True,
            stream_aims=(0.5, 0.125),
            diagnostic="stats",
        ),
        # Tenth session, from interp8 (the ninth session's default): the first run stores whole
        # key blocks (BlockSizes.bulk_first_run), with the runs' largest key per lane or not, and
        # with twice the capacity, which makes the cheap first run twice as long.
        "bulk": dict(_BULK),
        "bulk_lazy_max": dict(_BULK, lazy_run_max=True),
        "bulk_c16k": dict(_BULK, capacity=16384),
        "clocks_bulk": dict(_BULK, diagnostic="clocks"),
        "stats_bulk": dict(_BULK, diagnostic="stats"),
        "clocks_bulk_c16k": dict(_BULK, capacity=16384, diagnostic="clocks"),
        # 16384 slots with mid-stream pivots aimed at the counts (0.75, 0.25) give at 8192 slots
        # (3584 and 2560 entries): the bulk run twice as long, later compactions as small.
        "bulk_c16k_low": dict(_BULK, capacity=16384, stream_aims=(0.25, 0.083)),
        "clocks_bulk_c16k_low": dict(
            _BULK, capacity=16384, stream_aims=(0.25, 0.083), diagnostic="clocks"
        ),
    }
)


_BOOL_FIELDS = {f.name for f in dataclasses.fields(phk.BlockSizes) if f.type == "bool"}
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(phk.BlockSizes) if f.type == "float"}


def parse_variant(spec):
    """'preset' or 'NAME=field:value/field:value' -> (name, phk.BlockSizes)."""
    if "=" not in spec:
        if spec not in VARIANTS:
            raise ValueError(f"unknown variant {spec!r}; presets: {sorted(VARIANTS)}")
        return spec, phk.BlockSizes(**VARIANTS[spec])
    name, fields = spec.split("=", 1)
    kw = {}
    for item in filter(None, fields.split("/")):
        key, val = item.split(":", 1)
        kw[key] = (
            val
            if key in ("schedule", "diagnostic", "order")
            else val.lower() in ("1", "true")
            if key in _BOOL_FIELDS
            else float(val)
            if key in _FLOAT_FIELDS
            else int(val)
        )
    return name, phk.BlockSizes(**kw)


def epilogue_name(bs, k):
    """The record name of the epilogue a BlockSizes uses ("sort": the XLA sort, "sort_stable":
    the stable one-key XLA sort, "sort_position": the (key, int16 position) XLA sort), the
    buffer capacity and the sort width (entries per row) it reads; "epilogue:" keeps it apart
    from the variant names."""
    cap, width = bs.resolve_capacity(k), bs.resolve_sort_width(k)
    wide = "" if width == k else f":w{width}"
    if bs.order.startswith("xla"):
        name = {"xla": "sort", "xla_stable": "sort_stable", "xla_position": "sort_position"}[
            bs.order
        ]
        return name + ("" if cap == phk.BlockSizes().resolve_capacity(k) else f":cap{cap}") + wide
    return f"epilogue:pallas_r{bs.order_rows}w{bs.order_warps}:cap{cap}" + wide


def lowers_to_cub(fn, args):
    """Whether XLA compiled `fn` with CUB's radix sort (its sort rewriter's custom call)."""
    return "__cub$DeviceRadixSort" in jax.jit(fn).lower(*args).compile().as_text()


def run_variants(args, sizes, k, HI, DI, dtype, reps):
    """--variants mode: one row per (size, variant); see the module docstring."""
    B = 1
    variants = [parse_variant(v) for v in args.variants.split(",")]
    device = str(jax.devices()[0].device_kind)
    meta = dict(
        jax=jax.__version__,
        device=device,
        backend=jax.default_backend(),
        python=sys.version.split()[0],
        host=platform.node(),
        reps=reps,
        flop_formula="2*HI*DI*P, P = T*(2S-T+1)/2",
        argv=sys.argv[1:],
        variants={n: str(bs) for n, bs in variants},
    )
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "bench_selection_variants.json")
    records = []

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)

    for T in sizes:
        S = T
        flops = selection_flops(T, S, HI, DI)
        n_sets = 2 if B * T * HI * DI * 2 < 2 * L2_BYTES else 1
        input_sets = [normal_inputs(10 + i, B, T, S, HI, DI, dtype) for i in range(n_sets)]
        exact_args = int_inputs(1, B, T, S, HI, DI, dtype)
        base = dict(T=T, S=S, B=B, HI=HI, DI=DI, k=k, dtype="bfloat16", causal=True, flops=flops)
        full_ref, ref_ms = None, None
        if T > args.ref_max:  # XLA aborts the process (not an exception) at 2**31 entries
            log(f"  T={T:>6} reference not run (T > --ref-max={args.ref_max}): sampled rows only")
        else:
            try:
                ref_fn = impl_fn("reference", k)
                full_ref = np.asarray(ref_fn(*exact_args))
                ref_ms = median_ms(ref_fn, input_sets, max(3, reps // 2))
                records.append(
                    dict(
                        base,
                        variant="reference",
                        median_ms=ref_ms,
                        status="ok",
                        tflops=flops / ref_ms / 1e9,
                    )
                )
                log(f"  T={T:>6} {'reference':<18} {ref_ms:8.2f} ms")
            except Exception as e:  # noqa: BLE001  (out of memory: sampled-row checks only)
                ref_ms = None
                log(f"  T={T:>6} reference cannot run ({type(e).__name__}): sampled rows only")
        # Each epilogue the exact variants use, timed alone on fake candidate buffers of the
        # variant's capacity and sort width (epilogue_name).
        T_pad = -(-T // 16) * 16
        sort_ms = {}
        for _, bs in [("default", phk.BlockSizes())] + variants:
            name = epilogue_name(bs, k)
            if name in sort_ms:
                continue
            cap = bs.resolve_capacity(k)
            kk = jax.random.randint(
                jax.random.PRNGKey(0), (B, T_pad, cap), -(2**31), 2**31 - 1, jnp.int32
            )
            ii = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (B, T_pad, cap))
            cc = jnp.full((B, T_pad), bs.resolve_sort_width(k), jnp.int32)
            sort_fn = jax.jit(
                lambda a, b, c, bs=bs: phk.order_survivors(
                    a, b, c, T=T, k=k, block_sizes=bs, interpret=INTERPRET
                )
            )
            try:
                sort_ms[name] = median_ms(sort_fn, [(kk, ii, cc)], reps)
                cub = lowers_to_cub(sort_fn, (kk, ii, cc))
                records.append(
                    dict(
                        base,
                        variant=name,
                        kind="epilogue",
                        cub_radix_sort=cub,
                        median_ms=sort_ms[name],
                        status="ok",
                    )
                )
                log(
                    f"  T={T:>6} {name + ' (epilogue)':<18} {sort_ms[name]:8.2f} ms"
                    f"{'  (CUB radix sort)' if cub else ''}"
                )
            except Exception as e:  # noqa: BLE001  (its variants then get no kernel_ms)
                sort_ms[name] = None
                records.append(
                    dict(
                        base,
                        variant=name,
                        kind="epilogue",
                        status=f"failed: {type(e).__name__}: {str(e)[:400]}",
                    )
                )
                log(f"  T={T:>6} {name + ' (epilogue)':<18} failed: {type(e).__name__}")
            del kk, ii, cc
        rng = np.random.default_rng(0)
        for name, bs in variants:
            rec = dict(base, variant=name, block_sizes=str(bs))
            t0 = time.perf_counter()
            exact = not bs.diagnostic or bs.diagnostic in phk.COUNTER_FIELDS
            try:
                if exact:
                    fn = jax.jit(
                        lambda q, kk, w, bs=bs: phk.hytopk(
                            q, kk, w, k=k, causal=True, interpret=INTERPRET, block_sizes=bs
                        )
                    )
                    rec["verified"] = verify(name, fn, T, S, HI, DI, k, dtype, full_ref, rng)
                    ms = median_ms(fn, input_sets, reps)
                    epi_ms = sort_ms[epilogue_name(bs, k)]
                    rec.update(median_ms=ms, kernel_ms=None if epi_ms is None else ms - epi_ms)
                else:
                    fn = jax.jit(
                        lambda q, kk, w, bs=bs: phk.hytopk_candidates(
                            q, kk, w, k=k, causal=True, interpret=INTERPRET, block_sizes=bs
                        )[2]
                    )
                    rec["verified"] = "diagnostic (no selection)"
                    ms = median_ms(fn, input_sets, reps)
                    rec.update(median_ms=ms, kernel_ms=ms)
                rec.update(tflops=flops / (rec["kernel_ms"] or ms) / 1e9, status="ok")
                if ref_ms is not None and exact:
                    rec["speedup_vs_reference"] = ref_ms / ms
                if bs.diagnostic == "stats":
                    st = np.asarray(
                        phk.hytopk_candidates(
                            *input_sets[0], k=k, causal=True, interpret=INTERPRET, block_sizes=bs
                        )[3]
                    )[:, :T].reshape(-1, len(phk.STAT_FIELDS))
                    rec["stats_mean"] = {
                        f: float(st[:, i].mean()) for i, f in enumerate(phk.STAT_FIELDS)
                    }
                    rec["stats_max"] = {
                        f: int(st[:, i].max()) for i, f in enumerate(phk.STAT_FIELDS)
                    }
                if bs.diagnostic == "clocks":
                    rec["clocks"] = clock_shares(
                        np.asarray(
                            phk.hytopk_candidates(
                                *input_sets[0],
                                k=k,
                                causal=True,
                                interpret=INTERPRET,
                                block_sizes=bs,
                            )[3]
                        )[:, :T],
                        bs.block_q,
                        rec["kernel_ms"] or ms,
                    )
                sp = rec.get("speedup_vs_reference", float("nan"))
                km = rec["kernel_ms"] if rec["kernel_ms"] is not None else float("nan")
                log(
                    f"  T={T:>6} {name:<18} {ms:8.2f} ms (kernel {km:7.2f} ms, "
                    f"{rec['tflops']:5.1f} TFLOP/s)  x{sp:5.2f} vs ref  "
                    f"[{rec['verified']}; {time.perf_counter() - t0:.0f} s]"
                )
                if "clocks" in rec:
                    c = rec["clocks"]
                    log(
                        "      clocks "
                        + " ".join(f"{f}={c['share'][f]:.1%}" for f in c["share"])
                        + "  (share of the programs' summed cycles; ms = share x kernel ms: "
                        + " ".join(f"{f}={v:.1f}" for f, v in c["ms"].items())
                        + ")"
                    )
                if "stats_mean" in rec:
                    log(
                        "      stats mean "
                        + " ".join(f"{f}={v:.1f}" for f, v in rec["stats_mean"].items())
                    )
                    log(
                        "      stats max  "
                        + " ".join(f"{f}={v}" for f, v in rec["stats_max"].items())
                    )
            except AssertionError as e:
                rec["status"] = f"WRONG: {e}"
                log(f"  T={T:>6} {name:<18} WRONG: {e}")
            except Exception as e:  # noqa: BLE001  (compile failure, OOM: record, go on)
                rec["status"] = f"failed: {type(e).__name__}: {str(e)[:400]}"
                log(f"  T={T:>6} {name:<18} failed: {type(e).__name__}: {str(e)[:400]}")
            records.append(rec)
            save()
        del input_sets, exact_args, full_ref
    save()
    log(f"wrote {path}")
    variants_table(records)


def clock_shares(clk, block_q, kernel_ms):
    """Diagnostic "clocks" output [B, T, 8] (CLOCK_FIELDS, one value per program repeated on
    its rows) -> each phase's share of the summed program cycles, and that share of the kernel
    time. Shares are of the time programs were resident, summed over programs, so phases that
    overlap across co-resident programs are each counted in full."""
    per_prog = clk[:, ::block_q].reshape(-1, clk.shape[-1]).astype(np.int64)
    f = {name: per_prog[:, i] for i, name in enumerate(phk.CLOCK_FIELDS)}
    total = f["total"].sum()
    parts = dict(
        runs=f["runs"],
        compact_count=f["compact_count"],
        compact_rewrite=f["compact"] - f["compact_count"],
        final_count=f["final_count"],
        final_rewrite=f["final"] - f["final_count"],
    )
    parts["other"] = f["total"] - sum(parts.values())
    share = {n: float(v.sum() / total) for n, v in parts.items()}
    return dict(
        share=share,
        ms={n: v * kernel_ms for n, v in share.items()},
        mean_cycles_total=float(f["total"].mean()),
        mean_outer_iters=float(f["outer_iters"].mean()),
    )


def variants_table(records):
    log(
        f"{'T':>6} {'variant':<18} {'full ms':>9} {'kernel ms':>10} {'TFLOP/s':>8} "
        f"{'x ref':>6}  status"
    )
    for r in records:
        if r.get("status") != "ok":
            log(
                f"{r['T']:>6} {r['variant']:<18} {'':>9} {'':>10} {'':>8} {'':>6}  "
                f"{r['status'][:60]}"
            )
            continue
        km = r.get("kernel_ms")
        log(
            f"{r['T']:>6} {r['variant']:<18} {r['median_ms']:9.2f} "
            f"{km if km is not None else float('nan'):10.2f} {r.get('tflops', 0):8.1f} "
            f"{r.get('speedup_vs_reference', float('nan')):6.2f}  {r.get('verified', '')[:40]}"
        )


def rows_reference(q, kk, w, rows, k):
    """Exact selection for the query rows `rows` only ([B, len(rows), k]), causal end-aligned."""
    T, S = q.shape[1], kk.shape[1]
    rows = jnp.asarray(rows)
    scores, _ = indexer_score_table(q[:, rows], kk, w[:, rows], causal=False)
    vis = jnp.arange(S)[None, :] <= rows[:, None] + (S - T)
    keys = order_key(scores, vis[None])
    if k > S:
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, k - S)), constant_values=INVALID_KEY)
    top, idx = jax.lax.top_k(keys, k)
    return np.asarray(jnp.where(top == INVALID_KEY, -1, idx))


def verify(name, fn, T, S, HI, DI, k, dtype, full_ref, rng):
    """Index-for-index check on exact (small-integer) inputs; returns a short status string."""
    if name == "pallas_kernel":
        return "via pallas"
    q, kk, w = int_inputs(1, 1, T, S, HI, DI, dtype)
    got = np.asarray(fn(q, kk, w))
    rows = np.unique(np.concatenate([[0, 1, T // 2, T - 1], rng.integers(0, T, 60)]))
    want_rows = rows_reference(q, kk, w, rows, k)
    if not np.array_equal(got[:, rows], want_rows):
        bad = int(np.sum(np.any(got[:, rows] != want_rows, axis=-1)))
        raise AssertionError(f"{name} T={T}: {bad} of {len(rows)} sampled rows differ")
    status = f"{len(rows)} rows exact"
    if full_ref is not None:
        if not np.array_equal(got, full_ref):
            bad = int(np.sum(np.any(got != full_ref, axis=-1)))
            raise AssertionError(f"{name} T={T}: {bad} rows differ from topk_reference")
        status = "all rows == reference"
    return status


def memory_bytes(fn, args):
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (memory analysis is optional on some backends)
        return None


def process_peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def median_ms(fn, input_sets, reps):
    for args in input_sets:  # compile + warm up
        jax.block_until_ready(fn(*args))
    times = []
    for r in range(reps):
        args = input_sets[r % len(input_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = S in {8K, 32K}, fewer repetitions")
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated T = S values")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--ref-max",
        type=int,
        default=32768,
        help="largest T run by topk_reference (its table is 4*T*S bytes)",
    )
    ap.add_argument("--xla-max", type=int, default=32768, help="largest T run by the xla path")
    ap.add_argument("--impls", type=str, default=",".join(IMPLS))
    ap.add_argument("--out-dir", type=str, default=RESULTS)
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="off-GPU smoke test: run the kernel in Pallas interpret mode",
    )
    ap.add_argument(
        "--variants",
        type=str,
        default=None,
        help="kernel BlockSizes variants to time instead of the impl columns: "
        "comma-separated presets (" + ",".join(VARIANTS) + ") or "
        "NAME=field:value/field:value",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no timing: combine the records of earlier runs (bench_selection.json "
        "files, or the 'reference' and 'default' rows of variant files) into "
        "--out-dir/bench_selection.{json,png}; for a size, later files win",
    )
    args = ap.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    if args.merge:
        merge_runs(args.merge, args.out_dir)
        return
    if args.variants:
        sizes = tuple(int(s) for s in (args.sizes or "32768,8192").split(","))
        reps = args.reps or 5
        log(
            f"jax {jax.__version__} on {jax.devices()[0].device_kind}; B=1 HI={args.heads} "
            f"DI={args.dim} k={args.k} causal bf16; sizes {sizes}; reps {reps}; variants"
        )
        if jax.default_backend() != "gpu" and not INTERPRET:
            sys.exit("--variants times the compiled kernel: needs a GPU (or --interpret)")
        run_variants(args, sizes, args.k, args.heads, args.dim, jnp.bfloat16, reps)
        return

    sizes = (
        tuple(int(s) for s in args.sizes.split(","))
        if args.sizes
        else QUICK_SIZES
        if args.quick
        else ALL_SIZES
    )
    reps = args.reps or (5 if args.quick else 10)
    impls = args.impls.split(",")
    B, HI, DI, k, dtype = 1, args.heads, args.dim, args.k, jnp.bfloat16
    backend = jax.default_backend()
    if backend != "gpu" and "pallas" in args.impls and not INTERPRET:
        log(f"backend is {backend}: the compiled Pallas kernel needs a GPU; dropping pallas*")
        impls = [i for i in impls if not i.startswith("pallas")]
    device = str(jax.devices()[0].device_kind)
    log(
        f"jax {jax.__version__} on {device}; B={B} HI={HI} DI={DI} k={k} causal bf16; "
        f"sizes {sizes}; reps {reps}"
    )
    rng = np.random.default_rng(0)
    records = []
    os.makedirs(args.out_dir, exist_ok=True)
    meta = dict(
        jax=jax.__version__,
        device=device,
        backend=backend,
        python=sys.version.split()[0],
        host=platform.node(),
        reps=reps,
        block_sizes=str(phk.BlockSizes()),
        flop_formula="2*HI*DI*P, P = T*(2S-T+1)/2",
        argv=sys.argv[1:],
    )
    path = os.path.join(args.out_dir, "bench_selection.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)

    for T in sizes:
        S = T
        flops = selection_flops(T, S, HI, DI)
        q_bytes = B * T * HI * DI * 2
        n_sets = 2 if q_bytes < 2 * L2_BYTES else 1
        input_sets = [normal_inputs(10 + i, B, T, S, HI, DI, dtype) for i in range(n_sets)]
        full_ref = None
        if "reference" in impls and T <= args.ref_max:
            try:
                full_ref = np.asarray(
                    impl_fn("reference", k)(*int_inputs(1, B, T, S, HI, DI, dtype))
                )
            except Exception as e:  # noqa: BLE001  (out of memory: no full check)
                log(f"  reference T={T}: cannot run ({type(e).__name__})")
        ref_ms = None
        for name in impls:
            rec = dict(
                impl=name,
                T=T,
                S=S,
                B=B,
                HI=HI,
                DI=DI,
                k=k,
                dtype="bfloat16",
                causal=True,
                flops=flops,
            )
            if (name == "reference" and T > args.ref_max) or (name == "xla" and T > args.xla_max):
                rec["status"] = "skipped (size limit)"
                records.append(rec)
                log(f"  T={T:>7} {name:<14} skipped")
                continue
            fn = impl_fn(name, k)
            try:
                t0 = time.perf_counter()
                rec["verified"] = verify(name, fn, T, S, HI, DI, k, dtype, full_ref, rng)
                ms = median_ms(fn, input_sets, reps)
                rec.update(
                    median_ms=ms,
                    tflops=flops / ms / 1e9,
                    mem_bytes=memory_bytes(fn, input_sets[0]),
                    process_peak_bytes=process_peak_bytes(),
                    status="ok",
                )
                if name == "reference":
                    ref_ms = ms
                if ref_ms is not None:
                    rec["speedup_vs_reference"] = ref_ms / ms
                mem = rec["mem_bytes"]
                log(
                    f"  T={T:>7} {name:<14} {ms:9.2f} ms  {rec['tflops']:7.1f} TFLOP/s  "
                    f"x{rec.get('speedup_vs_reference', float('nan')):6.2f} vs ref  "
                    f"mem {mem / 2**30 if mem else float('nan'):7.3f} GiB  "
                    f"[{rec['verified']}; {time.perf_counter() - t0:.0f} s]"
                )
            except AssertionError as e:
                rec["status"] = f"WRONG: {e}"
                log(f"  T={T:>7} {name:<14} WRONG: {e}")
            except Exception as e:  # noqa: BLE001  (OOM or compile failure: record, go on)
                rec["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                log(f"  T={T:>7} {name:<14} failed: {type(e).__name__}: {str(e)[:300]}")
            records.append(rec)
        del input_sets, full_ref
        save()  # after every size, so a sweep cut off by a time limit keeps what it measured

    log(f"wrote {path}")
    table(records)
    plot(records, os.path.join(args.out_dir, "bench_selection.png"))


def _impl_family(impl):
    """Merge unit: the Pallas selection and its kernel-alone timing come from one run."""
    return "pallas" if impl.startswith("pallas") else impl


def merge_runs(paths, out_dir):
    """One record from several runs (each a device call's time limit may cut a sweep short).

    Every record keeps the run it came from (`source`: the file's argv and block sizes); a
    ratio to the reference is only ever one measured in the same run. A variants file
    contributes its "reference" row and its "default" row (the full selection at the then
    default BlockSizes) as the `reference` and `pallas` columns. At each size a later file
    replaces the columns it timed there (`pallas` and `pallas_kernel` together)."""
    by_size = {}
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        meta = run["meta"]
        source = dict(
            file=os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path),
            argv=meta.get("argv"),
            block_sizes=meta.get("block_sizes"),
        )
        runs.append(dict(meta, file=source["file"]))
        recs = []
        for r in run["records"]:
            rec_source = source
            if "impl" not in r:  # a variants file
                if r.get("variant") not in ("reference", "default"):
                    continue
                r = dict(r, impl="pallas" if r["variant"] == "default" else "reference")
                if r["impl"] == "pallas":
                    rec_source = dict(source, block_sizes=r.get("block_sizes"))
                r.pop("kernel_ms", None)  # full minus the separately timed sort: not measured
                if r.get("median_ms"):  # variant rows rate the kernel_ms; columns rate full ms
                    r["tflops"] = r["flops"] / r["median_ms"] / 1e9
            recs.append(dict(r, source=rec_source))
        for T in {r["T"] for r in recs}:
            for family in {_impl_family(r["impl"]) for r in recs if r["T"] == T}:
                got = [r for r in recs if r["T"] == T and _impl_family(r["impl"]) == family]
                # A run replaces a column family at a size only where it timed it there.
                if any(r.get("status") == "ok" for r in got) or (T, family) not in by_size:
                    by_size[T, family] = got
    order = {impl: i for i, impl in enumerate(IMPLS)}
    records = sorted(
        (r for got in by_size.values() for r in got),
        key=lambda r: (r["T"], order.get(r["impl"], len(order))),
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_selection.json")
    with open(path, "w") as f:
        json.dump(dict(meta=dict(merged_from=runs), records=records), f, indent=1)
    log(f"wrote {path}")
    table(records)
    plot(records, os.path.join(out_dir, "bench_selection.png"))


def table(records):
    log(f"{'T':>8} " + " ".join(f"{n:>22}" for n in IMPLS))
    for T in sorted({r["T"] for r in records}):
        cells = []
        for n in IMPLS:
            r = next((r for r in records if r["T"] == T and r["impl"] == n), None)
            if r is None or r.get("status") != "ok":
                cells.append(f"{'-' if r is None else r['status'][:22]:>22}")
            else:
                sp = r.get("speedup_vs_reference")
                cells.append(
                    f"{r['median_ms']:8.2f}ms"
                    + (f" x{sp:6.1f}" if sp else " " * 8)
                    + f" {r['tflops']:4.0f}T"
                )
        log(f"{T:>8} " + " ".join(cells))


def plot(records, path):
    import matplotlib  # noqa: PLC0415  (a dependency; imported here so the GPU needs no display)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name in IMPLS:
        pts = sorted(
            (r["T"], r["median_ms"])
            for r in records
            if r["impl"] == name and r.get("status") == "ok"
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T = S (tokens)")
    ax.set_ylabel("median ms")
    ax.set_title("HyTopK selection, B=1 HI=32 DI=128 k=2048 causal bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
