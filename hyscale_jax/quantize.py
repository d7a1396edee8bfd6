"""FP8 indexer inputs: DeepSeek-V3.2's production lightning indexer (docs/design.md,
'FP8 indexer').

`quantize_indexer` turns indexer activations (bf16, f16 or f32) into the form `hs.hytopk` takes
with `k_scale`:

  1. optionally rotate q_idx and k_idx by the orthonormal Walsh-Hadamard transform over DI
     (`hadamard_transform`), as DeepSeek-V3.2 does. A rotation leaves every q . k unchanged in
     exact arithmetic and spreads an outlier feature over all DI features. (e4m3 is a float
     format: its relative rounding error is the same at every magnitude down to 2**-15 of the
     row's largest element, so rotation matters less than for integer formats; docs/design.md,
     'FP8 indexer', gives what it changes on a trained model);
  2. quantize each query row (b, t, h) and each key row (b, s) to float8_e4m3fn with its own
     absmax scale (`quantize_rows`: the row's largest magnitude maps to e4m3's 448);
  3. fold the query scales into the head weights (w' = w * q_scale, f32) and return the key
     scales as `k_scale`.

Because every scale is positive, relu commutes with it:

    k_scale[s] * sum_h w'[t,h] * relu(q8[t,h] . k8[s])
        = sum_h w[t,h] * relu((q_scale[t,h] q8[t,h]) . (k_scale[s] k8[s]))

so the FP8 score is the original score of the dequantized (rotated) vectors, and its error is
bounded by e4m3's rounding of each element (relative 2**-4, see `quantize_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hyscale_jax import _checks

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = jnp.float8_e4m3fn


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard_transform(x):
    """The orthonormal Walsh-Hadamard transform over the last axis, in f32.

    x: [..., D] real floating, D a power of two. Returns f32 [..., D], x @ (H_D / sqrt(D)) with
    H_D the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]). H_D / sqrt(D)
    is symmetric and orthogonal, so the transform preserves dot products and is its own inverse.
    Computed as the fast transform: log2(D) butterfly stages of D additions each.
    """
    _checks._check_float("x", x)
    D = x.shape[-1] if x.ndim else 0
    if not _is_power_of_two(D):
        raise ValueError(
            f"hadamard_transform needs the last axis to be a power of two; got x "
            f"{tuple(x.shape)} (last axis {D})"
        )
    return _fwht(x)


@jax.jit
def _fwht(x):
    """`hadamard_transform` of a checked x [..., D], jitted: one program, not op-by-op."""
    D = x.shape[-1]
    lead = x.shape[:-1]
    y = x.astype(jnp.float32)
    h = 1
    while h < D:  # stage: pairs (i, i + h) inside each block of 2h -> (a + b, a - b)
        y = y.reshape(*lead, D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    return y.reshape(*lead, D) * jnp.float32(D**-0.5)


def quantize_rows(x):
    """Per-row absmax quantization to float8_e4m3fn.

    x: [..., D] real floating. Returns (x8 float8_e4m3fn [..., D], scale f32 [...]) with
    x8 * scale ~= x: scale = max|x| / 448 over the row, so the row's largest element maps to
    +-448. Each element of x8 * scale is within 2**-4 |x| of x (e4m3 keeps 3 mantissa bits), or
    within 2**-10 * scale for an element below 2**-6 * scale (e4m3's subnormals), plus f32
    rounding.

    A row of zeros gets scale 1 (and zeros): no division by zero. A row holding NaN or inf gets
    scale 1 and an all-NaN x8 row (e4m3fn has no inf): such a key is never selected and such a
    query selects nothing (docs/design.md, 'NaN and empty slots'). Scales are always positive
    and finite (at least f32's smallest normal number).
    """
    _checks._check_float("x", x)
    return _quantize_rows(x)


@jax.jit
def _quantize_rows(x):
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    finite = jnp.isfinite(amax)
    usable = finite & (amax > 0)
    tiny = jnp.finfo(jnp.float32).tiny
    scale = jnp.where(usable, jnp.maximum(amax / E4M3_MAX, tiny), 1.0)
    # amax / scale can round to a hair above 448; clipping keeps it finite in e4m3fn.
    y = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX)
    y = jnp.where(finite[..., None], y, jnp.nan)
    return y.astype(FP8), scale


def quantize_indexer(q_idx, k_idx, w, *, hadamard: bool = True):
    """Indexer activations in DeepSeek-V3.2's FP8 form, for `hs.hytopk(..., k_scale=...)`.

    Args:
      q_idx: [B, T, HI, DI] indexer queries (bf16, f16 or f32).
      k_idx: [B, S, DI] indexer keys (bf16, f16 or f32).
      w: [B, T, HI] per-head weights (bf16, f16 or f32).
      hadamard: rotate q_idx and k_idx by `hadamard_transform` over DI first (DI must then be a
        power of two). Rotation does not change q . k; it evens out the features of each row
        before the per-row scale is chosen.
    Returns:
      (q8 float8_e4m3fn [B, T, HI, DI], k8 float8_e4m3fn [B, S, DI], w' f32 [B, T, HI],
      k_scale f32 [B, S]) with w' = w * q_scale (one absmax scale per query row (b, t, h)) and
      k_scale the key rows' absmax scales, so that
      k_scale[b,s] * sum_h w'[b,t,h] * relu(q8[b,t,h] . k8[b,s]) approximates
      sum_h w[b,t,h] * relu(q_idx[b,t,h] . k_idx[b,s]).

    w' is f32 whatever w's dtype: the fold then rounds once in f32 (relative 2**-24), far
    below e4m3's 2**-4, so the selection sees the FP8 error alone. In bf16 the fold would add
    a rounding of up to 2**-9 per head weight, and in f16 small q scales (a row of magnitude
    below ~0.03 has a scale under f16's smallest normal number 6e-5) would lose precision or
    flush to zero. It costs HI f32 values per query against HI * DI FP8 bytes for q8.
    The result is not differentiable (apply it to `stop_gradient` inputs, as selection does).
    """
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("w", w)):
        _checks._check_float(name, x)
    _checks.check_indexer_shapes(q_idx, k_idx, w)
    DI = q_idx.shape[-1]
    if hadamard:
        if not _is_power_of_two(DI):
            raise ValueError(
                f"hadamard=True needs the indexer width DI to be a power of two; got DI={DI} "
                f"from q_idx {tuple(q_idx.shape)} and k_idx {tuple(k_idx.shape)} (pass "
                f"hadamard=False to quantize without rotation)"
            )
        q_idx, k_idx = hadamard_transform(q_idx), hadamard_transform(k_idx)
    q8, q_scale = quantize_rows(q_idx)
    k8, k_scale = quantize_rows(k_idx)
    return q8, k8, w.astype(jnp.float32) * q_scale, k_scale
