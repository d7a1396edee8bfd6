"""Why a sort form's speed alone (probe_sort.py) does not carry over to the HyTopK epilogue
(issue 3): times each stage of the two XLA epilogues on the same buffers, and writes XLA's
optimized HLO of each so the compiled programs can be compared.

    PYTHONPATH=. python3 experiments/probe_epilogue.py [--rows 32768] [--out DIR]

Stages, per epilogue (stable: `order_candidates_stable`; position:
`order_candidates_position`): `sort` sorts ready-made order keys [1, rows, k] (`sort 2-D`:
the same keys as [rows, k], the probe_sort form); `keys+sort` adds the survivor-key masking
from the [1, rows, capacity] buffer; `full` is the epilogue as hytopk runs it (with the
gather of the key indices).

Answer (fourteenth session, H200, jax 0.11.2; `results/hytopk_position/gpu_epilogue/`): the
position epilogue then called lax.sort with its default is_stable=True, and XLA's stable-sort
expander added an int32 iota as a third operand (`position_sort.hlo.txt` there): 4.82 ms for
the sort, against 3.18 ms for the same sort unflagged in probe_sort.py. The epilogue now sorts
unflagged.
"""
import argparse
import os

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels.hytopk as phk
from bench_selection import median_ms


def stages(T, k):
    def sort_stable(nkeys):
        pos = lax.broadcasted_iota(jnp.int32, nkeys.shape, 2)
        return lax.sort((nkeys, pos), dimension=2, num_keys=1, is_stable=True)

    def sort_position(nkeys):
        pos = lax.broadcasted_iota(jnp.int16, nkeys.shape, 2)
        return lax.sort((nkeys, pos), dimension=2, num_keys=2, is_stable=False)

    def sort_position_2d(nkeys):  # the same sort on [rows, k], as probe_sort.py runs it
        flat = nkeys.reshape(-1, nkeys.shape[-1])
        pos = lax.broadcasted_iota(jnp.int16, flat.shape, 1)
        return lax.sort((flat, pos), dimension=1, num_keys=2, is_stable=False)

    def with_keys(sort):
        def f(keys, idx, cnt):
            del idx
            return sort(phk._survivor_keys(keys, cnt, T=T, width=k))
        return f

    def full(epilogue):
        return lambda keys, idx, cnt: epilogue(keys, idx, cnt, T=T, k=k)

    return {
        "stable sort": ("nkeys", sort_stable),
        "position sort": ("nkeys", sort_position),
        "position sort 2-D": ("nkeys", sort_position_2d),
        "stable keys+sort": ("buffers", with_keys(sort_stable)),
        "position keys+sort": ("buffers", with_keys(sort_position)),
        "stable full": ("buffers", full(phk.order_candidates_stable)),
        "position full": ("buffers", full(phk.order_candidates_position)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", default="experiments/results/probe_epilogue")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    T, k = args.rows, args.k
    cap = phk.BlockSizes().resolve_capacity(k)
    print("jax", jax.__version__, jax.devices()[0].device_kind, f"rows={T} k={k} cap={cap}",
          flush=True)
    keys = jax.random.randint(jax.random.key(0), (1, T, cap), -2**31, 2**31 - 1, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (1, T, cap))
    cnt = jnp.full((1, T), k, jnp.int32)
    nkeys = jax.block_until_ready(phk._survivor_keys(keys, cnt, T=T, width=k))
    inputs = {"nkeys": (nkeys,), "buffers": (keys, idx, cnt)}
    for name, (kind, f) in stages(T, k).items():
        fn = jax.jit(f)
        hlo = fn.lower(*inputs[kind]).compile().as_text()
        with open(os.path.join(args.out, name.replace(" ", "_").replace("+", "_") + ".hlo.txt"),
                  "w") as fh:
            fh.write(hlo)
        print(f"{name:<20} {median_ms(fn, [inputs[kind]], 9):8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
