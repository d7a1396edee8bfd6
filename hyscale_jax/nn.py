"""Flax NNX modules: a small long-context decoder LM with HyScale attention.

Every block runs grouped-query attention over either
  * "hyscale":      exact HyTopK selection + sparse attention (paper sections 3-4),
  * "materialized": the DSA baseline, `topk_reference` (the T x S score table and `lax.top_k`)
                    + the same sparse attention,
  * "dense":        `jax.nn.dot_product_attention` (cuDNN on GPU where it applies),
and is rematerialized per block with nothing ("none"), plain `jax.checkpoint` ("full": the
selection runs again in the backward pass, the baseline) or `jax.checkpoint` with
`hs.replay_policy()` ("replay": only the indices are saved and replayed, paper section 4;
`offload_indices` keeps them in host memory until the backward pass needs them).

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
_DTYPES = ("float32", "bfloat16", "float16")


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
    topk: int = 32  # keys each query attends to (k; 2048 in GLM-5)
    attention: str = "hyscale"  # "hyscale" | "materialized" | "dense"
    remat: str = "none"  # per-block rematerialization: "none" | "full" | "replay"
    offload_indices: bool = False  # replay: keep the saved indices in host memory (pinned)
    impl: str = "auto"  # hs ops kernel choice: auto|pallas|interpret|xla|reference
    mlp_dim: int | None = None  # SwiGLU hidden width (default 4 * d_model)
    rope_base: float = 10_000.0  # RoPE base wavelength (raise it for very long contexts)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    dtype: str = "bfloat16"  # activation / compute dtype
    param_dtype: str = "float32"  # parameter (and optimizer) dtype

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
        if self.mlp_dim is not None and (not isinstance(self.mlp_dim, int) or self.mlp_dim < 1):
            raise ValueError(
                f"ModelConfig.mlp_dim must be a positive int or None; got {self.mlp_dim!r}"
            )
        for name, choices in (
            ("attention", ATTENTIONS),
            ("remat", REMATS),
            ("impl", IMPLS),
            ("dtype", _DTYPES),
            ("param_dtype", _DTYPES),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(
                    f"ModelConfig.{name}={value!r} is not one of "
                    f"{', '.join(repr(c) for c in choices)}"
                )
        if self.offload_indices not in (False, True):
            raise ValueError(
                f"ModelConfig.offload_indices must be a bool; got {self.offload_indices!r}"
            )
        if self.offload_indices and self.remat != "replay":
            raise ValueError(
                f"ModelConfig.offload_indices=True offloads the indices that remat='replay' "
                f"saves; got remat={self.remat!r}"
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
        if not self.rope_base > 1:
            raise ValueError(f"ModelConfig.rope_base must be > 1; got {self.rope_base}")

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
        return cls(**d)


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
        q_idx = rope(q_idx, positions, cfg.rope_base)
        k_idx = self.k_norm(self.wk(x))[:, :, None, :]
        k_idx = rope(k_idx, positions, cfg.rope_base)[:, :, 0, :]
        # (HI * DI) ** -0.5 keeps initial scores O(1): the KL target is softmax(score).
        w = self.w_proj(x) * (cfg.index_heads * cfg.index_dim) ** -0.5
        return q_idx, k_idx, w.astype(cfg.compute_dtype)


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
            if cfg.attention == "hyscale" and self.mesh is not None:
                out, idx = parallel.hyscale_attention(
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
                )
            elif cfg.attention == "hyscale":
                out, idx = hs.hyscale_attention(
                    q, k, v, q_idx, k_idx, w, topk=cfg.topk, causal=True, impl=cfg.impl
                )
            else:  # "materialized": the DSA baseline, same attention, T x S table for selection
                sg = jax.lax.stop_gradient
                idx = hs.topk_reference(sg(q_idx), sg(k_idx), sg(w), k=cfg.topk, causal=True)
                idx = checkpoint_name(idx, hs.INDICES_NAME)
                out = hs.sparse_attention(q, k, v, idx, impl=cfg.impl)
            loss = zero
            if indexer_stage == "sparse":
                loss_impl = "xla" if cfg.impl == "reference" else cfg.impl
                if self.mesh is not None:
                    loss = (
                        parallel.indexer_kl_loss(
                            q, k, q_idx, k_idx, w, idx, mesh=self.mesh, impl=loss_impl
                        )
                        / T
                    )
                else:
                    loss = hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx, impl=loss_impl) / T
        y = self.o_proj(out.reshape(B, T, cfg.n_heads * cfg.head_dim))
        return y, {"indexer_loss": loss, "idx": idx}


def _dense_implementation(q):
    """cuDNN flash attention on GPU for 16-bit inputs; else None (jax picks XLA). jax's own
    default is XLA everywhere, which materializes [B, H, T, S] logits (64 GiB at T=32K)."""
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


class MLP(nnx.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.d_model, cfg.hidden_dim, rngs)
        self.up = _linear(cfg, cfg.d_model, cfg.hidden_dim, rngs)
        self.down = _linear(cfg, cfg.hidden_dim, cfg.d_model, rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


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
        self.attn = HyScaleAttention(cfg, rngs=rngs, mesh=mesh)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, *, indexer_stage: str = "none"):
        """x: [B, T, d_model] -> (x', aux) as in `HyScaleAttention`."""
        y, aux = self.attn(self.attn_norm(x), positions, indexer_stage=indexer_stage)
        x = x + y
        x = x + self.mlp(self.mlp_norm(x))
        return x, aux


def remat_block(block: Block, remat: str, *, offload_indices: bool = False):
    """`block`'s call, wrapped in the per-block rematerialization `remat` asks for.

    "full": plain `jax.checkpoint` (everything recomputed, selection included: the baseline);
    "replay": `jax.checkpoint(policy=hs.replay_policy(offload_indices))` (the indices are saved,
    in host memory with offload_indices, and replayed).
    """
    if remat == "none":
        return block
    graphdef, state = nnx.split(block)
    policy = hs.replay_policy(offload=offload_indices) if remat == "replay" else None

    def run(state, x, positions, indexer_stage):
        return nnx.merge(graphdef, state)(x, positions, indexer_stage=indexer_stage)

    checkpointed = jax.checkpoint(run, policy=policy, static_argnums=(3,))
    return lambda x, positions, *, indexer_stage="none": checkpointed(
        state, x, positions, indexer_stage
    )


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

    def forward(self, tokens, *, indexer_stage: str = "none"):
        """tokens: [B, T] int.

        Returns (logits [B, T, V] f32, aux) with aux = {
          "indexer_loss": f32 scalar, the indexer KL per query averaged over layers (add it to
                          the LM loss: no gradient of one reaches the other's parameters),
          "indices": tuple of int32 [B, T, topk] per layer (empty for dense attention or the
                     dense indexer stage)}.
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
        x = constrain(self.embed(tokens))
        losses, indices = [], []
        for block in self.blocks:
            x, aux = remat_block(block, cfg.remat, offload_indices=cfg.offload_indices)(
                x, positions, indexer_stage=indexer_stage
            )
            x = constrain(x)
            losses.append(aux["indexer_loss"])
            if aux["idx"] is not None:
                indices.append(aux["idx"])
        logits = self.lm_head(self.final_norm(x)).astype(jnp.float32)
        return logits, {"indexer_loss": jnp.mean(jnp.stack(losses)), "indices": tuple(indices)}
