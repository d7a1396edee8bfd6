"""Shared test utilities: the numpy selection oracle, jaxpr inspection, error measures, and
the experiment scripts loaded as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# A one-layer model small enough to train a few steps in seconds on a CPU (training tests).
TINY_TRAIN_MODEL = dict(
    vocab_size=256,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    index_heads=2,
    index_dim=16,
    topk=8,
    impl="xla",
)

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_script(name: str, module_name: str | None = None):
    """experiments/<name>.py loaded as a module (its `main` not run), e.g. the train CLI."""
    spec = importlib.util.spec_from_file_location(module_name or name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The GPU a CPU host lowers the kernels for: jax 0.11's Triton lowering reads the target's
# compute capability from the device, or from an abstract one where there is no GPU.
_LOWERING_TARGET = jax.sharding.AbstractMesh(
    (),
    (),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    ),
)


def lower_for_cuda(fn, *args):
    """`jax.jit(fn)` traced at `args` and lowered for CUDA on any host; on a host without a GPU,
    for an abstract H100 (traced under it too: the trace keeps the mesh it ran under)."""
    if jax.default_backend() == "gpu":
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    with jax.sharding.use_abstract_mesh(_LOWERING_TARGET):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


SELECTION_NAME_PREFIXES = ("hytopk", "topk_reference")
# The `impl` that runs the Pallas kernels themselves: compiled on GPU, interpret mode elsewhere.
KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def rel_err(x, ref):
    """Relative error ||x - ref|| / ||ref|| (Frobenius, in float64)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def topk_oracle(q_idx, k_idx, w, k, causal=True, k_scale=None):
    """Selection by the rule of docs/design.md, in float64 numpy: exact for small-integer inputs
    (and small-integer or power-of-two scales).

    q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI] (any dtype, FP8 included), k_scale [B,S] or
    None -> int64 [B,T,k] with -1 padding.
    """
    q, kk, w = (
        np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (q_idx, k_idx, w)
    )
    B, T, HI, _ = q.shape
    S = kk.shape[1]
    with np.errstate(invalid="ignore"):
        dots = np.einsum("bthd,bsd->bths", q, kk)
        scores = np.einsum(
            "bths,bth->bts", np.where(np.isnan(dots), np.nan, np.maximum(dots, 0.0)), w
        )
    if k_scale is not None:
        scores = scores * np.asarray(k_scale, np.float64)[:, None, :]
    out = np.full((B, T, k), -1, np.int64)
    for b in range(B):
        for t in range(T):
            limit = t + (S - T) if causal else S - 1
            cands = [s for s in range(min(limit + 1, S)) if not np.isnan(scores[b, t, s])]
            cands.sort(key=lambda s: (-scores[b, t, s], s))
            chosen = cands[:k]
            out[b, t, : len(chosen)] = chosen
    return out


def key_ordered(idx):
    """A selection [..., k] in score order, -1 padded -> the same keys by ascending key index,
    -1 after them (what `order="index"` returns)."""
    idx = np.asarray(idx, np.int64)
    big = np.iinfo(np.int64).max
    ordered = np.sort(np.where(idx < 0, big, idx), axis=-1)
    return np.where(ordered == big, -1, ordered)


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _sub_jaxprs(item)


def all_eqns(jaxpr):
    """Every equation of a jaxpr (or closed jaxpr) and of the jaxprs nested in its equations'
    parameters (scan/while/cond bodies, checkpoint, custom_vjp, pallas_call)."""
    if hasattr(jaxpr, "jaxpr") and not hasattr(jaxpr, "eqns"):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from all_eqns(sub)


def count_named_eqns(jaxpr, prefixes=SELECTION_NAME_PREFIXES):
    """Count equations (jit calls, pallas_calls) whose `name` parameter starts with a prefix,
    searching every nested jaxpr (scan/while/cond bodies, checkpoint, custom_vjp)."""
    if hasattr(jaxpr, "jaxpr") and not hasattr(jaxpr, "eqns"):
        jaxpr = jaxpr.jaxpr
    count = 0
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if name is None and "name_and_src_info" in eqn.params:  # pallas_call
            name = getattr(eqn.params["name_and_src_info"], "name", None)
        if isinstance(name, str) and name.startswith(prefixes):
            count += 1
            continue  # do not also count the selection's own internals
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                count += count_named_eqns(sub, prefixes)
    return count


def kl_rows_oracle(q, k, q_idx, k_idx, w, idx=None, causal=True):
    """Per-query KL(p || softmax(score)) in float64 numpy, [B, T]; GQA with G groups.

    q [B,T,H,D], k [B,S,G,D], q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI]; idx [B,T,K] (sparse
    stage: entries outside [0, S) are not members) or None (dense stage over visible keys).
    """
    q, k, q_idx, k_idx, w = (np.asarray(x, np.float64) for x in (q, k, q_idx, k_idx, w))
    Bq, Tq, Hq, Dq = q.shape
    Sk, Gk = k.shape[1], k.shape[2]
    out = np.zeros((Bq, Tq))
    for b in range(Bq):
        for t in range(Tq):
            if idx is None:
                keys = [s for s in range(Sk) if not causal or s <= t + Sk - Tq]
            else:
                keys = [int(s) for s in np.asarray(idx)[b, t] if 0 <= s < Sk]
            if not keys:
                continue
            p = np.zeros(len(keys))
            for h in range(Hq):
                g = h // (Hq // Gk)
                logits = np.array([q[b, t, h] @ k[b, s, g] for s in keys]) / np.sqrt(Dq)
                e = np.exp(logits - logits.max())
                p += e / e.sum()
            p /= Hq
            scores = np.array(
                [np.sum(w[b, t] * np.maximum(q_idx[b, t] @ k_idx[b, s], 0)) for s in keys]
            )
            log_q = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
            out[b, t] = np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - log_q), 0))
    return out


def kl_rows_oracle_grads(q, k, q_idx, k_idx, w, idx, g):
    """Gradients of sum_t g[b,t] * loss[b,t] (sparse stage) in q_idx, k_idx, w, float64 numpy.

    Same arguments as `kl_rows_oracle` plus the per-row cotangent g [B, T]. Written from the
    closed form: d loss / d s_j = softmax(s)_j - p_j (p sums to 1), through the relu head sum.
    """
    q, k, q_idx, k_idx, w, g = (np.asarray(x, np.float64) for x in (q, k, q_idx, k_idx, w, g))
    Bq, Tq, Hq, Dq = q.shape
    Sk, Gk = k.shape[1], k.shape[2]
    d_qi, d_ki, d_w = np.zeros_like(q_idx), np.zeros_like(k_idx), np.zeros_like(w)
    for b in range(Bq):
        for t in range(Tq):
            keys = np.array([int(s) for s in np.asarray(idx)[b, t] if 0 <= s < Sk], np.int64)
            if not len(keys):
                continue
            p = np.zeros(len(keys))
            for h in range(Hq):
                logits = k[b, keys, h // (Hq // Gk)] @ q[b, t, h] / np.sqrt(Dq)
                e = np.exp(logits - logits.max())
                p += e / e.sum() / Hq
            dots = q_idx[b, t] @ k_idx[b, keys].T  # [HI, n]
            scores = w[b, t] @ np.maximum(dots, 0)
            soft = np.exp(scores - scores.max())
            ds = g[b, t] * (soft / soft.sum() - p)  # [n]
            d_dots = np.where(dots > 0, w[b, t][:, None] * ds[None, :], 0.0)
            d_qi[b, t] += d_dots @ k_idx[b, keys]
            d_w[b, t] += np.maximum(dots, 0) @ ds
            np.add.at(d_ki[b], keys, d_dots.T @ q_idx[b, t])
    return d_qi, d_ki, d_w


def poisoned_index_rows(seed: int, B: int, T: int, S: int, K: int):
    """int32 [B, T, K] index rows for the contract that an invalid entry is never read.

    Valid entries name keys 3 .. S-2 only, with repeats, so keys 0 (where a careless kernel
    clamps invalid entries), 1, 2 and S-1 can be poisoned. Each row holds invalid entries (-1
    padding at its end, S, -5, 2**31 - 1, -2**31, S + 1000); row T // 2 of batch 0 holds only
    invalid entries."""
    rng = np.random.default_rng(seed + 1)
    idx = rng.integers(3, S - 1, (B, T, K))
    idx[:, :, -3:] = -1
    idx[:, ::2, 0] = S
    idx[:, 1::2, 0] = -5
    idx[:, ::3, 1] = 2**31 - 1
    idx[:, 1::3, 2] = -(2**31)
    idx[:, 2::3, 2] = S + 1000
    idx[:, :, 4] = idx[:, :, 5]  # a repeated key counts twice
    idx[0, T // 2] = np.resize(np.array([-1, S, -5, 2**31 - 1, -(2**31), S + 1000]), K)
    return jnp.asarray(idx, jnp.int32)
