"""Up-front argument checks shared by the public ops (docs/design.md, "Bad input"; the values
they accept are described in docs/design.md, "Values jit cannot check").

Every check runs on static shapes, dtypes and Python values, before any kernel is traced, and
names the argument and the shapes or values it got.
"""

from __future__ import annotations

import math
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

SELECTION_IMPLS = ("auto", "pallas", "interpret", "xla", "reference")
ATTENTION_IMPLS = ("auto", "pallas", "interpret", "xla", "reference")
# Sparse-stage indexer loss; its dense warm-up stage always runs the XLA table formula.
INDEXER_LOSS_IMPLS = ("auto", "pallas", "interpret", "xla")
INT32_MAX = 2**31 - 1


def check_impl(impl: str, choices: tuple[str, ...]) -> None:
    if impl not in choices:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(repr(c) for c in choices)}")


def _check_array(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (jax or NumPy); got {type(x).__name__}")


def _check_float(name: str, x) -> None:
    _check_array(name, x)
    dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} must be a real floating array (bf16, f16 or f32); got dtype {dtype}"
        )


def _check_indexer_float(name: str, x) -> None:
    """A real floating array whose dtype selection computes exactly: bf16, f16, f32, or
    float8_e4m3fn (widened exactly to bf16). Other 8-bit (and 4-bit) floats are a TypeError."""
    _check_float(name, x)
    dtype = jnp.dtype(x.dtype)
    if dtype.itemsize < 2 and dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise TypeError(
            f"{name} must be bf16, f16, f32 or float8_e4m3fn; got dtype {dtype} (the only "
            f"8-bit float selection supports is float8_e4m3fn)"
        )


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}; got shape {tuple(x.shape)}")


def check_indexer_shapes(q_idx, k_idx, w) -> None:
    """Ranks and matching sizes of q_idx [B,T,HI,DI], k_idx [B,S,DI] and w [B,T,HI]."""
    _check_rank("q_idx", q_idx, 4, "[B, T, HI, DI]")
    _check_rank("k_idx", k_idx, 3, "[B, S, DI]")
    _check_rank("w", w, 3, "[B, T, HI]")
    B, T, HI, DI = q_idx.shape
    if k_idx.shape[0] != B or k_idx.shape[2] != DI:
        raise ValueError(
            f"k_idx must be [B={B}, S, DI={DI}] to match q_idx {tuple(q_idx.shape)}; "
            f"got k_idx {tuple(k_idx.shape)}"
        )
    if tuple(w.shape) != (B, T, HI):
        raise ValueError(
            f"w must be [B, T, HI] = {(B, T, HI)} to match q_idx {tuple(q_idx.shape)}; "
            f"got w {tuple(w.shape)}"
        )


def check_selection_args(q_idx, k_idx, w, k: int, causal: bool, k_name: str = "k") -> int:
    """q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI]. Returns k as a Python int (NumPy and
    concrete jax integer scalars are accepted); k_name is the caller's name for it. Each of
    the three may be bf16, f16, f32 or float8_e4m3fn, mixed freely."""
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("w", w)):
        _check_indexer_float(name, x)
    check_indexer_shapes(q_idx, k_idx, w)
    B, T, HI, DI = q_idx.shape
    try:
        k_int = None if isinstance(k, bool) else operator.index(k)
    except TypeError:
        k_int = None
    if k_int is None or k_int < 1:
        raise ValueError(f"{k_name} must be a positive int; got {k_name}={k!r}")
    S = k_idx.shape[1]
    if causal and T > S:
        raise ValueError(
            f"causal selection needs T <= S (queries are end-aligned with keys); got {T=} {S=} "
            f"from q_idx {tuple(q_idx.shape)} and k_idx {tuple(k_idx.shape)}"
        )
    if T == 0 or S == 0:
        raise ValueError(f"T and S must be non-empty; got {T=} {S=}")
    if HI == 0 or DI == 0:
        raise ValueError(
            f"q_idx needs at least one head and feature; got q_idx {tuple(q_idx.shape)}"
        )
    # Slots past S can only hold -1: selection runs with min(k, S) slots and pads the result
    # (`pad_slots`), so no kernel sees them. They are allowed up to a result of 2**31 - 1
    # elements (8 GiB of -1); a larger k is rejected here rather than allocated.
    if k_int > S and max(B * T, 1) * k_int > INT32_MAX:
        raise ValueError(
            f"{k_name}={k_int} is larger than the S={S} keys, so its last {k_int - S} slots "
            f"can only hold -1, and the int32 result [B, T, {k_name}] = {[B, T, k_int]} would "
            f"hold {B * T * k_int} elements, more than 2**31 - 1; use {k_name} <= S"
        )
    return k_int


def check_k_scale(k_scale, k_idx):
    """The per-key scales `k_scale` [B, S] of keys k_idx [B, S, DI] as f32, or None.

    Any real floating dtype (cast to f32; bf16, f16 and FP8 exactly). Concrete values must be
    positive and finite (ValueError naming the first bad entry); a traced k_scale cannot be
    checked and follows the NaN rule instead (docs/design.md, "Values jit cannot check").
    """
    if k_scale is None:
        return None
    _check_float("k_scale", k_scale)
    B, S = k_idx.shape[0], k_idx.shape[1]
    if tuple(k_scale.shape) != (B, S):
        raise ValueError(
            f"k_scale must be [B, S] = {(B, S)}, one scale per key of k_idx "
            f"{tuple(k_idx.shape)}; got k_scale {tuple(k_scale.shape)}"
        )
    if not isinstance(k_scale, jax.core.Tracer):
        values = np.asarray(k_scale, np.float32)
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            b, s = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"k_scale must hold positive finite scales; got {int(bad.sum())} entries that "
                f"are not, the first k_scale[{b}, {s}] = {values[b, s]}"
            )
    return jnp.asarray(k_scale).astype(jnp.float32)


def check_qkv(q, k, v) -> None:
    """q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
    _check_rank("q", q, 4, "[B, T, H, D]")
    _check_rank("k", k, 4, "[B, S, G, D]")
    _check_rank("v", v, 4, "[B, S, G, Dv]")
    B, T, H, D = q.shape
    _, S, G, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k must be [B={B}, S, G, D={D}] to match q {tuple(q.shape)}; got k {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must be [B, S, G, Dv] with B, S, G of k {tuple(k.shape)}; got v {tuple(v.shape)}"
        )
    if G == 0 or H % G != 0:
        raise ValueError(
            f"H must be a multiple of G (kv groups); got H={H} from q "
            f"{tuple(q.shape)} and G={G} from k {tuple(k.shape)}"
        )
    if S == 0:
        raise ValueError(f"k and v must hold at least one key; got k {tuple(k.shape)}")
    if 0 in (T, H, D, v.shape[3]):
        raise ValueError(
            f"q needs at least one query, head and feature, and v a feature; got "
            f"q {tuple(q.shape)}, v {tuple(v.shape)}"
        )


def value_operand(k, v, value_dim):
    """The value array of an attention call: v itself, or, with v=None, the key's leading
    value_dim features k[..., :value_dim] (MLA's absorbed form, where the value is the latent
    part of the key). Exactly one of v and value_dim is given; value_dim is an int in [1, D]."""
    if (v is None) == (value_dim is None):
        raise ValueError(
            "pass either v [B, S, G, Dv] or value_dim (the value is then k[..., :value_dim]); "
            f"got v={None if v is None else tuple(np.shape(v))} and value_dim={value_dim!r}"
        )
    if v is not None:
        return v
    _check_float("k", k)
    _check_rank("k", k, 4, "[B, S, G, D]")
    if isinstance(value_dim, bool) or not isinstance(value_dim, (int, np.integer)):
        raise TypeError(f"value_dim must be an int; got {type(value_dim).__name__} {value_dim!r}")
    if not 1 <= value_dim <= k.shape[3]:
        raise ValueError(
            f"value_dim must be in [1, D={k.shape[3]}] (the key's leading features); got "
            f"value_dim={value_dim} for k {tuple(k.shape)}"
        )
    return k[..., : int(value_dim)]


def static_scale(scale, head_dim: int) -> float:
    """The logit scale as a Python float: head_dim ** -0.5 for None, else a finite real number
    (a Python int or float, or a NumPy or concrete jax scalar of a real dtype).

    It is compiled into the kernels, so a traced value is a TypeError that says so, as is
    anything that is not a real number (str, complex, bool, an array with axes); NaN and inf
    are a ValueError (every logit would be NaN).
    """
    if scale is None:
        return float(head_dim) ** -0.5
    if hasattr(scale, "shape") and hasattr(scale, "dtype"):  # NumPy or jax scalar array
        real = jnp.issubdtype(scale.dtype, jnp.integer) or jnp.issubdtype(scale.dtype, jnp.floating)
        is_number = real and np.shape(scale) == ()
    else:
        is_number = isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_))
    if not is_number:
        raise TypeError(f"scale must be a finite real number; got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            f"scale must be a static Python number (it is compiled into the kernels); got a "
            f"traced value {scale!r}: pass a Python float, or mark it static under jit"
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite real number; got scale={scale!r}")
    return value


def check_attention_args(q, k, v, idx) -> None:
    """q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv], idx [B,T,K] integer."""
    check_qkv(q, k, v)
    _check_array("idx", idx)
    _check_rank("idx", idx, 3, "[B, T, K]")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"idx must be an integer array [B, T, K]; got dtype {idx.dtype}")
    B, T = q.shape[:2]
    if idx.shape[:2] != (B, T):
        raise ValueError(
            f"idx must be [B={B}, T={T}, K] to match q {tuple(q.shape)}; got idx {tuple(idx.shape)}"
        )
    if idx.shape[2] < 1:
        raise ValueError(f"idx must hold at least one entry per row; got idx {tuple(idx.shape)}")


def int32_indices(idx, num_keys: int):
    """idx as int32 with every entry outside [0, num_keys) set to -1, so a wide (int64, uint32)
    index past the int32 range stays out of range instead of wrapping onto a key."""
    if idx.dtype == jnp.int32:
        return idx
    in_range = (idx >= 0) & (idx < num_keys)
    return jnp.where(in_range, idx.astype(jnp.int32), jnp.int32(-1))


def pad_slots(idx, k: int):
    """idx [B, T, k'] int32 with k' <= k -> [B, T, k], the new trailing slots -1."""
    extra = k - idx.shape[-1]
    if extra == 0:
        return idx
    return jnp.pad(idx, ((0, 0), (0, 0), (0, extra)), constant_values=-1)


def resolve_impl(impl: str, choices: tuple[str, ...]) -> str:
    """Validate `impl` and resolve "auto": the compiled Pallas kernels on GPU, else "xla"."""
    import jax

    check_impl(impl, choices)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(
            f"impl='pallas' runs compiled GPU kernels, and the backend is "
            f"{jax.default_backend()!r}; use impl='interpret' (the same kernels, "
            "interpreted) or impl='xla'"
        )
    return impl


def pick_block(requested: int | None, default: int, size: int) -> int:
    """Block length along an axis of `size`: the requested or default length, never past
    the axis."""
    block = default if requested is None else requested
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block sizes must be positive ints; got {block!r}")
    return min(block, size)


def check_layer_args(q, k, v, q_idx, k_idx, w, topk: int, causal: bool, impl: str) -> int:
    """All checks of the layer op: attention and indexer inputs, and that they line up.
    Returns topk as a Python int."""
    check_impl(impl, SELECTION_IMPLS)
    check_qkv(q, k, v)
    topk = check_selection_args(q_idx, k_idx, w, topk, causal, k_name="topk")
    if k.shape[1] != k_idx.shape[1]:
        raise ValueError(
            f"k and k_idx must have the same S; got k {tuple(k.shape)} and "
            f"k_idx {tuple(k_idx.shape)}"
        )
    if q.shape[:2] != q_idx.shape[:2]:
        raise ValueError(
            f"q and q_idx must have the same [B, T]; got q {tuple(q.shape)} and "
            f"q_idx {tuple(q_idx.shape)}"
        )
    return topk
