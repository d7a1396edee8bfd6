"""Flax NNX modules: a small long-context decoder LM with HyScale attention.

Every block runs grouped-query attention (`HyScaleAttention`), or with
`attention_kind="mla"` multi-head latent attention (`MLAAttention`: GLM-5 / DeepSeek-V3.2, whose
sparse paths run DSA's absorbed multi-query form), over either
  * "hyscale":      exact HyTopK selection + sparse attention (paper sections 3-4),
  * "materialized": the DSA baseline, `topk_reference` (the T x S score table and `lax.top_k`)
                    + the same sparse attention,
  * "dense":        `jax.nn.dot_product_attention` (cuDNN on GPU where it applies),
and is rematerialized per block with nothing ("none"), plain `jax.checkpoint` ("full": the
selection runs again in the backward pass, the baseline) or `jax.checkpoint` with
`hs.replay_policy(indexer_statistics=True)` ("replay": the indices are saved and replayed,
paper section 4, with the sparse-stage indexer loss's small per-query statistics;
`offload_indices` keeps the indices in host memory until the backward pass needs them).

The lightning indexer learns by KL distillation from the main attention (docs/design.md,
'Indexer loss'): its input hidden states are detached and `hs.hyscale_attention` selects on
detached indexer outputs, so the LM loss never reaches it and the KL loss reaches nothing else.
Two stages, picked per call with `indexer_stage`:
  * "dense":  DSA's warm-up. Main attention is dense (every visible key) and the KL runs over all
              visible keys: O(T*S), for short sequences only.
  * "sparse": main attention over the selected keys, KL restricted to the selection: O(T*k).
  * "none":   no indexer loss (inference, evaluation).

Parameters are f32; activations are computed in `ModelConfig.dtype` (bf16 by default).

Sharding (`LongContextLM(cfg, rngs=..., mesh=hs.parallel.make_mesh(data=2, seq=4))`): the mesh
is a structural (static) attribute, not a config field, so checkpoints and configs do not depend
on the device layout. With a mesh, activations [B, T, ...] are constrained to batch over "data"
and sequence over "seq" after the embedding and every block, and "hyscale" attention runs
`hs.parallel.hyscale_attention` (keys all-gathered over "seq", per-shard exact selection with
causal offsets, zig-zag load balance). Everything else (projections, MLP, the dense warm-up and
the materialized baseline) is left to XLA's SPMD partitioner. Parameters are placed by the
caller (replicated in `hyscale_jax.train`). Results equal the unsharded model's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import hyscale_jax as hs
from hyscale_jax import parallel

ATTENTIONS = ("hyscale", "materialized", "dense")
REMATS = ("none", "full", "replay")
IMPLS = ("auto", "pallas", "interpret", "xla", "reference")
INDEXER_STAGES = ("none", "dense", "sparse")
ATTENTION_KINDS = ("gqa", "mla")
_DTYPES = ("float32", "bfloat16", "float16")
INDEX_DTYPES = ("compute", "float8_e4m3fn")
SELECTION_ORDERS = ("score", "index")


# ModelConfig's options of remat="replay" (where it keeps the saved indices).
REPLAY_OPTIONS = ("offload_indices",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # token vocabulary (256: raw bytes)
    d_model: int = 128  # residual stream width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention query heads H
    n_kv_heads: int = 1  # key/value heads G (H % G == 0; G = 1 is DSA's MQA mode)
    head_dim: int = 32  # per-head width D of q, k, v (even: RoPE)
    index_heads: int = 4  # lightning-indexer query heads HI
    index_dim: int = 32  # lightning-indexer width DI (even: RoPE)
    # Indexer features RoPE rotates (even; the rest carry no position, as DSA's indexer: 64 of
    # 128). None rotates all DI. Position-free features let a match learned on short sequences
    # hold at any distance.
    index_rope_dim: int | None = None
    topk: int = 32  # keys each query attends to (k; 2048 in GLM-5)
    attention: str = "hyscale"  # "hyscale" | "materialized" | "dense"
    # Multi-head latent attention (`MLAAttention`, docs/design.md, 'MLA in the model'):
    # attention_kind="mla" replaces the grouped-query projections (n_kv_heads and head_dim are
    # then unused).
    attention_kind: str = "gqa"  # "gqa" | "mla"
    q_lora_rank: int = 64  # MLA query latent width
    kv_lora_rank: int = 64  # MLA key/value latent width (the absorbed form's value width)
    qk_nope_dim: int = 32  # MLA per-head query/key width without position
    qk_rope_dim: int = 16  # MLA decoupled RoPE width, one key shared by all heads (even)
    v_head_dim: int = 32  # MLA per-head value width
    remat: str = "none"  # per-block rematerialization: "none" | "full" | "replay"
    offload_indices: bool = False  # replay: keep the saved indices in host memory (pinned)
    # Sparse stage: the indexer loss keeps its target distribution (f32 [B, T, ~topk] per
    # layer, about as large as the indices; replay saves it beside them, in host memory with
    # offload_indices), so that its Pallas backward gathers no main keys
    # (`hs.indexer_kl_loss(save_target=True)`).
    save_indexer_target: bool = False
    # The order of each query's selected keys (`hs.hytopk`'s `order`): "score", or "index"
    # (ascending key index; the Pallas selection then skips its ordering sort). Attention and
    # the indexer loss read the selection as a set.
    selection_order: str = "score"
    impl: str = "auto"  # hs ops kernel choice: auto|pallas|interpret|xla|reference
    mlp_dim: int | None = None  # SwiGLU hidden width (default 4 * d_model)
    # Tokens per SwiGLU chunk (None: the whole sequence at once). Chunks are rematerialized one
    # at a time in the backward pass, so the [B, T, mlp_dim] activations stop bounding memory at
    # long T (one device only: not with a mesh).
    mlp_chunk: int | None = None
    rope_base: float = 10_000.0  # RoPE base wavelength (raise it for very long contexts)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    dtype: str = "bfloat16"  # activation / compute dtype
    param_dtype: str = "float32"  # parameter (and optimizer) dtype
    # Indexer scores the selection uses: "compute" (the compute dtype) or "float8_e4m3fn"
    # (DSA's FP8 indexer: `hs.quantize_indexer`; the indexer KL still uses the unquantized ones).
    index_dtype: str = "compute"
    index_hadamard: bool = True  # FP8 indexer only: Hadamard-rotate before quantizing (DI 2**n)

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "index_heads",
            "index_dim",
            "topk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        for name in ("mlp_dim", "mlp_chunk"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(
                    f"ModelConfig.{name} must be a positive int or None; got {value!r}"
                )
        for name, choices in (
            ("attention", ATTENTIONS),
            ("remat", REMATS),
            ("impl", IMPLS),
            ("dtype", _DTYPES),
            ("param_dtype", _DTYPES),
            ("index_dtype", INDEX_DTYPES),
            ("selection_order", SELECTION_ORDERS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(
                    f"ModelConfig.{name}={value!r} is not one of "
                    f"{', '.join(repr(c) for c in choices)}"
                )
        for name in REPLAY_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool; got {getattr(self, name)!r}")
            if getattr(self, name) and self.remat != "replay":
                raise ValueError(
                    f"ModelConfig.{name}=True changes what remat='replay' saves; got "
                    f"remat={self.remat!r}"
                )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads must be a multiple of n_kv_heads; got "
                f"n_heads={self.n_heads} n_kv_heads={self.n_kv_heads}"
            )
        for name in ("head_dim", "index_dim"):
            if getattr(self, name) % 2:
                raise ValueError(
                    f"ModelConfig.{name} must be even (RoPE rotates pairs); got "
                    f"{getattr(self, name)}"
                )
        rope_dim = self.index_rope_dim
        if rope_dim is not None and (
            not isinstance(rope_dim, int)
            or isinstance(rope_dim, bool)
            or not 0 <= rope_dim <= self.index_dim
            or rope_dim % 2
        ):
            raise ValueError(
                f"ModelConfig.index_rope_dim must be None or an even int in [0, index_dim="
                f"{self.index_dim}]; got {rope_dim!r}"
            )
        if not isinstance(self.save_indexer_target, bool):
            raise ValueError(
                f"ModelConfig.save_indexer_target must be a bool; got {self.save_indexer_target!r}"
            )
        if not isinstance(self.index_hadamard, bool):
            raise ValueError(
                f"ModelConfig.index_hadamard must be a bool; got {self.index_hadamard!r}"
            )
        fp8_rotated = self.index_dtype == "float8_e4m3fn" and self.index_hadamard
        if fp8_rotated and self.index_dim & (self.index_dim - 1):
            raise ValueError(
                f"ModelConfig.index_dim must be a power of two for the Hadamard-rotated FP8 "
                f"indexer (index_hadamard=True); got index_dim={self.index_dim}"
            )
        if not self.rope_base > 1:
            raise ValueError(f"ModelConfig.rope_base must be > 1; got {self.rope_base}")
        if self.attention_kind not in ATTENTION_KINDS:
            raise ValueError(
                f"ModelConfig.attention_kind={self.attention_kind!r} is not one of "
                f"{', '.join(repr(c) for c in ATTENTION_KINDS)}"
            )
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        if self.qk_rope_dim % 2:
            raise ValueError(
                f"ModelConfig.qk_rope_dim must be even (RoPE rotates pairs); got {self.qk_rope_dim}"
            )

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        # Configurations saved while replay's saving of the indexer loss's statistics was an
        # option still name it; replay always saves them now, and neither changes a step's math.
        return cls(**{k: v for k, v in d.items() if k != "save_indexer_statistics"})


# The attention layers of the two models HyScale is for, from their public configs (GLM-5.1,
# DeepSeek-V3.2): one layer, for layer-level benchmarks (`MLAAttention(cfg, rngs=...)`, or a
# one-layer `LongContextLM`). Both models are mixtures of experts: the SwiGLU here is this
# model's, not theirs. DeepSeek-V3.2 runs its indexer in FP8; these shapes are bf16.
MLA_LAYER_PRESETS: dict[str, ModelConfig] = {
    "glm-5.1": ModelConfig(
        d_model=6144,
        n_layers=1,
        n_heads=64,
        index_heads=32,
        index_dim=128,
        index_rope_dim=64,
        topk=2048,
        attention_kind="mla",
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_dim=192,
        qk_rope_dim=64,
        v_head_dim=256,
    ),
    "deepseek-v3.2": ModelConfig(
        d_model=7168,
        n_layers=1,
        n_heads=128,
        index_heads=64,
        index_dim=128,
        index_rope_dim=64,
        topk=2048,
        attention_kind="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
}


def rope(x, positions, base: float):
    """Rotary position embedding (rotate-half form), applied in f32.

    x: [B, T, N, D] (D even); positions: [T] int. Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, half]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, **kw) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
        **kw,
    )


class Indexer(nnx.Module):
    """DSA lightning indexer: per-head queries, one shared key, per-head weights.

    score[b,t,s] = sum_h w[b,t,h] * relu(q_idx[b,t,h] . k_idx[b,s])

    (docs/design.md, 'Indexer score').

    The input hidden states are detached: the indexer learns only from `hs.indexer_kl_loss`.
    With `index_dtype="float8_e4m3fn"` the selection scores FP8 copies of the outputs
    (`selection_inputs`), while the KL loss trains the unquantized ones.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wq = _linear(cfg, cfg.d_model, cfg.index_heads * cfg.index_dim, rngs)
        self.wk = _linear(cfg, cfg.d_model, cfg.index_dim, rngs)
        self.k_norm = nnx.LayerNorm(
            cfg.index_dim,
            epsilon=cfg.norm_eps,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.dtype(cfg.param_dtype),
            rngs=rngs,
        )
        self.w_proj = _linear(cfg, cfg.d_model, cfg.index_heads, rngs)

    def __call__(self, x, positions):
        """x: [B, T, d_model]; positions: [T].

        Returns q_idx [B, T, HI, DI], k_idx [B, T, DI], w [B, T, HI] in the compute dtype.
        """
        cfg = self.cfg
        B, T, _ = x.shape
        x = jax.lax.stop_gradient(x)
        q_idx = self.wq(x).reshape(B, T, cfg.index_heads, cfg.index_dim)
        q_idx = self._rope(q_idx, positions)
        k_idx = self.k_norm(self.wk(x))[:, :, None, :]
        k_idx = self._rope(k_idx, positions)[:, :, 0, :]
        # (HI * DI) ** -0.5 keeps initial scores O(1): the KL target is softmax(score).
        w = self.w_proj(x) * (cfg.index_heads * cfg.index_dim) ** -0.5
        return q_idx, k_idx, w.astype(cfg.compute_dtype)

    def _rope(self, x, positions):
        """RoPE on x's leading `index_rope_dim` features (all when None); x: [B, T, N, DI]."""
        rope_dim = self.cfg.index_rope_dim
        if rope_dim is None or rope_dim == x.shape[-1]:
            return rope(x, positions, self.cfg.rope_base)
        rotated = rope(x[..., :rope_dim], positions, self.cfg.rope_base)
        return jnp.concatenate([rotated, x[..., rope_dim:]], axis=-1)

    def selection_inputs(self, q_idx, k_idx, w):
        """The selection's (q_idx, k_idx, w, k_scale) from this indexer's outputs (shapes as
        returned by `__call__`): unchanged with k_scale None, or for the FP8 indexer
        `hs.quantize_indexer` of the detached outputs (e4m3 q and k [B, T, HI, DI] /
        [B, T, DI], f32 w [B, T, HI] and k_scale [B, T])."""
        if self.cfg.index_dtype == "compute":
            return q_idx, k_idx, w, None
        sg = jax.lax.stop_gradient
        return hs.quantize_indexer(sg(q_idx), sg(k_idx), sg(w), hadamard=self.cfg.index_hadamard)


def _check_single_device_indexer(cfg: ModelConfig, mesh) -> None:
    if mesh is not None and cfg.attention == "hyscale" and cfg.index_dtype != "compute":
        raise ValueError(
            f"index_dtype={cfg.index_dtype!r} runs on one device only: the sharded "
            f"hs.parallel.hyscale_attention takes no k_scale; use index_dtype='compute' "
            f"with a mesh"
        )


class HyScaleAttention(nnx.Module):
    """Grouped-query causal self-attention with a learned sparse selection (or dense).

    Returns (y [B, T, d_model], aux) with aux = {"indexer_loss": f32 scalar (mean KL per query;
    0 when no indexer loss runs), "idx": int32 [B, T, topk] selected keys, or None}.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        self.cfg = cfg
        self.mesh = mesh  # static: a ("data", "seq") Mesh runs the sharded op, None the local one
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, cfg.d_model, H * D, rngs)
        self.k_proj = _linear(cfg, cfg.d_model, G * D, rngs)
        self.v_proj = _linear(cfg, cfg.d_model, G * D, rngs)
        self.o_proj = _linear(cfg, H * D, cfg.d_model, rngs)
        self.indexer = Indexer(cfg, rngs=rngs) if cfg.attention != "dense" else None
        _check_single_device_indexer(cfg, mesh)

    def __call__(self, x, positions, *, indexer_stage: str = "none"):
        cfg = self.cfg
        B, T, _ = x.shape
        q = rope(self.q_proj(x).reshape(B, T, cfg.n_heads, cfg.head_dim), positions, cfg.rope_base)
        k = rope(
            self.k_proj(x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_base
        )
        v = self.v_proj(x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        zero = jnp.zeros((), jnp.float32)
        idx = None
        if cfg.attention == "dense" or (indexer_stage == "dense"):
            # Dense attention; with an indexer this is DSA's warm-up stage.
            out = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=_dense_implementation(q)
            )
            loss = zero
            if self.indexer is not None:
                q_idx, k_idx, w = self.indexer(x, positions)
                loss = hs.indexer_kl_loss(q, k, q_idx, k_idx, w, causal=True) / T
        else:
            q_idx, k_idx, w = self.indexer(x, positions)
            sel_q, sel_k, sel_w, k_scale = self.indexer.selection_inputs(q_idx, k_idx, w)
            if cfg.attention == "hyscale" and self.mesh is not None:
                out, idx, lse = parallel.hyscale_attention(
                    q,
                    k,
                    v,
                    q_idx,
                    k_idx,
                    w,
                    topk=cfg.topk,
                    mesh=self.mesh,
                    causal=True,
                    impl=cfg.impl,
                    return_lse=True,
                    order=cfg.selection_order,
                )
            elif cfg.attention == "hyscale":
                out, idx, lse = hs.hyscale_attention(
                    q,
                    k,
                    v,
                    sel_q,
                    sel_k,
                    sel_w,
                    topk=cfg.topk,
                    causal=True,
                    k_scale=k_scale,
                    impl=cfg.impl,
                    return_lse=True,
                    order=cfg.selection_order,
                )
            else:  # "materialized": the DSA baseline, same attention, T x S table for selection
                idx = _materialized_selection(cfg, sel_q, sel_k, sel_w, k_scale)
                out, lse = hs.sparse_attention(q, k, v, idx, impl=cfg.impl, return_lse=True)
            loss = zero
            if indexer_stage == "sparse":
                loss_impl = "xla" if cfg.impl == "reference" else cfg.impl
                args = (q, k, q_idx, k_idx, w, idx)
                kw = dict(impl=loss_impl, attention_lse=lse, save_target=cfg.save_indexer_target)
                # The attention's log-sum-exps spare the loss a sweep of its own.
                if self.mesh is not None:
                    loss = parallel.indexer_kl_loss(*args, mesh=self.mesh, **kw)
                else:
                    loss = hs.indexer_kl_loss(*args, **kw)
                loss = loss / T
        y = self.o_proj(out.reshape(B, T, cfg.n_heads * cfg.head_dim))
        return y, {"indexer_loss": loss, "idx": idx}


def _materialized_selection(cfg: ModelConfig, q_idx, k_idx, w, k_scale):
    """The DSA baseline's selection, int32 [B, T, topk]: `topk_reference` over the T x S score
    table of the indexer's selection inputs (q_idx [B, T, HI, DI], k_idx [B, S, DI], w
    [B, T, HI], k_scale [B, S] or None), named for replay as HyScale's is."""
    sg = jax.lax.stop_gradient
    idx = hs.topk_reference(
        sg(q_idx),
        sg(k_idx),
        sg(w),
        k=cfg.topk,
        causal=True,
        k_scale=k_scale,
        order=cfg.selection_order,
    )
    return checkpoint_name(idx, hs.INDICES_NAME)


def _dense_implementation(q):
    """cuDNN flash attention on GPU for 16-bit inputs; else None (jax picks XLA). jax's own
    default is XLA everywhere, which materializes [B, H, T, S] logits (64 GiB at T=32K)."""
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


def _rms_norm(cfg: ModelConfig, n: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        n,
        epsilon=cfg.norm_eps,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
    )


def _dense_causal_attention(q, k, v, scale: float):
    """Causal `jax.nn.dot_product_attention` for a value width that differs from the key's.

    q: [B, T, H, D]; k: [B, S, G, D]; v: [B, S, G, Dv]. Returns [B, T, H, Dv].

    jax requires v's shape to equal k's, so q, k and v are zero-padded to max(D, Dv) features:
    zero features add nothing to a score (the scale is passed explicitly, so the padding does
    not change it either) and the padded output columns are dropped. Padding keeps cuDNN's
    flash attention usable on GPU; GLM-5's MLA heads need none (192 + 64 = 256 = v_head_dim).
    """
    D, Dv = q.shape[-1], v.shape[-1]
    width = max(D, Dv)

    def pad(x):
        return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    out = jax.nn.dot_product_attention(
        pad(q), pad(k), pad(v), scale=scale, is_causal=True, implementation=_dense_implementation(q)
    )
    return out[..., :Dv]


class MLAAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2; GLM-5, DeepSeek-V3.2) with a learned sparse
    selection (or dense). docs/design.md, 'MLA in the model'.

    With H = n_heads, C = kv_lora_rank, N = qk_nope_dim, R = qk_rope_dim, V = v_head_dim:

        c_q = RMSNorm(W_dq x) [q_lora_rank]; q_h = (W_uq c_q)_h = [q_nope_h (N), RoPE (R)]
        c_kv = RMSNorm(W_dkv x) [C];         k_rope = RoPE(W_kr x) [R], shared by all heads
        k_nope_h = W_uk_h c_kv [N];          v_h = W_uv_h c_kv [V]
        score_h = (q_nope_h . k_nope_h + q_rope_h . k_rope) * (N + R) ** -0.5
        y = W_o concat_h(sum_j p_hj v_hj)

    Dense attention (attention="dense" and the indexer's dense warm-up) runs this form, H heads
    of N + R features and V-wide values. The sparse paths run DSA's absorbed form, multi-query
    attention over the latent: q'_h = [W_uk_h^T q_nope_h (C), q_rope_h (R)] and one shared key
    k' = [c_kv, k_rope] (G = 1, C + R features) whose leading C features are the value
    (`value_dim=C`), so the kernels gather each selected latent row once; the output o_h [C] is
    then up-projected, W_uv_h o_h [V]. q'_h . k' equals q_nope_h . k_nope_h + q_rope_h . k_rope,
    and the scale stays (N + R) ** -0.5 (not (C + R) ** -0.5), so both forms compute the same
    attention, and the indexer's KL target is the same distribution in both.

    Returns (y [B, T, d_model], aux) as `HyScaleAttention`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        self.cfg = cfg
        self.mesh = mesh  # static: a ("data", "seq") Mesh runs the sharded op, None the local one
        H, C, R = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
        N, V = cfg.qk_nope_dim, cfg.v_head_dim
        self.wq_a = _linear(cfg, cfg.d_model, cfg.q_lora_rank, rngs)  # W_dq
        self.q_norm = _rms_norm(cfg, cfg.q_lora_rank, rngs)
        self.wq_b = _linear(cfg, cfg.q_lora_rank, H * (N + R), rngs)  # W_uq, per head [N | R]
        self.wkv_a = _linear(cfg, cfg.d_model, C + R, rngs)  # [W_dkv | W_kr]
        self.kv_norm = _rms_norm(cfg, C, rngs)
        self.wkv_b = _linear(cfg, C, H * (N + V), rngs)  # [W_uk | W_uv], per head [N | V]
        self.o_proj = _linear(cfg, H * V, cfg.d_model, rngs)
        self.indexer = Indexer(cfg, rngs=rngs) if cfg.attention != "dense" else None
        _check_single_device_indexer(cfg, mesh)

    def __call__(self, x, positions, *, indexer_stage: str = "none"):
        """x: [B, T, d_model]; positions: [T]. Returns (y [B, T, d_model], aux)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, C, R = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
        N, V = cfg.qk_nope_dim, cfg.v_head_dim
        scale = (N + R) ** -0.5
        q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(B, T, H, N + R)
        q_nope, q_rope = q[..., :N], rope(q[..., N:], positions, cfg.rope_base)
        kv = self.wkv_a(x)
        c_kv = self.kv_norm(kv[..., :C])  # [B, T, C]
        k_rope = rope(kv[:, :, None, C:], positions, cfg.rope_base)  # [B, T, 1, R]
        zero = jnp.zeros((), jnp.float32)
        loss, idx = zero, None
        if cfg.attention == "dense" or indexer_stage == "dense":
            # Dense attention; with an indexer this is DSA's warm-up stage.
            up = self.wkv_b(c_kv).reshape(B, T, H, N + V)
            q_full = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, H, N + R]
            k_full = jnp.concatenate(
                [up[..., :N], jnp.broadcast_to(k_rope, (B, T, H, R))], axis=-1
            )  # [B, T, H, N + R]
            out = _dense_causal_attention(q_full, k_full, up[..., N:], scale)  # [B, T, H, V]
            if self.indexer is not None:
                q_idx, k_idx, w = self.indexer(x, positions)
                loss = (
                    hs.indexer_kl_loss(q_full, k_full, q_idx, k_idx, w, causal=True, scale=scale)
                    / T
                )
        else:
            w_up = self.wkv_b.kernel[...].astype(cfg.compute_dtype).reshape(C, H, N + V)
            q_abs = jnp.einsum(
                "bthn,chn->bthc", q_nope, w_up[..., :N], preferred_element_type=jnp.float32
            ).astype(cfg.compute_dtype)
            q_lat = jnp.concatenate([q_abs, q_rope], axis=-1)  # [B, T, H, C + R]
            k_lat = jnp.concatenate([c_kv[:, :, None, :], k_rope], axis=-1)  # [B, T, 1, C + R]
            q_idx, k_idx, w = self.indexer(x, positions)
            sel_q, sel_k, sel_w, k_scale = self.indexer.selection_inputs(q_idx, k_idx, w)
            if cfg.attention == "hyscale" and self.mesh is not None:
                # The sharded op takes the value explicitly: the latent part of the key.
                out, idx, lse = parallel.hyscale_attention(
                    q_lat,
                    k_lat,
                    k_lat[..., :C],
                    q_idx,
                    k_idx,
                    w,
                    topk=cfg.topk,
                    mesh=self.mesh,
                    causal=True,
                    scale=scale,
                    impl=cfg.impl,
                    return_lse=True,
                    order=cfg.selection_order,
                )
            elif cfg.attention == "hyscale":
                out, idx, lse = hs.hyscale_attention(
                    q_lat,
                    k_lat,
                    None,
                    sel_q,
                    sel_k,
                    sel_w,
                    topk=cfg.topk,
                    causal=True,
                    scale=scale,
                    k_scale=k_scale,
                    impl=cfg.impl,
                    value_dim=C,
                    return_lse=True,
                    order=cfg.selection_order,
                )
            else:  # "materialized": the DSA baseline, same attention, T x S table for selection
                idx = _materialized_selection(cfg, sel_q, sel_k, sel_w, k_scale)
                out, lse = hs.sparse_attention(
                    q_lat,
                    k_lat,
                    None,
                    idx,
                    scale=scale,
                    impl=cfg.impl,
                    value_dim=C,
                    return_lse=True,
                )
            # out: [B, T, H, C] latent outputs -> per-head values [B, T, H, V]
            out = jnp.einsum(
                "bthc,chv->bthv", out, w_up[..., N:], preferred_element_type=jnp.float32
            ).astype(cfg.compute_dtype)
            if indexer_stage == "sparse":
                loss_impl = "xla" if cfg.impl == "reference" else cfg.impl
                args = (q_lat, k_lat, q_idx, k_idx, w, idx)
                kw = dict(
                    scale=scale,
                    impl=loss_impl,
                    attention_lse=lse,
                    save_target=cfg.save_indexer_target,
                )
                # The attention's log-sum-exps spare the loss a sweep of its own.
                if self.mesh is not None:
                    loss = parallel.indexer_kl_loss(*args, mesh=self.mesh, **kw)
                else:
                    loss = hs.indexer_kl_loss(*args, **kw)
                loss = loss / T
        y = self.o_proj(out.reshape(B, T, H * V))
        return y, {"indexer_loss": loss, "idx": idx}


class MLP(nnx.Module):
    """SwiGLU feed-forward, over the sequence in chunks of `cfg.mlp_chunk` tokens if set.

    The MLP acts on each token alone, so a chunk's output rows are the unchunked ones. Each chunk
    runs under `jax.checkpoint` inside a `lax.map`: the backward pass keeps only the chunks'
    inputs and recomputes one chunk's [B, chunk, mlp_dim] activations at a time, instead of
    holding the whole sequence's (at T = 1M and mlp_dim 4096, 8 GiB per bf16 tensor, several
    live at once). The price is one more MLP forward per step.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.d_model, cfg.hidden_dim, rngs)
        self.up = _linear(cfg, cfg.d_model, cfg.hidden_dim, rngs)
        self.down = _linear(cfg, cfg.hidden_dim, cfg.d_model, rngs)
        self.chunk = cfg.mlp_chunk

    def _swiglu(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    def __call__(self, x):
        """x: [B, T, d_model] -> [B, T, d_model]."""
        B, T, d = x.shape
        if self.chunk is None or T <= self.chunk:
            return self._swiglu(x)
        C = self.chunk
        n = T // C
        swiglu = jax.checkpoint(self._swiglu)
        chunks = x[:, : n * C].reshape(B, n, C, d).swapaxes(0, 1)  # [n, B, C, d]
        out = jax.lax.map(swiglu, chunks).swapaxes(0, 1).reshape(B, n * C, d)
        if n * C < T:  # the last T % C tokens
            out = jnp.concatenate([out, swiglu(x[:, n * C :])], axis=1)
        return out


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        def norm():
            return nnx.RMSNorm(
                cfg.d_model,
                epsilon=cfg.norm_eps,
                dtype=cfg.compute_dtype,
                param_dtype=jnp.dtype(cfg.param_dtype),
                rngs=rngs,
            )

        self.attn_norm = norm()
        attention = MLAAttention if cfg.attention_kind == "mla" else HyScaleAttention
        self.attn = attention(cfg, rngs=rngs, mesh=mesh)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, *, indexer_stage: str = "none"):
        """x: [B, T, d_model] -> (x', aux) as in `HyScaleAttention`."""
        y, aux = self.attn(self.attn_norm(x), positions, indexer_stage=indexer_stage)
        x = x + y
        x = x + self.mlp(self.mlp_norm(x))
        return x, aux


def _fence(tree):
    """An identity that XLA cannot see through (`jax.lax.optimization_barrier`): what comes out
    exists only once everything that goes in has been computed, and its transpose does the
    same for the cotangents. `LongContextLM` fences its blocks with it."""
    return jax.lax.optimization_barrier(tree)


def remat_block(block: Block, cfg: ModelConfig):
    """`block`'s call, wrapped in the per-block rematerialization `cfg.remat` asks for.

    "full": plain `jax.checkpoint` (everything recomputed, selection included: the baseline);
    "replay": `jax.checkpoint(policy=hs.replay_policy(...))` (the indices are saved, in host
    memory with cfg.offload_indices, and replayed; so are the sparse-stage indexer loss's small
    per-query statistics, so that its forward kernel does not run again in the backward pass,
    and with cfg.save_indexer_target its target distribution).
    Under both, the block's parameters and input pass a `_fence` first, so that in the backward
    pass the block's input cotangent leaves only with its parameter gradients complete.
    """
    if cfg.remat == "none":
        return block
    graphdef, state = nnx.split(block)
    policy = None
    if cfg.remat == "replay":
        policy = hs.replay_policy(
            offload=cfg.offload_indices,
            indexer_statistics=True,
            indexer_target=cfg.save_indexer_target,
        )

    def run(state, x, positions, indexer_stage):
        return nnx.merge(graphdef, state)(x, positions, indexer_stage=indexer_stage)

    checkpointed = jax.checkpoint(run, policy=policy, static_argnums=(3,))

    def call(x, positions, *, indexer_stage="none"):
        # Without the tie XLA defers the gradients nothing downstream waits for (the indexer's
        # KL gradient reaches only the indexer's weights) to the end of the backward pass, and
        # every deferred layer keeps its rematerialized indexer activations and indices live.
        tied_state, x = _fence((state, x))
        return checkpointed(tied_state, x, positions, indexer_stage)

    return call


class LongContextLM(nnx.Module):
    """Decoder-only byte/token LM. `model(tokens [B, T]) -> logits [B, T, V]` (f32).

    mesh: optional ("data", "seq") `jax.sharding.Mesh` (`hs.parallel.make_mesh`): activations
      sharded by batch over "data" and sequence over "seq", HyScale attention sequence-parallel
      (module docstring). B must divide by the data size and T by 2 * seq.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig; got {type(config).__name__}")
        if mesh is not None:
            parallel.check_mesh(mesh)
            if config.mlp_chunk is not None:
                raise ValueError(
                    f"ModelConfig.mlp_chunk={config.mlp_chunk} chunks the sequence on one device; "
                    "with a mesh the sequence is sharded over 'seq' instead: leave it None"
                )
        self.config = config
        self.mesh = mesh
        cfg = config
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.dtype(cfg.param_dtype),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs=rngs, mesh=mesh) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.RMSNorm(
            cfg.d_model,
            epsilon=cfg.norm_eps,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.dtype(cfg.param_dtype),
            rngs=rngs,
        )
        self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

    def __call__(self, tokens):
        return self.forward(tokens)[0]

    def forward(self, tokens, *, indexer_stage: str = "none", index_rows=None):
        """tokens: [B, T] int; index_rows: optional int [B, Q] query positions.

        Returns (logits [B, T, V] f32, aux) with aux = {
          "indexer_loss": f32 scalar, the indexer KL per query averaged over layers (add it to
                          the LM loss: no gradient of one reaches the other's parameters),
          "indices": tuple of int32 [B, T, topk] per layer (empty for dense attention or the
                     dense indexer stage); with index_rows, only those rows, [B, Q, topk],
                     taken as soon as the layer has run, so that no layer's whole index tensor
                     (8 GiB at T = 1M, k = 2048) outlives its layer for the sake of a metric}.
        """
        if indexer_stage not in INDEXER_STAGES:
            raise ValueError(
                f"indexer_stage={indexer_stage!r} is not one of "
                f"{', '.join(repr(s) for s in INDEXER_STAGES)}"
            )
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer array [B, T]; got shape "
                f"{tuple(tokens.shape)} dtype {tokens.dtype}"
            )
        cfg = self.config
        T = tokens.shape[1]
        positions = jnp.arange(T, dtype=jnp.int32)
        constrain = lambda x: x  # noqa: E731
        if self.mesh is not None:
            sharding = parallel.activation_sharding(self.mesh)
            constrain = lambda x: jax.lax.with_sharding_constraint(x, sharding)  # noqa: E731
        if index_rows is not None:
            index_rows = jnp.asarray(index_rows)
            if (
                index_rows.ndim != 2
                or index_rows.shape[0] != tokens.shape[0]
                or not jnp.issubdtype(index_rows.dtype, jnp.integer)
            ):
                raise ValueError(
                    f"index_rows must be integer query positions [B, Q] with B = "
                    f"{tokens.shape[0]}; got shape {tuple(index_rows.shape)} dtype "
                    f"{index_rows.dtype}"
                )
        x = constrain(self.embed(tokens))
        losses, indices = [], []
        for block in self.blocks:
            x, aux = remat_block(block, cfg)(x, positions, indexer_stage=indexer_stage)
            idx = aux["idx"]
            if idx is not None and index_rows is not None:
                idx = jnp.take_along_axis(idx, index_rows[..., None], axis=1)
            # The next block starts only once this one's indexer loss and index rows exist:
            # only the step's final metrics read them, so XLA would otherwise compute them at
            # the end and keep every layer's index tensor on the device through the step.
            x, loss, idx = _fence((x, aux["indexer_loss"], idx))
            x = constrain(x)
            losses.append(loss)
            if idx is not None:
                indices.append(idx)
        logits = self.lm_head(self.final_norm(x)).astype(jnp.float32)
        return logits, {"indexer_loss": jnp.mean(jnp.stack(losses)), "indices": tuple(indices)}
