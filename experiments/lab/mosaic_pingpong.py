"""Lab probe: does the Mosaic GPU forward gain from its consumers' schedule barrier?

    PYTHONPATH=. python3 experiments/lab/mosaic_pingpong.py --seq 32768 --heads 64 128 [--out DIR]

`pallas_kernels/sparse_attention_mosaic.py`'s forward traced with `_PINGPONG` on (the
consumers take turns on the tensor cores) and off (each consumer runs its matmuls and softmax
as they come; the kernel as it runs today), at MLA's absorbed shape (D = 576, the value the
key's leading 512 features, k = 2048, bf16, causal random indices as in bench_attention). The
two variants must lower to different modules and give bit-identical outputs (the arithmetic is
the same); then each is timed alone, the two interleaved over --rounds rounds (each round the
median of --reps calls, bench_attention's `median_ms`), the median round per variant. Prints
a table and writes <out>/mosaic_pingpong.json (default runs/mosaic_pingpong/). Needs a Hopper
GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import make_inputs, median_ms, run_meta, save  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402
from pallas_kernels import sparse_attention_mosaic as psm  # noqa: E402

D, DV, TOPK = 576, 512, 2048


def forward(pingpong: bool, q, k, idx):
    """The forward kernel jitted with the schedule barrier on or off, traced and compiled now
    (the flag is read at trace time), and its lowered module's text."""
    psm._PINGPONG = pingpong
    scale = D**-0.5
    fwd = jax.jit(
        lambda q, k, idx: psm.forward(
            q, k, idx, scale_log2=scale * psa._LOG2E, mask_value=psa._MASK_VALUE
        )
    )
    text = fwd.lower(q, k, idx).as_text()
    jax.block_until_ready(fwd(q, k, idx))
    return fwd, text


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
        q, k, _, idx, _ = make_inputs(1, args.seq, H, D, DV, TOPK, shared=True)
        fwd = {}
        texts = {}
        for pingpong in (True, False):
            fwd[pingpong], texts[pingpong] = forward(pingpong, q, k, idx)
        assert texts[True] != texts[False], "the flag did not change the kernel"
        for a, b in zip(fwd[True](q, k, idx), fwd[False](q, k, idx)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for pingpong in (True, False):
                times[pingpong].append(median_ms(fwd[pingpong], (q, k, idx), args.reps))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        records.append(dict(T=args.seq, H=H, kernel="forward", pingpong_ms=on, without_ms=off))
        print(f"T={args.seq} H={H} forward: schedule barrier {on:.2f} ms, without {off:.2f} ms")
    path = save(args.out, run_meta(), records, name="mosaic_pingpong")
    print("wrote", path)


if __name__ == "__main__":
    main()
