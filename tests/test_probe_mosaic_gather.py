"""experiments/probe_mosaic_gather.py: the Mosaic GPU gather probe's logic, on CPU.

The probe's kernel times a Hopper-native gather on the H200. Here it runs in Mosaic GPU's
interpret mode (its copies, barriers, masking and online softmax; see `gather_probe`'s
docstring for what the interpreter cannot run) against jnp references, and its compiled form
is lowered for CUDA, so that a device call is not spent on a wrong or unlowerable probe.
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
import probe_mosaic_gather as probe  # noqa: E402

B, T, H, D, S, K = 1, 4, 64, 128, 200, 256   # K: two 128-key or four 64-key blocks


def _inputs(nan_row_0=False):
  """nan_row_0: K and V row 0 hold NaN and no valid entry selects it. Invalid slots copy row
  0 (the probe's copies promise to stay in bounds), so the kernel must keep it out."""
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, D), jnp.bfloat16)
  if nan_row_0:
    k, v = k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan)
  idx = jax.random.randint(keys[3], (B, T, K), 1, S)
  # query 0: one negative entry; query 1: an entry past S and -1 padding from slot 100 on
  # (so its last blocks hold no valid slot); query 2: no valid entry at all; query 3: plain.
  idx = idx.at[0, 0, 7].set(-5).at[0, 1, 5].set(S + 7).at[0, 1, 100:].set(-1)
  return q, k, v, idx.at[0, 2].set(-1)


@pytest.mark.parametrize("block_k, stages, consumers", [(64, 2, 1), (128, 1, 1), (64, 1, 2)])
def test_forward_interpret_matches_reference(block_k, stages, consumers):
  q, k, v, idx = _inputs(nan_row_0=True)
  out, lse = probe.gather_probe(q, k, v, idx, mode="forward", block_k=block_k, stages=stages,
                                consumers=consumers, interpret=True)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  want_out, want_lse = probe.forward_reference(q, k, v, idx, np.arange(T))
  # bf16 output of an f32 computation: its rounding alone is ~2e-3 relative.
  assert probe.bench_attention.rel_err(out.astype(jnp.float32), want_out) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5)
  assert np.all(np.asarray(out[0, 2]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 2])))


@pytest.mark.parametrize("mode", ["arrive", "tma", "relayout"])
def test_pipeline_only_modes_run_and_return_zeros(mode):
  """The modes without matmuls complete their barrier protocol (the interpreter checks every
  phase is observed) and write zeros."""
  q, k, v, idx = _inputs()
  out, _ = probe.gather_probe(q, k, v, jnp.maximum(idx, 0) % S, mode=mode, consumers=2,
                              stages=1, interpret=True)
  assert np.all(np.asarray(out) == 0)


def test_matmul_interpret_matches_reference():
  q, k, v, idx = _inputs()
  idx = jnp.maximum(idx, 0) % S                # the matmul mode's inputs: every slot valid
  out, _ = probe.gather_probe(q, k, v, idx, mode="matmul", interpret=True)
  want = probe.matmul_reference(q, k, v, idx, np.arange(T))
  assert probe.bench_attention.rel_err(out.astype(jnp.float32), want) < 1e-2


@pytest.mark.parametrize("mode, consumers", [(m, 1) for m in probe.MODES] + [("forward", 2)])
def test_compiled_probe_lowers_for_cuda(mode, consumers):
  q, k, v, idx = _inputs()
  got = probe._lowers(functools.partial(probe.gather_probe, mode=mode, consumers=consumers,
                                        stages=3 - consumers), q, k, v, idx)
  assert got == "lowers", got


def test_unpadded_relayout_is_refused():
  """The reason for the padded staging rows: jax's Mosaic GPU will not lower the unpadded
  re-layout (its transfer planner finds only bank-conflicting patterns)."""
  q, k, v, idx = _inputs()
  got = probe._lowers(functools.partial(probe.gather_probe, mode="relayout", row_pad=0),
                      q, k, v, idx)
  assert got.startswith("refused") and "bank conflicts" in got, got
