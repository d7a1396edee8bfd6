"""Multi-device scaling of sequence-parallel HyScale training.

    PYTHONPATH=. python experiments/scale_parallel.py          # CPU preset, simulated devices
    PYTHONPATH=. python experiments/scale_parallel.py --preset h200 --devices 1,2,4,8

Every point is one training step (forward, backward, AdamW, sparse-stage indexer KL) of
reproduce.py's end-to-end model, batch 1, on the mesh `data=1, seq=N` (`hs.parallel.make_mesh`:
queries sharded over "seq", keys all-gathered, exact selection per shard, zig-zag load balance;
docs/design.md, "Sequence parallelism"). Each point runs in its own subprocess that sees exactly N
devices (`CUDA_VISIBLE_DEVICES` on GPU, simulated host devices on CPU), so its peak memory is its
own and an out of memory error cannot poison the next point. NCCL's NVLink multicast is off
unless NCCL_NVLS_ENABLE is set.

Parts (`--only`, default all):
  check    the sharded step on N devices against the unsharded step on one device, at a size
           one device holds: same init, same batches, `--check-steps` steps; loss, indexer loss
           and gradient norm per step, and every layer's selected indices of the first batch.
  weak     T = T_per_device * N: step time, tokens/s per device, efficiency against N = 1.
           Causal selection scores T^2 / 2 pairs, so each device's share, T * T / (2N), grows
           with N at fixed T/N: weak efficiency < 1 even with free communication.
  strong   one T for every N: step time, speedup and efficiency against N = 1.
  longest  per N, T doubles from a start until the step fails (out of memory, error, timeout)
           or the preset's cap: hyscale/replay against the materialized/full baseline on the
           same mesh. The baseline's selection is left to XLA's SPMD partitioner, which builds
           whole [T, T] buffers on every device (the compiled CPU step at N=2, T=512 holds
           [1, 512, 512] buffers beside the [1, 256, 512] shards), so its points are skipped
           where that table reaches 2**31 entries (XLA's GPU kernels crash there:
           hyscale_jax.reference.TABLE_ENTRIES_LIMIT), whatever N.

Timing: reproduce.py's (compile, one warm-up step, median of --reps steps alternating two
batches, each synchronized with block_until_ready). Every T must be divisible by 2N (the zig-zag
layout); the script checks that before it starts.

Output: <out>/scale_parallel_<preset>.{json,png} (one panel per part measured, besides the
check), by default under runs/scale_parallel/; the JSON is rewritten after every point, so a
stopped run keeps what it measured. Absolute times mean something only on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from reproduce import PRESETS as E2E_PRESETS  # noqa: E402
from reproduce import (  # noqa: E402
    RUNS,
    HelpFormatter,
    Progress,
    add_budget_and_out,
    command_line,
    e2e_train_config,
    is_oom,
    result_line,
    time_steps,
)

from hyscale_jax import parallel, reference  # noqa: E402
from hyscale_jax.data import Dataset  # noqa: E402
from hyscale_jax.nn import ModelConfig  # noqa: E402
from hyscale_jax.train import create_train_state, make_train_step  # noqa: E402

HYSCALE, BASELINE = ("hyscale", "replay"), ("materialized", "full")
PARTS = ("check", "weak", "strong", "longest")
MIN_POINT_S = 60  # a point is not started with less of the time budget left

PRESETS = {
    # Simulated CPU devices and reproduce.py's tiny model: checks the pipeline, not speed.
    "cpu": dict(
        model=E2E_PRESETS["cpu"]["e2e_model"],
        platform="cpu",
        devices=[1, 2, 4],
        check_T=256,
        weak_T_per_device=256,
        strong_T=1024,
        longest_start=512,
        longest_cap=512,
        reps=2,
        point_timeout_s=240,
    ),
    # H200s and reproduce.py's h200 end-to-end model (4 layers, d_model 1024, H=16, indexer
    # 32 x 64, k = 2048); 128K tokens per device for weak scaling.
    "h200": dict(
        model=E2E_PRESETS["h200"]["e2e_model"],
        platform="gpu",
        devices=[1, 2, 4, 8],
        check_T=16384,
        weak_T_per_device=131072,
        strong_T=131072,
        longest_start=32768,
        longest_cap=2**23,
        reps=3,
        point_timeout_s=570,
    ),
}


# ----------------------------------------------------------------------------- workers
# Run in a subprocess that sees exactly the devices of its mesh (see `_worker_env`).


def _step_point(cfg, T: int, n: int, reps: int) -> dict:
    """Median time of one training step on the mesh data=1, seq=n."""
    if jax.device_count() != n:
        raise RuntimeError(f"worker sees {jax.device_count()} devices, expected {n}")
    mesh = parallel.make_mesh(data=1, seq=n)
    tcfg = e2e_train_config(T, 1)
    graphdef, state, tx = create_train_state(cfg, tcfg, mesh=mesh)
    step = make_train_step(graphdef, tx, tcfg, mesh=mesh)
    dataset = Dataset(tcfg.data)
    batches = [parallel.shard_batch(dataset.batch(i, 1, T), mesh) for i in range(2)]
    timed = time_steps(step, state, batches, "sparse", reps)
    ms = timed["median_ms"]
    peaks = []
    for d in jax.devices():
        try:
            peaks.append((d.memory_stats() or {}).get("peak_bytes_in_use"))
        except Exception:
            peaks.append(None)
    peaks = [p for p in peaks if p is not None]
    return {
        "status": "ok",
        "median_ms": ms,
        "times_ms": timed["times_ms"],
        "compile_s": timed["compile_s"],
        "tokens_per_s": T / (ms * 1e-3),
        "tokens_per_s_per_device": T / (ms * 1e-3) / n,
        "peak_bytes_per_device": max(peaks) if peaks else None,
        "loss": timed["loss"],
    }


def _check_point(cfg, T: int, n: int, steps: int) -> dict:
    """The sharded model (mesh data=1, seq=n) against the unsharded one, same init and batches."""
    tcfg = e2e_train_config(T, 1)
    dataset = Dataset(tcfg.data)
    batches = [dataset.batch(i, 1, T) for i in range(steps)]

    def run(mesh):
        graphdef, state, tx = create_train_state(cfg, tcfg, mesh=mesh)
        put = (lambda b: parallel.shard_batch(b, mesh)) if mesh is not None else (lambda b: b)

        @jax.jit
        def indices(params, tokens):
            _, aux = nnx.merge(graphdef, params).forward(tokens[:, :-1], indexer_stage="sparse")
            return aux["indices"]

        tokens = put(batches[0])["tokens"]
        shard_maps = str(jax.make_jaxpr(indices)(state.params, tokens)).count("shard_map")
        idx = [np.asarray(i) for i in indices(state.params, tokens)]
        step = make_train_step(graphdef, tx, tcfg, mesh=mesh, donate=False)
        history = []
        for batch in batches:
            state, metrics = step(state, put(batch), "sparse")
            history.append(
                {k: float(metrics[k]) for k in ("loss", "ce", "indexer_loss", "grad_norm")}
            )
        return history, idx, shard_maps

    local, local_idx, _ = run(None)
    sharded, sharded_idx, shard_maps = run(parallel.make_mesh(data=1, seq=n))
    rel = {
        k: max(abs(s[k] - u[k]) / max(abs(u[k]), 1e-30) for s, u in zip(sharded, local))
        for k in local[0]
    }
    # Layer 0 selects on the embeddings, identical in both runs, so its indices must agree
    # bit for bit. Deeper layers see activations that went through sharded matmuls (another
    # f32 summation order, then bf16 rounding), so near-ties may flip there: their rows are
    # reported as exact matches, matching positions and overlap of the selected sets.
    layers = []
    for a, b in zip(local_idx, sharded_idx):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        # A row holds no index twice, so after sorting both rows together every adjacent
        # equal pair is one key both selected (each -1 padding slot gets its own negative
        # value first, so paddings never pair).
        col = np.arange(a2.shape[1])
        both = np.sort(
            np.concatenate(
                [np.where(a2 < 0, -2 - 2 * col, a2), np.where(b2 < 0, -3 - 2 * col, b2)], axis=1
            ),
            axis=1,
        )
        shared = (both[:, 1:] == both[:, :-1]).sum(axis=1)
        overlap = shared / np.maximum((a2 >= 0).sum(axis=1), 1)
        layers.append(
            {
                "rows_equal": float((a2 == b2).all(axis=1).mean()),
                "positions_equal": float((a2 == b2).mean()),
                "set_overlap": float(overlap.mean()),
            }
        )
    return {
        "status": "ok",
        "steps": steps,
        "unsharded": local,
        "sharded": sharded,
        "max_rel_diff": rel,
        "indices_by_layer": layers,
        "shard_maps_in_sharded_forward": shard_maps,
        "layer0_identical": bool(np.array_equal(local_idx[0], sharded_idx[0])),
    }


def _worker(spec: str) -> None:
    args = json.loads(spec)
    cfg = ModelConfig.from_dict(args["model"])
    try:
        if args["kind"] == "check":
            result = _check_point(cfg, args["T"], args["n"], args["steps"])
        else:
            result = _step_point(cfg, args["T"], args["n"], args["reps"])
    except Exception as err:
        text = str(err)
        result = {"status": "oom" if is_oom(err) else f"error: {type(err).__name__}: {text[:300]}"}
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver


def _worker_env(platform: str, n: int | None) -> dict:
    """The environment of a process that sees n devices (None: all the driver may use)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak memory is the point's own
    if platform == "cpu":
        flags = " ".join(
            f
            for f in env.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f
        )
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n or 1}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    elif n is not None:  # the first n GPUs the driver was given
        given = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = given.split(",") if given else [str(i) for i in range(n)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])
    return env


def _run_point(spec: dict, platform: str, timeout: float, by_budget: bool) -> dict:
    """by_budget: the timeout is what is left of --budget-s, not the preset's point limit."""
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_worker_env(platform, spec["n"]),
        )
    except subprocess.TimeoutExpired as err:
        result = result_line(err.stdout)  # measured, then hung on exit (e.g. NCCL teardown)
        if result is not None:
            return dict(result, note=f"worker killed after printing its result ({timeout:.0f} s)")
        if by_budget:
            return {"status": f"stopped by the time budget after {timeout:.0f} s"}
        return {"status": f"timeout ({timeout:.0f} s)"}
    result = result_line(proc.stdout)
    if result is not None:
        return result
    return {"status": f"error: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}


def _device_info(platform: str) -> dict:
    """Device count, kind and jax version, read in a subprocess (the driver never holds a
    device, so the workers get all of its memory)."""
    code = (
        "import jax, json; d = jax.devices(); print(json.dumps({'count': len(d), "
        "'device': f'{d[0].platform}:{d[0].device_kind}', 'jax': jax.__version__}))"
    )
    env = _worker_env(platform, None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


class Runner:
    """Runs points within a time budget, prints a line per point, keeps the record."""

    def __init__(self, preset: dict, budget_end: float, progress: Progress):
        self.preset, self.budget_end, self.progress = preset, budget_end, progress
        self.done = {}  # (mode, N, T) -> timed step result, shared by the parts

    def point(self, part: str, cfg, T: int, n: int, **extra) -> dict:
        mode = f"{cfg.attention}/{cfg.remat}"
        p = {"part": part, "mode": mode, "N": n, "T": T}
        self.progress.start(f"{part} N={n} T={T} {mode}")
        left = self.budget_end - time.time()
        key = (mode, n, T)
        if part != "check" and key in self.done:
            p.update(self.done[key], reused=True)
        elif (
            cfg.attention == "materialized"
            and self.preset["platform"] == "gpu"
            and T * T >= reference.TABLE_ENTRIES_LIMIT
        ):
            p["status"] = "skipped (the [T, T] score table >= 2**31 entries: XLA crashes)"
        elif left < MIN_POINT_S:
            p["status"] = "skipped (time budget)"
        else:
            spec = dict(
                kind=part if part == "check" else "step", model=cfg.to_dict(), T=T, n=n, **extra
            )
            limit = self.preset["point_timeout_s"]
            p.update(
                _run_point(spec, self.preset["platform"], min(limit, left), by_budget=left < limit)
            )
            if part != "check" and not p["status"].startswith("stopped by the time budget"):
                self.done[key] = {k: v for k, v in p.items() if k not in ("part",)}
        self.progress.done(_point_text(p))
        return p


def _point_text(p: dict) -> str:
    if p.get("status") != "ok":
        return p["status"]
    if p["part"] == "check":
        rel = ", ".join(f"{k} {v:.1e}" for k, v in p["max_rel_diff"].items())
        layers = "; ".join(
            f"L{i} rows {d['rows_equal']:.3f} sets {d['set_overlap']:.4f}"
            for i, d in enumerate(p["indices_by_layer"])
        )
        return (
            f"layer-0 indices identical: {p['layer0_identical']}; equal rows / set overlap: "
            f"{layers}; max relative difference over {p['steps']} steps: {rel}"
        )
    mem = p.get("peak_bytes_per_device")
    mem = f"{mem / 2**30:.2f} GiB/device" if mem else "n/a"
    reused = " (measured above)" if p.get("reused") else ""
    return (
        f"{p['median_ms']:.1f} ms, {p['tokens_per_s_per_device']:.0f} tok/s per device, "
        f"peak {mem}{reused}"
    )


def _ratios(points, *, weak: bool) -> None:
    """Efficiency against N = 1: tokens/s per device (weak), time ratio / N (strong)."""
    one = next((p for p in points if p["N"] == 1 and p.get("status") == "ok"), None)
    if one is None:  # no N = 1 point to compare with: no ratios (the summary says so)
        return
    for p in points:
        if p.get("status") != "ok":
            continue
        if weak:
            p["efficiency"] = p["tokens_per_s_per_device"] / one["tokens_per_s_per_device"]
        else:
            p["speedup"] = one["median_ms"] / p["median_ms"]
            p["efficiency"] = p["speedup"] / p["N"]


def run(
    preset: dict, parts, devices, reps: int, check_steps: int, runner: Runner, record: dict, save
) -> None:
    """Fills record[part] point by point, calling save() after each (a killed run keeps what
    it measured)."""
    model = preset["model"]
    hyscale = dataclasses.replace(model, attention=HYSCALE[0], remat=HYSCALE[1])
    baseline = dataclasses.replace(model, attention=BASELINE[0], remat=BASELINE[1])

    def add(part, point):
        record.setdefault(part, []).append(point)
        if part in ("weak", "strong"):
            _ratios(record[part], weak=part == "weak")
        save()
        return point

    if "check" in parts:
        for n in devices:
            if n > 1 or devices == [1]:
                add(
                    "check", runner.point("check", hyscale, preset["check_T"], n, steps=check_steps)
                )
    for part in ("weak", "strong"):
        if part in parts:
            for n in devices:
                T = preset["weak_T_per_device"] * n if part == "weak" else preset["strong_T"]
                add(part, runner.point(part, hyscale, T, n, reps=reps))
    if "longest" in parts:
        for n in devices:
            for cfg in (baseline, hyscale):  # the baseline fails early: cheap, so first
                T = preset["longest_start"]
                while T <= preset["longest_cap"]:
                    if (
                        add("longest", runner.point("longest", cfg, T, n, reps=1)).get("status")
                        != "ok"
                    ):
                        break
                    T *= 2


def longest_ok(points) -> dict:
    """{(mode, N): longest T whose step ran}."""
    best = {}
    for p in points:
        if p.get("status") == "ok":
            key = (p["mode"], p["N"])
            best[key] = max(best.get(key, 0), p["T"])
    return best


def print_summary(record: dict) -> None:
    for part in ("weak", "strong"):
        if part not in record:
            continue
        print(f"\n{part} scaling: N | T | step ms | tokens/s per device | efficiency")
        if not any(p["N"] == 1 and p.get("status") == "ok" for p in record[part]):
            print("  (no N = 1 point ran: no efficiency)")
        for p in record[part]:
            if p.get("status") == "ok":
                eff = f"{p['efficiency']:.2f}" if "efficiency" in p else "-"
                print(
                    f"  {p['N']:>2} | {p['T']:>8} | {p['median_ms']:>9.1f} | "
                    f"{p['tokens_per_s_per_device']:>9.0f} | {eff}"
                )
            else:
                print(f"  {p['N']:>2} | {p['T']:>8} | {p['status']}")
    if "longest" in record:
        best = longest_ok(record["longest"])
        print("\nlongest trainable T (doubling; the first failure ends a mode's search):")
        keys = dict.fromkeys((p["mode"], p["N"]) for p in record["longest"])
        for mode, n in sorted(keys, key=lambda key: (key[1], key[0])):
            fail = next(
                (
                    p["status"]
                    for p in record["longest"]
                    if p["mode"] == mode and p["N"] == n and p.get("status") != "ok"
                ),
                "none up to the cap",
            )
            T = best.get((mode, n))
            print(f"  N={n} {mode:<22} {T if T else 'none':>9}  (next: {fail})")


def plot(record: dict, path: Path) -> bool:
    """One panel per measured part (check has none). Returns whether a figure was written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("weak", "strong", "longest") if record.get(p)]
    if not panels:
        return False
    devices = record["meta"]["devices"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, part in zip(axes[0], panels):
        ok = [p for p in record[part] if p.get("status") == "ok"]
        if part == "weak":
            ax.plot(
                [p["N"] for p in ok],
                [p["tokens_per_s_per_device"] for p in ok],
                "o-",
                label="hyscale/replay",
            )
            if ok and ok[0]["N"] == 1:
                ax.axhline(ok[0]["tokens_per_s_per_device"], ls=":", c="gray", label="N = 1 rate")
            ax.set_ylabel("tokens / s per device")
            ax.set_title(f"weak: T = {record['meta']['weak_T_per_device']} x N")
        elif part == "strong":
            ax.plot(
                [p["N"] for p in ok], [p["median_ms"] for p in ok], "o-", label="hyscale/replay"
            )
            if ok and ok[0]["N"] == 1:
                ns = [p["N"] for p in ok]
                ax.plot(ns, [ok[0]["median_ms"] / n for n in ns], ls=":", c="gray", label="ideal")
            ax.set_yscale("log")
            ax.set_ylabel("step time (ms)")
            ax.set_title(f"strong: T = {record['meta']['strong_T']}")
        else:
            best = longest_ok(record[part])
            for i, mode in enumerate(dict.fromkeys(p["mode"] for p in record[part])):
                pts = sorted((n, T) for (m, n), T in best.items() if m == mode)
                capped = [
                    n
                    for n, _ in pts
                    if not any(
                        p["mode"] == mode and p["N"] == n and p.get("status") != "ok"
                        for p in record[part]
                    )
                ]
                shift = 1 + 0.03 * i if len(devices) > 1 else 1  # keeps equal curves visible
                if pts:
                    ax.plot(
                        [n * shift for n, _ in pts],
                        [T for _, T in pts],
                        "o-",
                        label=mode + (" (open marker: the cap, no failure)" if capped else ""),
                        c=f"C{i}",
                    )
                    ax.plot(
                        [n * shift for n, T in pts if n in capped],
                        [T for n, T in pts if n in capped],
                        "o",
                        mfc="white",
                        c=f"C{i}",
                    )
            ax.set_yscale("log", base=2)
            ax.set_ylabel("longest trainable T")
            ax.set_title("longest T per device count")
        ax.set_xscale("log", base=2)
        ax.set_xticks(devices, [str(n) for n in devices])
        ax.set_xlabel("devices N (mesh data=1, seq=N)")
        ax.legend()
    meta = record["meta"]
    fig.suptitle(f"{meta['device']}, jax {meta['jax']}, preset {meta['preset']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def _preset_values(key: str) -> str:
    def text(value):
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    return "; ".join(f"{name} {text(preset[key])}" for name, preset in sorted(PRESETS.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="cpu", help="model, lengths and platform"
    )
    p.add_argument(
        "--devices",
        type=_int_list,
        default=None,
        help="comma-separated device counts N (default: the preset's up to the devices present: "
        f"{_preset_values('devices')})",
    )
    p.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=",".join(PARTS),
        help="comma-separated parts to run",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help=f"timed steps per point, median reported (default: {_preset_values('reps')})",
    )
    p.add_argument(
        "--check-steps", type=int, default=3, help="training steps compared by the check part"
    )
    p.add_argument(
        "--check-T",
        type=int,
        default=None,
        help=f"sequence length of the check (default: {_preset_values('check_T')})",
    )
    p.add_argument(
        "--weak-T",
        type=int,
        default=None,
        help="tokens per device of the weak-scaling points "
        f"(default: {_preset_values('weak_T_per_device')})",
    )
    p.add_argument(
        "--strong-T",
        type=int,
        default=None,
        help="sequence length of every strong-scaling point "
        f"(default: {_preset_values('strong_T')})",
    )
    p.add_argument(
        "--longest-start",
        type=int,
        default=None,
        help=f"first T of the longest search (default: {_preset_values('longest_start')})",
    )
    p.add_argument(
        "--longest-cap",
        type=int,
        default=None,
        help=f"largest T the longest search tries (default: {_preset_values('longest_cap')})",
    )
    add_budget_and_out(p, "scale_parallel")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    bad = set(args.only) - set(PARTS)
    if bad:
        p.error(f"--only: unknown parts {sorted(bad)}; choose from {', '.join(PARTS)}")
    for name in (
        "reps",
        "check_steps",
        "check_T",
        "weak_T",
        "strong_T",
        "longest_start",
        "longest_cap",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.budget_s is not None and args.budget_s <= 0:
        p.error(f"--budget-s must be > 0; got {args.budget_s}")

    preset = dict(PRESETS[args.preset])
    for key, value in (
        ("check_T", args.check_T),
        ("weak_T_per_device", args.weak_T),
        ("strong_T", args.strong_T),
        ("longest_start", args.longest_start),
        ("longest_cap", args.longest_cap),
    ):
        if value is not None:
            preset[key] = value
    info = _device_info(preset["platform"])
    present = info["count"] if preset["platform"] == "gpu" else max(preset["devices"])
    devices = args.devices or [n for n in preset["devices"] if n <= present]
    if preset["platform"] == "gpu" and max(devices) > present:
        p.error(f"--devices {devices}: only {present} GPU(s) present")
    if info["device"].split(":")[0] != preset["platform"]:
        p.error(f"preset {args.preset} runs on {preset['platform']}, but jax sees {info['device']}")
    # The zig-zag layout needs T % (2N) == 0 for every point (doubling keeps it for longest).
    lengths = {
        "check": [("--check-T", preset["check_T"])],
        "weak": [("--weak-T", preset["weak_T_per_device"])],
        "strong": [("--strong-T", preset["strong_T"])],
        "longest": [("--longest-start", preset["longest_start"])],
    }
    for part in args.only:
        for flag, T in lengths[part]:
            bad_n = [n for n in devices if (T * (n if part == "weak" else 1)) % (2 * n)]
            if bad_n:
                p.error(
                    f"{flag} {T}: the {part} points need T divisible by 2N for N in "
                    f"{bad_n} (zig-zag layout over the seq axis)"
                )
    reps = args.reps if args.reps is not None else preset["reps"]
    meta = {
        "preset": args.preset,
        "device": info["device"],
        "jax": info["jax"],
        "devices": devices,
        "model": preset["model"].to_dict(),
        **{
            k: preset[k]
            for k in ("check_T", "weak_T_per_device", "strong_T", "longest_start", "longest_cap")
        },
        "reps": reps,
        "check_steps": args.check_steps,
        "command": command_line(),
    }
    out = Path(args.out) if args.out else RUNS / "scale_parallel"
    print(
        f"jax {info['jax']} on {info['device']}; preset {args.preset}; N in {devices}; "
        f"writing to {out}",
        flush=True,
    )
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scale_parallel_{args.preset}.json"
    record = {"meta": meta}

    def save():
        record["meta"]["wall_s"] = time.time() - t0
        path.write_text(json.dumps(record, indent=2) + "\n")

    budget_end = t0 + (args.budget_s if args.budget_s is not None else float("inf"))
    run(
        preset,
        args.only,
        devices,
        reps,
        args.check_steps,
        Runner(preset, budget_end, Progress()),
        record,
        save,
    )
    save()
    wrote_plot = plot(record, path.with_suffix(".png"))
    print_summary(record)
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if wrote_plot else ""))


if __name__ == "__main__":
    main()
