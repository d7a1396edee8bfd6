"""What the library's Pallas-Triton kernels ask of a Hopper GPU, found on any host without one.

Lowers a kernel family at the shapes you give (jax, for CUDA, on this host), compiles each
Triton kernel for sm_90 with the `triton` package's own compiler and ptxas, and prints per
kernel: its launch (warps, pipelining stages), the shared memory it asks for against the
232,448 bytes an H100 / H200 program may have, its matmul instructions (Hopper's `wgmma`
against `mma.sync`) and its registers and spills. A `BlockSizes` choice that would fail with
"Shared memory size limit exceeded" on the GPU shows here first, at no device time.

    pip install triton    # the compiler only; no GPU or CUDA driver needed
    PYTHONPATH=. python experiments/kernel_resources.py attention --heads 64 128
    PYTHONPATH=. python experiments/kernel_resources.py attention --heads 64 --sizes block_h_dkv=64
    PYTHONPATH=. python experiments/kernel_resources.py hytopk --index-heads 32 64
    PYTHONPATH=. python experiments/kernel_resources.py indexer-loss --heads 128 --index-heads 64

Families and shapes (bf16; T = S = --seq, the figures do not depend on it):
  attention     sparse attention forward and backward (`pallas_kernels/sparse_attention.py`),
                MLA's absorbed form by default: D = 576 over one shared key whose first 512
                features are the value (--dim, --value-dim; --value-dim 0: a separate value of
                width D), k = 2048; --deterministic for the sorted-sum backward.
  hytopk        the fused selection (`pallas_kernels/hytopk.py`), DI = 128, k = 2048, causal.
  indexer-loss  the sparse-stage KL loss forward and backward (`pallas_kernels/indexer_loss.py`)
                over MLA's 576-wide main keys (--dim); --given-lse: the attention's
                log-sum-exps given (as the model runs it); --save-target: the backward that
                reads the forward's target instead of the main keys.
--sizes FIELD=V,... sets that family's `BlockSizes` fields.

The figures are those of the `triton` package installed here, not of the Triton inside the
GPU's XLA build; they agreed to the byte with two H100 failures (HyTopK at 64 indexer heads:
360,448 bytes; a 64-head key-gradient program: 315,392 where the H100 reported 272-308 KiB
across tile sizes) with triton 3.9.0 and jax 0.10.2 here, jax 0.11.2 on the GPU, and missed one:
HyTopK at 64 indexer heads with 48 of them resident compiles to 229,376 bytes here and asked
for 278,528 on an H100: a configuration near the limit is unproven until it runs on the GPU.
Registers and spills come from ptxas -v (the one the triton package carries) on the generated
PTX (sm_90a). Nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import block_sizes  # noqa: E402

from pallas_kernels import hytopk as phk  # noqa: E402
from pallas_kernels import indexer_loss as pil  # noqa: E402
from pallas_kernels import sparse_attention as psa  # noqa: E402

SHARED_LIMIT = 232_448  # bytes of shared memory one program may have on an H100 / H200
_LAUNCH = re.compile(r'name = "([^"]+)".*?num_stages = (\d+) : i32, num_warps = (\d+)')


def lowered_kernels(fn, *args) -> list[tuple[str, str, int, int]]:
    """(name, Triton IR text, num_warps, num_stages) of every Pallas-Triton kernel that
    lowering `fn(*args)` for CUDA produces, in launch order."""
    from jax._src.pallas.triton import lowering

    modules = {}
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        modules[re.match(r"module @(\S+)", text).group(1)] = text
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return [
        (name, modules[name], int(warps), int(stages))
        for name, stages, warps in _LAUNCH.findall(hlo)
    ]


def compile_for_hopper(ir: str, warps: int, stages: int) -> dict:
    """Compile Triton IR for sm_90: shared bytes, wgmma / mma.sync counts, registers, spills."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; silences a warning
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir)
        kernel = triton.compile(
            path,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )
        ptx = kernel.asm["ptx"]
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        report = ""
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        for ptxas in ("ptxas-blackwell", "ptxas"):  # the newer one reads newer PTX versions
            path = os.path.join(bin_dir, ptxas)
            if not os.path.exists(path):
                continue
            run = subprocess.run(
                [path, "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(tmp, "kernel.cubin")],
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                report = run.stderr
                break
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {
        "shared": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "registers": int(registers.group(1)) if registers else None,
        "spill_stores": int(spills.group(1)) if spills else None,
    }


def attention_workload(args, H: int):
    shared = args.value_dim > 0
    Dv = args.value_dim if shared else args.dim
    sizes = block_sizes(psa.BlockSizes, args.sizes)
    T = args.seq
    q = jax.ShapeDtypeStruct((1, T, H, args.dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, 1, args.dim), jnp.bfloat16)
    v = None if shared else jax.ShapeDtypeStruct((1, T, 1, Dv), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, T, args.topk), jnp.int32)

    def loss(q, k, v, idx):
        out = psa.sparse_attention(
            q,
            k,
            v,
            idx,
            scale=args.dim**-0.5,
            value_dim=Dv if shared else None,
            deterministic=args.deterministic,
            block_sizes=sizes,
        )
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1) if shared else (0, 1, 2))
    return grads, (q, k, v, idx), f"H={H} D={args.dim} value={Dv}{' shared' if shared else ''}"


def hytopk_workload(args, HI: int):
    sizes = block_sizes(phk.BlockSizes, args.sizes)
    T = args.seq
    q = jax.ShapeDtypeStruct((1, T, HI, args.index_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, args.index_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, T, HI), jnp.float32)

    def select(q, k, w):
        return phk.hytopk(q, k, w, k=args.topk, causal=True, block_sizes=sizes)

    return select, (q, k, w), f"HI={HI} DI={args.index_dim}"


def indexer_loss_workload(args, H: int, HI: int):
    sizes = block_sizes(pil.BlockSizes, args.sizes)
    T = args.seq
    q = jax.ShapeDtypeStruct((1, T, H, args.dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, 1, args.dim), jnp.bfloat16)
    q_idx = jax.ShapeDtypeStruct((1, T, HI, args.index_dim), jnp.bfloat16)
    k_idx = jax.ShapeDtypeStruct((1, T, args.index_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, T, HI), jnp.float32)
    idx = jax.ShapeDtypeStruct((1, T, args.topk), jnp.int32)
    lse = jax.ShapeDtypeStruct((1, T, H), jnp.float32) if args.given_lse else None

    def grads(q, k, q_idx, k_idx, w, idx, lse):
        def loss(q_idx, k_idx, w):
            rows = pil.indexer_kl_rows(
                q,
                k,
                q_idx,
                k_idx,
                w,
                idx,
                scale=args.dim**-0.5,
                attention_lse=lse,
                save_target=args.save_target,
                block_sizes=sizes,
            )
            return jnp.sum(rows)

        return jax.grad(loss, argnums=(0, 1, 2))(q_idx, k_idx, w)

    return grads, (q, k, q_idx, k_idx, w, idx, lse), f"H={H} D={args.dim} HI={HI}"


def workloads(args):
    if args.family == "attention":
        return [attention_workload(args, H) for H in args.heads]
    if args.family == "hytopk":
        return [hytopk_workload(args, HI) for HI in args.index_heads]
    return [indexer_loss_workload(args, H, HI) for H in args.heads for HI in args.index_heads]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("family", choices=("attention", "hytopk", "indexer-loss"))
    p.add_argument("--heads", type=int, nargs="+", default=[64], help="attention heads H")
    p.add_argument("--index-heads", type=int, nargs="+", default=[32], help="indexer heads HI")
    p.add_argument("--dim", type=int, default=576, help="attention q/k width D (MLA: 576)")
    p.add_argument(
        "--value-dim", type=int, default=512, help="shared value width (0: separate v of width D)"
    )
    p.add_argument("--index-dim", type=int, default=128, help="indexer width DI")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--seq", type=int, default=4096, help="T = S (the figures do not depend on it)")
    p.add_argument("--deterministic", action="store_true", help="attention: sorted-sum backward")
    p.add_argument(
        "--given-lse",
        action="store_true",
        help="indexer-loss: the one-sweep forward, the attention's log-sum-exps given",
    )
    p.add_argument(
        "--save-target",
        action="store_true",
        help="indexer-loss: the forward keeps the target p and the backward reads it",
    )
    p.add_argument("--sizes", default="", help="BlockSizes fields of the family, FIELD=V,...")
    args = p.parse_args(argv)
    try:
        import triton
    except ImportError:
        raise SystemExit("needs the triton package (pip install triton); no GPU needed") from None

    print(f"jax {jax.__version__}, triton {triton.__version__}, sm_90, limit {SHARED_LIMIT:,} B")
    header = f"{'kernel':26s} {'warps':>5s} {'stages':>6s} {'shared B':>9s} {'of limit':>8s}"
    header += f" {'wgmma':>6s} {'mma.sync':>8s} {'regs':>5s} {'spills B':>8s}"
    for fn, fn_args, label in workloads(args):
        print(f"\n{args.family} {label} {args.sizes or '(default BlockSizes)'}")
        print(header)
        for name, ir, warps, stages in lowered_kernels(fn, *fn_args):
            r = compile_for_hopper(ir, warps, stages)
            flag = "  EXCEEDS" if r["shared"] > SHARED_LIMIT else ""
            regs, spills = (("?" if r[f] is None else r[f]) for f in ("registers", "spill_stores"))
            print(
                f"{name:26s} {warps:5d} {stages:6d} {r['shared']:9,d} "
                f"{r['shared'] / SHARED_LIMIT:8.0%} {r['wgmma']:6d} {r['mma_sync']:8d} "
                f"{regs:>5} {spills:>8}{flag}"
            )


if __name__ == "__main__":
    main()
