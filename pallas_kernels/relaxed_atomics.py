"""Float atomic add with relaxed memory ordering, for the Pallas-Triton backward kernels.

`jax.experimental.pallas.triton.atomic_add` lowers to `tt.atomic_rmw fadd, acq_rel`: every add
also orders all of the program's earlier memory traffic. The gradient sums of
pallas_kernels/sparse_attention.py (dK, dV) and pallas_kernels/indexer_loss.py (dk_idx) need
atomicity only: nothing else is published through those buffers, and they are read after the
kernel ends. With relaxed ordering Triton emits `red.global.gpu.relaxed.add.v4.f32` (no return
value, four floats per request). H200, T=32K, H=64, same run: sparse-attention forward+backward
60.89 ms relaxed against 123.42 ms acquire-release.

jax has no public switch for the ordering, so this module binds jax's own atomic primitive rules
under a private primitive whose Triton lowering passes `semantic=relaxed` to jax's
`_atomic_rmw` helper. That reaches into jax internals (`jax._src`), so it is version-guarded:
where an internal it needs is missing or has another signature, `atomic_add` is the public
`pltriton.atomic_add` (same sums, acquire-release ordering) and `RELAXED` is False.

The private primitive also has an interpret-mode rule (the state discharge), so the atomic
kernels run under Pallas interpret mode on CPU: each call adds `val` into `ref[idx]` with a
scatter-add, where repeated indices inside one call all count and `mask=False` lanes add
nothing, as on the GPU. (The public primitive's interpret rule reads `ref[idx]`, adds and
scatters back with `set`, so of several lanes naming one address only one add survives, and it
raises NotImplementedError for a mask or for an index that mixes an integer array with a slice.)

Exports:
  RELAXED: bool, True when `atomic_add` is the relaxed-ordering primitive.
  atomic_add(ref, idx, val, *, mask=None): add `val` into `ref[idx]` atomically (f32 on the GPU).
"""

from __future__ import annotations

import functools
import inspect

from jax.experimental.pallas import triton as pltriton


def _relaxed_atomic_add():
    """The relaxed-ordering `atomic_add`, or None where jax's internals differ from these."""
    try:
        import jax.numpy as jnp
        from jax._src import core as jax_core
        from jax._src import tree_util
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tt_lowering
        from jax._src.pallas.triton import primitives as tt_primitives
        from jax._src.state import discharge as state_discharge
        from jax._src.state import indexing
        from jax._src.state import primitives as state_primitives

        base_rule = tt_primitives._atomic_lowering_rule
        abstract_eval = tt_primitives._atomic_abstract_eval
        add = tt_primitives.AtomicOpType.ADD
        relaxed = tt_dialect.MemSemantic.RELAXED
        default_rmw = tt_lowering._atomic_rmw
        register_lowering = tt_lowering.register_lowering
        register_discharge = state_discharge.register_discharge_rule
        get_ref_and_transforms = state_primitives.get_ref_and_transforms
        slice_type = indexing.Slice
        indexer_type = indexing.NDIndexer
        if "semantic" not in inspect.signature(default_rmw).parameters:
            return None
    except (ImportError, AttributeError, TypeError, ValueError):
        return None

    prim = jax_core.Primitive("atomic_add_relaxed")
    prim.def_effectful_abstract_eval(abstract_eval)

    def lowering_rule(ctx, *args, args_tree, atomic_type):
        # jax's rule computes the pointers and picks the op; its `_atomic_rmw` call gets the
        # relaxed semantic for the duration of this one lowering.
        tt_lowering._atomic_rmw = functools.partial(default_rmw, semantic=relaxed)
        try:
            return base_rule(ctx, *args, args_tree=args_tree, atomic_type=atomic_type)
        finally:
            tt_lowering._atomic_rmw = default_rmw

    register_lowering(prim)(lowering_rule)

    def discharge_rule(*args, args_tree, atomic_type):
        """Interpret mode: ref.at[idx].add(val where mask), as the GPU's atomics sum. jax 0.10
        passes (in_avals, out_avals, *args_flat), jax 0.11 (context, *args_flat)."""
        del atomic_type  # ADD only
        args_flat = args[len(args) - args_tree.num_leaves :]
        ref, transforms, val, mask = args_tree.unflatten(args_flat)
        if len(transforms) != 1 or not isinstance(transforms[0], indexer_type):
            raise NotImplementedError(f"atomic_add on a transformed ref: {transforms}")
        index = []
        for i in transforms[0].indices:
            if isinstance(i, slice_type):
                if i.is_dynamic_start or i.is_dynamic_size:
                    raise NotImplementedError("atomic_add with a dynamic slice")
                index.append(slice(i.start, i.start + i.size * i.stride, i.stride))
            else:
                index.append(i)
        index = tuple(index)
        if mask is not None:
            val = jnp.where(mask, val, jnp.zeros_like(val))  # masked lanes add +0.0
        old = ref[index]
        return (ref.at[index].add(val),) + (None,) * (len(args_flat) - 1), old

    register_discharge(prim)(discharge_rule)

    def atomic_add(ref, idx, val, *, mask=None):
        x_ref, transforms = get_ref_and_transforms(ref, idx, "atomic_rmw")
        args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
        return prim.bind(*args_flat, args_tree=args_tree, atomic_type=add)

    return atomic_add


def _build():
    """(atomic_add, relaxed): the relaxed primitive if jax's internals allow, else the public op."""
    relaxed = _relaxed_atomic_add()
    if relaxed is None:
        return pltriton.atomic_add, False
    return relaxed, True


atomic_add, RELAXED = _build()
