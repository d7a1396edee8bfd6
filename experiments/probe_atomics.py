"""Which atomic and matmul instructions the sparse-attention kernels compile to (issue 4), on GPU.

    PYTHONPATH=. python3 experiments/probe_atomics.py [--out DIR]

The backward is bound by its dK/dV float atomics (`attention_notes.md`: the atomics alone take
~18 ms of the ~39 ms backward at T=32K, H=64). Hopper has vector float atomics
(`red/atom.global.add.v2.f32` / `.v4.f32`: one request for 2 or 4 neighbouring floats), and
recent Triton emits them when the pointers are provably contiguous and the mask is constant
across the vector; otherwise it emits one scalar `.f32` atomic per element. Which of the two
our kernels get decides whether the atomics floor is the hardware's or our layout's.

Each program below is compiled with XLA's Triton dump on; the atomic instructions (inline-PTX
strings) in the kernels lowered to the LLVM dialect are counted by form:
  forward         the forward kernel alone (impl="pallas"), default sizes;
  backward        the real custom_vjp backward (jax.grad through impl="pallas"), default sizes;
  atomics_only    diagnose_bounds' floor kernel (broadcast values), unmasked and masked.
Since the sixteenth session it also counts the matmul forms (probe_scoring_ir.FORMS: `wgmma`
against `mma.sync`, ldmatrix, shared-memory traffic, barriers) in every dumped kernel: with G=1
a program's matmuls have the query's H=64 heads as rows, a multiple of 64, which is what
Triton needs to pick Hopper's warpgroup MMA. Writes DIR/probe_atomics.json and keeps the dumps
that hold atomics or matmuls under DIR/ir/.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile


def _atomic_forms(ir_text: str) -> dict[str, int]:
  """Counts of each atomic instruction form (`red...` / `atom...`) in IR holding inline PTX."""
  forms = re.findall(r"\b((?:red|atom)\.(?:global|shared|gpu|relaxed|acq_rel|add)[\w.]*)", ir_text)
  return dict(collections.Counter(forms))


def start_triton_dump() -> str:
  """Turn on XLA's dump of the Triton kernels it compiles; returns the dump directory.

  XLA compiles the Pallas-Triton custom calls itself. With this dump on it writes
  <module>.<kernel>.triton-to-llvm.txt (the kernel lowered to the LLVM dialect, where NVVM ops
  and inline-PTX strings name the instructions). XLA's own module IR does not hold the Triton
  kernels. Call it before jax starts its backend.
  """
  dump = tempfile.mkdtemp(prefix="xla_dump_")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                             " --xla_dump_emitter_re=triton")
  return dump


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "probe_atomics"))
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dump = start_triton_dump()

  import jax
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import bench_attention
  import diagnose_bounds
  import probe_scoring_ir
  import hyscale_jax as hs
  from pallas_kernels import sparse_attention as psa

  if jax.default_backend() != "gpu":
    raise SystemExit("probe_atomics.py reads compiled GPU kernels: run it on a GPU")
  T, H, D, k = 4096, 64, 128, 2048
  q, kk, v, idx, do = bench_attention.make_inputs(1, T, H, D, D, k)
  sizes = psa.BlockSizes()

  def probe_forward(q, kk, v, idx):
    return hs.sparse_attention(q, kk, v, idx, impl="pallas")

  def probe_backward(q, kk, v, idx, do):
    out, vjp = jax.vjp(lambda q, kk, v: hs.sparse_attention(q, kk, v, idx, impl="pallas"),
                       q, kk, v)
    return vjp(do)

  def probe_atomics_unmasked(idx):
    return diagnose_bounds.atomics_only(idx, S=T, D=D, Dv=D, sizes=sizes, masked=False)

  def probe_atomics_masked(idx):
    return diagnose_bounds.atomics_only(idx, S=T, D=D, Dv=D, sizes=sizes, masked=True)

  programs = {"forward": (probe_forward, (q, kk, v, idx)),
              "backward": (probe_backward, (q, kk, v, idx, do)),
              "atomics_only_unmasked": (probe_atomics_unmasked, (idx[0],)),
              "atomics_only_masked": (probe_atomics_masked, (idx[0],))}
  record = dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                block_sizes=str(sizes), programs={}, instructions={})
  ir_dir = os.path.join(args.out, "ir")
  os.makedirs(ir_dir, exist_ok=True)
  for name, (fn, fn_args) in programs.items():
    pattern = os.path.join(dump, "*probe_*.triton-to-llvm.txt")  # jitted functions: probe_*
    before = set(glob.glob(pattern))
    jax.block_until_ready(jax.jit(fn)(*fn_args))
    forms, counts = {}, {}
    for path in sorted(set(glob.glob(pattern)) - before):
      with open(path) as f:
        text = f.read()
      found = _atomic_forms(text)
      found_mma = probe_scoring_ir.instruction_counts(text)
      if found:
        forms[os.path.basename(path)] = found
      if found or found_mma["mma_sync"] or found_mma["wgmma"]:
        counts[os.path.basename(path)] = found_mma
        with open(os.path.join(ir_dir, os.path.basename(path)), "w") as f:
          f.write(text)
    record["programs"][name] = forms
    record["instructions"][name] = counts
    print(f"{name}: atomic forms per dump file {forms}", flush=True)
    print(f"{name}: instruction counts per dump file {counts}", flush=True)
  path = os.path.join(args.out, "probe_atomics.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
