"""Benchmark of HyTopK selection: the fused Pallas kernel, the portable streaming XLA version and
the materialized reference, over sequence lengths T = S.

    PYTHONPATH=. python experiments/bench_selection.py                  # the H200 sweep
    PYTHONPATH=. python experiments/bench_selection.py --impls reference xla \\
        --seq 256 --index-heads 4 --index-dim 16 --topk 32                # CPU smoke run
    PYTHONPATH=. python experiments/bench_selection.py --dtype bfloat16 float8_e4m3fn \\
        --k-scale --index-heads 32 64                # FP8 beside bf16, GLM-5 and DeepSeek-V3.2

Shape: B=1, causal, the DSA indexer by default (HI=32, DI=128, k=2048; --index-heads 64 is
DeepSeek-V3.2's); q_idx and k_idx in each --dtype (bf16, or float8_e4m3fn: DSA's production
indexer), w in bf16, and with --k-scale a random positive f32 scale per key (hs.hytopk's
k_scale). Every (HI, dtype) pair runs in the same process, so their times compare. Columns:
  reference  hs.topk_reference: the [T, S] f32 table + lax.top_k (up to --ref-max)
  xla        hs.hytopk(impl="xla"), the streaming version without the table (up to --xla-max)
  pallas     hs.hytopk(impl="pallas"): the fused kernel and its epilogue (--interpret: the
             same kernel in Pallas interpret mode, for CPU smoke runs only)
  pallas:FIELD=V,...  the same kernel at other tile sizes, one column per --sizes spec (FIELD=V,...
             of pallas_kernels.hytopk.BlockSizes), timed in the same run as the default
  pallas/index  with --index-order: hs.hytopk(impl="pallas", order="index"), the same keys by
             ascending key index, without the ordering sort (checked against the reference's
             keys in that order)
FLOPs: selection 2 * HI * DI * P, P = T * (2S - T + 1) / 2 visible pairs. Speedups are time
ratios to the reference measured in the same run (and, for FP8, to the same impl in bf16).

Before timing, every impl is checked index for index on small-integer inputs of the timed
shape (exact scores, so every correct implementation agrees; heavy ties exercise the tie
rule; with --k-scale the check's scales are powers of two, so scaled scores stay exact): against
the full reference where it runs, and always against an exact per-row reference on sampled rows
(first, last and random rows scored against all keys). Timed inputs are normal (scales uniform
in [0.5, 2]); two input sets alternate when q is smaller than 2x L2 (50 MiB). Memory: argument +
output + temp bytes of the compiled program (XLA memory analysis). Writes bench_selection.json
(rewritten after every length) and bench_selection.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import block_sizes

import hyscale_jax as hs
from hyscale_jax.reference import indexer_score_table
from pallas_kernels import hytopk as phk
from pallas_kernels.order_keys import INVALID_KEY, in_key_order, order_key

IMPLS = ("reference", "xla", "pallas")
L2_BYTES = 50 * 2**20


def log(*args):
    print(*args, flush=True)


def selection_flops(T, S, HI, DI):
    """2 * HI * DI * P for the P = T * (2S - T + 1) / 2 causally visible (t, s) pairs."""
    return 2 * HI * DI * (T * (2 * S - T + 1) // 2)


def normal_inputs(seed, B, T, S, HI, DI, dtype, scaled):
    """(q_idx, k_idx, w, k_scale): normal q_idx and k_idx rounded to `dtype`, bf16 w, and
    k_scale [B, S] f32 uniform in [0.5, 2] (None unless `scaled`)."""
    kq, kk, kw, ks = jax.random.split(jax.random.key(seed), 4)
    k_scale = jax.random.uniform(ks, (B, S), jnp.float32, 0.5, 2.0) if scaled else None
    return (
        jax.random.normal(kq, (B, T, HI, DI), jnp.float32).astype(dtype),
        jax.random.normal(kk, (B, S, DI), jnp.float32).astype(dtype),
        jax.random.normal(kw, (B, T, HI), jnp.bfloat16),
        k_scale,
    )


def int_inputs(seed, B, T, S, HI, DI, dtype, scaled):
    """Small integers and power-of-two scales 2**-2..2**2 (None unless `scaled`): exact
    scores, heavy ties."""
    kq, kk, kw, ks = jax.random.split(jax.random.key(seed), 4)
    k_scale = 2.0 ** jax.random.randint(ks, (B, S), -2, 3).astype(jnp.float32) if scaled else None
    return (
        jax.random.randint(kq, (B, T, HI, DI), -2, 3).astype(dtype),
        jax.random.randint(kk, (B, S, DI), -2, 3).astype(dtype),
        jax.random.randint(kw, (B, T, HI), -1, 3).astype(jnp.bfloat16),
        k_scale,
    )


def parse_sizes(spec: str) -> phk.BlockSizes:
    """'block_k=128,num_stages=3' -> BlockSizes(block_k=128, num_stages=3) of HyTopK."""
    return block_sizes(phk.BlockSizes, spec)


def impl_fn(name, k, interpret):
    """The jitted selection of one column: (q_idx, k_idx, w, k_scale) -> int32 [B, T, k]."""
    if name.startswith("pallas:"):  # the fused kernel at other BlockSizes
        sizes = parse_sizes(name.partition(":")[2])
        return jax.jit(
            lambda q, kk, w, s: phk.hytopk(
                q, kk, w, k=k, causal=True, k_scale=s, interpret=interpret, block_sizes=sizes
            )
        )
    if name == "reference":
        return jax.jit(lambda q, kk, w, s: hs.topk_reference(q, kk, w, k=k, causal=True, k_scale=s))
    impl, _, order = name.partition("/")  # "pallas/index": the kernel in index order
    impl = "interpret" if impl == "pallas" and interpret else impl
    return jax.jit(
        lambda q, kk, w, s: hs.hytopk(
            q, kk, w, k=k, causal=True, k_scale=s, impl=impl, order=order or "score"
        )
    )


def rows_reference(q, kk, w, k_scale, rows, k):
    """Exact causal selection for the query rows `rows` only: [B, len(rows), k]."""
    T, S = q.shape[1], kk.shape[1]
    rows = jnp.asarray(rows)
    scores, _ = indexer_score_table(q[:, rows], kk, w[:, rows], causal=False, k_scale=k_scale)
    keys = order_key(scores, (jnp.arange(S)[None, :] <= rows[:, None] + (S - T))[None])
    if k > S:
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, k - S)), constant_values=INVALID_KEY)
    top, idx = jax.lax.top_k(keys, k)
    return np.asarray(jnp.where(top == INVALID_KEY, -1, idx))


def verify(name, got, exact_args, k, full_ref, rng):
    """Index-for-index check of `got` (the impl's output on exact_args); a short status.
    An index-order column is checked against the references' keys in index order."""
    T = got.shape[1]
    by_index = name.endswith("/index")
    rows = np.unique(np.concatenate([[0, 1, T // 2, T - 1], rng.integers(0, T, 60)]))
    want_rows = rows_reference(*exact_args, rows, k)
    if by_index:
        want_rows = np.asarray(in_key_order(jnp.asarray(want_rows)))
        full_ref = None if full_ref is None else np.asarray(in_key_order(jnp.asarray(full_ref)))
    if not np.array_equal(got[:, rows], want_rows):
        raise AssertionError(f"{name} T={T}: sampled rows differ from the exact selection")
    if full_ref is None:
        return f"{len(rows)} sampled rows exact"
    if not np.array_equal(got, full_ref):
        bad = int(np.sum(np.any(got != full_ref, axis=-1)))
        raise AssertionError(f"{name} T={T}: {bad} rows differ from topk_reference")
    return "all rows == reference"


def memory_bytes(fn, args):
    """Argument + output + temp bytes of the compiled program (None where not reported)."""
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
    except Exception:
        return None


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


def bench_length(args, T, HI, dtype_name, impls, rng):
    """Check, then time, every impl at T = S; returns one record per impl."""
    B, S, DI, k = 1, T, args.index_dim, args.topk
    dtype = jnp.dtype(dtype_name)
    flops = selection_flops(T, S, HI, DI)
    n_sets = 2 if B * T * HI * DI * dtype.itemsize < 2 * L2_BYTES else 1
    input_sets = [
        normal_inputs(10 + i, B, T, S, HI, DI, dtype, args.k_scale) for i in range(n_sets)
    ]
    exact_args = int_inputs(1, B, T, S, HI, DI, dtype, args.k_scale)
    full_ref, ref_ms, records = None, None, []
    for name in impls:
        rec = dict(impl=name, T=T, S=S, B=B, HI=HI, DI=DI, k=k, dtype=dtype_name, causal=True)
        rec["k_scale"] = args.k_scale
        rec["flops"] = flops
        limit = {"reference": args.ref_max, "xla": args.xla_max}.get(name)
        if limit is not None and T > limit:
            rec["status"] = f"skipped (T > {limit})"
            log(f"  HI={HI} {dtype_name} T={T:>7} {name:<10} {rec['status']}")
            records.append(rec)
            continue
        fn = impl_fn(name, k, args.interpret)
        t0 = time.perf_counter()
        try:
            got = np.asarray(fn(*exact_args))
            rec["verified"] = verify(name, got, exact_args, k, full_ref, rng)
            full_ref = got if name == "reference" else full_ref
            ms = median_ms(fn, input_sets, args.reps)
            ref_ms = ms if name == "reference" else ref_ms
            rec.update(median_ms=ms, tflops=flops / ms / 1e9, status="ok")
            rec["mem_bytes"] = memory_bytes(fn, input_sets[0])
            if ref_ms is not None:
                rec["speedup_vs_reference"] = ref_ms / ms
            speedup = rec.get("speedup_vs_reference")
            versus = "  (no reference)   " if speedup is None else f"x{speedup:6.2f} vs reference"
            log(
                f"  HI={HI} {dtype_name} T={T:>7} {name:<10} {ms:10.2f} ms "
                f"{rec['tflops']:7.1f} TFLOP/s  {versus}  "
                f"[{rec['verified']}; {time.perf_counter() - t0:.0f} s]"
            )
        except AssertionError as e:
            rec["status"] = f"WRONG: {e}"
            log(f"  T={T:>7} {name:<10} WRONG: {e}")
        except Exception as e:
            rec["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            log(f"  T={T:>7} {name:<10} {rec['status']}")
        records.append(rec)
    return records


def add_dtype_speedups(records):
    """speedup_vs_bfloat16: the bf16 record's median over this one's, same impl, HI and T."""
    ok = [r for r in records if r.get("status") == "ok"]
    bf16 = {(r["impl"], r["HI"], r["T"]): r for r in ok if r["dtype"] == "bfloat16"}
    for r in ok:
        base = bf16.get((r["impl"], r["HI"], r["T"]))
        if base is not None and r["dtype"] != "bfloat16":
            r["speedup_vs_bfloat16"] = base["median_ms"] / r["median_ms"]


def table(records, impls=IMPLS):
    log(f"{'HI':>3} {'dtype':>13} {'T':>8} " + " ".join(f"{n:>24}" for n in impls))
    configs = sorted({(r["HI"], r["dtype"], r["T"]) for r in records})
    for HI, dtype, T in configs:
        cells = []
        for n in impls:
            r = next(
                (
                    r
                    for r in records
                    if (r["HI"], r["dtype"], r["T"], r["impl"]) == (HI, dtype, T, n)
                ),
                None,
            )
            if r is None or r.get("status") != "ok":
                cells.append(f"{'-' if r is None else r['status'][:24]:>24}")
                continue
            sp = r.get("speedup_vs_reference")
            cells.append(
                f"{r['median_ms']:9.2f} ms"
                + (f" x{sp:5.1f}" if sp else " " * 7)
                + f" {r['tflops']:4.0f}T"
            )
        log(f"{HI:>3} {dtype:>13} {T:>8} " + " ".join(cells))


def plot(records, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    names = list(dict.fromkeys(r["impl"] for r in records))
    for HI, dtype in sorted({(r["HI"], r["dtype"]) for r in records}):
        for name in names:
            pts = sorted(
                (r["T"], r["median_ms"])
                for r in records
                if (r["impl"], r["HI"], r["dtype"]) == (name, HI, dtype) and r["status"] == "ok"
            )
            if pts:
                style = "--" if dtype != "bfloat16" else "-"
                ax.plot(*zip(*pts), style, marker="o", label=f"{name} HI={HI} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T = S (tokens)")
    ax.set_ylabel("median ms")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = " (default: %(default)s)"
    ap.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[8192, 16384, 32768, 65536, 131072, 262144],
        help="sequence lengths T = S" + default,
    )
    ap.add_argument(
        "--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="columns" + default
    )
    ap.add_argument(
        "--index-heads", type=int, nargs="+", default=[32], help="indexer heads HI" + default
    )
    ap.add_argument("--index-dim", type=int, default=128, help="indexer head dim DI" + default)
    ap.add_argument("--topk", type=int, default=2048, help="keys selected per query" + default)
    ap.add_argument(
        "--dtype",
        nargs="+",
        choices=("bfloat16", "float8_e4m3fn"),
        default=["bfloat16"],
        help="dtypes of q_idx and k_idx, each timed in turn (w is bf16)" + default,
    )
    ap.add_argument(
        "--k-scale",
        action="store_true",
        help="pass a random positive f32 scale per key (k_scale)" + default,
    )
    ap.add_argument(
        "--sizes",
        nargs="*",
        default=[],
        metavar="FIELD=V,...",
        help="extra pallas columns at these hytopk BlockSizes, e.g. block_k=128,num_stages=3",
    )
    ap.add_argument(
        "--index-order",
        action="store_true",
        help="also time the pallas kernel with order='index' (column pallas/index)" + default,
    )
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per cell" + default)
    ap.add_argument(
        "--ref-max",
        type=int,
        default=32768,
        help="largest T the reference runs (its table is 4*T*S bytes)" + default,
    )
    ap.add_argument(
        "--xla-max", type=int, default=32768, help="largest T the xla path runs" + default
    )
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="run the pallas column in Pallas interpret mode (CPU smoke runs)" + default,
    )
    ap.add_argument("--out", default="runs/bench_selection", help="output folder" + default)
    args = ap.parse_args()

    impls = [name for name in IMPLS if name in args.impls]  # the reference first
    for spec in args.sizes:
        parse_sizes(spec)  # a bad spec fails before anything runs
    if args.index_order:
        if "pallas" not in impls:
            ap.error("--index-order times the pallas kernel: add pallas to --impls")
        impls.append("pallas/index")
    impls += [f"pallas:{spec}" for spec in args.sizes]
    backend = jax.default_backend()
    if any(n.startswith("pallas") for n in impls) and backend != "gpu" and not args.interpret:
        log(f"backend {backend}: the compiled Pallas kernel needs a GPU; dropping pallas")
        impls = [n for n in impls if not n.startswith("pallas")]
    device = str(jax.devices()[0].device_kind)
    heads = ",".join(map(str, args.index_heads))
    shape = f"B=1 HI={heads} DI={args.index_dim} k={args.topk} causal {','.join(args.dtype)}"
    shape += " k_scale" if args.k_scale else ""
    log(f"jax {jax.__version__} on {device}; {shape}; T = S in {args.seq}; reps {args.reps}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_selection.json")
    meta = dict(
        jax=jax.__version__,
        device=device,
        backend=backend,
        python=sys.version.split()[0],
        host=platform.node(),
        command=shlex.join([sys.executable, *sys.argv]),
        shape=shape,
        reps=args.reps,
        block_sizes=str(phk.BlockSizes()),
        flop_formula="2*HI*DI*P, P = T*(2S-T+1)/2",
    )
    rng = np.random.default_rng(0)
    records = []
    for HI in args.index_heads:
        for dtype_name in args.dtype:
            for T in args.seq:
                records += bench_length(args, T, HI, dtype_name, impls, rng)
                add_dtype_speedups(records)
                with open(path, "w") as f:  # after every length: a cut-short sweep keeps it
                    json.dump(dict(meta=meta, records=records), f, indent=1)
    log(f"wrote {path}")
    table(records, impls)
    plot(records, os.path.join(args.out, "bench_selection.png"), f"HyTopK selection, {shape}")
    log(f"wrote {os.path.join(args.out, 'bench_selection.png')}")


if __name__ == "__main__":
    main()
