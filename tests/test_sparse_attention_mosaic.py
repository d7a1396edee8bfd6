"""The Mosaic GPU forward of MLA's sparse attention (pallas_kernels/sparse_attention_mosaic.py).

The kernel runs only on a Hopper GPU (its gathers are per-thread cp.async copies written in
Mosaic GPU's own IR, which interpret mode cannot run). On CPU: which operands it takes and the
reason it gives for the others, the `BlockSizes.forward_kernel` option, and its lowering for
CUDA at awkward sizes (tracing, layouts, shared-memory plan). Its results against the Triton
forward and the f32 reference: tests/test_mla_attention.py::TestCompiledGPU.
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
    reason = psm.unsupported_reason(k_shape, dtype, num_indices, value_dim)
    assert reason is not None and phrase in reason, reason


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
    reason = psm.unsupported_reason((1, 8, 1, 1024), jnp.bfloat16, 2048, 512)
    assert "fewer than 2 stages" in reason


def test_forward_kernel_option():
    with pytest.raises(ValueError, match="forward_kernel must be one of"):
        psa.BlockSizes(forward_kernel="cuda")
    q = jnp.zeros((1, 4, 16, 72), jnp.bfloat16)
    kv = jnp.zeros((1, 4, 1, 72), jnp.bfloat16)
    idx = jnp.zeros((1, 4, 2), jnp.int32)
    with pytest.raises(ValueError, match="forward_kernel='mosaic'.*interpret mode"):
        psa.sparse_attention(
            q,
            kv,
            None,
            idx,
            scale=1.0,
            value_dim=64,
            interpret=True,
            block_sizes=psa.BlockSizes(forward_kernel="mosaic"),
        )


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
