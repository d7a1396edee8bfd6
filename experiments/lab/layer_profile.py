"""Lab probe: where one layer's forward+backward spends its GPU time, kernel by kernel.

    PYTHONPATH=. python3 experiments/lab/layer_profile.py --preset glm-5.1 --T 32768 \\
        [--modes hyscale/replay dense/full] [--mlp-chunk 16384] [--steps 3] [--out DIR]
    PYTHONPATH=. python3 experiments/lab/layer_profile.py --preset cpu --T 256   # smoke run

The layer is reproduce.py's (`_layer_fn`: one block, forward+backward with the indexer loss,
bf16, B = 1). For each mode it compiles, runs one warm-up step, then --steps steps under
`jax.profiler.trace`, and sums the device's kernel events of the trace per kernel name (on a
CPU-only machine: the XLA runtime threads' events, a smoke test of the pipeline only). Kernels
are grouped by what they do (the Pallas selection, attention and indexer-loss kernels by their
`pallas_call` names, the Mosaic GPU attention kernels, cuDNN attention, matmuls, sorts, copies,
the rest of XLA's fusions); per mode the record holds the groups' ms per step, the 25 costliest
kernels, and the step's wall time beside the kernels' sum (their difference: time the GPU sat
idle). Writes <out>/layer_profile.{json,png} (default runs/layer_profile/).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import reproduce  # noqa: E402

# (group, pattern on the lower-cased kernel name and its HLO op), first match wins.
GROUPS = (
    ("HyTopK selection", r"hytopk"),
    # The Mosaic GPU kernels all carry one generic name: in the library they are the sparse
    # attention's forward and dQ kernels.
    ("sparse attention: Mosaic GPU (forward, dQ)", r"mosaic"),
    ("sparse attention: Triton (delta, key gradients)", r"sparse_attn"),
    ("indexer loss", r"indexer_kl"),
    ("cuDNN attention", r"cudnn|sdpa|fmha|flash"),
    ("matmuls", r"gemm|nvjet|cutlass|xmma|cublas|matmul|dot"),
    ("sorts", r"sort"),
    ("copies and transposes", r"memcpy|memset|copy|transpose"),
    ("reductions", r"reduce"),
)
OTHER = "other XLA kernels (elementwise fusions)"


def group_of(name: str) -> str:
    low = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, low):
            return group
    return OTHER


def kernel_events(trace_dir: str) -> tuple[list[dict], str]:
    """The kernel events of the one trace under trace_dir, and where they ran: the device's
    streams, or on a machine without one the XLA runtime threads of the host."""
    (path,) = Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    procs = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [e for e in events if e.get("ph") == "X"]
    device = {pid for pid, name in procs.items() if name.startswith("/device:")}
    # A device's kernels live on its "Stream" threads (other threads hold XLA op spans that
    # enclose them: counting both would count the time twice).
    on_device = [
        e
        for e in spans
        if e["pid"] in device and "stream" in threads.get((e["pid"], e.get("tid")), "").lower()
    ]
    if on_device:
        return on_device, "device streams"
    runtime = [
        e
        for e in spans
        if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
        and not e.get("name", "").startswith("ThunkExecutor")  # spans enclosing the ops
    ]
    return runtime, "host XLA runtime threads (no device in the trace)"


def summarize(events: list[dict], steps: int) -> dict:
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    hlo_ops: dict[str, str] = {}
    for e in events:
        name = e.get("name", "?")
        by_name[name][0] += e.get("dur", 0.0) / 1e3 / steps  # us -> ms per step
        by_name[name][1] += 1
        args = e.get("args", {})
        hlo_ops.setdefault(name, args.get("hlo_op", "") or args.get("long_name", ""))
    groups: dict[str, float] = collections.Counter()
    for name, (ms, _) in by_name.items():
        groups[group_of(f"{name} {hlo_ops.get(name, '')}")] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "kernels_ms_per_step": sum(ms for ms, _ in by_name.values()),
        "groups_ms_per_step": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {
                "name": name[:200],
                "hlo_op": hlo_ops.get(name, "")[:120],
                "group": group_of(f"{name} {hlo_ops.get(name, '')}"),
                "ms_per_step": ms,
                "launches_per_step": n / steps,
            }
            for name, (ms, n) in top
        ],
    }


def profile_mode(cfg, T: int, steps: int) -> dict:
    state, fn = reproduce._layer_fn(cfg, T)
    xs, r = reproduce._layer_inputs(cfg, 1, T)
    t0 = time.perf_counter()
    compiled = fn.lower(state, xs[0], r).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(state, xs[0], r))  # warm-up
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            for i in range(steps):
                jax.block_until_ready(compiled(state, xs[i % 2], r))
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        events, source = kernel_events(trace_dir)
    out = summarize(events, steps)
    return {"compile_s": compile_s, "wall_ms_per_step": wall_ms, "events_from": source, **out}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in record["modes"] if "groups_ms_per_step" in m]
    if not modes:
        return
    names = list(dict.fromkeys(g for m in modes for g in m["groups_ms_per_step"]))
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(modes)))
    colors = plt.get_cmap("tab20").colors
    for row, m in enumerate(modes):
        left = 0.0
        for i, g in enumerate(names):
            ms = m["groups_ms_per_step"].get(g, 0.0)
            ax.barh(
                row, ms, left=left, color=colors[i % len(colors)], label=g if row == 0 else None
            )
            left += ms
        ax.text(left, row, f" {left:.0f} ms (wall {m['wall_ms_per_step']:.0f})", va="center")
    ax.set_yticks(range(len(modes)), [m["mode"] for m in modes])
    ax.set_xlabel("GPU kernel time per forward+backward step (ms)")
    ax.set_title(f"{record['preset']} layer, T = {record['T']}, {record['device']}")
    ax.set_xlim(0, 1.25 * max(sum(m["groups_ms_per_step"].values()) for m in modes))
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="glm-5.1", choices=sorted(reproduce.PRESETS))
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--modes", nargs="+", default=["hyscale/replay", "dense/full"])
    p.add_argument("--mlp-chunk", type=int, default=16384, help="0: the SwiGLU unchunked")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="runs/layer_profile")
    args = p.parse_args(argv)
    base = reproduce.PRESETS[args.preset]["layer_model"]
    if args.mlp_chunk:
        base = dataclasses.replace(base, mlp_chunk=args.mlp_chunk)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "jax": jax.__version__,
        "device": reproduce.device_name(),
        "preset": args.preset,
        "T": args.T,
        "mlp_chunk": args.mlp_chunk,
        "steps": args.steps,
        "command": reproduce.command_line(),
        "modes": [],
    }
    for mode in args.modes:
        attention, remat = mode.split("/")
        cfg = reproduce.mode_config(base, attention, remat)
        try:
            row = {"mode": mode, **profile_mode(cfg, args.T, args.steps)}
        except Exception as err:  # out of memory at this length: recorded, go on
            row = {"mode": mode, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        record["modes"].append(row)
        (out / "layer_profile.json").write_text(json.dumps(record, indent=1))
        print(f"\n{mode}: " + (row.get("error") or ""))
        if "groups_ms_per_step" in row:
            print(
                f"  wall {row['wall_ms_per_step']:.2f} ms/step, kernels "
                f"{row['kernels_ms_per_step']:.2f} ({row['events_from']}), compile "
                f"{row['compile_s']:.0f} s"
            )
            for g, ms in row["groups_ms_per_step"].items():
                print(f"  {ms:9.2f} ms  {g}")
            print("  costliest kernels:")
            for k in row["top_kernels"][:15]:
                print(
                    f"  {k['ms_per_step']:9.2f} ms x{k['launches_per_step']:.0f}  "
                    f"[{k['group']}] {k['name'][:90]} {k['hlo_op'][:40]}"
                )
        jax.clear_caches()
    plot(record, out / "layer_profile.png")
    print(f"\nwrote {out / 'layer_profile.json'}")


if __name__ == "__main__":
    main()
