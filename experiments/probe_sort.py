"""Which lax.sort forms XLA runs as CUB's radix sort on this GPU, and how fast (a probe for the
HyTopK epilogue, issue 3). Prints one line per (form, rows, width): CUB or not, median ms.

    PYTHONPATH=. python3 experiments/probe_sort.py [--shapes 32768x2048,32768x2304]
                                                   [--forms stable_iota,keys_only]
"""
import argparse

import jax
import jax.numpy as jnp
from jax import lax

from bench_selection import lowers_to_cub, median_ms


def forms():
    def stable_iota(k):
        pos = lax.broadcasted_iota(jnp.int32, k.shape, k.ndim - 1)
        return lax.sort((k, pos), dimension=k.ndim - 1, num_keys=1, is_stable=True)

    def unstable_iota(k):
        pos = lax.broadcasted_iota(jnp.int32, k.shape, k.ndim - 1)
        return lax.sort((k, pos), dimension=k.ndim - 1, num_keys=1, is_stable=False)

    def stable_iota16(k):  # a 2-byte payload: 6 bytes per entry moved instead of 8
        pos = lax.broadcasted_iota(jnp.int16, k.shape, k.ndim - 1)
        return lax.sort((k, pos), dimension=k.ndim - 1, num_keys=1, is_stable=True)

    def unstable_iota16(k):
        pos = lax.broadcasted_iota(jnp.int16, k.shape, k.ndim - 1)
        return lax.sort((k, pos), dimension=k.ndim - 1, num_keys=1, is_stable=False)

    def two_keys16(k):  # (key, position) compared as two keys: the stable order, no expander
        pos = lax.broadcasted_iota(jnp.int16, k.shape, k.ndim - 1)
        return lax.sort((k, pos), dimension=k.ndim - 1, num_keys=2, is_stable=False)

    def keys_only(k):
        return lax.sort(k, dimension=k.ndim - 1, is_stable=False)

    def keys_only_stable(k):
        return lax.sort(k, dimension=k.ndim - 1, is_stable=True)

    def argsort_stable(k):
        return jnp.argsort(k, axis=-1, stable=True)

    return dict(stable_iota=stable_iota, unstable_iota=unstable_iota,
                stable_iota16=stable_iota16, unstable_iota16=unstable_iota16, two_keys16=two_keys16,
                keys_only=keys_only,
                keys_only_stable=keys_only_stable, argsort_stable=argsort_stable)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32768x2048,32768x4096,8192x16384,1x16777216",
                    help="comma-separated ROWSxWIDTH")
    ap.add_argument("--forms", default=",".join(forms()), help="comma-separated sort forms")
    args = ap.parse_args()
    chosen = {name: forms()[name] for name in args.forms.split(",")}
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    for shape in args.shapes.split(","):
        rows, width = map(int, shape.split("x"))
        x = jax.random.randint(jax.random.key(0), (rows, width), -2**31, 2**31 - 1, jnp.int32)
        for name, f in chosen.items():
            fn = jax.jit(f)
            print(f"{name:<18} rows={rows:<6} width={width:<8} "
                  f"cub={lowers_to_cub(fn, (x,))!s:<5} {median_ms(fn, [(x,)], 7):8.2f} ms",
                  flush=True)
        del x


if __name__ == "__main__":
    main()
