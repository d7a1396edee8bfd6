"""Lab probe: the MLA sparse-attention forward key-major, against the library's forward.

    PYTHONPATH=. python3 experiments/lab/mla_forward_key_major.py --seq 32768 --heads 64 \\
        [--forms 16,64,4,4 32,64,4,3 ...] [--out DIR]
    PYTHONPATH=. python3 experiments/lab/mla_forward_key_major.py --seq 128 --heads 32 \\
        --topk 64 --interpret        # CPU check of the numbers (times mean nothing)

The question: does the forward gain from the dQ kernel's orientation? The library's forward
runs 64 heads a program on 8 warps; its score matmul feeds the value matmul, and Triton lays a
chained dot out with every warp along its rows, so 64 heads fill one warpgroup's rows and
(inferred from the sm_90 compile) both warpgroups compute the same scores. Key-major, the
slot block's keys are the rows of both matmuls, on one warpgroup: per step
S^T = K Q^T ([block_k, heads], keys as M), the online softmax down the key axis, then
O^T += V^T P^T ([dv, heads] f32). Each query's rows are then gathered heads / block_h times.
Triton 3.9's sm_90 compile at H = 64: 16 heads, 64 keys, 4 warps, 4 stages: 168,704 bytes, 68
`wgmma` (m64n16k16), no spills; 32 heads at 3 stages: 189,184 bytes and 712 B of spills; 64
heads on 8 warps put both warpgroups on the 64 key rows again (`warpsPerCTA = [8, 1]`).

A form is `block_h,block_k,num_warps,num_stages`. MLA's absorbed shape only (D = 576 over one
shared key row whose first 512 features are the value, k = 2048, bf16, causal random indices
as in experiments/bench_attention.py). Each form's output and log-sum-exp are checked against
the library's forward first (relative error printed), then timed alone on the same padded
operands: median of --reps after two warm-up calls. Writes <out>/mla_forward_key_major.json
(default runs/mla_forward_key_major/).
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
import numpy as np  # noqa: E402
from attention_parts import DV, TOPK, D, library_forward  # noqa: E402
from bench_attention import make_inputs, median_ms, rel_err, run_meta, save  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from pallas_kernels import sparse_attention as psa  # noqa: E402


def key_major_forward_kernel(idx_ref, q_ref, k_ref, o_ref, lse_ref, *, scale_log2, block_k, lay):
    """One query's block_h heads, key-major; refs as in the library's `_forward_kernel` with a
    shared value (q_ref [block_h, width], k_ref [S, width], o_ref [block_h, dv], lse_ref
    [block_h] f32 log2-sum-exp2)."""
    num_keys = k_ref.shape[0]
    precision = psa._precision(q_ref.dtype)
    # Right operands transposed once, before the loop (inside it, Triton stages them into
    # shared memory again at every step).
    q_main, q_tail = (None if x is None else x.T for x in psa._pieces(q_ref, None, lay))

    def body(j, carry):
        acc_t, m_prev, l_prev = carry  # [dv, heads] f32, [heads], [heads]
        rows, valid = psa._gather_block(idx_ref, j, block_k, num_keys)
        k_main, k_tail = psa._masked_pieces(k_ref, rows, valid, lay)
        s_t = psa._dot(k_main, q_main, precision=precision)  # [block_k, heads]
        if lay.d_tail:
            s_t = s_t + psa._dot(k_tail, q_tail, precision=precision)
        s_t = jnp.where(valid[:, None], s_t * scale_log2, psa._MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s_t, axis=0))
        p_t = jnp.where(valid[:, None], jnp.exp2(s_t - m_next[None, :]), 0.0)
        correction = jnp.exp2(m_prev - m_next)
        l_next = l_prev * correction + jnp.sum(p_t, axis=0)
        pv_t = psa._dot(k_main, p_t.astype(k_main.dtype), trans_a=True, precision=precision)
        return acc_t * correction[None, :] + pv_t, m_next, l_next

    heads = q_ref.shape[0]
    init = (
        jnp.zeros((lay.dv, heads), jnp.float32),
        jnp.full((heads,), psa._MASK_VALUE, jnp.float32),
        jnp.zeros((heads,), jnp.float32),
    )
    acc_t, m, total = lax.fori_loop(0, psa._live_blocks(idx_ref, block_k, num_keys), body, init)
    nonempty = total > 0.0
    safe = jnp.where(nonempty, total, 1.0)
    o_ref[...] = (acc_t / safe[None, :]).T.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log2(safe), -jnp.inf)


def key_major_forward(qg, kp, idxp, *, scale, lay, block_h, block_k, warps, stages, interpret):
    """qg [B,T,G,heads,width], kp [B,S,G,width], idxp [B,T,Kp] (Kp a multiple of block_k)
    -> o [B,T,G,heads,dv], lse [B,T,G,heads] f32."""
    B, T, G = qg.shape[:3]
    S, Kp = kp.shape[1], idxp.shape[-1]
    kernel = functools.partial(
        key_major_forward_kernel, scale_log2=scale * psa._LOG2E, block_k=block_k, lay=lay
    )
    return pl.pallas_call(
        kernel,
        grid=(T * (lay.heads // block_h), B, G),
        in_specs=psa._input_specs(lay, S, Kp, block_h=block_h),
        out_specs=[psa._per_head(lay, block_h, lay.dv), psa._per_head(lay, block_h)],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, G, lay.heads, lay.dv), qg.dtype),
            jax.ShapeDtypeStruct((B, T, G, lay.heads), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sparse_attn_fwd_key_major",
    )(idxp, qg, kp)


def finite_rel_err(got, want) -> float:
    """bench_attention's relative error over the entries where `want` is finite (lse is -inf
    on rows with no valid entry); inf where `got` is finite elsewhere or not finite there."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if (np.isfinite(got) != finite).any():
        return float("inf")
    return rel_err(np.where(finite, got, 0.0), np.where(finite, want, 0.0))


def run(T: int, H: int, forms: list[str], topk: int, reps: int, interpret: bool) -> list[dict]:
    q, kv, _, idx, _ = make_inputs(1, T, H, D, DV, topk, shared=True)
    library, (qg, kp, idxp), lay, cfg = library_forward(q, kv, idx, psa.BlockSizes(), interpret)
    scale = cfg.scale
    want_o, want_lse = library(qg, kp, idxp)
    records = [{"T": T, "H": H, "form": "library", "ms": median_ms(library, (qg, kp, idxp), reps)}]
    print(f"T={T} H={H} library forward {records[0]['ms']:8.2f} ms", flush=True)
    for form in forms:
        block_h, bk, warps, stages = (int(x) for x in form.split(","))
        record = {"T": T, "H": H, "form": form}
        try:
            if idxp.shape[-1] % bk:
                raise ValueError(f"k = {idxp.shape[-1]} padded is not a multiple of {bk}")
            fn = jax.jit(
                functools.partial(
                    key_major_forward,
                    scale=scale,
                    lay=lay,
                    block_h=block_h,
                    block_k=bk,
                    warps=warps,
                    stages=stages,
                    interpret=interpret,
                )
            )
            o, lse = fn(qg, kp, idxp)
            record["rel_err_out"] = finite_rel_err(o, want_o)
            record["rel_err_lse"] = finite_rel_err(lse, want_lse)
            record["ms"] = median_ms(fn, (qg, kp, idxp), reps)
            print(
                f"T={T} H={H} key-major {form:12s} {record['ms']:8.2f} ms  rel err out "
                f"{record['rel_err_out']:.1e} lse {record['rel_err_lse']:.1e}",
                flush=True,
            )
        except Exception as e:  # e.g. a form beyond shared memory
            record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"T={T} H={H} key-major {form:12s} error {record['error']}", flush=True)
        records.append(record)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument(
        "--forms",
        nargs="+",
        default=["16,64,4,4", "16,64,4,2", "32,64,4,3"],
        help="block_h,block_k,num_warps,num_stages of each key-major form",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--interpret", action="store_true", help="CPU check (times mean nothing)")
    p.add_argument("--out", default=os.path.join("runs", "mla_forward_key_major"))
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    records = []
    for T in args.seq:
        for H in args.heads:
            records += run(T, H, args.forms, args.topk, args.reps, args.interpret)
    print("wrote", save(args.out, run_meta(), records, "mla_forward_key_major"))


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing
    main()
