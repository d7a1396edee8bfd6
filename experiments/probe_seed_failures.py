"""How often HyTopK's seeded start fails and its program re-runs (issue 3), on GPU.

    PYTHONPATH=. python3 experiments/probe_seed_failures.py [--sizes 8192,32768,65536]

The default kernel (BlockSizes.seed_rate=16) starts each row's stream at a threshold read off a
1/16 sample of its keys. A row that ends its stream with fewer than k entries had a seed above
its k-th key; its program (block_q rows) runs again from the floor (`hytopk_seed_rerun`), which
costs one unseeded program. Exactness never depends on this; speed does. This counts those rows
and programs on the benchmark's inputs (B=1, HI=32, DI=128, k=2048, causal, bf16): the
normal-distributed timed inputs of experiments/bench_selection.py, and its small-integer check
inputs (heavy ties).

A row counts as failed when it has at least k visible keys and its "stats" counter final_count
(entries before the final compaction; a re-run program keeps its first attempt's counters) is
below k: an unseeded row with k visible keys always reaches k. Writes DIR/probe_seed_failures.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_selection as bsel  # noqa: E402
from pallas_kernels import hytopk as phk  # noqa: E402


def failures(q, kk, w, k, bs, interpret=False):
    """(failed rows, failed programs, rows with >= k visible keys) of one causal selection."""
    T, S = q.shape[1], kk.shape[1]
    _, _, _, st = phk.hytopk_candidates(q, kk, w, k=k, causal=True, interpret=interpret,
                                        block_sizes=dataclasses.replace(bs, diagnostic="stats"))
    final = np.asarray(st)[0, :T, phk.STAT_FIELDS.index("final_count")]
    visible = np.arange(T) + (S - T) + 1
    failed = (visible >= k) & (final < k)
    programs = np.unique(np.nonzero(failed)[0] // bs.block_q)
    return int(failed.sum()), int(programs.size), int((visible >= k).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768,65536")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(bsel.RESULTS, "probe_seed_failures"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bs = phk.BlockSizes()
    record = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, block_sizes=str(bs),
                  k=args.k, rows=[])
    for T in (int(s) for s in args.sizes.split(",")):
        for name, make in (("normal", bsel.normal_inputs), ("integers", bsel.int_inputs)):
            for seed in (10, 11):
                q, kk, w = make(seed, 1, T, T, 32, 128, jnp.bfloat16)
                rows, programs, eligible = failures(q, kk, w, args.k, bs)
                n_programs = -(-T // bs.block_q)
                record["rows"].append(dict(T=T, inputs=name, seed=seed, failed_rows=rows,
                                           failed_programs=programs, programs=n_programs,
                                           rows_with_k_visible=eligible))
                print(f"T={T:6d} {name:8s} seed {seed}: {rows} of {eligible} rows failed their "
                      f"seed; {programs} of {n_programs} programs re-ran", flush=True)
                with open(os.path.join(args.out, "probe_seed_failures.json"), "w") as f:
                    json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
