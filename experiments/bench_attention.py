"""Benchmark of sparse attention: the Pallas kernels against the xla path and cuDNN dense attention.

    PYTHONPATH=. python experiments/bench_attention.py [--quick] [--seq T ...] [--heads H ...]
        [--impls pallas pallas_det xla cudnn] [--mla] [--sizes FIELD=V,...] [--out DIR]
    PYTHONPATH=. python experiments/bench_attention.py --seq 128 --heads 4 --dim 32 --topk 32 \\
        --impls xla interpret --reps 2          # CPU smoke run

Sweep: G = 1, D = Dv = 128 (--dim, --value-dim), k = 2048 (--topk), bf16, H in {16, 64}, T = S
in {8K, 32K, 128K} (--quick: {8K, 32K}). --mla: the absorbed MLA attention of GLM-5.1 and
DeepSeek-V3.2 instead: D = 576 over one shared key row whose first 512 features are the value
(`value_dim=512`, v=None), H in {64, 128}; its dense baseline is MLA's non-absorbed form, H
heads of q/k 256 and v 256 (GLM-5.1's qk_nope 192 + rope 64, v_head 256). Each query t attends
to k distinct random keys of [0, t] (all of them, then -1 padding, while t + 1 <= k): a causal
index set like the selection's, drawn on device by stratified sampling (one uniform key per
stratum of [0, t]).

Timed: forward, and forward+backward (jax.vjp with a fixed random cotangent), for
  pallas      hs.sparse_attention(impl="pallas"): compiled kernels, atomic dK/dV (GPU)
  pallas_det  the same with deterministic=True (sorted key-wise dK/dV sum), fwd+bwd only (GPU)
  interpret   the same kernels in Pallas interpret mode (CPU smoke runs; times mean nothing)
  xla         hs.sparse_attention(impl="xla")
  cudnn       jax.nn.dot_product_attention(is_causal=True, implementation="cudnn"), dense (GPU)
  pallas:SIZES the pallas kernels with other BlockSizes (--sizes block_h=32,num_stages=3 ...)
FLOPs: sparse forward 2*T*H*k_eff*(D+Dv) (k_eff: valid indices per row, averaged), fwd+bwd 3.5x
that; dense causal forward 2*P*H*(D+Dv) with P = T(T+1)/2, fwd+bwd 3.5x. Speedups are time
ratios from the same run, against `pallas` (or `interpret` where `pallas` is not timed).

Before any timing, every sparse impl is checked against `hs.sparse_attention_reference` (output
and the three gradients, f32 reference) at T = S = min(1024, smallest T), k = min(256, --topk);
a wrong impl stops the run. q, idx and the cotangent exceed L2 at every GPU size; K/V of one
sequence (4-64 MiB) is the working set the kernels are meant to keep L2-resident, so it is not
rotated.

Output: <out>/bench_attention.json (jax version, device, command line, per shape and impl the
medians, TFLOP/s and speedups) and <out>/bench_attention.png; <out> defaults to
runs/bench_attention/ in the repository. The JSON is rewritten after every shape, so a cut-off
sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("pallas", "pallas_det", "interpret", "xla", "cudnn")
GPU_ONLY = ("pallas", "pallas_det", "cudnn")


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


def make_inputs(B, T, H, D, Dv, k, dtype=jnp.bfloat16, seed=0, shared=False):
    """q [B,T,H,D], k [B,T,1,D], v [B,T,1,Dv] (None when shared: the value is k[..., :Dv]),
    idx [B,T,k] int32, cotangent [B,T,H,Dv]."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, H, D), dtype)
    kk = jax.random.normal(keys[1], (B, T, 1, D), dtype)
    v = None if shared else jax.random.normal(keys[2], (B, T, 1, Dv), dtype)
    idx = causal_random_indices(keys[3], B=B, T=T, k=k)
    do = jax.random.normal(keys[4], (B, T, H, Dv), dtype)
    return q, kk, v, idx, do


def _field_value(text: str):
    """A --sizes value: None, an int, a float, or else the text itself."""
    if text == "None":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_fields(spec: str) -> dict:
    """'block_h=32,num_stages=3,block_h_bwd=None' -> {'block_h': 32, 'num_stages': 3,
    'block_h_bwd': None}."""
    fields = {}
    for item in filter(None, spec.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--sizes {spec!r}: expected FIELD=VALUE items")
        fields[name.strip()] = _field_value(value.strip())
    return fields


def block_sizes(cls, spec: str):
    """A --sizes spec as a kernel's BlockSizes `cls`; a bad one stops the run, naming it."""
    fields = parse_fields(spec)
    annotations = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        if isinstance(value, str) and "str" not in annotations.get(name, "str"):
            raise SystemExit(f"--sizes {spec!r}: {name} takes a number, not {value!r}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--sizes {spec!r}: {e}") from None


def parse_sizes(spec: str) -> psa.BlockSizes:
    """'block_h=32,num_stages=3' -> BlockSizes(block_h=32, num_stages=3) of the attention."""
    return block_sizes(psa.BlockSizes, spec)


def attention_fn(impl, value_dim=None):
    """(q, k, v, idx) -> [B, T, H, Dv] for one impl name of IMPLS (or pallas:SIZES); with
    value_dim, v is None and the value is k[..., :value_dim]."""
    if impl.startswith("pallas:"):
        sizes = parse_sizes(impl.partition(":")[2])
        return lambda q, k, v, idx: psa.sparse_attention(
            q, k, v, idx, scale=q.shape[-1] ** -0.5, value_dim=value_dim, block_sizes=sizes
        )
    sparse_kw = {
        "pallas": dict(impl="pallas"),
        "pallas_det": dict(impl="pallas", deterministic=True),
        "interpret": dict(impl="interpret"),
        "xla": dict(impl="xla"),
    }
    if impl in sparse_kw:
        kw = sparse_kw[impl]
        return lambda q, k, v, idx: hs.sparse_attention(q, k, v, idx, value_dim=value_dim, **kw)
    if impl == "cudnn":
        return lambda q, k, v, idx: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    raise ValueError(f"impl={impl!r}; choose one of {IMPLS}")


def programs(impl, value_dim=None):
    """Jitted forward (q, k, v, idx) and forward+backward (q, k, v, idx, do) of one impl."""
    f = attention_fn(impl, value_dim)
    fwd = jax.jit(f)

    @jax.jit
    def fwd_bwd(q, k, v, idx, do):
        if v is None:  # shared value: gradients for q and k only
            out, vjp = jax.vjp(lambda q, k: f(q, k, None, idx), q, k)
        else:
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


def check(impls, T, H, D, Dv, k, shared, tol=3e-2):
    """Output and gradients of every sparse impl against the f32 reference at T = S, k, H;
    returns {impl: [rel err out, dq, dk(, dv)]} or exits on a disagreement."""
    q, kk, v, idx, do = make_inputs(1, T, H, D, Dv, k, seed=1, shared=shared)
    if shared:
        ref_fn = lambda q, k: hs.sparse_attention_reference(q, k, k[..., :Dv], idx)  # noqa: E731
        operands = (q, kk)
    else:
        ref_fn = lambda q, k, v: hs.sparse_attention_reference(q, k, v, idx)  # noqa: E731
        operands = (q, kk, v)
    ref_out, ref_vjp = jax.vjp(ref_fn, *(x.astype(jnp.float32) for x in operands))
    ref = (ref_out, *ref_vjp(do.astype(jnp.float32)))
    errors = {}
    for impl in impls:
        fwd, fwd_bwd = programs(impl, Dv if shared else None)
        try:
            out, grads = fwd_bwd(q, kk, v, idx, do)
        except Exception as e:  # e.g. a --sizes variant whose backward exceeds shared memory
            log(f"  check {impl:10s} backward failed: {type(e).__name__}: {_first_line(e)}")
            try:  # its forward may still run: check and time that alone
                out, grads = fwd(q, kk, v, idx), ()
            except Exception as e:
                log(f"  check {impl:10s} failed: {type(e).__name__}: {_first_line(e)}")
                errors[impl] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
        errs = [rel_err(a, b) for a, b in zip((out, *grads), ref)]
        ok = all(e < tol for e in errs)
        log(
            f"  check {impl:10s} T={T} H={H} k={k}: rel err out/dq/dk(/dv) = "
            + " ".join(f"{e:.1e}" for e in errs)
            + ("  ok" if ok else "  FAILED")
        )
        if not ok:
            raise SystemExit(f"{impl} disagrees with the reference (tolerance {tol}); not timing")
        errors[impl] = errs
    return errors


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def sparse_flops(T, H, D, Dv, k):
    k_eff = float(np.mean(np.minimum(np.arange(T) + 1, k)))
    return 2.0 * T * H * k_eff * (D + Dv)


def dense_causal_flops(T, H, D, Dv):
    return 2.0 * (T * (T + 1) / 2) * H * (D + Dv)


def parse_args(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--quick", action="store_true", help="only the T values up to 32K")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072], help="T = S")
    p.add_argument("--heads", type=int, nargs="+", default=None, help="query heads H")
    p.add_argument("--dim", type=int, default=128, help="query/key head dim D")
    p.add_argument("--value-dim", type=int, default=None, help="value dim Dv (default D)")
    p.add_argument(
        "--mla",
        action="store_true",
        help="MLA's absorbed form: D=576, the value is the key's first 512 features (v=None), "
        "H in {64, 128} unless --heads is given; cudnn runs the non-absorbed dense form",
    )
    p.add_argument(
        "--sizes",
        nargs="*",
        default=[],
        metavar="FIELD=V,...",
        help="also time the pallas kernels with these BlockSizes, one impl 'pallas:SIZES' each",
    )
    p.add_argument("--topk", type=int, default=2048, help="selected keys k per query")
    p.add_argument(
        "--reps",
        type=int,
        default=10,
        help="timed repetitions per point, median reported (xla: at most 3; cudnn and interpret "
        "a third of this above T = 32K)",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        default=["pallas", "pallas_det", "xla", "cudnn"],
        choices=IMPLS,
        help="what to time; off GPU the GPU-only impls (pallas, pallas_det, cudnn) are dropped",
    )
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "runs", "bench_attention"),
        help="folder for bench_attention.json and bench_attention.png",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    seqs = [T for T in args.seq if T <= 32768] if args.quick else args.seq
    if not seqs:
        raise SystemExit(f"--quick keeps no T of --seq {args.seq} (it drops T > 32768)")
    impls = [i for i in args.impls if on_gpu or i not in GPU_ONLY]
    impls += [f"pallas:{spec}" for spec in args.sizes if on_gpu]
    for spec in args.sizes:
        parse_sizes(spec)  # a bad spec stops the run before anything is timed
    dropped = sorted(set(args.impls) - set(impls)) + [s for s in args.sizes if not on_gpu]
    if dropped:
        log(f"no GPU: not timing {dropped}; absolute times off GPU mean nothing")
    if not impls:
        raise SystemExit("nothing to time here; off GPU try --impls xla interpret")
    base = "pallas" if "pallas" in impls else ("interpret" if "interpret" in impls else None)
    shared = args.mla
    D, Dv = (576, 512) if args.mla else (args.dim, args.value_dim or args.dim)
    heads = args.heads or ([64, 128] if args.mla else [16, 64])
    # Dense baseline: the same shapes, or MLA's non-absorbed form (H kv heads of 256 / 256).
    dense_dims = (256, 256) if args.mla else (D, Dv)
    meta = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        python=platform.python_version(),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        impls=impls,
        speedup_base=base,
        shape=dict(
            B=1,
            G=1,
            D=D,
            Dv=Dv,
            shared_value=shared,
            k=args.topk,
            dtype="bfloat16",
            T=seqs,
            H=heads,
        ),
        dense_shape=dict(G="H", D=dense_dims[0], Dv=dense_dims[1]) if args.mla else None,
    )
    log(
        f"jax {jax.__version__} on {meta['device']}; impls {impls}; T {seqs}; H {heads}; "
        f"D {D}; Dv {Dv}{' (value = key[:Dv])' if shared else ''}; k {args.topk}; out {args.out}"
    )

    check_T = min(1024, min(seqs))
    check_k = min(256, args.topk)
    sparse = [i for i in impls if i != "cudnn"]
    checks = {H: check(sparse, check_T, H, D, Dv, check_k, shared) for H in heads}
    checks = checks if sparse else {}
    broken = {i for c in checks.values() for i, e in c.items() if isinstance(e, str)}
    impls = [i for i in impls if i not in broken]
    # Impls whose backward failed the check (only the output's error recorded): forward only.
    forward_only = {
        i for c in checks.values() for i, e in c.items() if isinstance(e, list) and len(e) == 1
    }
    meta["check"] = dict(T=check_T, k=check_k, rel_err_out_dq_dk_dv=checks)

    records = []
    for H in heads:
        for T in seqs:
            q, k, v, idx, do = make_inputs(1, T, H, D, Dv, args.topk, shared=shared)
            dense = None
            if args.mla and "cudnn" in impls:  # non-absorbed: H heads of q, k, v
                dense = make_inputs(1, T, H, dense_dims[0], dense_dims[1], 1)
                kv_heads = (jnp.repeat(x, H, axis=2) for x in dense[1:3])
                dense = (dense[0], *kv_heads, None, dense[4])
            s_flops = sparse_flops(T, H, D, Dv, args.topk)
            d_flops = dense_causal_flops(T, H, *dense_dims)
            for impl in impls:
                flops = d_flops if impl == "cudnn" else s_flops
                reps = args.reps if impl.startswith("pallas") or T <= 32768 else args.reps // 3
                reps = max(1, min(reps, 3) if impl == "xla" else reps)
                fwd, fb = programs(impl, Dv if shared and impl != "cudnn" else None)
                dq, dk, dv, didx, ddo = dense if (impl == "cudnn" and dense) else (q, k, v, idx, do)
                rec = dict(impl=impl, T=T, S=T, H=H, flops_fwd=flops, flops_fwd_bwd=3.5 * flops)
                for mode, fn, fargs, fl in (
                    ("fwd", fwd, (dq, dk, dv, didx), flops),
                    ("fwd_bwd", fb, (dq, dk, dv, didx, ddo), 3.5 * flops),
                ):
                    if impl == "pallas_det" and mode == "fwd":
                        continue  # the same forward kernel as pallas
                    if impl in forward_only and mode == "fwd_bwd":
                        rec["fwd_bwd_error"] = "backward failed the check"
                        continue
                    t0 = time.perf_counter()
                    try:
                        ms = median_ms(fn, fargs, reps)
                    except Exception as e:  # out of memory, unsupported size: recorded, go on
                        log(
                            f"  {impl:10s} H={H:3d} T={T:6d} {mode:8s} failed: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
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
            add_speedups(records, base)
            save(args.out, meta, records)
            del q, k, v, idx, do, dense

    log(
        f"\n| impl | H | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
        f"{base} speedup fwd | fwd+bwd |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda r, key, f: f.format(r[key]) if key in r else "-"  # noqa: E731
    for r in records:
        log(
            f"| {r['impl']} | {r['H']} | {r['T']} | {fmt(r, 'fwd_ms', '{:.2f}')} | "
            f"{fmt(r, 'fwd_tflops', '{:.1f}')} | {fmt(r, 'fwd_bwd_ms', '{:.2f}')} | "
            f"{fmt(r, 'fwd_bwd_tflops', '{:.1f}')} | {fmt(r, 'speedup_fwd', '{:.2f}x')} | "
            f"{fmt(r, 'speedup_fwd_bwd', '{:.2f}x')} |"
        )
    path = save(args.out, meta, records)
    log(f"wrote {path}")
    plot(records, os.path.join(args.out, "bench_attention.png"), D, Dv, args.topk)


def add_speedups(records, base):
    """speedup_<mode> = this impl's median / base's median at the same (H, T), same run."""
    by_key = {(r["impl"], r["H"], r["T"]): r for r in records}
    for r in records:
        ref = by_key.get((base, r["H"], r["T"]))
        if ref is None or r["impl"] == base:
            continue
        for mode in ("fwd", "fwd_bwd"):
            if f"{mode}_ms" in r and f"{mode}_ms" in ref:
                r[f"speedup_{mode}"] = r[f"{mode}_ms"] / ref[f"{mode}_ms"]


def save(out, meta, records, name="bench_attention"):
    """Write {meta, records} to <out>/<name>.json; returns its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    return path


def run_meta() -> dict:
    """jax version, device and command line of this run, for its record."""
    return {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "command": "python3 " + " ".join(sys.argv),
    }


def plot(records, path, D, Dv, topk):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.set_title(f"sparse attention {mode.replace('_', '+')}, k={topk}, D={D}, Dv={Dv}, bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
