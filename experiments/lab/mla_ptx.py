"""Lab probe: which instructions the MLA sparse attention kernels compile to on the GPU.

Compiles the library's forward and backward at D = 576, Dv = 512 (value shared), H = 64,
T = 1024, with XLA dumping its PTX, and counts per kernel the tensor-core instructions (wgmma,
mma.sync), the global atomics by width (red/atom .f32, .v2.f32, .v4.f32) and local-memory
accesses (ld.local / st.local).

    PYTHONPATH=. python experiments/lab/mla_ptx.py [--sizes FIELD=V,...] [--dump /tmp/mla_ptx]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
p.add_argument("--sizes", default="", help="BlockSizes fields, e.g. block_h=64,num_warps=8")
p.add_argument("--dump", default="/tmp/mla_ptx", help="XLA dump folder (emptied first)")
ARGS = p.parse_args()
os.makedirs(ARGS.dump, exist_ok=True)
for name in os.listdir(ARGS.dump):
    os.remove(os.path.join(ARGS.dump, name))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={ARGS.dump}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels import sparse_attention as psa  # noqa: E402

PATTERNS = {
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "atomic.f32": r"\b(?:red|atom)\.[a-z.]*?add\.f32",
    "atomic.v2.f32": r"\b(?:red|atom)\.[a-z.]*?v2\.f32",
    "atomic.v4.f32": r"\b(?:red|atom)\.[a-z.]*?v4\.f32",
    "ld.local": r"\bld\.local",
    "st.local": r"\bst\.local",
    "cp.async": r"\bcp\.async\.(?:ca|cg)",
}


def main():
    fields = dict(item.split("=") for item in filter(None, ARGS.sizes.split(",")))
    sizes = psa.BlockSizes(**{f: int(v) for f, v in fields.items()})
    T, H, D, Dv, K = 1024, 64, 576, 512, 256
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (1, T, H, D), jnp.bfloat16)
    kv = jax.random.normal(key[1], (1, T, 1, D), jnp.bfloat16)
    idx = jax.random.randint(key[2], (1, T, K), -1, T)
    do = jax.random.normal(key[3], (1, T, H, Dv), jnp.bfloat16)

    def f(q, kv):
        return psa.sparse_attention(
            q, kv, None, idx, scale=D**-0.5, value_dim=Dv, interpret=False, block_sizes=sizes
        )

    out, vjp = jax.vjp(f, q, kv)
    jax.block_until_ready((out, vjp(do)))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; sizes {sizes}")
    for name in sorted(os.listdir(ARGS.dump)):
        if not name.endswith(".ptx"):
            continue
        text = open(os.path.join(ARGS.dump, name)).read()
        kernels = re.findall(r"\.entry\s+(\w+)", text)
        counts = {k: len(re.findall(pat, text)) for k, pat in PATTERNS.items()}
        regs = re.findall(r"\.reg \.(\w+)\s+%\w+<(\d+)>", text)
        print(f"{name}: kernels {kernels}; {counts}; virtual regs {regs[:6]}")


if __name__ == "__main__":
    main()
