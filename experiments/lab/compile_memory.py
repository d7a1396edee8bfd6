"""Compile-only memory of the end-to-end `h200` model's training step (no step runs): what
XLA's buffer assignment reserves on the device and in host memory, per remat mode. Run it under
different XLA_FLAGS to see what a flag changes.

    PYTHONPATH=. python3 experiments/lab/compile_memory.py --T 524288 --modes replay replay+offload

XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=jit_step" dumps the optimized HLO, buffer
assignment and memory-usage report of each compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reproduce import PRESETS, e2e_train_config, mode_config  # noqa: E402

from hyscale_jax.data import Dataset  # noqa: E402
from hyscale_jax.train import create_train_state, make_train_step  # noqa: E402


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
    p.add_argument(
        "--no-layer-barrier",
        action="store_true",
        help="compile the layers' policy checkpoints with prevent_cse=False (no optimization "
        "barrier on the rematerialized layer's inputs, the offloaded indices among them)",
    )
    args = p.parse_args()
    if args.no_layer_barrier:
        checkpoint = jax.checkpoint

        def checkpoint_without_barrier(fun, *a, policy=None, **kw):
            if policy is not None:
                kw["prevent_cse"] = False
            return checkpoint(fun, *a, policy=policy, **kw)

        jax.checkpoint = checkpoint_without_barrier
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
        tcfg = e2e_train_config(args.T, 1)
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
                    layer_barrier=not args.no_layer_barrier,
                    remat3=bool(jax.config.values.get("jax_remat3")),
                    compile_s=round(time.perf_counter() - t0, 1),
                    **gib,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
