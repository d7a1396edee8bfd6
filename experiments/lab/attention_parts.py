"""Lab probe: each MLA sparse-attention kernel timed alone (forward, delta, dQ, key gradients).

    PYTHONPATH=. python3 experiments/lab/attention_parts.py --seq 32768 --heads 64 \\
        [--sizes block_k_bwd=16 ...] [--out DIR]

MLA's absorbed shape (D = 576 over one shared key row whose first 512 features are the value,
k = 2048, bf16, causal random indices as in experiments/bench_attention.py). For the default
`BlockSizes` and each --sizes variant: the forward kernel, the split backward's delta kernel
(with its input padding), dQ kernel and key-gradient kernel, each jitted alone on operands
prepared beforehand (the padded inputs, the forward's log-sum-exp, the delta kernel's delta),
median of --reps after two warm-up calls.
Their sum is the library's forward+backward less the padding and the f32 -> bf16 casts. Prints a
table and writes <out>/attention_parts.json (default runs/attention_parts/). Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import make_inputs, median_ms, parse_sizes, run_meta, save  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402

D, DV, TOPK = 576, 512, 2048  # MLA's absorbed shape


def library_forward(q, kv, idx, sizes: psa.BlockSizes, interpret: bool):
    """The library's MLA forward kernel alone, on q [B,T,H,D], kv [B,S,1,D], idx [B,T,k]:
    (a jitted fn of the padded operands -> (o, lse), those operands (qg, kp, idxp), the
    forward's layout, the op's config)."""
    scale = D**-0.5
    cfg = psa._Config(scale, interpret, False, sizes, value_dim=DV)
    qg, kp, _, idxp, block_k, lay = psa._prepare(q, kv, None, idx, cfg, backward=False)
    fwd = jax.jit(
        lambda qg, kp, idxp: psa._forward_call(
            qg,
            kp,
            None,
            idxp,
            scale=scale,
            block_k=block_k,
            lay=lay,
            sizes=sizes,
            interpret=interpret,
        )
    )
    return fwd, (qg, kp, idxp), lay, cfg


def parts(q, kv, idx, do, sizes: psa.BlockSizes, reps: int, interpret: bool) -> dict:
    """ms of the forward, delta, dQ and key-gradient kernels alone at these BlockSizes."""
    B, T, H, _ = q.shape
    fwd, operands, _, cfg = library_forward(q, kv, idx, sizes, interpret)
    scale = cfg.scale
    out = {"forward": median_ms(fwd, operands, reps)}
    lse = psa._forward(q, kv, None, idx, cfg)[1]
    qb, kb, _, idxb, _, layb = psa._prepare(q, kv, None, idx, cfg, backward=True)
    assert layb.split_backward, "these BlockSizes run the single backward kernel"
    dog = do.reshape(B, T, 1, H, DV)
    dog = psa._pad_axis(dog, 3, layb.heads)
    lseg = psa._pad_axis(lse.reshape(B, T, 1, H), 3, layb.heads)
    common = dict(scale=scale, lay=layb, sizes=sizes, interpret=interpret)
    delta_fn = jax.jit(
        lambda q, kv, idx, do, lseg: psa._pad_axis(
            psa._forward(q, kv, None, idx, cfg, do, lseg), 3, layb.heads
        )
    )
    out["delta"] = median_ms(delta_fn, (q, kv, idx, do, lseg), reps)
    delta = delta_fn(q, kv, idx, do, lseg)
    dq = jax.jit(lambda *a: psa._dq_call(*a, **common))
    out["dq"] = median_ms(dq, (qb, kb, None, idxb, lseg, dog, delta), reps)
    key = jax.jit(lambda *a: psa._key_grad_call(*a, **common))
    out["key_grads"] = median_ms(key, (qb, kb, None, idxb, lseg, dog, delta), reps)
    out["sum"] = sum(out.values())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--sizes", nargs="*", default=[], help="BlockSizes variants, FIELD=V,...")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (times mean nothing)")
    p.add_argument("--out", default=os.path.join("runs", "attention_parts"))
    args = p.parse_args(argv)
    variants = {"default": psa.BlockSizes()} | {s: parse_sizes(s) for s in args.sizes}
    records = []
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for T in args.seq:
        for H in args.heads:
            q, kv, _, idx, do = make_inputs(1, T, H, D, DV, args.topk, shared=True)
            for name, sizes in variants.items():
                try:
                    ms = parts(q, kv, idx, do, sizes, args.reps, args.interpret)
                except Exception as e:  # e.g. a variant beyond shared memory
                    ms = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                records.append({"T": T, "H": H, "sizes": name, **ms})
                cells = " ".join(
                    f"{k} {v:8.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ms.items()
                )
                print(f"T={T} H={H} {name:40s} {cells}", flush=True)
    path = save(args.out, run_meta(), records, "attention_parts")
    print("wrote", path)


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing
    main()
