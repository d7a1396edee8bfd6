"""Compile-only memory of the end-to-end `h200` model's training step (no step runs): what
XLA's buffer assignment reserves on the device and in host memory, per remat mode, under XLA
compiler options and two variants of the model's layer structure.

    PYTHONPATH=. python3 experiments/lab/compile_memory.py --T 524288 --modes replay replay+offload

--no-layer-ties compiles the model without the optimization barriers that `LongContextLM`
places between blocks (`hyscale_jax.nn._fence` made a plain identity), to compare with them.
--offload-round-trip offloads the indices by hand instead of through the checkpoint policy: the
forward copies them to pinned host memory, names the host copy as the saved residual and copies
it back for its own use, so the device original dies once the copy to host is done; the
backward's rematerialization copies the saved host copy back again.

XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=jit_step" dumps the optimized HLO, buffer
assignment and memory-usage report of each compile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from unittest import mock

import jax
from jax.ad_checkpoint import checkpoint_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reproduce import PRESETS, e2e_train_config, mode_config  # noqa: E402

import hyscale_jax as hs  # noqa: E402
from hyscale_jax import layer as hs_layer  # noqa: E402
from hyscale_jax import nn as hs_nn  # noqa: E402
from hyscale_jax.data import Dataset  # noqa: E402
from hyscale_jax.train import create_train_state, make_train_step  # noqa: E402


def round_trip_name(x, name):
    """checkpoint_name, but the indices are saved as a pinned-host copy that the forward reads
    back: the remat recomputes the copy back from the saved host copy."""
    if name != hs.INDICES_NAME:
        return checkpoint_name(x, name)
    host = checkpoint_name(jax.device_put(x, jax.memory.Space.Host), name)
    return jax.device_put(host, jax.memory.Space.Device)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--modes", nargs="+", default=["replay", "replay+offload"])
    p.add_argument("--mlp-chunk", type=int, default=65536)
    p.add_argument(
        "--option",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="XLA compiler options for this compile "
        "(e.g. xla_gpu_enable_host_memory_offloading=true)",
    )
    p.add_argument("--no-layer-ties", action="store_true")
    p.add_argument("--offload-round-trip", action="store_true")
    args = p.parse_args()
    options = {}
    for item in args.option:
        name, value = item.split("=", 1)
        if value.lower() in ("true", "false"):
            options[name] = value.lower() == "true"
        else:
            options[name] = int(value) if value.lstrip("-").isdigit() else value
    base = dataclasses.replace(PRESETS["h200"]["e2e_model"], mlp_chunk=args.mlp_chunk or None)
    for mode in args.modes:
        cfg = mode_config(base, "hyscale", mode)
        round_trip = args.offload_round_trip and cfg.offload_indices
        if round_trip:  # the policy saves the (host) indices; the names do the offloading
            cfg = dataclasses.replace(cfg, offload_indices=False)
        tcfg = e2e_train_config(args.T, 1)
        with contextlib.ExitStack() as stack:
            if args.no_layer_ties:
                stack.enter_context(mock.patch.object(hs_nn, "_fence", lambda tree: tree))
            if round_trip:
                stack.enter_context(mock.patch.object(hs_layer, "checkpoint_name", round_trip_name))
                stack.enter_context(mock.patch.object(hs_nn, "checkpoint_name", round_trip_name))
            graphdef, state, tx = create_train_state(cfg, tcfg)
            step = make_train_step(graphdef, tx, tcfg)
            batch = Dataset(tcfg.data).batch(0, 1, args.T)
            t0 = time.perf_counter()
            lowered = step.lower(state, batch, "sparse")
        m = lowered.compile(compiler_options=options or None).memory_analysis()
        gib = {
            name: round(getattr(m, name) / 2**30, 3)
            for name in dir(m)
            if name.endswith("_in_bytes") and isinstance(getattr(m, name), int)
        }
        print(
            "MEMORY "
            + json.dumps(
                dict(
                    T=args.T,
                    mode=mode,
                    options=options,
                    layer_ties=not args.no_layer_ties,
                    offload_round_trip=round_trip,
                    remat3=bool(jax.config.values.get("jax_remat3")),
                    compile_s=round(time.perf_counter() - t0, 1),
                    **gib,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
