"""Cost of the sharded code path on a 1-device mesh: `hs.parallel.hyscale_attention` with
`make_mesh(data=1, seq=1)` against the single-device `hs.hyscale_attention`, forward and
forward+backward (grads in q, k, v under a random cotangent), same inputs, same impl.

    PYTHONPATH=. python experiments/bench_parallel_overhead.py                # T = 32768 (GPU)
    PYTHONPATH=. python experiments/bench_parallel_overhead.py --T 1024 --heads 4 --topk 128

Shapes: B=1, T=S=--T, H=--heads, G=1, D=Dv=128, HI=32, DI=128, k=--topk, bf16, causal.
Before timing, both paths must return identical indices and outputs (the script stops
otherwise). Timing: every call compiled and run once, then --reps rounds, each timing all four
calls in turn (single/mesh x fwd/fwd+bwd, so clock drift hits both paths alike), each call
synchronized with block_until_ready; medians per call, overhead = mesh / single - 1 from the same
run. Multi-device scaling of the full training step: scale_parallel.py.

Output: <out>/bench_parallel_overhead.{json,png}, by default under runs/bench_parallel_overhead/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reproduce

import hyscale_jax as hs

PHASES = ("fwd", "fwd+bwd")


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


def plot(record: dict, path: Path) -> None:
    """Median time per phase, single-device op against the 1-device mesh, overhead on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.bar([x - 0.2 for x in xs], [r["single_ms"] for r in rows], 0.4, label="hs.hyscale_attention")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["mesh1_ms"] for r in rows],
        0.4,
        label="hs.parallel.hyscale_attention, mesh data=1, seq=1",
    )
    for x, r in zip(xs, rows):
        top = max(r["single_ms"], r["mesh1_ms"])
        ax.annotate(f"{r['overhead_pct']:+.1f}%", (x, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs, [r["phase"] for r in rows])
    ax.set_ylabel("median ms")
    shape = record["shape"]
    ax.set_title(f"T = {shape['T']}, H = {shape['H']}, k = {shape['topk']}, impl {record['impl']}")
    ax.set_ylim(0, 1.35 * max(max(r["single_ms"], r["mesh1_ms"]) for r in rows))
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{record['device']}, jax {record['jax']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=reproduce.HelpFormatter)
    ap.add_argument("--T", type=int, default=32768, help="sequence length T = S")
    ap.add_argument("--heads", type=int, default=16, help="attention heads H (one kv head)")
    ap.add_argument("--topk", type=int, default=2048, help="keys selected per query (capped at T)")
    ap.add_argument(
        "--impl", default="auto", help="kernel implementation: auto, pallas, interpret, xla"
    )
    ap.add_argument("--reps", type=int, default=10, help="timing rounds, median reported")
    ap.add_argument(
        "--out",
        default=None,
        help="folder for the JSON and PNG (default: runs/bench_parallel_overhead/ in the "
        "repository)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else reproduce.RUNS / "bench_parallel_overhead"
    progress = reproduce.Progress()
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
    print(
        f"jax {jax.__version__} on {reproduce.device_name()}; T={T} H={H} k={topk} "
        f"impl={args.impl}; writing to {out}",
        flush=True,
    )
    progress.start("check: forward of both paths")
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
    progress.done(f"identical idx {same_idx}, identical out {same_out}")
    if not (same_idx and same_out):
        raise SystemExit("the 1-device mesh path disagrees with the single-device op")

    calls = {}
    for name, (fwd, grad) in paths.items():
        calls[(name, "fwd")] = lambda f=fwd: f(*inputs)
        calls[(name, "fwd+bwd")] = lambda g=grad: g((q, k, v), (q_idx, k_idx, w), cot)
    progress.start("compile and warm up all four calls")
    for fn in calls.values():
        jax.block_until_ready(fn())
    progress.done("done")
    times = {key: [] for key in calls}
    for rep in range(args.reps):
        progress.start(f"round {rep + 1}/{args.reps}")
        for key, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append((time.perf_counter() - t0) * 1e3)
        progress.done(", ".join(f"{n}/{p} {v[-1]:.2f} ms" for (n, p), v in times.items()))
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    print()
    for phase in PHASES:
        a, b = med[("single", phase)], med[("mesh1", phase)]
        rows.append(
            dict(
                phase=phase,
                single_ms=a,
                mesh1_ms=b,
                mesh1_over_single=b / a,
                overhead_pct=100 * (b / a - 1),
            )
        )
        print(
            f"{phase:<8} single {a:8.2f} ms   1-device mesh {b:8.2f} ms   "
            f"overhead {100 * (b / a - 1):+.1f}%",
            flush=True,
        )
    record = dict(
        jax=jax.__version__,
        device=reproduce.device_name(),
        shape=dict(
            B=B, T=T, S=T, H=H, G=1, D=D, HI=HI, DI=DI, topk=topk, dtype="bfloat16", causal=True
        ),
        impl=args.impl,
        reps=args.reps,
        command=reproduce.command_line(),
        identical=dict(idx=same_idx, out=same_out),
        rows=rows,
        raw_ms={f"{n}/{p}": v for (n, p), v in times.items()},
        wall_s=progress.elapsed(),
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_parallel_overhead.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
