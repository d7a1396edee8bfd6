"""How the HyTopK scoring core compiles (issue 3): static counts of the shared-memory fragment
loads and MMA instructions in the `score_only` kernel, on GPU.

    PYTHONPATH=. python3 experiments/probe_scoring_ir.py [--out DIR] [--variants bk256,bk128]

Question (hytopk_notes.md, eleventh session): the scoring loop runs HI dots
[block_q, DI] x [DI, block_k] per key block, one per head, all on the same key block. If
Triton loads the key block's MMA fragments from shared memory once and reuses them across the
unrolled heads, each key block needs ~HI x (q fragments) + 1 x (key fragments) ldmatrix
instructions; if it re-loads them for every head's dot, ~HI x (q + key fragments), about 3x
as many at block_q=16, block_k=256, 8 warps. The second case would make the core
shared-memory bound (a model that matches the measured ~11.8 ms at 32K), the first would
not. Counting the ldmatrix and mma instructions in the compiled kernel tells the two apart
without timing anything.

Each variant's `score_only` kernel (diagnostic: no selection) is compiled with XLA's Triton
dump on; every dump file of it (`*.triton-to-llvm.txt`: the kernel in the LLVM dialect, where
NVVM intrinsics and inline PTX name the instructions) is scanned for the instruction forms in
FORMS. Writes DIR/probe_scoring_ir.json and copies the dump files under DIR/ir/.

Answer (twelfth session, H200, jax 0.11.2; `results/hytopk_head_group/gpu_probe_ir.log`): at
the default, 3757 ldmatrix and 13312 mma.sync, 13 copies of 289 and 1024. ~289 per 1024 mma is
the first case: the key fragments are loaded once per key block (experiments/hytopk_notes.md).
That run's head_group 2 row found no files: every variant's dump files have the same names,
and the probe then looked only for new ones (it clears them before each compile since).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import sys

# Instruction forms, as NVVM ops or inline-PTX mnemonics in the LLVM-dialect dump.
FORMS = {
    "ldmatrix": r"\bnvvm\.ldmatrix\b|\bldmatrix\.[\w.]+",
    "mma_sync": r"\bnvvm\.mma\.sync\b|\bmma\.sync\.[\w.]+",
    "wgmma": r"\bnvvm\.wgmma\.[\w.]+|\bwgmma\.[\w.]+",
    "shared_load": r"llvm\.load [^\n]*!llvm\.ptr<3>|ld\.shared\.[\w.]+",
    "shared_store": r"llvm\.store [^\n]*!llvm\.ptr<3>|st\.shared\.[\w.]+",
    "barrier": r"\bnvvm\.barrier0\b|\bbar\.sync\b|\bnvvm\.barrier\b",
}


def instruction_counts(text: str) -> dict[str, int]:
    """Static count of each FORMS entry in one dump file's text."""
    return {name: len(re.findall(pattern, text)) for name, pattern in FORMS.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "probe_scoring_ir"))
    ap.add_argument("--variants", default="bk256=block_k:256,bk128=block_k:128",
                    help="comma-separated NAME=field:value/... (bench_selection.py syntax); "
                         "diagnostic=score_only is added to each")
    ap.add_argument("--seq", type=int, default=2048, help="T = S of the compiled program")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_atomics import start_triton_dump
    dump = start_triton_dump()  # before jax starts its backend

    import dataclasses

    import jax
    import jax.numpy as jnp
    from bench_selection import parse_variant
    from pallas_kernels import hytopk as phk

    if jax.default_backend() != "gpu":
        raise SystemExit("probe_scoring_ir.py reads compiled GPU kernels: run it on a GPU")
    T = S = args.seq
    HI, DI, k = 32, 128, 2048
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, T, HI, DI), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (1, S, DI), jnp.bfloat16)
    w = jax.random.normal(keys[2], (1, T, HI), jnp.bfloat16)
    record = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, T=T, S=S, HI=HI,
                  DI=DI, k=k, forms=FORMS, variants={})
    ir_dir = os.path.join(args.out, "ir")
    os.makedirs(ir_dir, exist_ok=True)
    for spec in args.variants.split(","):
        name, bs = parse_variant(spec)
        bs = dataclasses.replace(bs, diagnostic="score_only")

        def probe_score_only(q, kk, w, bs=bs):  # dump files are named after the jitted fn
            return phk.hytopk_candidates(q, kk, w, k=k, causal=True, block_sizes=bs)[2]

        # Every variant's dump files get the same names: clear the last variant's (copied
        # under ir/ already) so that only this compile's files match.
        pattern = os.path.join(dump, "*probe_score_only*.triton-to-llvm.txt")
        for path in glob.glob(pattern):
            os.remove(path)
        try:
            jax.block_until_ready(jax.jit(probe_score_only)(q, kk, w))
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory: record, go on)
            record["variants"][name] = dict(block_sizes=str(bs),
                                            failed=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        files = sorted(glob.glob(pattern))
        counts = {}
        for path in files:
            with open(path) as f:
                counts[os.path.basename(path)] = instruction_counts(f.read())
            shutil.copy(path, os.path.join(ir_dir, f"{name}.{os.path.basename(path)}"))
        total = collections.Counter()
        for c in counts.values():
            total.update(c)
        record["variants"][name] = dict(block_sizes=str(bs), files=counts, total=dict(total))
        print(f"{name}: {dict(total)} ({len(files)} dump file(s))", flush=True)
        if not files:
            print(f"  no {pattern} after compiling; dump dir has: "
                  f"{sorted(os.listdir(dump))[:20]}", flush=True)
    path = os.path.join(args.out, "probe_scoring_ir.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
