"""Would a dQ kernel that finds delta itself be accurate enough? (question for the MLA backward)

The split MLA backward runs a delta kernel (the forward again, for delta = dO . o) because the
residual contract saves no output. One sweep could do without it:

    dQ = sum_j P_j (dP_j - delta) K_j = A - delta * B,   A = sum_j P_j dP_j K_j,  B = sum_j P_j K_j

with delta = sum_j P_j dP_j accumulated in the same sweep (or, shifted by a constant c taken
from the first 64-key slot block, A_c = sum_j P_j (dP_j - c) K_j and dQ = A_c - (delta - c) B).
The dots take bf16 operands, so P dP and P are rounded to bf16 where the kernel today rounds
P (dP - delta). This measures dQ's error against a float64 truth for one query (H heads, k
selected keys of MLA's 576 features, value = the first 512) as the keys share a larger mean
and the softmax sharpens (CPU, numpy + jax's bf16 rounding).

Then the kernels themselves in interpret mode (CPU) at a small MLA analogue (32 heads of
72 = 64 + 8 features, value 64, 37 selected keys in 16-key dQ steps): dQ and dKV against the
f32 reference for the split backward with the delta kernel, with `BlockSizes.dq_delta`, and the
deterministic backward (delta summed from f32 P dP, dS in the standard form), as the keys'
shared vector grows.

    PYTHONPATH=. python experiments/lab/dq_without_delta_precision.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import rel_err
from tests.test_mla_attention import SMALL, mla_inputs, reference, shared_kernel

H, K, D, DV, BLOCK = 16, 2048, 576, 512, 64


def bf16(x):
    """x rounded to bf16 (as a dot's operand is), back in float64."""
    return np.asarray(
        jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64
    )


def errors(rng, offset: float, sharpness: float) -> tuple[float, float, float]:
    """Max-abs error of dQ relative to its largest entry: today's form, A - delta B, shifted."""
    q = bf16(rng.normal(size=(H, D)))
    keys = bf16(rng.normal(size=(K, D)) + offset * rng.normal(size=(1, D)))  # shared mean
    d_out = bf16(rng.normal(size=(H, DV)))
    s = sharpness * (q @ keys.T) / np.sqrt(D)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)  # [H, K]
    dp = d_out @ keys[:, :DV].T  # [H, K]
    delta = (p * dp).sum(1)  # [H]
    truth = (p * (dp - delta[:, None])) @ keys

    today = bf16(p * (dp - delta[:, None])) @ keys
    b = bf16(p) @ keys
    unshifted = bf16(p * dp) @ keys - delta[:, None] * b
    first = slice(0, BLOCK)
    c = (p[:, first] * dp[:, first]).sum(1) / p[:, first].sum(1)
    shifted = bf16(p * (dp - c[:, None])) @ keys - (delta - c)[:, None] * b

    def rel(x):
        return float(np.abs(x - truth).max() / np.abs(truth).max())

    return rel(today), rel(unshifted), rel(shifted)


def main():
    rng = np.random.default_rng(0)
    print("| key mean offset | softmax sharpness | P (dP - delta) | A - delta B | shifted by c |")
    print("|---|---|---|---|---|")
    for offset in (0.0, 1.0, 3.0, 10.0, 30.0):
        for sharpness in (1.0, 3.0):
            today, unshifted, shifted = errors(rng, offset, sharpness)
            print(f"| {offset:g} | {sharpness:g} | {today:.2e} | {unshifted:.2e} | {shifted:.2e} |")


def kernel_errors():
    shape = (1, 4, 37, 32, 72, 64, 37)  # B, T, S, H, D, Dv, K
    dv = shape[5]
    variants = {
        "delta kernel": dict(
            deterministic=False, block_sizes=dataclasses.replace(SMALL, block_k_dq=16)
        ),
        "dq_delta": dict(
            deterministic=False,
            block_sizes=dataclasses.replace(SMALL, block_k_dq=16, dq_delta=True),
        ),
        "deterministic": dict(deterministic=True, block_sizes=SMALL),
    }
    print("\n| keys' shared vector | " + " | ".join(f"{n}: dQ / dKV" for n in variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for offset in (0.0, 3.0, 10.0):
        q, kv, idx, d_out = mla_inputs(15, *shape, jnp.float32)
        kv = kv + offset * jax.random.normal(jax.random.key(0), (kv.shape[-1],))
        q, kv, d_out = (x.astype(jnp.bfloat16) for x in (q, kv, d_out))
        ref = jax.vjp(reference(idx, dv), q.astype(jnp.float32), kv.astype(jnp.float32))[1]
        want = ref(d_out.astype(jnp.float32))
        cells = []
        for kw in variants.values():
            grads = jax.vjp(shared_kernel(idx, dv, True, **kw), q, kv)[1](d_out)
            cells.append(" / ".join(f"{rel_err(g, w):.1e}" for g, w in zip(grads, want)))
        print(f"| {offset:g}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
    kernel_errors()
