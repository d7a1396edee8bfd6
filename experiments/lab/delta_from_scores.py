"""Lab probe: the MLA split backward's delta from the saved log-sum-exp and P dP, against the
delta kernel's dO . o.

    PYTHONPATH=. python3 experiments/lab/delta_from_scores.py --seq 32768 --heads 64 \\
        [--variants 3:8 3:4 2:8] [--resources] [--out DIR]
    PYTHONPATH=. python3 experiments/lab/delta_from_scores.py --interpret [--resources --heads 64]

The question: can delta = sum_j P_j (dO . v_j), with P from the forward's saved log-sum-exp
(as the dQ and key-gradient kernels form it) and dP = dO V^T on the tensor cores, replace the
delta kernel at no cost? The delta kernel runs the forward again (online softmax, a
[heads, 512] f32 accumulator) and takes dO . o, with o from bf16 probabilities: where the keys
share a vector much larger than their spread, that delta is off by a fraction of a large
number and dQ lands about 6x further from the f32 result than the deterministic backward's
(docs/performance.md, "MLA's absorbed form"). This kernel has no accumulator wider than
[heads] and no rescale, and sums delta from f32 P dP; but it keeps dO [heads, 512] resident in
shared memory beside q, so fewer gathered tiles fit (the forward: 3 buffers at 5 stages).

MLA's absorbed shape (D = 576 over one shared key row whose first 512 features are the value,
k = 2048, bf16, causal random indices as in experiments/bench_attention.py), in the forward's
layout (64 heads a program). For the delta kernel and this kernel at each --variants
(pipelining stages:warps): ms (GPU
only, median of --reps after two warm-up calls, each with its own input padding), delta's
largest error relative to the largest |delta| of the f32 reference, and dQ's relative
Frobenius error against the f32 reference on keys sharing a vector --shared-scale times their
spread (the library's dQ kernel fed each delta; --check-seq queries). Writes
<out>/delta_from_scores.json (default runs/delta_from_scores/).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import make_inputs, median_ms, run_meta, save  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

import hyscale_jax as hs  # noqa: E402
from pallas_kernels import sparse_attention as psa  # noqa: E402

D, DV, TOPK = 576, 512, 2048  # MLA's absorbed shape


def from_scores_kernel(
    idx_ref, q_ref, k_ref, do_ref, lse_ref, delta_ref, *, scale_log2, block_k, lay, precision
):
    """delta = sum_j P_j dP_j for one query's block_h heads (the value is the key's main piece).

    Refs: idx_ref [Kp] int32, q_ref [block_h, width], k_ref [S, width], do_ref [block_h, dv],
    lse_ref [block_h] f32 (the forward's base-2 log-sum-exp; padded heads 0 with q = dO = 0),
    delta_ref [block_h] f32 (out)."""
    num_keys = k_ref.shape[0]
    q_main, q_tail = psa._pieces(q_ref, None, lay)
    do = do_ref[...]
    lse = lse_ref[...]

    def body(j, delta):
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = psa._masked_pieces(k_ref, rows, valid, lay)  # zeros where invalid
        s = psa._scores(q_main, q_tail, k_main, k_tail, precision)  # [block_h, block_k]
        p = jnp.where(valid[None, :], jnp.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = psa._dot(do, k_main, trans_b=True, precision=precision)  # dO V^T, V = K's main
        return delta + jnp.sum(p * dp, axis=1)

    live = psa._live_blocks(idx_ref, block_k, num_keys)
    delta_ref[...] = lax.fori_loop(0, live, body, jnp.zeros((lay.block_h,), jnp.float32))


def config(interpret: bool):
    """The op's config at MLA's shape: atomic backward, default BlockSizes."""
    return psa._Config(D**-0.5, interpret, False, psa.BlockSizes(), value_dim=DV)


def padded_operands(q, kv, idx, do, lse, *, interpret, backward):
    """The op's config and its operands in the forward's (backward=False) or the backward's
    layout: (cfg, qg, kp, idxp, block_k, lay, dog [B,T,1,heads,dv], lseg [B,T,1,heads])."""
    B, T, H, _ = q.shape
    cfg = config(interpret)
    qg, kp, _, idxp, block_k, lay = psa._prepare(q, kv, None, idx, cfg, backward=backward)
    dog = psa._pad_axis(
        psa._pad_axis(do.astype(qg.dtype).reshape(B, T, 1, H, DV), 3, lay.heads), 4, lay.dv
    )
    lseg = psa._pad_axis(lse.reshape(B, T, 1, H), 3, lay.heads)
    return cfg, qg, kp, idxp, block_k, lay, dog, lseg


def delta_from_scores(q, kv, idx, do, lse, *, stages, interpret, warps=8):
    """The public op's MLA operands (q [B,T,H,D], kv [B,S,1,D], idx [B,T,k], do [B,T,H,DV]) and
    the forward's lse [B,T,H] -> delta [B,T,1,H] f32, in the forward's layout."""
    B, T, H, _ = q.shape
    cfg, qg, kp, idxp, block_k, lay, dog, lseg = padded_operands(
        q, kv, idx, do, lse, interpret=interpret, backward=False
    )
    kernel = functools.partial(
        from_scores_kernel,
        scale_log2=cfg.scale * psa._LOG2E,
        block_k=block_k,
        lay=lay,
        precision=psa._precision(qg.dtype),
    )
    heads_spec = pl.BlockSpec((None, None, None, lay.block_h), psa._query_map(lay))
    rows_spec = pl.BlockSpec((None, None, None, lay.block_h, lay.dv), psa._query_map(lay, 0))
    S, Kp = kp.shape[1], idxp.shape[-1]
    delta = pl.pallas_call(
        kernel,
        grid=(T * lay.head_blocks, B, 1),
        in_specs=psa._input_specs(lay, S, Kp) + [rows_spec, heads_spec],
        out_specs=heads_spec,
        out_shape=jax.ShapeDtypeStruct((B, T, 1, lay.heads), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="probe_delta_from_scores",
    )(idxp, qg, kp, dog, lseg)
    return delta[..., :H]


def delta_kernel_path(q, kv, idx, do, *, interpret):
    """The library's delta kernel (the forward again, dO . o) -> delta [B,T,1,H] f32."""
    return psa._forward(q, kv, None, idx, config(interpret), do)


def dq_from(q, kv, idx, do, lse, delta, *, interpret):
    """The library's dQ kernel fed delta [B,T,1,H] -> dQ [B,T,H,D] f32."""
    H = q.shape[2]
    cfg, qb, kb, idxb, _, lay, dog, lseg = padded_operands(
        q, kv, idx, do, lse, interpret=interpret, backward=True
    )
    dq = psa._dq_call(
        qb,
        kb,
        None,
        idxb,
        lseg,
        dog,
        psa._pad_axis(delta, 3, lay.heads),
        scale=cfg.scale,
        lay=lay,
        sizes=cfg.sizes,
        interpret=interpret,
    )
    return dq[:, :, 0, :H, :D].astype(jnp.float32)


def precision_check(T, H, topk, shared_scale, interpret) -> dict:
    """delta's and dQ's errors against the f32 reference, keys sharing a large vector."""
    q, kv, _, idx, do = make_inputs(1, T, H, D, DV, topk, shared=True, seed=1)
    shift = shared_scale * jax.random.normal(jax.random.key(2), (D,))
    kv = (kv.astype(jnp.float32) + shift).astype(kv.dtype)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = lambda q, kv: hs.sparse_attention_reference(q, kv, kv[..., :DV], idx)  # noqa: E731
    o_ref, vjp = jax.vjp(ref, f32(q), f32(kv))
    dq_ref = vjp(f32(do))[0]
    delta_ref = jnp.sum(f32(do) * o_ref, axis=-1)[:, :, None, :]  # [B,T,1,H]
    lse = psa._forward(q, kv, None, idx, config(interpret))[1]
    candidates = {
        "delta_kernel": delta_kernel_path(q, kv, idx, do, interpret=interpret),
        # stages and warps change the schedule, not the arithmetic
        "from_scores": delta_from_scores(q, kv, idx, do, lse, stages=1, interpret=interpret),
    }
    out = {}
    for name, delta in candidates.items():
        dq = dq_from(q, kv, idx, do, lse, delta, interpret=interpret)
        out[name] = {
            "delta_err": float(jnp.max(jnp.abs(delta - delta_ref)) / jnp.max(jnp.abs(delta_ref))),
            "dq_rel_err": float(jnp.linalg.norm(dq - dq_ref) / jnp.linalg.norm(dq_ref)),
        }
    return out


def compiled_candidates(q, kv, idx, do, lse, variants) -> dict:
    """name -> (fn, its operands): the delta kernel and this kernel at each (stages, warps)."""
    fns = {
        "delta_kernel": (functools.partial(delta_kernel_path, interpret=False), (q, kv, idx, do))
    }
    for name, (n, w) in variants.items():
        fn = functools.partial(delta_from_scores, stages=n, warps=w, interpret=False)
        fns[name] = (fn, (q, kv, idx, do, lse))
    return fns


def timings(T, H, topk, variants, reps) -> dict:
    q, kv, _, idx, do = make_inputs(1, T, H, D, DV, topk, shared=True)
    lse = psa._forward(q, kv, None, idx, config(False))[1]
    fns = {
        name: (jax.jit(fn), args)
        for name, (fn, args) in compiled_candidates(q, kv, idx, do, lse, variants).items()
    }
    want = fns["delta_kernel"][0](*fns["delta_kernel"][1])
    out = {}
    for name, (fn, args) in fns.items():
        try:
            ms = median_ms(fn, args, reps)
            got = fn(*args)
            scale = float(jnp.max(jnp.abs(want)))
            out[name] = {
                "ms": ms,
                "max_diff_vs_delta_kernel": float(jnp.max(jnp.abs(got - want))) / scale,
            }
        except Exception as e:  # e.g. a stage count beyond shared memory
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def resources(H, variants) -> dict:
    """Triton 3.9's sm_90 compile of each kernel (`experiments/kernel_resources.py`): shared
    bytes, wgmma, registers and spills; no GPU needed."""
    import kernel_resources

    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    T = 1024
    q, kv, do = shape(1, T, H, D), shape(1, T, 1, D), shape(1, T, H, DV)
    idx = jax.ShapeDtypeStruct((1, T, TOPK), jnp.int32)
    lse = jax.ShapeDtypeStruct((1, T, H), jnp.float32)
    out = {}
    for name, (fn, args) in compiled_candidates(q, kv, idx, do, lse, variants).items():
        (_, ir, warps, n_stages), *_ = kernel_resources.lowered_kernels(fn, *args)
        try:
            out[name] = {
                "warps": warps,
                "stages": n_stages,
                **kernel_resources.compile_for_hopper(ir, warps, n_stages),
            }
        except Exception as e:  # e.g. beyond shared memory
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--variants", nargs="+", default=["3:8", "3:4", "2:8"], help="stages:warps")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--check-seq", type=int, default=256, help="queries of the precision check")
    p.add_argument("--shared-scale", type=float, default=10.0)
    p.add_argument(
        "--interpret",
        action="store_true",
        help="the precision check in interpret mode (CPU; 32 heads unless --resources), no timing",
    )
    p.add_argument(
        "--resources",
        action="store_true",
        help="also Triton's sm_90 compile figures (with --interpret no GPU is needed)",
    )
    p.add_argument("--out", default=os.path.join("runs", "delta_from_scores"))
    args = p.parse_args(argv)
    variants = {f"from_scores:{v}": tuple(int(x) for x in v.split(":")) for v in args.variants}
    records = []
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    heads = [32] if args.interpret and not args.resources else args.heads
    for H in heads:
        topk = min(args.topk, args.check_seq)
        check = precision_check(args.check_seq, H, topk, args.shared_scale, args.interpret)
        rec = {"H": H, "check_T": args.check_seq, "check_k": topk, "precision": check}
        print(f"H={H} precision (keys sharing a {args.shared_scale}x vector): {check}", flush=True)
        if args.resources:
            rec["resources"] = resources(H, variants)
            print(f"H={H} sm_90 compile: {rec['resources']}", flush=True)
        if not args.interpret:
            rec["T"] = args.seq
            rec["timings"] = timings(args.seq, H, args.topk, variants, args.reps)
            print(f"H={H} T={args.seq} timings: {rec['timings']}", flush=True)
        records.append(rec)
    print("wrote", save(args.out, run_meta(), records, "delta_from_scores"))


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing
    main()
