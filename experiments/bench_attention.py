"""Benchmark of sparse attention (issue 4): Pallas kernels vs the xla path vs cuDNN dense causal.

    PYTHONPATH=. python3 experiments/bench_attention.py [--quick] [--tune]

Sweep: G = 1, D = Dv = 128, k = 2048, bf16, H in {16, 64}, T = S in {8K, 32K, 128K}
(--quick: T in {8K, 32K}). Each query t attends to k distinct random keys of [0, t] (all of them,
then -1 padding, while t + 1 <= k): a causal index set like the selection's, drawn on device by
stratified sampling (one uniform key per stratum of [0, t]).

Timed: forward, and forward+backward (jax.vjp with a fixed random cotangent), for
  pallas      hs.sparse_attention(impl="pallas"), atomic dK/dV
  pallas_det  the same with deterministic=True (sorted key-wise dK/dV sum), fwd+bwd only
  xla         hs.sparse_attention(impl="xla")
  cudnn       jax.nn.dot_product_attention(is_causal=True, implementation="cudnn"), dense
FLOPs (SPEC section 5): sparse forward 2*T*H*k_eff*(D+Dv), fwd+bwd 3.5x that; dense causal
forward 2*P*H*(D+Dv) with P = T(T+1)/2, fwd+bwd 3.5x. Speedups are time ratios from the same
run. Every impl is checked against `hs.sparse_attention_reference` (output and gradients) at a
small shape before any timing. q, idx and the cotangent exceed L2 at every size; K/V of one
sequence (4-64 MiB) is the working set the kernel is meant to keep L2-resident, so it is not
rotated. Results: experiments/results/bench_attention.{json,png}.
"""

from __future__ import annotations

import argparse
import functools
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
from pallas_kernels import sparse_attention as psa

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(*args):
    print(*args, flush=True)


@functools.partial(jax.jit, static_argnames=("B", "T", "k"))
def causal_random_indices(key, *, B: int, T: int, k: int):
    """int32 [B, T, k]: row t holds k distinct keys of [0, t] (stratified), or 0..t then -1."""
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    n = t + 1  # visible keys of query t
    lo = j * n // k  # stratum [lo, hi) of [0, t]
    hi = (j + 1) * n // k
    hi = jnp.maximum(hi, lo + 1)
    u = jax.random.uniform(key, (B, T, k))
    pick = jnp.minimum(lo + (u * (hi - lo)).astype(jnp.int32), hi - 1)
    pick = jnp.minimum(pick, t)
    dense = jnp.where(j <= t, j, -1)  # t + 1 <= k: all keys, -1 pad
    return jnp.where(n <= k, dense, pick).astype(jnp.int32)


def make_inputs(B, T, H, D, Dv, k, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, H, D), dtype)
    kk = jax.random.normal(keys[1], (B, T, 1, D), dtype)
    v = jax.random.normal(keys[2], (B, T, 1, Dv), dtype)
    idx = causal_random_indices(keys[3], B=B, T=T, k=k)
    do = jax.random.normal(keys[4], (B, T, H, Dv), dtype)
    return q, kk, v, idx, do


def attention_fn(impl, sizes=None):
    if impl == "pallas":
        return lambda q, k, v, idx: psa.sparse_attention(
            q, k, v, idx, scale=q.shape[-1] ** -0.5, block_sizes=sizes
        )
    if impl == "pallas_det":
        return lambda q, k, v, idx: psa.sparse_attention(
            q, k, v, idx, scale=q.shape[-1] ** -0.5, deterministic=True, block_sizes=sizes
        )
    if impl == "xla":
        return lambda q, k, v, idx: hs.sparse_attention(q, k, v, idx, impl="xla")
    if impl == "reference":
        return lambda q, k, v, idx: hs.sparse_attention_reference(q, k, v, idx)
    if impl == "cudnn":
        return lambda q, k, v, idx: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    raise ValueError(impl)


def programs(impl, sizes=None):
    f = attention_fn(impl, sizes)
    fwd = jax.jit(f)

    @jax.jit
    def fwd_bwd(q, k, v, idx, do):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, idx), q, k, v)
        return out, vjp(do)

    return fwd, fwd_bwd


def median_ms(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check(impls, H, log_tol=3e-2, sizes=None):
    """Output and gradients of every sparse impl vs the f32 reference at T = S = 1024, k = 256
    (sizes: the Pallas kernels' BlockSizes, default theirs)."""
    q, k, v, idx, do = make_inputs(1, 1024, H, 128, 128, 256, seed=1)
    ref_out, ref_vjp = jax.vjp(
        lambda q, k, v: hs.sparse_attention_reference(q, k, v, idx),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    ref = (ref_out, *ref_vjp(do.astype(jnp.float32)))
    for impl in impls:
        out, grads = programs(impl, sizes)[1](q, k, v, idx, do)
        errs = [rel_err(a, b) for a, b in zip((out, *grads), ref)]
        ok = all(e < log_tol for e in errs)
        log(
            f"  check {impl:10s} H={H}: rel err out/dq/dk/dv = "
            + " ".join(f"{e:.1e}" for e in errs)
            + ("  ok" if ok else "  FAILED")
        )
        if not ok:
            raise SystemExit(f"{impl} disagrees with the reference; not timing it")


def sparse_flops(T, H, D, Dv, k):
    k_eff = float(np.mean(np.minimum(np.arange(T) + 1, k)))
    return 2.0 * T * H * k_eff * (D + Dv)


def dense_causal_flops(T, H, D, Dv):
    return 2.0 * (T * (T + 1) / 2) * H * (D + Dv)


def tune(T, H, reps):
    """A few tile configurations of the Pallas kernels at one shape."""
    q, k, v, idx, do = make_inputs(1, T, H, 128, 128, 2048)
    flops = sparse_flops(T, H, 128, 128, 2048)
    # Earlier sweeps (results/bench_attention_tune_and_128k.log, results/bounds/,
    # results/bench_attention.log, results/hytopk_bk256/attn_bwd_tune/,
    # results/attn_tune_stages/) set the forward tiles, skip_invalid and the backward's tile,
    # warps and stages. These compare the backward's schedules (where dV's rows are formed; one
    # kernel or two), the default first and last.
    configs = [
        psa.BlockSizes(),
        psa.BlockSizes(bwd_schedule="dv_first"),
        psa.BlockSizes(bwd_schedule="split"),
        psa.BlockSizes(bwd_schedule="split", num_stages_bwd=3),
        psa.BlockSizes(bwd_schedule="split", block_k_bwd=32),
        psa.BlockSizes(),
    ]
    rows = []
    for sizes in configs:
        try:
            check(["pallas"], H, sizes=sizes)
        except SystemExit as e:  # a wrong variant is reported and not timed
            log(f"  tune {sizes}: {e}")
            continue
        fwd, fb = programs("pallas", sizes)
        try:
            ms_f = median_ms(fwd, (q, k, v, idx), reps)
            ms_fb = median_ms(fb, (q, k, v, idx, do), reps)
        except Exception as e:  # a tile that does not compile is a data point, not a crash
            log(f"  tune {sizes}: failed {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(
            dict(
                sizes=str(sizes),
                fwd_ms=ms_f,
                fwd_bwd_ms=ms_fb,
                fwd_tflops=flops / ms_f / 1e9,
                fwd_bwd_tflops=3.5 * flops / ms_fb / 1e9,
            )
        )
        log(
            f"  tune T={T} H={H} {sizes}: fwd {ms_f:.2f} ms ({flops / ms_f / 1e9:.0f} TFLOP/s), "
            f"fwd+bwd {ms_fb:.2f} ms ({3.5 * flops / ms_fb / 1e9:.0f} TFLOP/s)"
        )
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T in {8K, 32K} only")
    parser.add_argument("--tune", action="store_true", help="also sweep Pallas tile sizes")
    parser.add_argument(
        "--reps",
        type=int,
        default=10,
        help="timed repetitions per point (fewer for xla and at 128K)",
    )
    parser.add_argument("--seq", type=int, nargs="*", help="override the T = S sweep")
    parser.add_argument("--heads", type=int, nargs="*", default=[16, 64], help="H values")
    parser.add_argument(
        "--impls",
        nargs="*",
        default=["pallas", "pallas_det", "xla", "cudnn"],
        choices=["pallas", "pallas_det", "xla", "cudnn"],
        help="what to time (off GPU only xla runs)",
    )
    parser.add_argument(
        "--out",
        default=os.path.join(RESULTS, "bench_attention"),
        help="path prefix of the .json and .png records",
    )
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    seqs = args.seq or ([8192, 32768] if args.quick else [8192, 32768, 131072])
    impls = [i for i in args.impls if on_gpu or i in ("xla",)]
    if not on_gpu:
        log("no GPU: only the xla path runs; absolute times are meaningless here")
    D = Dv = 128
    topk = 2048
    log(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; impls {impls}; T {seqs}; "
        f"H {args.heads}"
    )

    for H in args.heads:
        check([i for i in impls if i != "cudnn"], H)

    tuning = []
    if args.tune and on_gpu:
        tuning = tune(32768, 64, max(3, args.reps // 2))

    records = []
    for H in args.heads:
        for T in seqs:
            q, k, v, idx, do = make_inputs(1, T, H, D, Dv, topk)
            s_flops = sparse_flops(T, H, D, Dv, topk)
            d_flops = dense_causal_flops(T, H, D, Dv)
            for impl in impls:
                flops = d_flops if impl == "cudnn" else s_flops
                reps = (
                    args.reps if impl.startswith("pallas") or T <= 32768 else max(3, args.reps // 3)
                )
                if impl == "xla":
                    reps = min(reps, 3)
                fwd, fb = programs(impl)
                rec = dict(
                    impl=impl,
                    B=1,
                    T=T,
                    S=T,
                    H=H,
                    G=1,
                    D=D,
                    Dv=Dv,
                    k=topk,
                    dtype="bfloat16",
                    flops_fwd=flops,
                    flops_fwd_bwd=3.5 * flops,
                )
                for mode, fn, fargs, fl in (
                    ("fwd", fwd, (q, k, v, idx), flops),
                    ("fwd_bwd", fb, (q, k, v, idx, do), 3.5 * flops),
                ):
                    if impl == "pallas_det" and mode == "fwd":
                        continue  # same forward kernel as pallas
                    t0 = time.perf_counter()
                    try:
                        ms = median_ms(fn, fargs, reps)
                    except (
                        Exception
                    ) as e:  # out of memory, unsupported size: recorded, sweep goes on
                        log(
                            f"  {impl:10s} H={H:3d} T={T:6d} {mode:8s} failed: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160]}"
                        )
                        rec[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        continue
                    rec[f"{mode}_ms"] = ms
                    rec[f"{mode}_tflops"] = fl / ms / 1e9
                    log(
                        f"  {impl:10s} H={H:3d} T={T:6d} {mode:8s} {ms:9.2f} ms "
                        f"{fl / ms / 1e9:7.1f} TFLOP/s   ({time.perf_counter() - t0:.0f} s)"
                    )
                records.append(rec)
                save(args, records, tuning)  # after every shape, so a cut-off sweep keeps its data
            del q, k, v, idx, do

    # Speedups of the Pallas kernels over the other impls, same run.
    by_key = {(r["impl"], r["H"], r["T"]): r for r in records}
    for r in records:
        base = by_key.get(("pallas", r["H"], r["T"]))
        if base is None or r["impl"] == "pallas":
            continue
        for mode in ("fwd", "fwd_bwd"):
            if f"{mode}_ms" in r and f"{mode}_ms" in base:
                r[f"pallas_speedup_{mode}"] = r[f"{mode}_ms"] / base[f"{mode}_ms"]

    log(
        "\n| impl | H | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
        "pallas speedup fwd | fwd+bwd |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda r, key, f: f.format(r[key]) if key in r else "-"  # noqa: E731
    for r in records:
        log(
            f"| {r['impl']} | {r['H']} | {r['T']} | {fmt(r, 'fwd_ms', '{:.2f}')} | "
            f"{fmt(r, 'fwd_tflops', '{:.0f}')} | {fmt(r, 'fwd_bwd_ms', '{:.2f}')} | "
            f"{fmt(r, 'fwd_bwd_tflops', '{:.0f}')} | {fmt(r, 'pallas_speedup_fwd', '{:.1f}x')} | "
            f"{fmt(r, 'pallas_speedup_fwd_bwd', '{:.1f}x')} |"
        )

    save(args, records, tuning)
    log(f"wrote {args.out}.json")
    plot(records, args.out + ".png")


def save(args, records, tuning):
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        python=platform.python_version(),
        argv=sys.argv[1:],
        default_block_sizes=str(psa.BlockSizes()),
    )
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, records=records, tuning=tuning), f, indent=1)


def plot(records, path):
    import matplotlib  # noqa: PLC0415  (a dependency; imported here so the GPU needs no display)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for impl in sorted({r["impl"] for r in records}):
            for H in sorted({r["H"] for r in records}):
                pts = sorted(
                    (r["T"], r[f"{mode}_ms"])
                    for r in records
                    if r["impl"] == impl and r["H"] == H and f"{mode}_ms" in r
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{impl} H={H}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T = S (tokens)")
        ax.set_ylabel("median ms")
        ax.set_title(f"sparse attention {mode.replace('_', '+')}, k=2048, D=Dv=128, bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
