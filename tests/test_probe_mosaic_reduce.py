"""experiments/probe_mosaic_reduce.py: the Mosaic GPU row-reduction probe's logic, on CPU.

The probe times bulk tensor reductions of dK/dV rows on the H200. Here it runs in Mosaic GPU's
interpret mode (where each row reduction is a read-modify-write: the interpreter has no TMA
reduction; see `reduce_probe`'s docstring) against a jnp scatter-add, and its compiled form is
lowered for CUDA, so that a device call is not spent on a wrong or unlowerable probe.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import probe_mosaic_reduce as probe  # noqa: E402

B, T, H, D, S = 1, 3, 64, 128, 200


def _inputs(K=256):
  """K = 256: four 64-key blocks and one index copy; 512: eight blocks, two index copies on
  one barrier. Every fourth slot is -1; query 0 also holds a negative entry and query 1 an
  entry equal to S (both must add nothing: the kernel clamps them to row 0 for the copy's
  address); query 2 has no valid entry at all."""
  keys = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  idx = jax.random.randint(keys[1], (B, T, K), 0, S)
  idx = idx.at[:, :, ::4].set(-1).at[0, 0, 1].set(-7).at[0, 1, 2].set(S).at[0, 2].set(-1)
  return q, probe.make_coeffs(), idx


@pytest.mark.parametrize("mode, stages, K", [("reduce", 1, 256), ("reduce", 2, 512),
                                             ("reduce_only", 1, 256)])
def test_interpret_matches_scatter_add(mode, stages, K):
  q, coeffs, idx = _inputs(K)
  got = probe.reduce_probe(q, coeffs, idx, S, mode=mode, stages=stages, interpret=True)
  want = probe.reduce_reference(q, coeffs, idx, S, mode)
  for g, w in zip(got, want):
    assert float(jnp.max(jnp.abs(w))) > 1.0      # the rows did add up to something
    # f32 sums of the same rows, possibly in another order.
    assert probe.bench_attention.rel_err(g, w) < 1e-6


def test_store_mode_adds_nothing():
  q, coeffs, idx = _inputs()
  for out in probe.reduce_probe(q, coeffs, idx, S, mode="store", interpret=True):
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("mode, stages", [("reduce_only", 1), ("store", 2), ("reduce", 1),
                                          ("reduce", 2)])
def test_compiled_probe_lowers_for_cuda(mode, stages):
  q, coeffs, idx = _inputs()
  got = probe.gather._lowers(functools.partial(probe.reduce_probe, num_keys=S, mode=mode,
                                               stages=stages), q, coeffs, idx)
  assert got == "lowers", got


def test_bad_shapes_and_modes_are_refused():
  q, coeffs, idx = _inputs()
  with pytest.raises(ValueError, match="mode"):
    probe.reduce_probe(q, coeffs, idx, S, mode="atomic")
  with pytest.raises(ValueError, match="multiple of 256"):
    probe.reduce_probe(q, coeffs, idx[..., :200], S, mode="reduce")
