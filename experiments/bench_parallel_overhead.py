"""Cost of the sharded code path on a 1-device mesh (issue 6): `hs.parallel.hyscale_attention`
with `make_mesh(data=1, seq=1)` against the single-device `hs.hyscale_attention`, forward and
forward+backward (grads in q, k, v under a random cotangent), same inputs, same impl.

    PYTHONPATH=. python experiments/bench_parallel_overhead.py            # T = 32768 on GPU
    python experiments/bench_parallel_overhead.py --T 2048 --reps 3       # a CPU smoke run

Checks that both paths return identical indices and outputs before timing; the two paths are
timed interleaved (A, B, A, B, ...) so clock drift hits both alike. Writes a JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import hyscale_jax as hs

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def make_inputs(key, B, T, H, D, HI, DI, dtype):
    ks = jax.random.split(key, 7)
    n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)  # noqa: E731
    q, k, v = n(ks[0], (B, T, H, D)), n(ks[1], (B, T, 1, D)), n(ks[2], (B, T, 1, D))
    q_idx, k_idx = n(ks[3], (B, T, HI, DI)), n(ks[4], (B, T, DI))
    w = jax.random.uniform(ks[5], (B, T, HI), jnp.float32).astype(dtype)
    cot = n(ks[6], (B, T, H, D))
    return (q, k, v, q_idx, k_idx, w), cot


def build(layer, topk, impl):
    fwd = jax.jit(lambda *a: layer(*a, topk=topk, impl=impl))

    def loss(qkv, rest, cot):
        out, _ = layer(*qkv, *rest, topk=topk, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss))
    return fwd, grad


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--T", type=int, default=32768, help="T = S")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    B, T, H, D, HI, DI = 1, args.T, args.heads, 128, 32, 128
    topk = min(args.topk, T)
    (q, k, v, q_idx, k_idx, w), cot = make_inputs(
        jax.random.key(0), B, T, H, D, HI, DI, jnp.bfloat16
    )
    mesh = hs.parallel.make_mesh(data=1, seq=1)
    sharded = lambda *a, **kw: hs.parallel.hyscale_attention(*a, mesh=mesh, **kw)  # noqa: E731
    paths = {
        "single": build(hs.hyscale_attention, topk, args.impl),
        "mesh1": build(sharded, topk, args.impl),
    }

    inputs = (q, k, v, q_idx, k_idx, w)
    results = {name: fwd(*inputs) for name, (fwd, _) in paths.items()}
    same_idx = bool(
        np.array_equal(np.asarray(results["single"][1]), np.asarray(results["mesh1"][1]))
    )
    same_out = bool(
        np.array_equal(
            np.asarray(results["single"][0], np.float32),
            np.asarray(results["mesh1"][0], np.float32),
        )
    )
    print(
        f"T={T} H={H} k={topk} impl={args.impl} device={jax.devices()[0].device_kind}: "
        f"identical idx {same_idx}, identical out {same_out}",
        flush=True,
    )
    if not (same_idx and same_out):
        raise SystemExit("the 1-device mesh path disagrees with the single-device op")

    calls = {}
    for name, (fwd, grad) in paths.items():
        calls[(name, "fwd")] = lambda f=fwd: f(*inputs)
        calls[(name, "fwd+bwd")] = lambda g=grad: g((q, k, v), (q_idx, k_idx, w), cot)
    for fn in calls.values():  # compile + warm up
        jax.block_until_ready(fn())
    times = {key: [] for key in calls}
    for _ in range(args.reps):
        for key, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append((time.perf_counter() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    for phase in ("fwd", "fwd+bwd"):
        a, b = med[("single", phase)], med[("mesh1", phase)]
        rows.append(dict(phase=phase, single_ms=a, mesh1_ms=b, overhead_pct=100 * (b / a - 1)))
        print(
            f"{phase:<8} single {a:8.2f} ms   1-device mesh {b:8.2f} ms   "
            f"overhead {100 * (b / a - 1):+.1f}%",
            flush=True,
        )
    os.makedirs(args.out_dir, exist_ok=True)
    record = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        shape=dict(
            B=B, T=T, S=T, H=H, G=1, D=D, HI=HI, DI=DI, topk=topk, dtype="bfloat16", causal=True
        ),
        impl=args.impl,
        reps=args.reps,
        identical=dict(idx=same_idx, out=same_out),
        rows=rows,
        raw_ms={f"{n}/{p}": v for (n, p), v in times.items()},
    )
    path = os.path.join(args.out_dir, "bench_parallel_overhead.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
