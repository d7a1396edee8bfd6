"""The Mosaic GPU kernels of MLA's sparse attention (pallas_kernels/sparse_attention_mosaic.py):
the forward and the backward's dQ kernel.

The kernels run only on a Hopper GPU (their gathers are per-thread cp.async copies written in
Mosaic GPU's own IR, which interpret mode cannot run). On CPU: which operands they take and the
reason they give for the others, the `BlockSizes.forward_kernel` and `dq_kernel` options, and
their lowering for CUDA at awkward sizes (tracing, layouts, shared-memory plan), and the split
backward's hand-off to the dQ kernel with the kernel's math emulated in jnp. Their results
against the Triton kernels and the f32 reference: tests/test_mla_attention.py::TestCompiledGPU.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import relaxed_atomics
from pallas_kernels import sparse_attention as psa
from pallas_kernels import sparse_attention_mosaic as psm
from tests.helpers import lower_for_cuda, rel_err

MLA_K = (1, 8, 1, 576)
ON_HOPPER = jax.default_backend() == "gpu" and str(
    getattr(jax.devices()[0], "compute_capability", "")
).startswith("9.")


@pytest.mark.parametrize(
    "k_shape, dtype, num_indices, value_dim, phrase",
    [
        (MLA_K, jnp.bfloat16, 2048, None, "leading 512 features"),
        (MLA_K, jnp.bfloat16, 2048, 256, "leading 512 features"),
        ((1, 8, 2, 576), jnp.bfloat16, 2048, 512, "G = 1"),
        ((1, 8, 1, 520), jnp.bfloat16, 2048, 512, "multiple of 64"),
        (MLA_K, jnp.float32, 2048, 512, "bf16 or f16"),
        (MLA_K, jnp.bfloat16, 8193, 512, "at most 8192 indices"),
    ],
)
def test_operands_it_does_not_take_get_a_reason(k_shape, dtype, num_indices, value_dim, phrase):
    for kernel in ("forward", "dq"):
        reason = psm.unsupported_reason(k_shape, dtype, num_indices, value_dim, kernel)
        assert reason is not None and phrase in reason, (kernel, reason)


@pytest.mark.parametrize(
    "D, num_indices, phrase",
    [(640, 2048, "D <= 576"), (576, 4096, "dQ kernel's shared memory")],
)
def test_operands_only_the_dq_kernel_refuses(D, num_indices, phrase):
    """Wider keys than 576 (a consumer's dQ columns live in registers) and more indices than
    fit beside q, dO and two stages: the forward takes them, the dQ kernel gives a reason."""
    k_shape = (1, 8, 1, D)
    reason = psm.unsupported_reason(k_shape, jnp.bfloat16, num_indices, 512, "dq")
    assert reason is not None and phrase in reason, reason
    forward_reason = psm.unsupported_reason(k_shape, jnp.bfloat16, num_indices, 512)
    assert forward_reason is None or "Hopper" in forward_reason


@pytest.mark.skipif(ON_HOPPER, reason="on a Hopper GPU the kernel runs")
def test_other_devices_get_a_reason():
    reason = psm.unsupported_reason(MLA_K, jnp.bfloat16, 2048, 512)
    assert reason is not None and "Hopper" in reason


def test_stages_fit_shared_memory():
    """Three 32-key stages of 576-wide rows beside q and 2048 indices (192,768 bytes of data),
    also beside 8192 indices; 1024-wide rows leave room for one stage, so those operands get a
    reason."""
    assert psm._stages(576, 2048) == 3
    assert psm._stages(576, 8192) == 3
    for K in (2048, 8192):
        data = 64 * 576 * 2 + 3 * 32 * 576 * 2 + K * 4 + 64 * 4
        assert data <= 232_448 - 2_872  # a program's limit, less Mosaic GPU's own share
    assert psm._stages(1024, 2048) == 1
    # The dQ kernel: q, dO, two stages, 2048 indices and the rows' statistics.
    data = 64 * (576 + 512) * 2 + 2 * 32 * 576 * 2 + 2048 * 4 + 2 * 64 * 4
    assert psm._dq_shared_bytes(576, 2048) == data <= 232_448 - 2_872
    reason = psm.unsupported_reason((1, 8, 1, 1024), jnp.bfloat16, 2048, 512)
    assert "fewer than 2 stages" in reason


@pytest.mark.parametrize("kernel", ["forward", "dq"])
def test_kernel_options(kernel):
    """A choice outside auto / triton / mosaic is refused; "mosaic" where the kernel cannot run
    (interpret mode) raises with the reason, in the forward or in the backward."""
    option = f"{kernel}_kernel"
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        psa.BlockSizes(**{option: "cuda"})
    q = jnp.zeros((1, 4, 16, 72), jnp.bfloat16)
    kv = jnp.zeros((1, 4, 1, 72), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 2), jnp.int32)

    def loss(q):
        out = psa.sparse_attention(
            q,
            kv,
            None,
            idx,
            scale=1.0,
            value_dim=64,
            interpret=True,
            block_sizes=psa.BlockSizes(**{option: "mosaic"}),
        )
        return out.astype(jnp.float32).sum()

    with pytest.raises(ValueError, match=f"{option}='mosaic'.*interpret mode"):
        jax.grad(loss)(q)


@pytest.mark.parametrize("B, T, H, K", [(2, 100, 40, 70), (1, 64, 128, 2048)])
def test_lowers_for_cuda(B, T, H, K):
    """Traced and lowered to Mosaic GPU's custom call on any host: heads padded to 64, indices
    to 32-key blocks, two batches' keys in one buffer."""
    q = jax.ShapeDtypeStruct((B, T, H, 576), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T + 3, 1, 576), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, T, K), jnp.int32)

    def fn(q, kv, idx):
        return psm.forward(q, kv, idx, scale_log2=576**-0.5, mask_value=-1e30)

    out = jax.eval_shape(fn, q, kv, idx)
    assert out[0].shape == (B, T, H, 512) and out[0].dtype == jnp.bfloat16
    assert out[1].shape == (B, T, H) and out[1].dtype == jnp.float32
    lowered = lower_for_cuda(fn, q, kv, idx)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "B, T, H, K, D", [(2, 100, 40, 70, 576), (1, 64, 128, 2048, 576), (1, 48, 64, 96, 512)]
)
def test_dq_lowers_for_cuda(B, T, H, K, D):
    """The dQ kernel traced and lowered for CUDA on any host: heads padded to 64 (their
    statistics too), indices to 32-key blocks, two batches, and D = 512 (one column matmul a
    consumer) beside 576 (a 256- and a 32-wide one)."""
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T + 3, 1, D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, T, K), jnp.int32)
    stat = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    d_out = jax.ShapeDtypeStruct((B, T, H, 512), jnp.bfloat16)

    def fn(*args):
        return psm.dq(*args, scale=D**-0.5, scale_log2=D**-0.5 * 1.4426950408889634)

    out = jax.eval_shape(fn, q, kv, idx, stat, stat, d_out)
    assert out.shape == (B, T, H, D) and out.dtype == jnp.bfloat16
    lowered = lower_for_cuda(fn, q, kv, idx, stat, stat, d_out)
    assert "mosaic_gpu" in lowered.as_text()


def emulated_dq(q, k, idx, lse, delta, d_out, *, scale, scale_log2):
    """`psm.dq`'s math in jnp on the kernel's own program operands (`_program_operands`,
    `_pad_heads`): per program, the gathered rows (zero where the slot is invalid), P from the
    base-2 log-sum-exp, dS = P (dP - delta) rounded to the operands' dtype as the kernel feeds
    it to `wgmma`, dQ = scale dS K."""
    B, T, H, D = q.shape
    S = k.shape[1]
    qp, keys, ids, head_blocks = psm._program_operands(q, k, idx)
    dtype, programs = qp.dtype, qp.shape[0]
    bt = jnp.arange(programs) // head_blocks
    slots = ids.reshape(B * T, -1)[bt]  # [P, Kp]
    valid = (slots >= 0) & (slots < S)
    rows = keys[(bt // T)[:, None] * S + jnp.where(valid, slots, 0)]
    rows = jnp.where(valid[..., None], rows, 0).astype(jnp.float32)  # [P, Kp, D]
    do = psm._pad_heads(d_out.astype(dtype)).astype(jnp.float32)
    s = jnp.einsum("phd,pkd->phk", qp.astype(jnp.float32), rows)
    dp = jnp.einsum("phd,pkd->phk", do, rows[..., : psm.VALUE_DIM])
    p = jnp.exp2(s * scale_log2 - psm._pad_heads(lse)[..., None])
    p = jnp.where(valid[:, None, :], p, 0.0)
    ds = (p * (dp - psm._pad_heads(delta)[..., None])).astype(dtype).astype(jnp.float32)
    out = jnp.einsum("phk,pkd->phd", ds, rows) * scale
    return out.astype(dtype).reshape(B, T, -1, D)[:, :, :H].astype(q.dtype)


@pytest.mark.skipif(
    not relaxed_atomics.RELAXED,
    reason="the atomic backward runs in interpret mode only through the relaxed atomic add",
)
def test_interpret_dq_kernel_hand_off(monkeypatch):
    """The split backward (interpret mode) with the Mosaic dQ kernel chosen, the kernel replaced
    by its math in jnp (`emulated_dq`; the kernel itself runs only on Hopper): the operands it
    is handed (the saved log-sum-exp, the delta kernel's delta per head, dO) and the dQ it
    returns give the Triton dQ kernel's result, 40 heads padded to 64, two batches, K = 20
    padded to 32. A zeroed delta, lse + 0.01 or scale x 1.01 in the hand-off each miss it by
    7.7e-3 or more."""
    from tests.test_mla_attention import mla_inputs, reference

    B, T, S, H, D, Dv, K = 2, 6, 37, 40, 576, 512, 20
    q, kv, idx, d_out = mla_inputs(3, B, T, S, H, D, Dv, K, jnp.bfloat16)
    cfg = psa._Config(D**-0.5, True, False, psa.BlockSizes(), Dv)  # interpret, atomic
    assert psa._layout(H, 1, D, Dv, True, cfg.sizes, backward=True).split_backward
    lse = psa._forward(q, kv, None, idx, cfg)[1]
    monkeypatch.setattr(psm, "dq", emulated_dq)

    def backward(mosaic: bool):
        """(dQ, dK) of the split backward with the Mosaic (emulated) or the Triton dQ kernel."""
        monkeypatch.setattr(psa, "_use_mosaic", lambda kernel, *a, **kw: mosaic)
        return psa._sparse_attention_bwd(cfg, (q, kv, None, idx, lse), (d_out, None))[:2]

    (dq, dk), (dq_triton, dk_triton) = backward(True), backward(False)
    assert dq.shape == q.shape and dq.dtype == q.dtype
    assert rel_err(dq, dq_triton) <= 1e-4  # summation order may flip a bf16 rounding
    assert bool(jnp.all(dk == dk_triton))  # the key gradients' kernel is the same
    want = jax.grad(
        lambda q: jnp.vdot(reference(idx, Dv)(q, kv.astype(jnp.float32)), d_out.astype(jnp.float32))
    )(q.astype(jnp.float32))
    assert rel_err(dq, want) <= 1e-2
