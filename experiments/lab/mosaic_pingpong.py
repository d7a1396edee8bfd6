"""Lab probe: do the Mosaic GPU kernels gain from the consumers' schedule barrier?

    PYTHONPATH=. python3 experiments/lab/mosaic_pingpong.py --seq 32768 --heads 64 128 [--out DIR]

`pallas_kernels/sparse_attention_mosaic.py`'s forward and dQ kernels, each traced with
`_PINGPONG` on (the consumers take turns on the tensor cores) and off (each consumer runs its
matmuls and softmax as they come), at MLA's absorbed shape (D = 576, the value the key's
leading 512 features, k = 2048, bf16, causal random indices as in bench_attention). Both
variants must give bit-identical outputs (the arithmetic is the same); then each is timed
alone, the two interleaved over --rounds rounds of --reps calls, median per variant. Prints a
table and writes <out>/mosaic_pingpong.json (default runs/mosaic_pingpong/). Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import make_inputs, run_meta, save  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402
from pallas_kernels import sparse_attention_mosaic as psm  # noqa: E402

D, DV, TOPK = 576, 512, 2048


def kernels(pingpong: bool):
    """The forward and dQ kernels jitted with the schedule barrier on or off."""
    psm._PINGPONG = pingpong
    scale = D**-0.5
    fwd = jax.jit(
        lambda q, k, idx: psm.forward(
            q, k, idx, scale_log2=scale * psa._LOG2E, mask_value=psa._MASK_VALUE
        )
    )
    dq = jax.jit(
        lambda q, k, idx, lse, delta, do: psm.dq(
            q, k, idx, lse, delta, do, scale=scale, scale_log2=scale * psa._LOG2E
        )
    )
    return fwd, dq


def timed(fn, args, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="runs/mosaic_pingpong")
    args = ap.parse_args(argv)
    records = []
    for H in args.heads:
        q, k, _, idx, do = make_inputs(1, args.seq, H, D, DV, TOPK, shared=True)
        variants = {}
        for pingpong in (True, False):
            fwd, dq = kernels(pingpong)
            o, lse = jax.block_until_ready(fwd(q, k, idx))
            # Any delta times the kernel alike; sum(o dO) keeps dS of the usual size.
            delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
            g = jax.block_until_ready(dq(q, k, idx, lse, delta, do))
            variants[pingpong] = dict(fwd=fwd, dq=dq, outs=(o, lse, g), dq_args=(lse, delta))
        for a, b in zip(variants[True]["outs"], variants[False]["outs"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        _, lse, _ = variants[True]["outs"]
        delta = variants[True]["dq_args"][1]
        times = {(p, part): [] for p in (True, False) for part in ("forward", "dq")}
        for _ in range(args.rounds):
            for p in (True, False):
                v = variants[p]
                times[(p, "forward")] += timed(v["fwd"], (q, k, idx), args.reps)
                times[(p, "dq")] += timed(v["dq"], (q, k, idx, lse, delta, do), args.reps)
        for part in ("forward", "dq"):
            on = statistics.median(times[(True, part)])
            off = statistics.median(times[(False, part)])
            records.append(dict(T=args.seq, H=H, kernel=part, pingpong_ms=on, without_ms=off))
            print(f"T={args.seq} H={H} {part}: schedule barrier {on:.2f} ms, without {off:.2f} ms")
    path = save(args.out, run_meta(), records, name="mosaic_pingpong")
    print("wrote", path)


if __name__ == "__main__":
    main()
