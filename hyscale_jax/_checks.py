"""Up-front argument checks shared by the public ops (SPEC section 3, "Bad input").

Every check runs on static shapes and dtypes, before any kernel is traced, and names the
argument and the shapes it got.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

SELECTION_IMPLS = ("auto", "pallas", "interpret", "xla", "reference")
ATTENTION_IMPLS = ("auto", "pallas", "interpret", "xla", "reference")
# Sparse-stage indexer loss; its dense warm-up stage always runs the XLA table formula.
INDEXER_LOSS_IMPLS = ("auto", "pallas", "interpret", "xla")


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


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}; got shape {tuple(x.shape)}")


def check_selection_args(q_idx, k_idx, w, k: int, causal: bool, k_name: str = "k") -> int:
    """q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI]. Returns k as a Python int (NumPy and
    concrete jax integer scalars are accepted); k_name is the caller's name for it."""
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx), ("w", w)):
        _check_float(name, x)
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
    return k_int


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


def static_scale(scale, head_dim: int) -> float:
    """The logit scale as a Python float (default head_dim ** -0.5); it is baked into the
    kernels, so a traced value is a TypeError that says so."""
    if scale is None:
        return float(head_dim) ** -0.5
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"scale must be a static Python number (it is compiled into the "
            f"kernels); got {type(scale).__name__} {scale!r}"
        ) from None


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
