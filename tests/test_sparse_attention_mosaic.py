"""The Mosaic GPU kernels of MLA's sparse attention (pallas_kernels/sparse_attention_mosaic.py):
the forward and the backward's dQ kernel.

The kernels run only on a Hopper GPU (their gathers are per-thread cp.async copies written in
Mosaic GPU's own IR, which interpret mode cannot run). On CPU: which operands they take and the
reason they give for the others, the `BlockSizes.forward_kernel` and `dq_kernel` options, and
their lowering for CUDA at awkward sizes (tracing, layouts, shared-memory plan). Their results
against the Triton kernels and the f32 reference: tests/test_mla_attention.py::TestCompiledGPU.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import sparse_attention as psa
from pallas_kernels import sparse_attention_mosaic as psm

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
    lowered = jax.jit(fn).trace(q, kv, idx).lower(lowering_platforms=("cuda",))
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
    lowered = jax.jit(fn).trace(q, kv, idx, stat, stat, d_out).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
