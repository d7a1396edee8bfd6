"""experiments/probe_mosaic_backward.py: the Mosaic GPU backward probe's logic, on CPU.

The probe times a Hopper-native sparse-attention backward on the H200. Here its two kernels
run in Mosaic GPU's interpret mode (see `backward_probe`'s docstring for what the interpreter
cannot run) against the f32 reference's gradients, and their compiled forms are lowered for
CUDA, so that a device call is not spent on a wrong or unlowerable probe.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import probe_mosaic_backward as probe  # noqa: E402

B, T, H, D, S = 1, 3, 64, 128, 200


def _inputs(K=256):
  """Four 64-key blocks (K=256) or eight, with two index copies (K=512). K and V row 0 hold
  NaN and no valid entry selects it (invalid slots copy row 0: the kernel must keep it out).
  Query 0 has a negative entry, query 1 an entry equal to S and -1 padding from slot 100 on
  (its last blocks hold no valid slot), query 2 no valid entry at all."""
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, D), jnp.bfloat16).at[:, 0].set(jnp.nan)
  v = jax.random.normal(keys[2], (B, S, D), jnp.bfloat16).at[:, 0].set(jnp.nan)
  do = jax.random.normal(keys[3], (B, T, H, D), jnp.bfloat16)
  idx = jax.random.randint(keys[4], (B, T, K), 1, S)
  idx = idx.at[0, 0, 7].set(-5).at[0, 1, 5].set(S).at[0, 1, 100:].set(-1).at[0, 2].set(-1)
  return q, k, v, do, idx


def _reference(q, k, v, do, idx):
  """The f32 reference's gradients and output on finite copies of K and V (the dense
  reference reads every row; row 0 is never selected, so the answer is the same)."""
  finite = [x.at[:, 0].set(0) for x in (k, v)]
  return probe.reference_backward(q, *finite, idx, do)


def _lse(q, k, v, idx):
  return probe.gather.forward_reference(q, k, v, idx, np.arange(T))[1]


@pytest.mark.parametrize("stages, K", [(2, 256), (1, 512)])
def test_backward_interpret_matches_reference(stages, K):
  q, k, v, do, idx = _inputs(K)
  (want_dq, want_dk, want_dv), want_out = _reference(q, k, v, do, idx)
  lse = _lse(q, k, v, idx)
  delta = probe.backward_probe(q, k, v, do, lse, None, idx, mode="delta", stages=stages,
                               interpret=True)
  # delta is dO . O in f32 on both sides: only the summation order differs.
  np.testing.assert_allclose(np.asarray(delta),
                             np.asarray(jnp.sum(do.astype(jnp.float32) * want_out, -1)),
                             atol=2e-5, rtol=1e-5)
  dq, dk, dv = probe.backward_probe(q, k, v, do, lse, delta, idx, mode="grad", stages=stages,
                                    interpret=True)
  rel_err = probe.bench_attention.rel_err
  # P and dS go to the tensor cores in bf16 (as in the Triton backward): ~2e-3 relative.
  for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got.astype(jnp.float32), want) < 1e-2
  assert not np.asarray(dq[0, 2], np.float32).any()            # no valid entry: zero dQ
  assert not np.asarray(dk[0, 0]).any() and not np.asarray(dv[0, 0]).any()   # never selected


def test_mosaic_backward_composes_the_kernels():
  q, k, v, do, idx = _inputs()
  (want_dq, want_dk, want_dv), _ = _reference(q, k, v, do, idx)
  grads = probe.mosaic_backward(q, k, v, idx, _lse(q, k, v, idx), do, interpret=True)
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
  for got, want in zip(grads, (want_dq, want_dk, want_dv)):
    assert probe.bench_attention.rel_err(got.astype(jnp.float32), want) < 1e-2


def test_compiled_kernels_lower_for_cuda():
  assert set(probe.lowering_survey().values()) == {"lowers"}


def test_bad_shapes_and_modes_are_refused():
  q, k, v, do, idx = _inputs()
  lse = jnp.zeros((B, T, H), jnp.float32)
  with pytest.raises(ValueError, match="mode"):
    probe.backward_probe(q, k, v, do, lse, lse, idx, mode="dq", interpret=True)
  with pytest.raises(ValueError, match="H=32"):
    probe.backward_probe(q[:, :, :32], k, v, do[:, :, :32], lse[..., :32], lse[..., :32], idx,
                         mode="grad", interpret=True)
  with pytest.raises(ValueError, match="kk=200"):
    probe.backward_probe(q, k, v, do, lse, lse, idx[..., :200], mode="grad", interpret=True)
