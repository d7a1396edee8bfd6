"""What bounds the kernels (issues 3 and 4): floors measured with stripped-down kernels, on GPU.

    PYTHONPATH=. python3 experiments/diagnose_bounds.py [--T 32768] [--reps 5]

1. HyTopK epilogue (issue 3). `order_candidates` sorts each row's <= k survivors by
   (key descending, index ascending) with a two-key `lax.sort`. The survivors sit in ascending
   key-index order in the kernel's buffer, so a *stable* sort on the key alone gives the same
   order (here with the key indices as payload; `phk.order_candidates_stable`, the default
   epilogue since 2026-12-03's seventh session, sorts buffer positions instead, a form XLA
   sorts faster, and gathers the indices after). Both are timed on candidate buffers of the
   benchmark's shape (T rows x k, random order keys with ties) and checked equal, and so is
   the Pallas bitonic epilogue (`order_candidates_pallas`) at several rows per program and
   warp counts.
2. Sparse attention floors (issue 4), at the benchmark's shape (G=1, H=64, D=Dv=128, k=2048,
   bf16, causal random indices from bench_attention.py):
     gather_only   the forward's memory traffic alone: every program gathers its k K rows and
                   k V rows in blocks of `block_k` (as `_forward_kernel`), no matmul.
     atomics_only  the backward's dK/dV accumulation alone: every program adds a [block_k, D]
                   and a [block_k, Dv] f32 tile per block into dK/dV with the same relaxed
                   atomics, grid and launch parameters as `_backward_kernel` (no gathers, no
                   matmuls); once adding the invalid slots' zeros into row 0 over every block
                   (skip_invalid=False), once masked with trailing empty blocks skipped.
   Next to them, the real kernels' forward and forward+backward times at the same shape.

Writes experiments/results/diagnose_bounds.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention  # noqa: E402
from hyscale_jax.scores import INVALID_KEY  # noqa: E402
from pallas_kernels import hytopk as phk  # noqa: E402
from pallas_kernels import sparse_attention as psa  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(*args):
  print(*args, flush=True)


median_ms = bench_attention.median_ms


# ------------------------------------------------------------------------------ 1. epilogue


@functools.partial(jax.jit, static_argnames=("T", "k"))
def order_two_keys(keys, idx, cnt, *, T, k):
  return phk.order_candidates(keys, idx, cnt, T=T, k=k)


@functools.partial(jax.jit, static_argnames=("T", "k"))
def order_stable_one_key(keys, idx, cnt, *, T, k):
  """The same order as `order_candidates` for buffers in ascending index order."""
  keys, idx, cnt = keys[:, :T, :k], idx[:, :T, :k], cnt[:, :T]
  keys = jnp.where(jnp.arange(k) < cnt[..., None], keys, INVALID_KEY)
  nkeys, idx = lax.sort((~keys, idx), dimension=2, num_keys=1, is_stable=True)
  return jnp.where(nkeys == ~INVALID_KEY, -1, idx).astype(jnp.int32)


def candidate_buffers(T, k, seed=0):
  """keys/idx [1, T, k] int32 like the kernel's final buffers: ascending distinct indices,
  keys drawn from a small range (many ties), some rows not full."""
  rng = jax.random.split(jax.random.key(seed), 3)
  gaps = jax.random.randint(rng[0], (1, T, k), 1, 8)
  idx = jnp.cumsum(gaps, axis=-1).astype(jnp.int32)
  keys = jax.random.randint(rng[1], (1, T, k), 0, 4096).astype(jnp.int32) + 0x3F000000
  cnt = jnp.where(jax.random.uniform(rng[2], (1, T)) < 0.1, k // 3, k).astype(jnp.int32)
  return keys, idx, cnt


# The Pallas epilogue (`phk.order_candidates_pallas`, a bitonic network per row): (rows per
# program, warps) tried against the XLA sort.
PALLAS_ORDERS = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8))


def epilogue(T, k, reps):
  keys, idx, cnt = candidate_buffers(T, k)
  a = order_two_keys(keys, idx, cnt, T=T, k=k)
  b = order_stable_one_key(keys, idx, cnt, T=T, k=k)
  equal = bool(jnp.array_equal(a, b))
  rec = dict(T=T, k=k, equal=equal,
             two_keys_ms=median_ms(functools.partial(order_two_keys, T=T, k=k),
                                   (keys, idx, cnt), reps),
             stable_one_key_ms=median_ms(functools.partial(order_stable_one_key, T=T, k=k),
                                         (keys, idx, cnt), reps))
  log(f"epilogue T={T} k={k}: two-key sort {rec['two_keys_ms']:.2f} ms, stable one-key sort "
      f"{rec['stable_one_key_ms']:.2f} ms, same result: {equal}")
  rec["pallas"] = []
  for rows, warps in PALLAS_ORDERS:
    fn = jax.jit(functools.partial(phk.order_candidates_pallas, T=T, k=k, rows=rows,
                                   num_warps=warps))
    try:
      same = bool(jnp.array_equal(a, fn(keys, idx, cnt)))
      ms = median_ms(fn, (keys, idx, cnt), reps)
    except Exception as e:  # noqa: BLE001  (a config that does not compile: record, go on)
      rec["pallas"].append(dict(rows=rows, num_warps=warps, failed=f"{type(e).__name__}: "
                                f"{str(e)[:300]}"))
      log(f"epilogue T={T} k={k}: pallas bitonic rows={rows} warps={warps} failed: "
          f"{type(e).__name__}")
      continue
    rec["pallas"].append(dict(rows=rows, num_warps=warps, ms=ms, equal=same))
    log(f"epilogue T={T} k={k}: pallas bitonic rows={rows} warps={warps} {ms:.2f} ms, "
        f"same result: {same}")
  return rec


# ------------------------------------------------------------------- 2. attention floors


def _gather_only_kernel(idx_ref, k_ref, v_ref, o_ref, *, block_k):
  """idx_ref [Kp]; k_ref [S, D]; v_ref [S, D] (D == Dv here); o_ref [D] f32 (keeps the loads
  alive)."""
  num_keys = k_ref.shape[0]

  def body(j, acc):
    rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
    k_blk = k_ref[rows, :].astype(jnp.float32)
    v_blk = jnp.where(valid[:, None], v_ref[rows, :], 0).astype(jnp.float32)
    return acc + k_blk + v_blk

  acc = lax.fori_loop(0, idx_ref.shape[0] // block_k, body,
                      jnp.zeros((block_k, k_ref.shape[1]), jnp.float32))
  o_ref[...] = jnp.sum(acc, axis=0)


def gather_only(k, v, idx, sizes):
  S, D = k.shape
  T, Kp = idx.shape
  return pl.pallas_call(
      functools.partial(_gather_only_kernel, block_k=sizes.block_k),
      grid=(T,),
      in_specs=[pl.BlockSpec((None, Kp), lambda t: (t, 0)),
                pl.BlockSpec((S, D), lambda t: (0, 0)),
                pl.BlockSpec((S, v.shape[1]), lambda t: (0, 0))],
      out_specs=pl.BlockSpec((None, D), lambda t: (t, 0)),
      out_shape=jax.ShapeDtypeStruct((T, D), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps,
                                              num_stages=sizes.num_stages),
      name="diag_gather_only",
  )(idx, k, v)


def _atomics_only_kernel(idx_ref, *refs, block_k, masked):
  """idx_ref [Kp]; refs: the zero inputs, then the aliased f32 accumulators [S, width] (dK and
  dV, or one of them).

  masked=False: as the backward without skip_invalid (invalid slots add 0 into row 0, every
  block runs); masked=True: as with skip_invalid (trailing empty blocks skipped, invalid slots'
  atomics masked off)."""
  acc_refs = refs[len(refs) // 2:]
  num_keys = acc_refs[0].shape[0]

  def body(j, carry):
    rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
    one = valid.astype(jnp.float32)[:, None]
    for ref in acc_refs:
      shape = (block_k, ref.shape[1])
      mask = jnp.broadcast_to(valid[:, None], shape) if masked else None
      psa._relaxed_atomic_add(ref, (rows, slice(None)), jnp.broadcast_to(one, shape),
                              mask=mask)
    return carry

  lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys, masked), body, 0)


def atomics_only(idx, S, widths, sizes, masked=False):
  """One f32 [S, width] accumulator per width; every valid (query, slot) adds a row of ones
  (or its validity, 0, unmasked) into each."""
  T, Kp = idx.shape
  specs = [pl.BlockSpec((S, w), lambda t: (0, 0)) for w in widths]
  return pl.pallas_call(
      functools.partial(_atomics_only_kernel, block_k=sizes.block_k_bwd, masked=masked),
      grid=(T,),
      in_specs=[pl.BlockSpec((None, Kp), lambda t: (t, 0))] + specs,
      out_specs=specs,
      out_shape=[jax.ShapeDtypeStruct((S, w), jnp.float32) for w in widths],
      input_output_aliases={1 + i: i for i in range(len(widths))},
      compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps_bwd,
                                              num_stages=sizes.num_stages_bwd),
      name="diag_atomics_only",
  )(idx, *(jnp.zeros((S, w), jnp.float32) for w in widths))


def attention(T, H, reps):
  D = Dv = 128
  k = 2048
  sizes = psa.BlockSizes()
  q, kk, v, idx, do = bench_attention.make_inputs(1, T, H, D, Dv, k)
  k2, v2, idx2 = kk[0, :, 0], v[0, :, 0], idx[0]
  # Exact check of the atomics kernel: every valid (query, slot) adds 1 to its key's row.
  hits = jnp.zeros((T,), jnp.float32).at[jnp.where(idx2 >= 0, idx2, T)].add(1.0, mode="drop")
  for masked in (False, True):
    dk, _ = jax.jit(functools.partial(atomics_only, S=T, widths=(D, Dv), sizes=sizes,
                                      masked=masked))(idx2)
    assert bool(jnp.array_equal(dk[:, 0], hits)), f"atomics_only kernel miscounts ({masked=})"
  fwd, fwd_bwd = bench_attention.programs("pallas")
  flops = bench_attention.sparse_flops(T, H, D, Dv, k)
  rec = dict(T=T, H=H, D=D, Dv=Dv, k=k, block_sizes=str(sizes),
             atomics=float(jnp.sum(idx2 >= 0)) * (D + Dv),
             gather_bytes=float(jnp.sum(idx2 >= 0)) * (D + Dv) * 2)
  rec["gather_only_ms"] = median_ms(jax.jit(functools.partial(gather_only, sizes=sizes)),
                                    (k2, v2, idx2), reps)
  rec["atomics_only_ms"] = median_ms(
      jax.jit(functools.partial(atomics_only, S=T, widths=(D, Dv), sizes=sizes)), (idx2,), reps)
  rec["atomics_only_masked_ms"] = median_ms(
      jax.jit(functools.partial(atomics_only, S=T, widths=(D, Dv), sizes=sizes, masked=True)),
      (idx2,), reps)
  # Half of the adds, into dK's buffer alone, as each kernel of the split backward
  # (BlockSizes.bwd_schedule="split") does: twice this against the line above says whether
  # one buffer at a time (16 MiB at 32K, not 32 MiB beside K/V in the L2) reduces faster.
  rec["atomics_only_masked_one_buffer_ms"] = median_ms(
      jax.jit(functools.partial(atomics_only, S=T, widths=(D,), sizes=sizes, masked=True)),
      (idx2,), reps)
  rec["fwd_ms"] = median_ms(fwd, (q, kk, v, idx), reps)
  rec["fwd_bwd_ms"] = median_ms(fwd_bwd, (q, kk, v, idx, do), reps)
  rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
  rec["fwd_bwd_tflops"] = 3.5 * flops / rec["fwd_bwd_ms"] / 1e9
  log(f"attention T={T} H={H}: gather_only {rec['gather_only_ms']:.2f} ms "
      f"({rec['gather_bytes'] / rec['gather_only_ms'] / 1e9:.2f} TB/s gathered), "
      f"atomics_only {rec['atomics_only_ms']:.2f} ms "
      f"({rec['atomics'] / rec['atomics_only_ms'] / 1e6:.1f} G f32 atomics/s), masked "
      f"{rec['atomics_only_masked_ms']:.2f} ms, masked into dK's buffer alone "
      f"{rec['atomics_only_masked_one_buffer_ms']:.2f} ms; "
      f"kernels: fwd {rec['fwd_ms']:.2f} ms ({rec['fwd_tflops']:.0f} TFLOP/s), "
      f"fwd+bwd {rec['fwd_bwd_ms']:.2f} ms ({rec['fwd_bwd_tflops']:.0f} TFLOP/s)")
  return rec


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--T", type=int, default=32768)
  ap.add_argument("--heads", type=int, default=64)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out", default=RESULTS)
  ap.add_argument("--no-epilogue", dest="epilogue", action="store_false",
                  help="skip part 1 (the HyTopK epilogue sort)")
  ap.add_argument("--no-attention", dest="attention", action="store_false",
                  help="skip part 2 (the sparse-attention floors)")
  args = ap.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("diagnose_bounds.py times compiled Pallas GPU kernels: run it on a GPU")
  record = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, argv=sys.argv[1:],
                epilogue=epilogue(args.T, 2048, args.reps) if args.epilogue else None,
                attention=attention(args.T, args.heads, args.reps) if args.attention else None)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "diagnose_bounds.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  log(f"wrote {path}")


if __name__ == "__main__":
  main()
