"""Quickstart: run the HyScale layer, check it against the references, then compare the
streaming selection (`hytopk`, impl="xla") with the materialized baseline (`topk_reference`)
in time and peak temporary memory as the sequence grows.

    python experiments/quickstart.py                    # small CPU default, a minute or two
    python experiments/quickstart.py --seq 32768 --index-heads 32 --index-dim 128 --topk 2048

Every selection is checked index for index against `topk_reference` before it is timed, and
the script ends with "all checks passed" (or exits with an error naming the check). Writes
quickstart.json (jax version, device, shapes, medians, ratios, command line) and
quickstart.png into --out (default runs/quickstart/, from the directory it runs in).

Reading the table: "temporaries" is the scratch memory XLA plans for the compiled function
(`memory_analysis()`). The reference builds the [B, T, S] f32 score table, so its temporaries
grow as T^2. The streaming path holds one block of scores at a time, [B, block_q, HI, block_k]
f32 (512 queries x 4096 keys by default); a block never extends past the sequence, so below
T = block_k its temporaries grow with T, and from T = block_k on they stay flat. At small T the
table is small and the reference needs less. Time: both compute every visible score, so on CPU
neither is much faster; the streaming path's gain here is memory (its speed on GPU comes from
the Pallas kernel, impl="pallas").
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
import hyscale_jax as hs
from hyscale_jax import reference, selection


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        metavar="T",
        help="sequence lengths T = S to compare (causal)",
    )
    p.add_argument("--batch", type=int, default=1, metavar="B", help="batch size B")
    p.add_argument("--index-heads", type=int, default=4, metavar="HI", help="indexer heads HI")
    p.add_argument("--index-dim", type=int, default=32, metavar="DI", help="indexer head dim DI")
    p.add_argument("--topk", type=int, default=64, metavar="K", help="keys selected per query")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="indexer input dtype",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/quickstart"),
        metavar="DIR",
        help="folder for quickstart.json and quickstart.png",
    )
    return p.parse_args(argv)


def check_layer():
    """One small layer forward through the public API, checked against the references."""
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
        f"layer check (B={B}, T={T}, H={H}, k={K}, f32): indices equal to topk_reference: "
        f"{same:.4f}; max |out - sparse_attention_reference| = {err:.2e}"
    )
    if same < 0.999 or err > 1e-4:
        sys.exit("layer check FAILED: hyscale_attention disagrees with the references")
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


def plot(record, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("reference", "topk_reference (table)"), ("xla", "hytopk, impl='xla'")):
        pts = [(r["T"], r[f"{key}_ms"], r[f"{key}_temp_bytes"]) for r in rows if f"{key}_ms" in r]
        if not pts:
            continue
        ts = [p[0] for p in pts]
        ax_t.plot(ts, [p[1] for p in pts], "o-", label=label)
        mem = [(t, b / 2**20) for t, _, b in pts if b is not None]
        ax_m.plot([m[0] for m in mem], [m[1] for m in mem], "o-", label=label)
    bk = record["shape"]["block_k"]
    ax_m.axvline(bk, color="grey", ls=":", label=f"T = one key block ({bk})")
    for ax, title in ((ax_t, "time (median ms)"), (ax_m, "temporaries (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T = S")
        ax.set_title(title)
        ax.legend()
    s = record["shape"]
    fig.suptitle(
        f"exact top-{s['k']} selection, B={s['B']}, HI={s['HI']}, DI={s['DI']}, {s['dtype']}, "
        f"causal; {record['device']}"
        + ("" if record["device"] == record["backend"] else f" ({record['backend']})"),
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    B, HI, DI, K = args.batch, args.index_heads, args.index_dim, args.topk
    BQ, BK = selection.DEFAULT_BLOCK_Q, selection.DEFAULT_BLOCK_K
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    record = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "command": " ".join([sys.executable, *sys.argv]),
        "layer_check": check_layer(),
        "shape": {
            "B": B,
            "HI": HI,
            "DI": DI,
            "k": K,
            "dtype": args.dtype,
            "causal": True,
            "block_q": BQ,
            "block_k": BK,
        },
        "rows": [],
    }
    xla = jax.jit(lambda q, k, w: hs.hytopk(q, k, w, k=K, impl="xla"))
    ref = jax.jit(lambda q, k, w: hs.topk_reference(q, k, w, k=K))
    print(
        f"\nselection: B={B}, HI={HI}, DI={DI}, k={K}, {args.dtype}, causal; median of "
        f"{args.repeats} runs\n"
        "temporaries = scratch memory XLA plans for the compiled function (memory_analysis()):\n"
        "  reference: the [B, T, S] f32 score table, growing as T^2 (small at small T, where it\n"
        "    needs less than the streaming path)\n"
        "  xla (streaming): one block of scores, [B, queries, HI, keys] f32 ('xla block'), at\n"
        f"    most {BQ} x {BK}; a block stops at T, so they grow with T up to T = {BK}, then stay "
        "flat\n"
        "time: both compute every visible score; on CPU the streaming path gains memory, not time\n"
    )
    header = (
        f"{'T=S':>7} {'table MiB':>10} {'ref ms':>9} {'ref temp MiB':>13} "
        f"{'xla ms':>9} {'xla temp MiB':>13} {'xla block':>10} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    checked = 0
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
        row["xla_block"] = [min(BQ, T), min(BK, T)]
        # XLA's GPU kernels index a table with int32: from 2**31 entries on, the materialized
        # reference fails (seen on an H200 at T=S=65536: illegal memory access); it builds one
        # batch element's [T, S] table at a time, so B does not count.
        if T * T < reference.TABLE_ENTRIES_LIMIT:
            got, want = xla(*arg_sets[0]), ref(*arg_sets[0])
            row["index_agreement"] = float(jnp.mean(got == want))
            if row["index_agreement"] < 0.999:  # random floats: only near-ties may differ
                sys.exit(
                    f"check FAILED at T={T}: hytopk disagrees with topk_reference "
                    f"({row['index_agreement']:.4f} of indices equal)"
                )
            checked += 1
            row["reference_ms"] = timed(ref, arg_sets, args.repeats)
            row["reference_temp_bytes"] = temp_bytes(ref, arg_sets[0])
            row["speedup"] = row["reference_ms"] / row["xla_ms"]
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
        print(
            f"{T:>7} {row['table_bytes'] / 2**20:>10.1f} "
            f"{row.get('reference_ms', float('nan')):>9.2f} "
            f"{mib(row.get('reference_temp_bytes')):>13} {row['xla_ms']:>9.2f} "
            f"{mib(row['xla_temp_bytes']):>13} "
            f"{'x'.join(map(str, row['xla_block'])):>10} "
            f"{row.get('speedup', float('nan')):>7.2f}x",
            flush=True,
        )
        if "reference_ms" not in row:
            print(f"{'':>7} reference skipped: its [T,S] table has >= 2**31 entries")
        record["rows"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quickstart.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(record, args.out / "quickstart.png")
    print(f"\nwrote {args.out / 'quickstart.json'} and {args.out / 'quickstart.png'}")
    print(
        f"all checks passed: the layer matches the references, and hytopk's indices match "
        f"topk_reference at {checked} of {len(args.seq)} lengths (the rest too long for the "
        "reference)"
        if checked < len(args.seq)
        else f"all checks passed: the layer matches the references, and hytopk's indices match "
        f"topk_reference at every length ({', '.join(map(str, args.seq))})"
    )


if __name__ == "__main__":
    main()
