"""MLA's sparse-attention forward on Hopper as a warp-specialized Pallas Mosaic GPU kernel.

The absorbed form of DSA's attention (GLM-5.1, DeepSeek-V3.2): G = 1, one shared key row of D
features per position (576 = 512 latent + 64 rope) whose first 512 features are the value. The
Pallas-Triton forward (`sparse_attention._forward_kernel`) waits on its gathers: one program an
SM, and Triton's software pipeline does not overlap a step's gathered rows with the matmuls
(docs/performance.md, "MLA's absorbed form"). Here a program splits into a producer and two
consumers, so the gathers of the next slot blocks fly while the tensor cores work.

Pallas Mosaic GPU has no indexed copy into shared memory on sm_90 (TMA's `gather4` is sm_100,
its CP_ASYNC copy takes no indices), so the producer issues per-thread 16-byte `cp.async`
copies of the selected rows itself (`plgpu.inline_mgpu`), to the addresses of the swizzled
tiles `wgmma` reads.

One program = 64 heads of one query; three warpgroups:
  producer (warpgroup 2): for each slot block of `_BLOCK_K` keys, every thread copies its
    16-byte chunks of the gathered rows into a stage's [block_k, D] tile (8-row tiles, 64-byte
    swizzle); a slot whose index is outside [0, S) is zero-filled by the copy itself and reads
    no key row. Once its copies have landed: a proxy fence (cp.async writes through the
    generic proxy, `wgmma` reads through the async proxy), then the stage's ready barrier.
  consumers (warpgroups 0 and 1): each computes the whole score tile S = q K^T [64, block_k]
    (the duplicate is 53% more tensor work, yet scoring half each and exchanging the softmax
    statistics through shared memory gained nothing: docs/performance.md) and
    its own half of the output, acc[:, 256 w : 256 (w + 1)] += P V_w with V the tile's first
    512 columns, then frees the stage. Online softmax in f32 with base-2 exponentials, invalid
    slots' probabilities exactly 0, as the Triton forward.
q (64 x D) and the query's indices stay in shared memory for the program; the output tile
reuses the stages' memory after both consumers' last matmuls.

H100, T = S = 32K, k = 2048, D = 576: 31.06 ms (291.5 TFLOP/s) at H = 64 and 60.98 at H = 128,
against 48.71 and 97.84 for the Triton forward in the same run, each checked against the f32
reference first (experiments/results/bench_attention/h100_mla_mosaic_forward_76ff2c2.json).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

HEADS = 64  # heads a program: the rows of every matmul (one warpgroup's `wgmma` M)
VALUE_DIM = 512  # the value's width: two consumer halves of 256 (a `wgmma` N of at most 256)
_HALF = VALUE_DIM // 2
_BLOCK_K = 32  # keys per slot block (the value matmul's K: a multiple of half the swizzle)
_SWIZZLE = 64  # bytes; tiles of 8 rows x 32 bf16 columns
_CHUNK = 8  # bf16 elements of one 16-byte cp.async
_MAX_STAGES = 3  # 3: 29.76 ms against 35.79 at 2 (above); 4 exceed shared memory at D = 576
# The dQ kernel: two key stages beside q and dO (three exceed shared memory at D = 576), and
# each consumer's half of dQ's columns in f32 registers (144 a thread at D = 576).
_DQ_STAGES = 2
_DQ_MAX_WIDTH = 576
# Shared memory a program may take (232,448 bytes on sm_90), less what Mosaic GPU adds for
# alignment and barriers (2,872 bytes in a probe that asked for 229,632 of data).
_SHARED_BYTES = 232_448 - 4_096


def unsupported_reason(
    k_shape, dtype, num_indices: int, shared_value_dim, kernel: str = "forward"
) -> str | None:
    """None when `kernel` ("forward" or "dq") can run on the default device; else why not.

    k_shape [B, S, G, D] (any number of heads runs: they are padded to 64), dtype the
    operands' common dtype, num_indices K, shared_value_dim the value's width when it is the
    key's leading features (None for a separate value)."""
    *_, G, D = k_shape
    if shared_value_dim != VALUE_DIM:
        return f"the value must be the key's leading {VALUE_DIM} features (value_dim={VALUE_DIM})"
    if G != 1:
        return f"one key/value group (G = 1), got G = {G}"
    if D % 64 or D < VALUE_DIM:
        return f"D a multiple of 64 and >= {VALUE_DIM}, got {D}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"bf16 or f16 operands, got {jnp.dtype(dtype).name}"
    if _padded_indices(num_indices) // _BLOCK_K > 256:  # one TMA copy: <= 256 rows a dimension
        return f"at most {256 * _BLOCK_K} indices a query, got {num_indices}"
    if kernel == "forward" and _stages(D, num_indices) < 2:
        return f"{num_indices} indices and D = {D} leave shared memory for fewer than 2 stages"
    if kernel == "dq":
        if D > _DQ_MAX_WIDTH:
            return f"D <= {_DQ_MAX_WIDTH} (a consumer's dQ columns in registers), got {D}"
        if _dq_shared_bytes(D, num_indices) > _SHARED_BYTES:
            return f"{num_indices} indices at D = {D} do not fit the dQ kernel's shared memory"
    device = jax.devices()[0]
    if device.platform != "gpu" or not str(getattr(device, "compute_capability", "")).startswith(
        "9."
    ):
        return f"a Hopper GPU (sm_90), got {device.device_kind}"
    return None


def _padded_indices(num_indices: int) -> int:
    return -(-num_indices // _BLOCK_K) * _BLOCK_K


def _stages(D: int, num_indices: int) -> int:
    """Key stages that fit beside q and the indices in a program's shared memory."""
    resident = HEADS * D * 2 + _padded_indices(num_indices) * 4 + HEADS * 4
    tile = _BLOCK_K * D * 2
    return min(_MAX_STAGES, (_SHARED_BYTES - resident) // tile)


def _dq_shared_bytes(D: int, num_indices: int) -> int:
    """The dQ kernel's shared memory: q and dO, two key stages (the output tile reuses them),
    the indices and the rows' log-sum-exp and delta."""
    return (
        HEADS * (D + VALUE_DIM) * 2
        + _DQ_STAGES * _BLOCK_K * D * 2
        + _padded_indices(num_indices) * 4
        + 2 * HEADS * 4
    )


def _gather_rows(keys, ids, dst, *, num_keys: int, width: int):
    """One producer thread's share of a slot block: 16-byte cp.async copies of the rows `ids`
    [n] (n a multiple of 16) of `keys` [S, width] (GMEM) into `dst` [n, width] (SMEM, 8-row
    tiles of `_SWIZZLE` bytes a row, swizzled), zero-filled where the index is outside [0, S);
    one commit group.

    Thread `tid` of the warpgroup copies rows 16 r + tid // 8 and, of each row, the 16-byte
    chunks c = tid % 8 + 8 i: eight neighbouring threads read 128 contiguous bytes of a row."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = _SWIZZLE
    chunks_per_tile_row = swizzle // 16
    tiles = width * 2 // swizzle  # column tiles of one key row
    tile_bytes = 8 * swizzle
    tiles_per_step = 8 // chunks_per_tile_row  # column tiles that eight chunks span
    rows = ids.shape[0]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_tile_transforms()))
    )
    def issue(ctx, keys_ref, ids_ref, dst_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)

        def c32(v):
            return arith.constant(i32, v)

        tid = arith.remui(mu.thread_idx(), c32(128))
        lane = arith.remui(tid, c32(8))
        group = arith.divui(tid, c32(8))  # rows advance by 16: row % 8 = group % 8
        row_in_tile = arith.remui(group, c32(8))
        # The swizzle XORs a 16-byte chunk's index within its tile row with the index of the
        # 128-byte group holding that row, modulo the chunks a tile row has (Mosaic GPU's
        # `transfer_tiled`): (row // 2) % 4 at 64 bytes.
        xor = arith.remui(
            arith.divui(arith.muli(row_in_tile, c32(chunks_per_tile_row)), c32(8)),
            c32(chunks_per_tile_row),
        )
        chunk_in_row = arith.remui(lane, c32(chunks_per_tile_row))
        lane_bytes = arith.addi(
            arith.addi(
                arith.muli(row_in_tile, c32(swizzle)),
                arith.muli(arith.xori(chunk_in_row, xor), c32(16)),
            ),
            arith.muli(arith.divui(lane, c32(chunks_per_tile_row)), c32(tile_bytes)),
        )
        dst_base = mu.memref_ptr(dst_ref)  # shared::cta
        src_base = llvm.addrspacecast(
            llvm.PointerType.get(address_space=1), mu.memref_ptr(keys_ref)
        )
        for r in range(rows // 16):
            row = arith.addi(c32(16 * r), group)
            key = memref.load(ids_ref, [arith.index_cast(ir.IndexType.get(), row)])
            valid = arith.andi(
                arith.cmpi(arith.CmpIPredicate.sge, key, c32(0)),
                arith.cmpi(arith.CmpIPredicate.slt, key, c32(num_keys)),
            )
            # An invalid slot copies 0 bytes from row 0 and zero-fills its 16.
            src_size = arith.select(valid, c32(16), c32(0))
            src_row = arith.addi(
                arith.muli(
                    arith.extui(i64, arith.select(valid, key, c32(0))), arith.constant(i64, width)
                ),
                arith.extui(i64, arith.muli(lane, c32(_CHUNK))),
            )
            row_bytes = arith.addi(
                arith.muli(arith.divui(row, c32(8)), c32(tiles * tile_bytes)), lane_bytes
            )
            for i in range(width // (8 * _CHUNK)):
                src = mu.getelementptr(
                    src_base,
                    [arith.addi(src_row, arith.constant(i64, i * 8 * _CHUNK))],
                    ir.BF16Type.get(),
                )
                dst = mu.getelementptr(
                    dst_base,
                    [arith.addi(row_bytes, c32(i * tiles_per_step * tile_bytes))],
                    ir.IntegerType.get_signless(8),
                )
                nvvm.cp_async_shared_global(
                    dst, src, 16, nvvm.LoadCacheModifierKind.CG, cp_size=src_size
                )
        nvvm.cp_async_commit_group()

    issue(keys, ids, dst)


def _wait_copies(pending: int):
    """Wait until at most `pending` of this thread's cp.async groups are in flight."""
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)

    wait()


def _tile_transforms():
    """8-row tiles of `_SWIZZLE` bytes a row (bf16 / f16), swizzled as `wgmma` reads them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))


def _load(ref, layout):
    """`plgpu.load` of a whole ref into `layout` (jax 0.11 dropped the index argument)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    try:
        return plgpu.load(ref, layout=layout)
    except TypeError:  # jax 0.10: load(src, idx, *, layout)
        return plgpu.load(ref, (), layout=layout)


def _produce(keys, ids_smem, stages_smem, ready, free, *, stages: int):
    """The producer warpgroup's loop, run after `plgpu.set_max_registers(40, "decrease")` once
    the query's indices are in shared memory. For each slot block j of `ids_smem` [blocks, n]
    int32: wait until its stage of `stages_smem` [stages, n, width] is free (`free`, from the
    second use of a stage on), gather its rows of `keys` [S, width] into it (`_gather_rows`);
    once the previous block's copies have landed, fence them for `wgmma` and arrive on that
    block's `ready` barrier. Gathers run up to `stages` blocks ahead of the consumers."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    blocks = ids_smem.shape[0]
    num_keys, width = keys.shape

    def step(j, carry):
        slot = lax.rem(j, stages)

        @pl.when(j < blocks)
        def _issue():
            pl.when(j >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
            _gather_rows(keys, ids_smem.at[j], stages_smem.at[slot], num_keys=num_keys, width=width)

        @pl.when(j >= 1)
        def _publish():  # slot block j - 1 has landed: hand it to the consumers
            pl.when(j < blocks)(lambda: _wait_copies(1))
            pl.when(j == blocks)(lambda: _wait_copies(0))
            plgpu.commit_smem()  # proxy fence (cp.async writes, wgmma reads), warpgroup barrier
            plgpu.barrier_arrive(ready.at[lax.rem(j - 1, stages)])

        return carry

    lax.fori_loop(0, blocks + 1, step, None)


def _program_ids(k_ref, head_blocks: int, T: int, S: int):
    """Inside a kernel of `_launch` over `_program_operands`' programs: (program, warpgroup,
    query row b T + t, the keys [S, D] of that row's batch in `k_ref` [B S, D])."""
    from jax.experimental import pallas as pl

    prog = lax.axis_index("p")
    bt = prog // head_blocks
    return prog, lax.axis_index("wg"), bt, k_ref.at[pl.ds((bt // T) * S, S)]


def _run_warpgroups(consumer, inputs_bar, keys, ids_smem, stages_smem, ready, free, stages):
    """Inside a kernel of `_launch`: warpgroups 0 and 1 run `consumer(0)` and `consumer(1)`
    (each with up to 232 registers a thread), warpgroup 2 the producer (`_produce`, 40
    registers) once `inputs_bar` says the indices are in shared memory."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wg = lax.axis_index("wg")

    def run_consumer(half: int):
        plgpu.set_max_registers(232, action="increase")
        consumer(half)

    pl.when(wg == 0)(lambda: run_consumer(0))
    pl.when(wg == 1)(lambda: run_consumer(1))

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.barrier_wait(inputs_bar)
        _produce(keys, ids_smem, stages_smem, ready, free, stages=stages)


def _launch(kernel, out_type, programs: int):
    """`kernel` over a grid of `programs` (axis "p"), three warpgroups a program (axis "wg")."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(programs,),
        grid_names=("p",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _store_output(acc, m, total, half: int, o_smem, lse_smem, o_ref, lse_ref, prog, done):
    """A consumer's epilogue: once both consumers have arrived on `done` (the output tile
    `o_smem` [2, 64, 256] reuses the key stages' memory), normalize its accumulator `acc`
    [64, 256] f32 by the softmax denominators `total` [64] and copy it to columns
    [256 half, 256 half + 256) of `o_ref` [P, 64, 512] at program `prog`; consumer 0 also
    writes the base-2 log-sum-exp m + log2(total) [64] to `lse_ref` [P, 64]. Rows without a
    valid entry (total = 0) get 0 and -inf."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)
    nonempty = total > 0.0
    denom = jnp.where(nonempty, total, 1.0)
    o = acc / lax.broadcast_in_dim(denom, acc.shape, [0])
    o_smem.at[half][...] = o.astype(o_smem.dtype)
    if half == 0:
        lse_smem[...] = jnp.where(nonempty, m + jnp.log2(denom), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[half], o_ref.at[prog, :, pl.ds(half * _HALF, _HALF)])
    if half == 0:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[prog])
    plgpu.wait_smem_to_gmem(0)


def forward(q, k, idx, *, scale_log2: float, mask_value: float):
    """q [B, T, H, D], k [B, S, 1, D] (the value is k[..., :512]), idx [B, T, K] int, and the
    logit scale times log2(e) -> (o [B, T, H, 512] in q's dtype, lse [B, T, H] f32: the base-2
    log-sum-exp of the base-2 logits, -inf with o = 0 on rows without a valid entry). Entries
    of idx outside [0, S) are ignored and never read. `unsupported_reason` must be None for
    these operands."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, T, H, D = q.shape
    S = k.shape[1]
    qp, keys, ids, head_blocks = _program_operands(q, k, idx)
    dtype, programs, blocks = qp.dtype, qp.shape[0], ids.shape[1]
    stages = _stages(D, idx.shape[-1])
    tiles = _tile_transforms()
    out_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(q_ref, k_ref, ids_ref, o_ref, lse_ref):
        def body(q_smem, stage_or_out, ids_smem, lse_smem, q_bar, ids_bar, ready, free, done):
            k_smem, o_smem = stage_or_out  # the key stages; after the last step, the output
            prog, wg, bt, batch_keys = _program_ids(k_ref, head_blocks, T, S)

            @pl.when(wg == 0)
            def _load_inputs():
                plgpu.copy_gmem_to_smem(q_ref.at[prog], q_smem, q_bar)
                plgpu.copy_gmem_to_smem(ids_ref.at[bt], ids_smem, ids_bar)

            def consumer(half: int):
                plgpu.barrier_wait(q_bar)
                plgpu.barrier_wait(ids_bar)
                row_layout = plgpu.Layout.WGMMA.reduce(1)
                acc = plgpu.layout_cast(jnp.zeros((HEADS, _HALF), jnp.float32), plgpu.Layout.WGMMA)
                m = plgpu.layout_cast(jnp.full((HEADS,), mask_value, jnp.float32), row_layout)
                total = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), row_layout)

                def step(j, carry):
                    acc, m, total = carry
                    slot = lax.rem(j, stages)
                    plgpu.barrier_wait(ready.at[slot])

                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                        return acc_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((HEADS, _BLOCK_K), jnp.float32))
                    key = _load(ids_smem.at[j], plgpu.Layout.WGMMA.reduce(0))
                    valid = lax.broadcast_in_dim((key >= 0) & (key < S), s.shape, [1])
                    s = jnp.where(valid, s * scale_log2, mask_value)
                    m_next = jnp.maximum(m, s.max(axis=1))
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
                    p = jnp.where(valid, p, 0.0)  # also while every slot so far was invalid
                    correction = jnp.exp2(m - m_next)
                    total = total * correction + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])

                    def values(acc_ref):
                        v = k_smem.at[slot, :, pl.ds(half * _HALF, _HALF)]
                        plgpu.wgmma(acc_ref, p.astype(dtype), v)

                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(free.at[slot])
                    return acc, m_next, total

                acc, m, total = lax.fori_loop(0, blocks, step, (acc, m, total))
                _store_output(acc, m, total, half, o_smem, lse_smem, o_ref, lse_ref, prog, done)

            _run_warpgroups(consumer, ids_bar, batch_keys, ids_smem, k_smem, ready, free, stages)

        pl.run_scoped(
            body,
            plgpu.SMEM((HEADS, D), dtype, transforms=tiles),
            plgpu.RefUnion(
                plgpu.SMEM((stages, _BLOCK_K, D), dtype, transforms=tiles),
                plgpu.SMEM((2, HEADS, _HALF), dtype, transforms=out_tiles),
            ),
            plgpu.SMEM((blocks, _BLOCK_K), jnp.int32),
            plgpu.SMEM((HEADS,), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    out_type = (
        jax.ShapeDtypeStruct((programs, HEADS, VALUE_DIM), dtype),
        jax.ShapeDtypeStruct((programs, HEADS), jnp.float32),
    )
    o, lse = _launch(kernel, out_type, programs)(qp, keys, ids)
    o = o.reshape(B, T, -1, VALUE_DIM)[:, :, :H].astype(q.dtype)
    return o, lse.reshape(B, T, -1)[:, :, :H]


def _pad_heads(x, fill=0.0):
    """x [B, T, H, ...] -> [B * T * ceil(H / 64), 64, ...]: one row of programs per 64 heads,
    the added heads filled with `fill` (their results are dropped)."""
    B, T, H = x.shape[:3]
    heads = -(-H // HEADS) * HEADS
    if heads != H:
        pad = [(0, 0)] * x.ndim
        pad[2] = (0, heads - H)
        x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape(B * T * (heads // HEADS), HEADS, *x.shape[3:])


def _program_operands(q, k, idx):
    """q [B, T, H, D], k [B, S, 1, D], idx [B, T, K] -> the kernels' q [P, 64, D] (P = B T
    ceil(H / 64) programs, zero heads added) and keys [B S, D] (the batches' rows one after
    another) in the operands' common dtype, ids [B T, blocks, 32] int32 (padded with -1 to
    whole slot blocks), and the programs a query row has, ceil(H / 64)."""
    B, S, _, D = k.shape
    K = idx.shape[-1]
    Kp = _padded_indices(K)
    ids = idx.astype(jnp.int32)
    if Kp != K:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, Kp - K)), constant_values=-1)
    ids = ids.reshape(-1, Kp // _BLOCK_K, _BLOCK_K)
    dtype = jnp.result_type(q.dtype, k.dtype)
    qp = _pad_heads(q.astype(dtype))
    return qp, k.astype(dtype).reshape(B * S, D), ids, qp.shape[0] // ids.shape[0]


def dq(q, k, idx, lse, delta, d_out, *, scale: float, scale_log2: float):
    """The backward's query gradient. q [B, T, H, D], k [B, S, 1, D] (the value is
    k[..., :512]), idx [B, T, K] int, lse [B, T, H] f32 (the forward's base-2 log-sum-exp of
    the base-2 logits, -inf on rows without a valid entry), delta [B, T, H] f32 (sum_j P_j dP_j,
    the delta kernel's), d_out [B, T, H, 512], the logit scale and scale_log2 = scale log2(e)
    -> dQ = scale dS K [B, T, H, D] in q's dtype, with dS = P (dP - delta),
    P = exp2(scale_log2 q k - lse) and dP = dO v^T over the valid entries.
    `unsupported_reason(..., kernel="dq")` must be None for these operands.

    One program = 64 heads of one query, as the forward's: the producer warpgroup gathers each
    32-key slot block (`_produce`), and each of the two consumers computes the block's whole S
    and dP ([64, 32] each; the duplicate is 66% more tensor work) and its half of dQ's columns,
    D / 2 as a 256-wide and a (D / 2 - 256)-wide `wgmma` into f32 registers. q, dO, the
    indices and the rows' statistics stay in shared memory; the output tile reuses the stages'.
    H100, T = S = 32K, k = 2048, D = 576: 66.63 ms at H = 64 and 132.11 at 128, against 79.68
    and 153.83 for the Triton dQ kernel alone (the same kernel as a lab probe, 76ff2c2)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, T, H, D = q.shape
    S = k.shape[1]
    qp, keys, ids, head_blocks = _program_operands(q, k, idx)
    dtype, programs, blocks = qp.dtype, qp.shape[0], ids.shape[1]
    # Added heads: q = 0 and dO = 0 with lse = 0 and delta = 0 give dS = 0, never NaN.
    stats = jnp.stack([_pad_heads(lse), _pad_heads(delta)], axis=1)  # [P, 2, 64] f32
    do = _pad_heads(d_out.astype(dtype))
    cols = D // 2  # dQ columns a consumer owns
    tail = cols - _HALF  # 0 or 32: the second matmul's width
    tiles = _tile_transforms()
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, ids_ref, stats_ref, do_ref, dq_ref):
        def body(q_smem, do_smem, stage_or_out, ids_smem, stats_smem, in_bar, ready, free, done):
            k_smem, out_smem = stage_or_out
            prog, wg, bt, batch_keys = _program_ids(k_ref, head_blocks, T, S)

            @pl.when(wg == 0)
            def _load_inputs():
                plgpu.copy_gmem_to_smem(q_ref.at[prog], q_smem, in_bar)
                plgpu.copy_gmem_to_smem(do_ref.at[prog], do_smem, in_bar)
                plgpu.copy_gmem_to_smem(ids_ref.at[bt], ids_smem, in_bar)
                plgpu.copy_gmem_to_smem(stats_ref.at[prog], stats_smem, in_bar)

            def consumer(half: int):
                plgpu.barrier_wait(in_bar)
                lse = _load(stats_smem.at[0], row_layout)
                delta = _load(stats_smem.at[1], row_layout)
                col0 = half * cols
                widths = (_HALF, tail) if tail else (_HALF,)
                accs = tuple(
                    plgpu.layout_cast(jnp.zeros((HEADS, w), jnp.float32), plgpu.Layout.WGMMA)
                    for w in widths
                )

                def step(j, accs):
                    slot = lax.rem(j, _DQ_STAGES)
                    plgpu.barrier_wait(ready.at[slot])

                    def scores(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
                        plgpu.wgmma(dp_ref, do_smem, k_smem.at[slot, :, pl.ds(0, VALUE_DIM)].T)
                        return s_ref[...], dp_ref[...]

                    acc_type = plgpu.ACC((HEADS, _BLOCK_K), jnp.float32)
                    s, dp = pl.run_scoped(scores, acc_type, acc_type)
                    key = _load(ids_smem.at[j], plgpu.Layout.WGMMA.reduce(0))
                    valid = lax.broadcast_in_dim((key >= 0) & (key < S), s.shape, [1])
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(lse, s.shape, [0]))
                    p = jnp.where(valid, p, 0.0)  # also where lse = -inf (no valid entry)
                    ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
                    ds = ds.astype(dtype)

                    def grads(acc_refs):
                        for n, acc_ref in enumerate(acc_refs):
                            window = pl.ds(col0 + n * _HALF, widths[n])
                            plgpu.wgmma(acc_ref, ds, k_smem.at[slot, :, window])

                    accs = pl.run_state(grads)(tuple(plgpu.ACC.init(a) for a in accs))
                    plgpu.barrier_arrive(free.at[slot])
                    return accs

                accs = lax.fori_loop(0, blocks, step, accs)
                plgpu.barrier_arrive(done)  # the output tile reuses the stages' memory
                plgpu.barrier_wait(done)
                for n, acc in enumerate(accs):
                    window = pl.ds(n * _HALF, widths[n])
                    out_smem.at[half, :, window][...] = (acc * scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[half], dq_ref.at[prog, :, pl.ds(col0, cols)])
                plgpu.wait_smem_to_gmem(0)

            _run_warpgroups(consumer, in_bar, batch_keys, ids_smem, k_smem, ready, free, _DQ_STAGES)

        pl.run_scoped(
            body,
            plgpu.SMEM((HEADS, D), dtype, transforms=tiles),
            plgpu.SMEM((HEADS, VALUE_DIM), dtype, transforms=tiles),
            plgpu.RefUnion(
                plgpu.SMEM((_DQ_STAGES, _BLOCK_K, D), dtype, transforms=tiles),
                plgpu.SMEM((2, HEADS, cols), dtype, transforms=tiles),
            ),
            plgpu.SMEM((blocks, _BLOCK_K), jnp.int32),
            plgpu.SMEM((2, HEADS), jnp.float32),
            plgpu.Barrier(num_arrivals=4),
            plgpu.Barrier(num_arrivals=1, num_barriers=_DQ_STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=_DQ_STAGES),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    out_type = jax.ShapeDtypeStruct((programs, HEADS, D), dtype)
    out = _launch(kernel, out_type, programs)(qp, keys, ids, stats, do)
    return out.reshape(B, T, -1, D)[:, :, :H].astype(q.dtype)
