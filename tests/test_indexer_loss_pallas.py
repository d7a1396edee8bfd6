"""Pallas sparse-stage indexer loss kernels (pallas_kernels/indexer_loss.py).

On CPU the kernels run in Pallas interpret mode: with dk_idx written per slot and summed by
XLA (what `interpret=True` runs), and with the atomic backward kernel that the GPU runs (its
relaxed atomic add has an exact interpret rule, see pallas_kernels/relaxed_atomics.py).
`TestCompiledGPU` repeats the checks on the compiled Triton kernels and skips elsewhere. Losses
are compared with the float64 oracle; gradients (random cotangent per row) with the float64
gradient oracle, within 2x the error of the portable xla path run in the same dtype plus a
dtype noise floor.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax._src.core import MemorySpace

import hyscale_jax as hs
from hyscale_jax import indexer_loss as xla_loss
from pallas_kernels import indexer_loss as pil
from pallas_kernels import relaxed_atomics
from tests.helpers import (
    count_named_eqns,
    kl_rows_oracle,
    kl_rows_oracle_grads,
    lower_for_cuda,
    poisoned_index_rows,
    rel_err,
)

ON_GPU = jax.default_backend() == "gpu"
SMALL = pil.BlockSizes(block_k=16)  # several slot blocks on the small shapes below
NOISE_FLOOR = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 2e-3}
LOSS_RTOL = 1e-5  # losses are f32 sums of exact 16-bit products: summation order only
needs_relaxed = pytest.mark.skipif(
    not relaxed_atomics.RELAXED,
    reason="the atomic backward runs in interpret mode only through the relaxed atomic add",
)


def inputs(seed, B, T, S, H, G, D, HI, DI, K, dtype):
    """Main q [B,T,H,D], k [B,S,G,D]; indexer q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI];
    idx [B,T,K] with -1, out-of-range entries on both sides, a repeated key and one empty row;
    a cotangent per row [B,T]."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    idx = np.stack([np.stack([rng.permutation(S)[:K] for _ in range(T)]) for _ in range(B)])
    idx[:, ::3, 0] = -1
    idx[:, 1::4, -1] = S + 2
    idx[:, 2::5, 1] = -S
    idx[:, ::2, 2] = idx[:, ::2, 3]  # a repeated key counts twice
    idx[0, T // 2] = -1  # no member: loss 0, no gradient
    g = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    return (
        normal(B, T, H, D),
        normal(B, S, G, D),
        normal(B, T, HI, DI),
        normal(B, S, DI),
        normal(B, T, HI),
        jnp.asarray(idx, jnp.int32),
        g,
    )


def xla_rows(q, k, q_idx, k_idx, w, idx):
    return xla_loss._sparse_loss(q, k, q_idx, k_idx, w, idx, q.shape[-1] ** -0.5, 4)


def attention_lse(q, k, idx):
    """The main attention's log-sum-exps [B, T, H] as the sparse attention returns them."""
    return hs.sparse_attention(q, k, k, idx, impl="reference", return_lse=True)[1]


def kernel_fn(q, k, idx, interpret, atomic=None, block_sizes=None, lse=None, save_target=False):
    """The kernels as a function of (q_idx, k_idx, w). atomic=None: what `indexer_kl_rows`
    runs (atomics compiled, per-slot rows in interpret mode); True/False picks the dk_idx path.
    lse: the attention's log-sum-exps for the one-sweep forward, or None. save_target: the
    backward reads the forward's target p."""

    def f(q_idx, k_idx, w):
        return pil._kl_rows(
            q,
            k,
            q_idx,
            k_idx,
            w,
            idx,
            scale=q.shape[-1] ** -0.5,
            interpret=interpret,
            atomic=not interpret if atomic is None else atomic,
            block_sizes=block_sizes,
            attention_lse=lse,
            save_target=save_target,
        )

    return f


def check_kernel(
    args, interpret, atomic=None, block_sizes=None, clean=None, given_lse=False, save_target=False
):
    """Losses and gradients against the float64 oracles. clean: optional (q, k, q_idx, k_idx, w)
    for the oracles when the inputs hold poisoned rows that must not matter. given_lse: the
    kernels take the attention's log-sum-exps (of the clean inputs) and sweep once.
    save_target: the backward reads the forward's target p instead of recomputing it."""
    q, k, q_idx, k_idx, w, idx, g = args
    dtype = q.dtype
    cq, ck, cqi, cki, cw = (q, k, q_idx, k_idx, w) if clean is None else clean
    lse = attention_lse(cq, ck, idx) if given_lse else None
    f = kernel_fn(q, k, idx, interpret, atomic, block_sizes, lse, save_target)
    rows, vjp = jax.vjp(f, q_idx, k_idx, w)
    assert rows.dtype == jnp.float32 and rows.shape == idx.shape[:2]
    np.testing.assert_allclose(
        rows, kl_rows_oracle(cq, ck, cqi, cki, cw, idx), rtol=LOSS_RTOL, atol=1e-6
    )
    grads = vjp(g)
    _, vjp_naive = jax.vjp(lambda qi, ki, ww: xla_rows(cq, ck, qi, ki, ww, idx), cqi, cki, cw)
    wants = kl_rows_oracle_grads(cq, ck, cqi, cki, cw, idx, g)
    for got, want, naive, x in zip(grads, wants, vjp_naive(g), (q_idx, k_idx, w)):
        assert got.dtype == x.dtype and got.shape == x.shape
        assert np.isfinite(np.asarray(got, np.float32)).all()
        bound = 2.0 * rel_err(naive, want) + NOISE_FLOOR[jnp.dtype(dtype)]
        assert rel_err(got, want) <= bound, (rel_err(got, want), bound)
    T = q.shape[1]
    assert rows[0, T // 2] == 0
    assert not np.asarray(grads[0][0, T // 2]).any() and not np.asarray(grads[2][0, T // 2]).any()
    return rows, grads


# (B, T, S, H, G, D, HI, DI, K): K over two 16-slot blocks and padded; H, HI, D, DI not powers
# of two (padding); GQA with H // G = 3 (its [G * D] = 48 features read as 32 + 16); MLA's
# two-piece feature axis in small (D = 72 = 64 + 8, 20 heads).
SHAPES = [
    (2, 7, 37, 4, 1, 16, 3, 8, 19),
    (1, 6, 29, 6, 2, 24, 5, 20, 21),
    (1, 5, 33, 20, 1, 72, 3, 8, 37),
]


# Every shape in f32; bf16 (its tolerance path, shared by all shapes) on the MLA shape.
@pytest.mark.parametrize(
    "shape, dtype",
    [(shape, jnp.float32) for shape in SHAPES] + [(SHAPES[2], jnp.bfloat16)],
    ids=["f32-mqa", "f32-gqa", "f32-mla", "bf16-mla"],
)
def test_interpret_matches_oracle_and_xla(shape, dtype):
    check_kernel(inputs(0, *shape, dtype), interpret=True, block_sizes=SMALL)


@needs_relaxed
@pytest.mark.parametrize(
    "shape,dtype", [(SHAPES[0], jnp.float32), (SHAPES[1], jnp.bfloat16)], ids=["mqa", "gqa"]
)
def test_interpret_atomic_backward_matches_oracle(shape, dtype):
    """The GPU's backward kernel (dk_idx by f32 atomics) in the interpreter; keys repeat inside
    rows and across queries."""
    check_kernel(inputs(0, *shape, dtype), interpret=True, atomic=True, block_sizes=SMALL)


def poisoned_inputs(seed, B, T, S, H, G, D, HI, DI, K, dtype):
    """(clean, poisoned) (q, k, q_idx, k_idx, w, idx, g) for the contract that an invalid entry
    is never read: they differ only in rows no valid entry names.

    Valid entries name keys 3 .. S-2 only, with repeats; keys 0 (where invalid entries are
    clamped), 1, 2 and S-1 hold NaN, +inf and -inf in the poisoned k and k_idx. Each row holds
    invalid entries (-1 padding at its end, S, -5, 2**31 - 1, -2**31, S + 1000); row T // 2 of
    batch 0 holds only invalid entries, and its own q, q_idx (NaN) and w (+inf) are poisoned."""
    q, k, q_idx, k_idx, w, _, g = inputs(seed, B, T, S, H, G, D, HI, DI, K, dtype)
    idx = poisoned_index_rows(seed, B, T, S, K)
    poison = jnp.array([jnp.nan, jnp.inf, -jnp.inf, jnp.nan], dtype)
    rows = np.array([0, 1, 2, S - 1])
    bad_k = k.at[:, rows].set(jnp.broadcast_to(poison[:, None, None], (B, 4, G, D)))
    bad_ki = k_idx.at[:, rows].set(jnp.broadcast_to(poison[::-1, None], (B, 4, DI)))
    bad_q = q.at[0, T // 2].set(jnp.nan)
    bad_qi = q_idx.at[0, T // 2].set(jnp.nan)
    bad_w = w.at[0, T // 2].set(jnp.inf)
    return (q, k, q_idx, k_idx, w, idx, g), (bad_q, bad_k, bad_qi, bad_ki, bad_w, idx, g)


def check_poisoned(
    interpret, atomic, shape, dtype, block_sizes=None, given_lse=False, save_target=False
):
    """Losses and gradients on poisoned inputs: the oracles' on clean inputs, exact zeros for the
    empty row and the poisoned rows' dk_idx; bit for bit the kernels' on clean inputs, except
    for the compiled atomics (whose order of adds varies)."""
    clean, bad = poisoned_inputs(30, *shape, dtype)
    rows, grads = check_kernel(
        bad, interpret, atomic, block_sizes, clean[:5], given_lse, save_target
    )
    S = shape[2]
    assert not np.asarray(grads[1][:, [0, 1, 2, S - 1]]).any()
    if interpret or not atomic:
        q, k, q_idx, k_idx, w, idx, g = clean
        lse = attention_lse(q, k, idx) if given_lse else None
        f = kernel_fn(q, k, idx, interpret, atomic, block_sizes, lse, save_target)
        rows_clean, vjp = jax.vjp(f, q_idx, k_idx, w)
        np.testing.assert_array_equal(rows, rows_clean)
        for x, x_clean in zip(grads, vjp(g)):
            np.testing.assert_array_equal(x, x_clean)


@pytest.mark.parametrize(
    "atomic", [False, pytest.param(True, marks=needs_relaxed)], ids=["rows", "atomic"]
)
def test_poisoned_rows_are_never_read_interpret(atomic):
    check_poisoned(True, atomic, (1, 6, 29, 6, 2, 24, 5, 20, 21), jnp.float32, SMALL)


@pytest.mark.parametrize(
    "shape, dtype, atomic",
    [
        (SHAPES[1], jnp.float32, False),
        pytest.param(SHAPES[2], jnp.bfloat16, True, marks=needs_relaxed),
    ],
    ids=["f32-gqa-rows", "bf16-mla-atomic"],
)
def test_interpret_with_attention_lse_matches_oracle(shape, dtype, atomic):
    """The one-sweep forward (the attention's log-sum-exps given) against the same oracles,
    and its losses within f32 rounding of the two-sweep forward's; some rows have a 16-slot
    block with no valid entry before (odd rows) or after or between (every fourth) valid ones."""
    q, k, q_idx, k_idx, w, idx, g = inputs(0, *shape, dtype)
    idx = idx.at[:, 1::2, :16].set(-1).at[:, ::4, 16:32].set(-1)
    rows, _ = check_kernel((q, k, q_idx, k_idx, w, idx, g), True, atomic, SMALL, given_lse=True)
    two_sweeps = kernel_fn(q, k, idx, True, atomic, SMALL)(q_idx, k_idx, w)
    np.testing.assert_allclose(rows, two_sweeps, rtol=LOSS_RTOL, atol=1e-6)


def test_poisoned_rows_are_never_read_with_attention_lse_interpret():
    check_poisoned(True, False, (1, 6, 29, 6, 2, 24, 5, 20, 21), jnp.float32, SMALL, True)


def test_attention_lse_through_the_public_api():
    """`indexer_kl_loss(..., attention_lse=)` on the xla and interpret paths: the loss and the
    indexer's gradients of the attention's own statistics; a wrong lse changes the loss (so it
    is read); bad arguments get errors naming attention_lse."""
    q, k, q_idx, k_idx, w, idx, _ = inputs(2, *SHAPES[1], jnp.float32)
    args = (q, k, q_idx, k_idx, w, idx)
    _, lse = hs.sparse_attention(q, k, k, idx, impl="xla", return_lse=True)

    def loss(impl, given):
        return jax.value_and_grad(
            lambda qi, ki, ww: hs.indexer_kl_loss(
                q, k, qi, ki, ww, idx, impl=impl, attention_lse=given
            ),
            argnums=(0, 1, 2),
        )(q_idx, k_idx, w)

    want, want_grads = loss("xla", None)
    for impl in ("xla", "interpret"):
        got, grads = loss(impl, lse)
        np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
        for x, y in zip(grads, want_grads):
            assert rel_err(x, y) <= 1e-5
        assert abs(float(loss(impl, lse + 0.5)[0]) - float(want)) > 0.1
    with pytest.raises(ValueError, match="attention_lse must be"):
        hs.indexer_kl_loss(*args, attention_lse=lse[:, 1:])
    with pytest.raises(ValueError, match="attention_lse is the sparse stage's"):
        hs.indexer_kl_loss(*args[:5], causal=False, attention_lse=lse)
    with pytest.raises(TypeError, match="attention_lse"):
        hs.indexer_kl_loss(*args, attention_lse=lse.astype(jnp.int32))
    with pytest.raises(ValueError, match="save_target is the sparse stage's"):
        hs.indexer_kl_loss(*args[:5], causal=False, save_target=True)
    with pytest.raises(TypeError, match="save_target must be a bool"):
        hs.indexer_kl_loss(*args, save_target="yes")


def target_oracle(q, k, idx, width):
    """float64 [B, T, width]: the target p of every slot (a repeated key once per occurrence),
    0 on invalid and padded slots."""
    q, k, idx = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(idx)
    B, T, H, D = q.shape
    S, G = k.shape[1], k.shape[2]
    p = np.zeros((B, T, width))
    for b in range(B):
        for t in range(T):
            slots = [j for j, s in enumerate(idx[b, t]) if 0 <= s < S]
            for h in range(H):
                logits = k[b, idx[b, t, slots], h // (H // G)] @ q[b, t, h] / np.sqrt(D)
                e = np.exp(logits - logits.max(initial=0.0))
                p[b, t, slots] += e / max(e.sum(), 1e-300) / H
    return p


@pytest.mark.parametrize(
    "shape, dtype, atomic, given_lse",
    [
        (SHAPES[0], jnp.float32, False, False),
        (SHAPES[1], jnp.float32, False, True),
        pytest.param(SHAPES[2], jnp.bfloat16, True, False, marks=needs_relaxed),
        pytest.param(SHAPES[2], jnp.float32, True, True, marks=needs_relaxed),
    ],
    ids=["f32-mqa-rows", "f32-gqa-rows-lse", "bf16-mla-atomic", "f32-mla-atomic-lse"],
)
def test_saved_target_matches_oracle_and_recomputed(shape, dtype, atomic, given_lse):
    """save_target: the forward writes p per slot (the float64 oracle's, zeros on invalid and
    padded slots), and the backward that reads it gives the oracle's gradients and the
    recomputing backward's up to f32 rounding (the two p come from different programs)."""
    args = inputs(0, *shape, dtype)
    q, k, q_idx, k_idx, w, idx, g = args
    rows, grads = check_kernel(args, True, atomic, SMALL, given_lse=given_lse, save_target=True)
    lse = attention_lse(q, k, idx) if given_lse else None
    f = kernel_fn(q, k, idx, True, atomic, SMALL, lse, save_target=False)
    rows_recomputed, vjp = jax.vjp(f, q_idx, k_idx, w)
    np.testing.assert_allclose(rows, rows_recomputed, rtol=LOSS_RTOL, atol=1e-6)
    for got, want in zip(grads, vjp(g)):
        if dtype == jnp.float32:
            assert rel_err(got, want) <= 1e-6
        else:  # a gradient rounded to bf16 may land one unit apart
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-6
            )
    cfg = pil._config(
        q,
        k,
        q_idx,
        idx,
        scale=q.shape[-1] ** -0.5,
        interpret=True,
        atomic=atomic,
        block_sizes=SMALL,
        save_target=True,
    )
    _, (_, target) = pil._row_losses_fwd(q, k, q_idx, k_idx, w, idx, lse, cfg)
    assert target.dtype == jnp.float32 and target.shape[:2] == idx.shape[:2]
    assert target.shape[2] % cfg.block_k == 0 and target.shape[2] >= idx.shape[2]
    np.testing.assert_allclose(
        target,
        target_oracle(q, k, idx, target.shape[2]),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    "atomic", [False, pytest.param(True, marks=needs_relaxed)], ids=["rows", "atomic"]
)
def test_poisoned_rows_are_never_read_given_target_interpret(atomic):
    check_poisoned(True, atomic, (1, 6, 29, 6, 2, 24, 5, 20, 21), jnp.float32, SMALL, True, True)


def test_target_residual_under_the_replay_policy():
    """Under `hs.replay_policy(indexer_statistics=True, indexer_target=True)` the saved
    residuals are the statistics and the target (f32 [B, T, Kp], named INDEXER_TARGET_NAME; in
    host memory with offload=True), the backward is the one that reads the target, and the
    gradients are those of the recomputing backward's policy; without indexer_target the
    target is not saved (the backward's rematerialization makes it again)."""
    q, k, q_idx, k_idx, w, idx, _ = inputs(1, *SHAPES[0], jnp.float32)

    def loss(qi, save_target=True):
        return hs.indexer_kl_loss(
            q, k, qi, k_idx, w, idx, impl="interpret", save_target=save_target
        )

    want = jax.grad(jax.checkpoint(lambda qi: loss(qi, False)))(q_idx)
    for target, offload in ((True, False), (True, True), (False, False)):
        policy = hs.replay_policy(offload=offload, indexer_statistics=True, indexer_target=target)
        replay = jax.checkpoint(loss, policy=policy)
        saved = [(a, src) for a, src in saved_residuals(replay, q_idx) if "argument" not in src]
        # B = 2, T = 7, K = 19 slots in one 32-slot block; offloaded, it is a device_put's output
        targets = [a for a, _ in saved if a.shape == (2, 7, 32)]
        assert [a.dtype for a in targets] == [jnp.float32] * target, saved
        assert any(hs.INDEXER_TARGET_NAME in src for _, src in saved) == (target and not offload)
        if target:
            want_space = MemorySpace.Host if offload else MemorySpace.Device
            assert targets[0].memory_space == want_space, saved
        jaxpr = jax.make_jaxpr(jax.grad(replay))(q_idx)
        assert count_named_eqns(jaxpr, ("indexer_kl_bwd_given_target",)) == 1
        assert count_named_eqns(jaxpr, ("indexer_kl_bwd_rows", "indexer_kl_bwd_atomic")) == 0
        assert rel_err(jax.grad(replay)(q_idx), want) <= 1e-6


def test_public_api_dispatch_and_names():
    q, k, q_idx, k_idx, w, idx, _ = inputs(1, *SHAPES[0], jnp.float32)
    args = (q, k, q_idx, k_idx, w, idx)
    got = hs.indexer_kl_loss(*args, impl="interpret")
    want = hs.indexer_kl_loss(*args, impl="xla")
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda qi: hs.indexer_kl_loss(q, k, qi, k_idx, w, idx, impl="interpret"))
    )(q_idx)
    assert count_named_eqns(jaxpr, ("indexer_kl_fwd",)) == 1
    assert count_named_eqns(jaxpr, ("indexer_kl_bwd",)) == 1
    with pytest.raises(ValueError, match="impl"):
        hs.indexer_kl_loss(*args, impl="reference")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_wide_indices_past_int32_are_ignored(impl):
    """int64 entries past the int32 range count as out of range, not as the key they wrap to."""
    q, k, q_idx, k_idx, w, idx, _ = inputs(5, *SHAPES[0], jnp.float32)
    with jax.enable_x64(True):
        wide = jnp.asarray(idx, jnp.int64).at[:, :, 1].set(2**32 + 3)
        got = hs.indexer_kl_loss(q, k, q_idx, k_idx, w, wide, impl=impl)
    want = hs.indexer_kl_loss(q, k, q_idx, k_idx, w, idx.at[:, :, 1].set(-1), impl=impl)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_lowers_to_triton():
    """The GPU lowering (Pallas -> Triton IR) runs on CPU too: catches ops Triton lacks."""
    shapes = [(2, 100, 16, 128), (2, 300, 1, 128), (2, 100, 32, 128), (2, 300, 128), (2, 100, 32)]
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    idx = jax.ShapeDtypeStruct((2, 100, 64), jnp.int32)

    def loss(q, k, qi, ki, w, idx, lse=None, save_target=False):
        rows = pil.indexer_kl_rows(
            q, k, qi, ki, w, idx, scale=0.1, attention_lse=lse, save_target=save_target
        )
        return jnp.sum(rows)

    lse = jax.ShapeDtypeStruct((2, 100, 16), jnp.float32)
    for save_target in (False, True):
        backward = "indexer_kl_bwd_given_target_atomic" if save_target else "indexer_kl_bwd_atomic"
        for extra, forward in (((), "indexer_kl_fwd"), ((lse,), "indexer_kl_fwd_given_lse")):
            fn = functools.partial(loss, save_target=save_target)
            text = lower_for_cuda(jax.grad(fn, argnums=(2, 3, 4)), *specs, idx, *extra).as_text()
            assert text.count("xla.gpu.triton") == 2
            assert f'{forward}"' in text and f'{backward}"' in text


def test_wide_features_are_split_not_padded():
    """MLA's absorbed keys (576 = 512 + 64 features) reach the kernels 576 wide in two
    power-of-two windows (a padded 1024-wide tile would not fit a program's shared memory),
    with 32-key tiles in five stages where three of them fit beside the program's queries and
    in one stage elsewhere (the backward given the target, which gathers only the indexer's
    keys, where three of its tiles fit beside the indexer's queries); the toy width stays one
    128-wide window of 64-key tiles in two stages."""
    idx = jnp.zeros((1, 4, 256), jnp.int32)
    ki = jnp.zeros((1, 8, 128))
    for D, H, HI, features, block_k, stages, target_stages in (
        (576, 64, 32, (512, 64), 32, 5, 5),  # GLM-5.1: five stages fit beside its queries
        (576, 64, 64, (512, 64), 32, 1, 5),  # 64 indexer heads: they do not
        (576, 128, 32, (512, 64), 32, 1, 5),  # 128 main heads (DeepSeek-V3.2): nor here
        (576, 16, 1024, (512, 64), 32, 1, 1),  # 1024 indexer heads: nor beside the target's
        (128, 16, 32, (128, 0), 64, 2, 2),
    ):
        q = jnp.zeros((1, 4, H, D), jnp.bfloat16)
        k = jnp.zeros((1, 8, 1, D), jnp.bfloat16)
        qi, w = jnp.zeros((1, 4, HI, 128)), jnp.zeros((1, 4, HI))
        cfg = pil._config(q, k, qi, idx, scale=0.1, interpret=False, atomic=True, block_sizes=None)
        assert (cfg.features.d_main, cfg.features.d_tail) == features
        assert (cfg.block_k, cfg.stages, cfg.target_stages) == (block_k, stages, target_stages)
        ops = pil._prepare(q, k, qi, ki, w, idx, cfg)
        assert ops[1].shape[-1] == ops[2].shape[-1] == D


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas-Triton kernels need a GPU")
class TestCompiledGPU:
    """The compiled kernels on realistic tiles (default BlockSizes), dk_idx by f32 atomics."""

    @pytest.mark.parametrize(
        "shape,dtype",
        [
            ((1, 256, 512, 16, 1, 128, 32, 128, 128), jnp.bfloat16),  # DSA: MQA, HI=32, DI=128
            ((1, 64, 300, 64, 1, 576, 32, 128, 256), jnp.bfloat16),  # MLA: 64 heads of 576
            ((2, 96, 300, 8, 2, 192, 16, 64, 100), jnp.bfloat16),  # GQA, padded D and K
            ((1, 33, 70, 3, 1, 24, 5, 20, 19), jnp.float32),  # awkward everything, f32
        ],
        ids=["dsa_bf16", "mla_bf16", "gqa_bf16", "awkward_f32"],
    )
    def test_matches_oracle_and_xla(self, shape, dtype):
        check_kernel(inputs(3, *shape, dtype), interpret=False)

    @pytest.mark.parametrize(
        "shape,dtype",
        [
            ((1, 64, 300, 64, 1, 576, 32, 128, 256), jnp.bfloat16),  # MLA: 64 heads of 576
            ((2, 96, 300, 8, 2, 192, 16, 64, 100), jnp.bfloat16),  # GQA, padded D and K
            ((1, 33, 70, 3, 1, 24, 5, 20, 19), jnp.float32),  # awkward everything, f32
        ],
        ids=["mla_bf16", "gqa_bf16", "awkward_f32"],
    )
    def test_with_attention_lse_matches_oracle(self, shape, dtype):
        """The one-sweep forward, the attention's log-sum-exps given."""
        check_kernel(inputs(3, *shape, dtype), interpret=False, given_lse=True)

    @pytest.mark.parametrize(
        "shape,dtype",
        [
            ((1, 32, 64, 16, 1, 64, 32, 64, 96), jnp.bfloat16),
            ((1, 19, 45, 6, 2, 24, 5, 20, 37), jnp.float32),
        ],
        ids=["dsa_bf16", "awkward_f32"],
    )
    def test_poisoned_rows_are_never_read(self, shape, dtype):
        check_poisoned(False, True, shape, dtype)
        check_poisoned(False, True, shape, dtype, given_lse=True)
        check_poisoned(False, True, shape, dtype, given_lse=True, save_target=True)

    @pytest.mark.parametrize(
        "shape,dtype,given_lse",
        [
            ((1, 64, 300, 64, 1, 576, 32, 128, 256), jnp.bfloat16, True),  # GLM-5.1's layer
            ((1, 32, 300, 128, 1, 576, 64, 128, 256), jnp.bfloat16, True),  # DeepSeek-V3.2's
            ((2, 96, 300, 8, 2, 192, 16, 64, 100), jnp.bfloat16, False),  # GQA, padded D and K
            ((1, 33, 70, 3, 1, 24, 5, 20, 19), jnp.float32, True),  # awkward everything, f32
        ],
        ids=["mla64_bf16", "mla128_bf16", "gqa_bf16", "awkward_f32"],
    )
    def test_saved_target_matches_oracle(self, shape, dtype, given_lse):
        """The backward that reads the forward's target p (no main keys gathered)."""
        check_kernel(inputs(3, *shape, dtype), False, given_lse=given_lse, save_target=True)

    def test_public_api_auto_is_pallas(self):
        q, k, q_idx, k_idx, w, idx, _ = inputs(4, *SHAPES[0], jnp.bfloat16)
        jaxpr = jax.make_jaxpr(lambda qi: hs.indexer_kl_loss(q, k, qi, k_idx, w, idx))(q_idx)
        assert count_named_eqns(jaxpr, ("indexer_kl_fwd",)) == 1
