"""The relaxed-ordering atomic add (pallas_kernels/relaxed_atomics.py): which path is active on
this jax, what each path lowers to, the fallback to the public op, and the interpret rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import relaxed_atomics
from tests.helpers import lower_for_cuda

ROWS = np.array([3, 1, 3, 3, 0, 7, 1, 2], np.int32)  # repeated rows inside one add
MASK = np.array([1, 1, 1, 0, 1, 1, 0, 1], bool)


def scatter_kernel(atomic_add):
    """pallas_call: out [10, 16] f32 = init + the masked rows of val [8, 16] added at ROWS."""

    def kernel(rows_ref, val_ref, mask_ref, init_ref, out_ref):
        del init_ref  # aliased to out_ref
        mask = jnp.broadcast_to(mask_ref[...][:, None], val_ref.shape)
        atomic_add(out_ref, (rows_ref[...], slice(None)), val_ref[...], mask=mask)

    def call(rows, val, mask, init, *, interpret, debug=False):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(init.shape, init.dtype),
            input_output_aliases={3: 0},
            compiler_params=pltriton.CompilerParams(
                num_warps=4, num_stages=1
            ),  # Triton, not Mosaic
            interpret=interpret,
            debug=debug,
            name="atomic_probe",
        )(rows, val, mask, init)

    return call


def triton_ir(atomic_add, capsys):
    """The Triton module of the probe kernel, lowered for CUDA (runs on CPU too)."""
    call = scatter_kernel(atomic_add)
    args = (
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((8,), jnp.bool_),
        jax.ShapeDtypeStruct((10, 16), jnp.float32),
    )
    capsys.readouterr()
    lower_for_cuda(lambda *a: call(*a, interpret=False, debug=True), *args)
    return capsys.readouterr().out


def test_active_path_on_this_jax(capsys):
    """Prints which path this jax gets; the module's flag matches the lowered ordering."""
    text = triton_ir(relaxed_atomics.atomic_add, capsys)
    atomics = [line for line in text.splitlines() if "tt.atomic_rmw" in line]
    print(f"jax {jax.__version__}: relaxed_atomics.RELAXED = {relaxed_atomics.RELAXED}")
    assert len(atomics) == 1, text
    if relaxed_atomics.RELAXED:
        assert "tt.atomic_rmw fadd, relaxed, gpu" in atomics[0], atomics[0]
    else:
        assert relaxed_atomics.atomic_add is pltriton.atomic_add
        assert "acq_rel" in atomics[0], atomics[0]


def test_public_op_is_acquire_release(capsys):
    """What the relaxed path replaces: jax's public op asks for acquire-release ordering."""
    text = triton_ir(pltriton.atomic_add, capsys)
    assert "tt.atomic_rmw fadd, acq_rel, gpu" in text, text


@pytest.mark.parametrize(
    "break_internals",
    ["no_lowering_rule", "rmw_without_semantic", "no_discharge"],
)
def test_falls_back_to_public_op_where_internals_differ(monkeypatch, break_internals):
    from jax._src.pallas.triton import lowering as tt_lowering
    from jax._src.pallas.triton import primitives as tt_primitives
    from jax._src.state import discharge as state_discharge

    if break_internals == "no_lowering_rule":
        monkeypatch.delattr(tt_primitives, "_atomic_lowering_rule")
    elif break_internals == "rmw_without_semantic":
        monkeypatch.setattr(tt_lowering, "_atomic_rmw", lambda op, ptr, val, mask=None: None)
    else:
        monkeypatch.delattr(state_discharge, "register_discharge_rule")
    atomic_add, relaxed = relaxed_atomics._build()
    assert atomic_add is pltriton.atomic_add and relaxed is False


@pytest.mark.skipif(
    not relaxed_atomics.RELAXED, reason="the public op has no masked interpret rule"
)
def test_interpret_rule_sums_repeated_rows_and_drops_masked_lanes():
    """Interpret mode adds every lane, repeated rows included, and skips masked-off lanes (the
    public op's interpret rule keeps one add per repeated row and raises for a mask)."""
    rng = np.random.default_rng(0)
    val = rng.normal(size=(8, 16)).astype(np.float32)
    val[~MASK] = np.nan  # masked lanes must not be read into the sum
    init = rng.normal(size=(10, 16)).astype(np.float32)
    call = scatter_kernel(relaxed_atomics.atomic_add)
    got = call(ROWS, val, MASK, init, interpret=True)
    want = init.copy()
    np.add.at(want, ROWS[MASK], val[MASK])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
