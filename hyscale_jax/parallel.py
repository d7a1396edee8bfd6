"""Data + sequence (context) parallel HyScale with JAX's own SPMD (`jax.jit`, `NamedSharding`,
`jax.shard_map`): no runtime of our own.

Mesh: two axes, `"data"` (batch) and `"seq"` (sequence), from `make_mesh(data=..., seq=...)`.
`hyscale_attention(..., mesh=mesh)` returns exactly what the single-device
`hs.hyscale_attention` returns, `(out, idx)`, index for index:

* batch over `"data"`; queries (q, q_idx, w) over `"seq"`; keys (k_idx, k, v) are sharded over
  `"seq"` on entry and **all-gathered** across `"seq"` inside `jax.shard_map` (under MQA they are
  small: S * (DI + 2 * G * D) per sequence against the queries' T * (HI * DI + H * D)). The
  all-gather's transpose is a reduce-scatter, so dk / dv come back summed over the shards that
  read each key: gradients equal the single-device ones up to f32 summation order.
* Each shard selects (HyTopK) and attends (sparse attention) on its own queries inside the
  shard_map, so Pallas kernels run per device. The indices are tagged `INDICES_NAME` inside the
  shard_map body: `jax.checkpoint(policy=hs.replay_policy())` saves them per shard and the
  backward pass replays them (shard_map's remat rule applies the policy to its body).

`indexer_kl_loss(..., mesh=mesh)` is the sparse-stage indexer loss laid out the same way
(rows over "seq", k and k_idx gathered inside the shard_map, the Pallas kernels per device).

Causal offsets (exact). A shard's query chunk that starts at global query position t0 must see
key s iff s <= t0 + t + (S - T) (docs/design.md, "Causality"; t local). Two exact
ways, both giving the single-device answer index for index (same scores, same total order, same
tie rule):
  * `impl="xla"` (CPU/TPU/GPU): `hytopk_xla(..., diagonal=t0 + S - T)`, a traced scalar computed
    from `lax.axis_index("seq")`. The streaming loop skips key blocks past the chunk's last
    visible key, so a chunk costs only its causal share. One compiled program for all shards.
  * Pallas / interpret / reference: the kernel takes no offset, but end-aligned causality on a
    key *prefix* is the offset rule: selecting the chunk's queries against keys
    [0, t0 + len + S - T) with `causal=True` sees s <= t + (t0 + S - T). Prefix lengths must be
    static, so the shard picks its branch with `lax.switch(axis_index("seq"), ...)`: one branch
    per seq shard (compile time grows with the `"seq"` size; only one branch runs).
  With `causal=False` there is no offset: every shard selects over all keys.

Load balance (`load_balance="zigzag"`, the default for causal masks). With contiguous blocks,
shard r of n holds queries [r T/n, (r+1) T/n) and scores ~ (r + 1/2) T^2/n^2 pairs: the last
shard does ~(2n - 1)x the first one's work and everyone waits for it. Zig-zag (as in ring /
context-parallel attention, e.g. Megatron CP, Llama 3) cuts the sequence into 2n chunks and
gives shard r chunks r and 2n-1-r; every shard then scores (2n + 1) T^2 / (4 n^2) pairs
(exactly equal work up to the chunk diagonal). Cost: (a) T must be divisible by 2 * seq;
(b) with `layout="natural"` (the default: arrays in natural sequence order, as the
single-device op takes them) the queries are permuted into zig-zag order before the shard_map
and the output and indices permuted back after it. These are static chunk permutations that
XLA lowers to collective permutes: per layer about one exchange of q, q_idx, w (inputs) and
out, idx (outputs), ~half of each moves. A model that keeps its activations in zig-zag order
end to end passes `layout="zigzag"` and pays none of that (the gathered keys are un-permuted
locally, a copy of S * (DI + 2 G D) elements). `load_balance="contiguous"` skips the
permutation and keeps the causal imbalance.

Multi-host (one process per host, e.g. 64 hosts x 8 GPUs):

    import jax
    jax.distributed.initialize()   # before any other jax call; on SLURM, Open MPI,
                                   # Kubernetes and Cloud TPU the coordinator, process count
                                   # and id are auto-detected; otherwise pass
                                   # coordinator_address="host0:1234", num_processes=64,
                                   # process_id=<this host's rank>
    import hyscale_jax as hs
    mesh = hs.parallel.make_mesh(data=64, seq=8)   # jax.devices() is now the global list
    # every process runs the same program; put inputs on the mesh as global arrays with
    # hs.parallel.shard_batch (each process materializes only its own shards)

or, with the training script, run on every host (same command, same data: each process builds
the same global batch and keeps its own shards):

    python experiments/train.py --preset h200-128k --mesh data=64,seq=8 --distributed \\
        [--coordinator host0:1234 --num-processes 64 --process-id $RANK]

(the three bracketed flags only where the cluster is not auto-detected). Checkpoints are
written by Orbax collectively from all processes, so --out must be a shared filesystem.
Put "seq" inside a host (the key all-gather and its reduce-scatter run every layer: NVLink)
and "data" across hosts (one gradient all-reduce per step): the mesh is [data, seq] row-major
over `jax.devices()` (process-major), so with seq <= GPUs per host each "seq" group is one
host's GPUs.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hyscale_jax import _checks
from hyscale_jax import indexer_loss as _indexer_loss
from hyscale_jax import selection as _selection
from hyscale_jax.layer import attend_selected

DATA, SEQ = "data", "seq"
AXES = (DATA, SEQ)
LOAD_BALANCES = ("zigzag", "contiguous")
LAYOUTS = ("natural", "zigzag")


# ----------------------------------------------------------------------------- compatibility


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` (jax >= 0.7) or `jax.experimental.shard_map.shard_map`, with the
    replication / varying-axes check off (Pallas calls have no such rule)."""
    if hasattr(jax, "shard_map"):
        fn = jax.shard_map
        check = "check_vma" if "check_vma" in inspect.signature(fn).parameters else "check_rep"
    else:  # pragma: no cover (older jax)
        from jax.experimental.shard_map import shard_map as fn

        check = "check_rep"
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check: False})


def _auto_axis_types(n: int):
    axis_type = getattr(jax.sharding, "AxisType", None)
    return None if axis_type is None else (axis_type.Auto,) * n


# ----------------------------------------------------------------------------- meshes


def make_mesh(data: int | None = None, seq: int | None = None, devices=None) -> Mesh:
    """A 2-D mesh with axes ("data", "seq"): batch over "data", sequence over "seq".

    data, seq: axis sizes; one may be None (inferred from the device count); both None puts
      every device on "data". data * seq must equal the number of devices.
    devices: the devices to use (default `jax.devices()`, all processes' devices).
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    for name, value in (("data", data), ("seq", seq)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"make_mesh: {name} must be a positive int or None; got {value!r}")
    if data is None and seq is None:
        data, seq = n, 1
    elif data is None or seq is None:
        known = seq if data is None else data
        if n % known:
            raise ValueError(
                f"make_mesh(data={data}, seq={seq}): {n} devices do not factor "
                f"into {known} x something"
            )
        data, seq = (n // known, seq) if data is None else (data, n // known)
    if data * seq != n:
        raise ValueError(
            f"make_mesh(data={data}, seq={seq}) needs data * seq == the number of "
            f"devices; got {data} * {seq} = {data * seq} for {n} devices "
            f"(CPU tests: XLA_FLAGS="
            f"--xla_force_host_platform_device_count={data * seq})"
        )
    types = _auto_axis_types(2)
    kw = {} if types is None else {"axis_types": types}
    if devices is None:
        return jax.make_mesh((data, seq), AXES, **kw)
    return Mesh(np.asarray(devs, dtype=object).reshape(data, seq), AXES, **kw)


def parse_mesh(spec: str) -> dict[str, int]:
    """ "data=2,seq=4" -> {"data": 2, "seq": 4} (the `--mesh` flag)."""
    out = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq or name not in AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"mesh spec {spec!r}: expected 'data=N,seq=M' with positive N, M; bad part {part!r}"
            )
        out[name] = int(value)
    return out


def check_mesh(mesh) -> tuple[int, int]:
    """(data size, seq size) of `mesh`; ValueError when it is not a Mesh with both axes."""
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh with axes {AXES} (see "
            f"hs.parallel.make_mesh); got {type(mesh).__name__}"
        )
    missing = [a for a in AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh must have axes named {AXES} (hs.parallel.make_mesh builds one); "
            f"got axis names {tuple(mesh.axis_names)}, missing {tuple(missing)}"
        )
    return mesh.shape[DATA], mesh.shape[SEQ]


def activation_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """[B, T, ...] activations: batch over "data", sequence over "seq"."""
    return NamedSharding(mesh, P(DATA, SEQ, *([None] * (ndim - 2))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_batch(batch, mesh: Mesh):
    """Host arrays [B, ...] (the same global batch on every process) -> global jax arrays with
    the batch over "data". Works multi-host: each process only materializes its own shards."""

    def put(x):
        x = np.asarray(x)
        sharding = NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1))) if x.ndim else P())
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, batch)


# ----------------------------------------------------------------------------- zig-zag order


def _zigzag_chunk(x, n: int, axis: int):
    """x with `axis` moved first, and the chunk length L / (2n); checks divisibility."""
    L = x.shape[axis]
    if L % (2 * n):
        raise ValueError(
            f"zig-zag order needs the sequence length divisible by 2 * seq; got {L=} seq={n}"
        )
    return jnp.moveaxis(x, axis, 0), L // (2 * n)


def to_zigzag(x, n: int, axis: int = 1):
    """Natural -> zig-zag order along `axis`: 2n chunks, shard r holds chunks r and 2n-1-r.

    Sharding the result contiguously over n devices gives the balanced causal split.
    """
    if n == 1:
        return x
    x, c = _zigzag_chunk(x, n, axis)
    rest = x.shape[1:]
    halves = x.reshape(2, n, c, *rest)
    z = jnp.stack([halves[0], halves[1][::-1]], axis=1)  # [n, 2, c, ...]
    return jnp.moveaxis(z.reshape(2 * n * c, *rest), 0, axis)


def from_zigzag(x, n: int, axis: int = 1):
    """Inverse of `to_zigzag`."""
    if n == 1:
        return x
    x, c = _zigzag_chunk(x, n, axis)
    rest = x.shape[1:]
    pairs = x.reshape(n, 2, c, *rest)
    z = jnp.stack([pairs[:, 0], pairs[::-1, 1]], axis=0)  # [2, n, c, ...]
    return jnp.moveaxis(z.reshape(2 * n * c, *rest), 0, axis)


def zigzag_positions(L: int, n: int) -> np.ndarray:
    """int32 [L]: the natural position held at each slot of the zig-zag order."""
    return np.asarray(to_zigzag(np.arange(L, dtype=np.int32)[None], n)[0])


# ----------------------------------------------------------------------------- the layer op


def _chunk_starts(r, n: int, T: int, zigzag: bool):
    """Global start positions (and the length) of shard r's query chunks, in local order."""
    if zigzag:
        c = T // (2 * n)
        return [r * c, (2 * n - 1 - r) * c], c
    return [r * (T // n)], T // n


def _select_local(q_idx, k_idx, w, *, topk, causal, impl, resolved, n_seq, T, zigzag, order):
    """This shard's exact selection: local queries [B, T_l, ...], all keys [B, S, DI]."""
    S = k_idx.shape[1]
    if not causal or n_seq == 1:  # no offset: the single-device call is the answer
        return _selection.hytopk(q_idx, k_idx, w, k=topk, causal=causal, impl=impl, order=order)

    def chunks(starts, length):
        return [(i * length, start) for i, start in enumerate(starts)]

    r = lax.axis_index(SEQ)
    if resolved == "xla":  # one program: the causal diagonal is a traced scalar
        starts, length = _chunk_starts(r, n_seq, T, zigzag)
        block_q = _checks.pick_block(None, _selection.DEFAULT_BLOCK_Q, length)
        block_k = _checks.pick_block(None, _selection.DEFAULT_BLOCK_K, S)
        parts = [
            _selection.hytopk_xla(
                lax.slice_in_dim(q_idx, lo, lo + length, axis=1),
                k_idx,
                lax.slice_in_dim(w, lo, lo + length, axis=1),
                k=min(topk, S),  # slots past S hold -1 (hs.hytopk pads them the same way)
                causal=True,
                block_q=block_q,
                block_k=block_k,
                diagonal=(start + (S - T)).astype(jnp.int32),
            )
            for lo, start in chunks(starts, length)
        ]
        idx = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        if order == "index":
            idx = _selection.in_key_order(idx)
        return _checks.pad_slots(idx, topk)

    def branch(shard: int):  # static offsets: end-aligned causality on a key prefix
        def run(q_idx, k_idx, w):
            starts, length = _chunk_starts(shard, n_seq, T, zigzag)
            parts = [
                _selection.hytopk(
                    lax.slice_in_dim(q_idx, lo, lo + length, axis=1),
                    k_idx[:, : start + length + (S - T)],
                    lax.slice_in_dim(w, lo, lo + length, axis=1),
                    k=topk,
                    causal=True,
                    impl=impl,
                    order=order,
                )
                for lo, start in chunks(starts, length)
            ]
            return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

        return run

    return lax.switch(r, [branch(s) for s in range(n_seq)], q_idx, k_idx, w)


def _local_attention(
    q,
    k,
    v,
    q_idx,
    k_idx,
    w,
    *,
    topk,
    causal,
    scale,
    impl,
    resolved,
    n_seq,
    T,
    zigzag,
    keys_zigzag,
    return_lse,
    order,
):
    if n_seq > 1:
        k, v, k_idx = (lax.all_gather(x, SEQ, axis=1, tiled=True) for x in (k, v, k_idx))
        if keys_zigzag:  # local copy: the gathered keys back in natural order
            k, v, k_idx = (from_zigzag(x, n_seq) for x in (k, v, k_idx))
    sg = lax.stop_gradient
    idx = _select_local(
        sg(q_idx),
        sg(k_idx),
        sg(w),
        topk=topk,
        causal=causal,
        impl=impl,
        resolved=resolved,
        n_seq=n_seq,
        T=T,
        zigzag=zigzag,
        order=order,
    )
    # named per shard: replay works inside the shard_map
    return attend_selected(q, k, v, idx, scale=scale, impl=impl, return_lse=return_lse)


def hyscale_attention(
    q,
    k,
    v,
    q_idx,
    k_idx,
    w,
    *,
    topk: int,
    mesh: Mesh,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "auto",
    load_balance: str = "zigzag",
    layout: str = "natural",
    return_lse: bool = False,
    order: str = "score",
):
    """`hs.hyscale_attention` sharded over a ("data", "seq") mesh; same `(out, idx)`.

    Args:
      q: [B, T, H, D]; k: [B, S, G, D]; v: [B, S, G, Dv]; q_idx: [B, T, HI, DI];
        k_idx: [B, S, DI]; w: [B, T, HI] (global arrays; any input sharding, the op
        reshards to batch over "data" and sequence over "seq").
      topk, causal, scale, impl, order: as in `hs.hyscale_attention`.
      mesh: a Mesh with axes "data" and "seq" (`make_mesh`). B % data == 0, S % seq == 0,
        T % seq == 0 (T % (2 * seq) == 0 with zig-zag).
      load_balance: "zigzag" (causal only: shard r takes query chunks r and 2*seq-1-r of 2*seq,
        equal causal work per shard) or "contiguous" (plain blocks; late shards do more).
      layout: "natural": arrays in sequence order (as the single-device op). "zigzag": the
        caller's queries *and* keys are already in `to_zigzag` order along T / S (a model that
        stays in that order saves the per-layer permutations); out and idx rows come back in
        that order; idx values are natural key positions either way.
      return_lse: also return the attention's log-sum-exps, as `hs.hyscale_attention` does.
    Returns:
      (out [B, T, H, Dv], idx int32 [B, T, topk]), identical to the single-device op; with
      return_lse, (out, idx, lse f32 [B, T, H]), lse's rows in out's order.
    """
    topk = _checks.check_layer_args(q, k, v, q_idx, k_idx, w, topk, causal, impl)
    scale = _checks.static_scale(scale, q.shape[-1])
    _selection.check_order(order)
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance={load_balance!r} is not one of {LOAD_BALANCES}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    n_data, n_seq = check_mesh(mesh)
    B, T = q.shape[:2]
    S = k.shape[1]
    keys_zigzag = layout == "zigzag" and n_seq > 1
    zigzag = n_seq > 1 and (layout == "zigzag" or (causal and load_balance == "zigzag"))
    if B % n_data:
        raise ValueError(
            f"batch B={B} must be divisible by the mesh's data axis ({n_data}); "
            f"got q {tuple(q.shape)}"
        )
    q_div = 2 * n_seq if zigzag else n_seq
    why = " (zig-zag load balance: two chunks per shard)" if zigzag and n_seq > 1 else ""
    if T % q_div:
        raise ValueError(
            f"sequence length T={T} must be divisible by {q_div} (mesh seq="
            f"{n_seq}){why}; got q {tuple(q.shape)}"
        )
    k_div = 2 * n_seq if keys_zigzag else n_seq
    if S % k_div:
        raise ValueError(
            f"key sequence length S={S} must be divisible by {k_div} (mesh seq="
            f"{n_seq}); got k {tuple(k.shape)}"
        )
    resolved = _checks.resolve_impl(impl, _checks.SELECTION_IMPLS)
    permute = zigzag and layout == "natural"
    if permute:
        q, q_idx, w = (to_zigzag(x, n_seq) for x in (q, q_idx, w))
    body = functools.partial(
        _local_attention,
        topk=topk,
        causal=causal,
        scale=scale,
        impl=impl,
        resolved=resolved,
        n_seq=n_seq,
        T=T,
        zigzag=zigzag,
        keys_zigzag=keys_zigzag,
        return_lse=return_lse,
        order=order,
    )
    spec = P(DATA, SEQ)
    outputs = shard_map(
        body, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * (3 if return_lse else 2)
    )(q, k, v, q_idx, k_idx, w)
    if permute:
        outputs = tuple(from_zigzag(x, n_seq) for x in outputs)
    return outputs


# ----------------------------------------------------------------------------- indexer loss


def indexer_kl_loss(
    q,
    k,
    q_idx,
    k_idx,
    w,
    idx,
    *,
    mesh: Mesh,
    scale: float | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    attention_lse=None,
    save_target: bool = False,
):
    """`hs.indexer_kl_loss`'s sparse stage sharded over a ("data", "seq") mesh; same scalar.

    Rows (q, q_idx, w, idx) go batch over "data" and sequence over "seq"; the keys (k, k_idx)
    are all-gathered across "seq" inside `jax.shard_map`, so the Pallas kernels run per device
    and k_idx's gradient comes back reduce-scattered (summed over the shards that read each
    key). A row costs O(k) wherever it sits, so natural order is already balanced.

    Args:
      q: [B, T, H, D]; k: [B, S, G, D]; q_idx: [B, T, HI, DI]; k_idx: [B, S, DI]; w: [B, T, HI];
        idx: [B, T, K] selected keys (e.g. from `hyscale_attention`), global arrays.
      mesh: a Mesh with axes "data" and "seq"; B % data == 0, T % seq == 0, S % seq == 0.
      scale, impl, block_q, attention_lse, save_target: as in `hs.indexer_kl_loss` (sparse
        stage; attention_lse [B, T, H] sharded as the rows).
    Returns:
      f32 scalar: KL summed over queries, averaged over the batch (0 for an empty batch).
    """
    _indexer_loss.check_args(q, k, q_idx, k_idx, w, idx, False, impl, attention_lse, save_target)
    n_data, n_seq = check_mesh(mesh)
    B, T = q.shape[:2]
    S = k.shape[1]
    for name, size, axis, n in (
        ("batch B", B, "data", n_data),
        ("sequence length T", T, "seq", n_seq),
        ("key sequence length S", S, "seq", n_seq),
    ):
        if size % n:
            raise ValueError(
                f"{name}={size} must be divisible by the mesh's {axis} axis ({n}); "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
    scale = _checks.static_scale(scale, q.shape[-1])
    if B == 0:  # an empty batch: no loss, as in hs.indexer_kl_loss
        return jnp.zeros((), jnp.float32)

    def local_rows(q, k, q_idx, k_idx, w, idx, *lse):
        if n_seq > 1:
            k, k_idx = (lax.all_gather(x, SEQ, axis=1, tiled=True) for x in (k, k_idx))
        kw = dict(scale=scale, impl=impl, block_q=block_q, save_target=save_target)
        kw["attention_lse"] = lse[0] if lse else None
        return _indexer_loss.sparse_rows(q, k, q_idx, k_idx, w, idx, **kw)

    spec = P(DATA, SEQ)
    operands = (q, k, q_idx, k_idx, w, idx) + (() if attention_lse is None else (attention_lse,))
    rows = shard_map(local_rows, mesh=mesh, in_specs=(spec,) * len(operands), out_specs=spec)(
        *operands
    )
    return jnp.sum(rows) / B
