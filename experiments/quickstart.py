"""Quickstart: run the HyScale layer, check it against the references, then compare the
streaming selection (`hytopk`, impl="xla") with the materialized baseline (`topk_reference`)
in time and peak temporary memory as the sequence grows.

    python experiments/quickstart.py                    # small CPU default, a minute or two
    python experiments/quickstart.py --seq 32768 --index-heads 32 --index-dim 128 --topk 2048
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import hyscale_jax as hs  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="sequence lengths T = S to compare (causal)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--index-heads", type=int, default=4, help="indexer heads HI")
    p.add_argument("--index-dim", type=int, default=32, help="indexer head dim DI")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="JSON record (default experiments/results/quickstart_<backend>.json)",
    )
    return p.parse_args()


def check_layer():
    """One small layer forward+backward through the public API, checked against references."""
    rng = np.random.default_rng(0)
    B, T, H, D, HI, DI, K = 2, 96, 4, 32, 4, 16, 24
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(B, T, H, D), normal(B, T, 1, D), normal(B, T, 1, D)
    q_idx, k_idx, w = normal(B, T, HI, DI), normal(B, T, DI), normal(B, T, HI)
    out, idx = hs.hyscale_attention(q, k, v, q_idx, k_idx, w, topk=K, impl="xla")
    ref_idx = hs.topk_reference(q_idx, k_idx, w, k=K)
    ref_out = hs.sparse_attention_reference(q, k, v, ref_idx)
    same = float(jnp.mean(idx == ref_idx))
    err = float(jnp.max(jnp.abs(out - ref_out)))
    print(
        f"layer check: indices equal to topk_reference: {same:.4f}; "
        f"max |out - reference| = {err:.2e}"
    )
    if same < 0.999 or err > 1e-4:
        sys.exit("layer check FAILED")
    return {"index_agreement": same, "max_abs_err": err}


def timed(fn, arg_sets, repeats):
    fn(*arg_sets[0]).block_until_ready()  # compile + warm up
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(*arg_sets[i % len(arg_sets)]).block_until_ready()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def temp_bytes(fn, args):
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if stats is None else stats.temp_size_in_bytes


def main():
    args = parse_args()
    dtype = jnp.dtype(args.dtype)
    B, HI, DI, K = args.batch, args.index_heads, args.index_dim, args.topk
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    record = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "layer_check": check_layer(),
        "shape": {"B": B, "HI": HI, "DI": DI, "k": K, "dtype": args.dtype, "causal": True},
        "rows": [],
    }
    xla = jax.jit(lambda q, k, w: hs.hytopk(q, k, w, k=K, impl="xla"))
    ref = jax.jit(lambda q, k, w: hs.topk_reference(q, k, w, k=K))
    header = (
        f"{'T=S':>7} {'table MiB':>10} {'ref ms':>9} {'ref temp MiB':>13} "
        f"{'xla ms':>9} {'xla temp MiB':>13} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    for T in args.seq:
        rng = np.random.default_rng(T)
        arg_sets = [
            tuple(
                jnp.asarray(rng.normal(size=s), dtype)
                for s in ((B, T, HI, DI), (B, T, DI), (B, T, HI))
            )
            for _ in range(2)
        ]
        flops = 2 * HI * DI * B * T * (T + 1) / 2
        row = {"T": T, "table_bytes": B * T * T * 4, "gflop": flops / 1e9}
        row["xla_ms"] = timed(xla, arg_sets, args.repeats)
        row["xla_temp_bytes"] = temp_bytes(xla, arg_sets[0])
        # XLA's GPU kernels index the [B, T, S] table with int32: from 2**31 entries on, the
        # materialized reference fails (seen on an H200 at T=S=65536: illegal memory access).
        if B * T * T < 2**31:
            got, want = xla(*arg_sets[0]), ref(*arg_sets[0])
            row["index_agreement"] = float(jnp.mean(got == want))
            if row["index_agreement"] < 0.999:  # random floats: only near-ties may differ
                sys.exit(
                    f"T={T}: hytopk disagrees with topk_reference "
                    f"({row['index_agreement']:.4f} of indices equal)"
                )
            row["reference_ms"] = timed(ref, arg_sets, args.repeats)
            row["reference_temp_bytes"] = temp_bytes(ref, arg_sets[0])
            row["speedup"] = row["reference_ms"] / row["xla_ms"]
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
        print(
            f"{T:>7} {row['table_bytes'] / 2**20:>10.1f} "
            f"{row.get('reference_ms', float('nan')):>9.2f} "
            f"{mib(row.get('reference_temp_bytes')):>13} {row['xla_ms']:>9.2f} "
            f"{mib(row['xla_temp_bytes']):>13} {row.get('speedup', float('nan')):>7.2f}x",
            flush=True,
        )
        if "reference_ms" not in row:
            print(f"{'':>7} reference skipped: its [B,T,S] table has >= 2**31 entries")
        record["rows"].append(row)
    out = args.out or RESULTS / f"quickstart_{jax.default_backend()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
