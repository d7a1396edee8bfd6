"""Sharded-versus-single-device checks on 8 simulated CPU devices.

XLA_FLAGS must be set before jax initializes, and other test files import jax first, so
tests/test_parallel.py runs this module in a fresh interpreter:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m tests.parallel_checks [name ...]

It prints one JSON line per check: {"name", "ok", "seconds", "error"}. With 8 or more devices
already present, test_parallel.py calls each check in-process instead.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

if __name__ == "__main__":  # before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import hyscale_jax as hs
from hyscale_jax import parallel

B, T, S, H, G, D, HI, DI, TOPK = 2, 32, 32, 4, 2, 8, 2, 4, 6
MESHES = ((1, 2), (2, 2), (1, 4), (2, 4))
RTOL, ATOL = 1e-5, 1e-6
NAMES = ("q", "k", "v", "q_idx", "k_idx", "w")


def inputs(seed=0, t=T, s=S):
    """Indexer inputs are small integers: scores are exact in f32, so every summation order
    gives the same selection (docs/design.md, "Tie rule") and many ties exercise the tie rule."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    ints = lambda *shape: jnp.asarray(rng.integers(-3, 4, size=shape), jnp.float32)  # noqa: E731
    return dict(
        q=normal(B, t, H, D),
        k=normal(B, s, G, D),
        v=normal(B, s, G, D),
        q_idx=ints(B, t, HI, DI),
        k_idx=ints(B, s, DI),
        w=ints(B, t, HI),
    )


def mesh_of(data, seq):
    return parallel.make_mesh(data=data, seq=seq, devices=jax.devices()[: data * seq])


def _loss(attention, ct, x):
    out, _ = attention(**x)
    return jnp.sum(out * ct)


@functools.lru_cache(maxsize=None)
def _single_device(causal):
    """The single-device reference of `compare`, jitted once per causal flag (the checks share
    its shapes): hs.hyscale_attention (impl="xla") of x, and the gradient of <out, ct> in x."""
    single = functools.partial(hs.hyscale_attention, topk=TOPK, causal=causal, impl="xla")
    return (
        jax.jit(lambda x: single(**x)),
        jax.jit(lambda ct, x: jax.grad(functools.partial(_loss, single, ct))(x)),
    )


def compare(x, mesh, *, grads=True, causal=True, **kw):
    """Sharded == single-device: indices exactly, outputs and gradients to f32 tolerance."""
    single, single_grad = _single_device(causal)
    sharded = functools.partial(
        parallel.hyscale_attention, topk=TOPK, mesh=mesh, causal=causal, **{"impl": "xla", **kw}
    )
    want_out, want_idx = single(x)
    got_out, got_idx = jax.jit(lambda x: sharded(**x))(x)
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    np.testing.assert_allclose(got_out, want_out, rtol=RTOL, atol=ATOL)
    if grads:
        ct = jnp.asarray(np.random.default_rng(9).normal(size=want_out.shape), jnp.float32)
        want = single_grad(ct, x)
        got = jax.jit(jax.grad(functools.partial(_loss, sharded, ct)))(x)
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
        for name in ("q_idx", "k_idx", "w"):  # the indexer learns only from its KL loss
            assert not np.asarray(got[name]).any(), name


# ----------------------------------------------------------------------------- checks


def _attention_check(data, seq):
    def check():
        compare(inputs(data * 10 + seq), mesh_of(data, seq))

    return check


def check_contiguous_and_end_aligned():
    # T < S (end-aligned queries), plain contiguous blocks.
    compare(inputs(1, t=16, s=32), mesh_of(2, 2), load_balance="contiguous")
    compare(inputs(2, t=16, s=32), mesh_of(1, 4))  # zig-zag with T < S


def check_noncausal():
    compare(inputs(3), mesh_of(2, 4), causal=False, grads=False)


def check_prefix_switch_path():
    """Non-xla impls select on static key prefixes under lax.switch (reference: cheap on CPU)."""
    for (data, seq), lb in (((2, 4), "zigzag"), ((1, 2), "contiguous")):
        compare(inputs(4), mesh_of(data, seq), impl="reference", load_balance=lb, grads=False)


def check_zigzag_layout():
    x = inputs(5)
    n = 4
    mesh = mesh_of(2, n)
    want_out, want_idx = hs.hyscale_attention(**x, topk=TOPK, impl="xla")
    zx = {name: parallel.to_zigzag(a, n) for name, a in x.items()}
    out, idx = jax.jit(
        lambda zx: parallel.hyscale_attention(
            **zx, topk=TOPK, mesh=mesh, impl="xla", layout="zigzag"
        )
    )(zx)
    np.testing.assert_array_equal(np.asarray(parallel.from_zigzag(idx, n)), want_idx)
    np.testing.assert_allclose(parallel.from_zigzag(out, n), want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(parallel.zigzag_positions(16, 2), np.r_[0:4, 12:16, 4:8, 8:12])


def check_selection_order():
    """order="index": each shard's selection in key-index order, the single-device op's rows
    exactly (the xla path's sort of each shard's zig-zag chunks, and the reference impl's
    static key prefixes), with the same outputs as the score order's to f32 tolerance."""
    x = inputs(6)
    want_out, want_idx = hs.hyscale_attention(**x, topk=TOPK, impl="xla", order="index")
    score_out, score_idx = hs.hyscale_attention(**x, topk=TOPK, impl="xla")
    np.testing.assert_array_equal(
        np.sort(np.where(want_idx < 0, S, want_idx), axis=-1),
        np.sort(np.where(score_idx < 0, S, score_idx), axis=-1),
    )
    np.testing.assert_allclose(want_out, score_out, rtol=RTOL, atol=ATOL)
    assert (np.diff(np.where(want_idx < 0, S, want_idx), axis=-1) >= 0).all()  # -1s last
    for impl, (data, seq) in (("xla", (2, 4)), ("reference", (1, 2))):
        out, idx = jax.jit(
            lambda x, impl=impl, mesh=mesh_of(data, seq): parallel.hyscale_attention(
                **x, topk=TOPK, mesh=mesh, impl=impl, order="index"
            )
        )(x)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx), err_msg=impl)
        np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL, err_msg=impl)


def check_replay_per_shard():
    from jax._src.ad_checkpoint import saved_residuals

    from tests.helpers import count_named_eqns

    x = inputs(6)
    mesh = mesh_of(2, 4)

    def loss(x):
        out, _ = parallel.hyscale_attention(**x, topk=TOPK, mesh=mesh, impl="xla")
        return jnp.sum(jnp.sin(out))

    counts = {}
    for mode, wrap in (
        ("none", lambda f: f),
        ("full", jax.checkpoint),
        ("replay", functools.partial(jax.checkpoint, policy=hs.replay_policy())),
    ):
        counts[mode] = count_named_eqns(jax.make_jaxpr(jax.grad(wrap(loss)))(x))
    # zig-zag: two query chunks per shard, so two selection calls per forward
    assert counts == {"none": 2, "full": 4, "replay": 2}, counts
    replay = functools.partial(jax.checkpoint, policy=hs.replay_policy())(loss)
    res = saved_residuals(lambda *a: replay(dict(zip(NAMES, a))), *(x[n] for n in NAMES))
    saved = [(tuple(a.shape), str(a.dtype)) for a, src in res if "argument" not in src]
    assert saved == [((B, T, TOPK), "int32")], res


def check_train_step():
    from hyscale_jax.data import DataConfig, Dataset
    from hyscale_jax.nn import ModelConfig
    from hyscale_jax.train import TrainConfig, create_train_state, make_train_step
    from tests.helpers import TINY_TRAIN_MODEL

    model_cfg = ModelConfig(**TINY_TRAIN_MODEL, dtype="float32", remat="replay")
    data = DataConfig(n_pairs=4, n_queries=4, corpus_bytes=2**18)
    train_cfg = TrainConfig(seq_len=64, batch_size=4, steps=4, data=data)
    batch = Dataset(data).batch(0, 4, 64)
    results = []
    for mesh in (None, mesh_of(2, 4)):
        graphdef, state, tx = create_train_state(model_cfg, train_cfg, mesh=mesh)
        step = make_train_step(graphdef, tx, train_cfg, mesh=mesh)
        feed = batch if mesh is None else parallel.shard_batch(batch, mesh)
        results.append(step(state, feed, "sparse"))
    (s0, m0), (s1, m1) = results
    for name in ("loss", "ce", "indexer_loss", "grad_norm", "needle_recall"):
        np.testing.assert_allclose(m1[name], m0[name], rtol=RTOL, atol=ATOL, err_msg=name)
    for a, b in zip(
        jax.tree.leaves((s0.params, s0.opt_state)), jax.tree.leaves((s1.params, s1.opt_state))
    ):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=ATOL)
    leaf = jax.tree.leaves(s1.params)[0]
    assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8


@functools.lru_cache(maxsize=None)
def _single_device_loss(impl):
    """The single-device sparse-stage indexer loss of x given idx, and its gradient in x,
    jitted once per impl (the checks share its shapes)."""

    def loss(x, idx):
        return hs.indexer_kl_loss(x["q"], x["k"], x["q_idx"], x["k_idx"], x["w"], idx, impl=impl)

    return jax.jit(loss), jax.jit(jax.grad(loss))


def _indexer_loss_check(data, seq, impl="xla"):
    """The sharded sparse-stage indexer loss == the single-device one, with its gradients in
    q_idx, k_idx (summed across the shards that read a key) and w."""

    def check():
        x = inputs(data * 100 + seq)
        idx = hs.hytopk(x["q_idx"], x["k_idx"], x["w"], k=TOPK, impl="xla")
        idx = idx.at[:, ::5, 0].set(-1)  # invalid entries are not members
        args = lambda x: (x["q"], x["k"], x["q_idx"], x["k_idx"], x["w"], idx)  # noqa: E731
        single, single_grad = _single_device_loss(impl)
        sharded = lambda x: parallel.indexer_kl_loss(  # noqa: E731
            *args(x), mesh=mesh_of(data, seq), impl=impl
        )
        np.testing.assert_allclose(jax.jit(sharded)(x), single(x, idx), rtol=RTOL, atol=ATOL)
        want = single_grad(x, idx)
        got = jax.jit(jax.grad(sharded))(x)
        for name in ("q_idx", "k_idx", "w"):
            assert np.asarray(want[name]).any(), name
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
        _raises(
            "sequence length T=30 must be divisible",
            lambda: parallel.indexer_kl_loss(
                *args({**x, **inputs(1, t=30, s=32)})[:5],
                idx[:, :30],
                mesh=mesh_of(1, 4),
                impl=impl,
            ),
        )

    return check


def check_attention_lse():
    """The sharded op's `return_lse` (zig-zag order inside, natural outside) equals the
    single-device op's, and the sharded indexer loss given it equals the single-device loss
    computing its own, with the same gradients."""
    x = inputs(7)
    mesh = mesh_of(2, 4)
    single = hs.hyscale_attention(**x, topk=TOPK, impl="xla", return_lse=True)
    got = jax.jit(
        lambda x: parallel.hyscale_attention(**x, topk=TOPK, mesh=mesh, impl="xla", return_lse=True)
    )(x)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(single[1]))
    np.testing.assert_allclose(got[2], single[2], rtol=RTOL, atol=ATOL)
    idx, lse = single[1], single[2]
    want_loss, want_grad = _single_device_loss("xla")

    def sharded(x):
        args = (x["q"], x["k"], x["q_idx"], x["k_idx"], x["w"], idx)
        return parallel.indexer_kl_loss(*args, mesh=mesh, impl="xla", attention_lse=lse)

    np.testing.assert_allclose(jax.jit(sharded)(x), want_loss(x, idx), rtol=RTOL, atol=ATOL)
    got_grad, want = jax.jit(jax.grad(sharded))(x), want_grad(x, idx)
    for name in ("q_idx", "k_idx", "w"):
        np.testing.assert_allclose(got_grad[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def check_indexer_statistics_per_shard():
    """The model's replay on a mesh: the Pallas indexer loss's per-query statistics, given the
    attention's log-sum-exps, are saved from inside the shards (f32, two a row) under
    `hs.replay_policy(indexer_statistics=True)`, and the loss and gradients are those of the
    policy that recomputes them, bit for bit; with `save_target=True` and
    `indexer_target=True` the target is saved too (f32, one per slot of a row), with the same
    loss and the gradients to f32 rounding."""
    from jax._src.ad_checkpoint import saved_residuals

    x = inputs(8)
    mesh = mesh_of(2, 4)
    _, idx, lse = hs.hyscale_attention(**x, topk=TOPK, impl="xla", return_lse=True)
    names = ("q", "k", "q_idx", "k_idx", "w")
    B, T = x["q"].shape[:2]
    slots = -(-TOPK // 16) * 16  # the kernels' slot blocks at this k

    results = {}
    for statistics, target in ((False, False), (True, False), (True, True)):

        def loss(*args, target=target):
            q, k, q_idx, k_idx, w = args
            return parallel.indexer_kl_loss(
                q,
                k,
                q_idx,
                k_idx,
                w,
                idx,
                mesh=mesh,
                impl="interpret",
                attention_lse=lse,
                save_target=target,
            )

        policy = hs.replay_policy(indexer_statistics=statistics, indexer_target=target)
        replay = jax.checkpoint(loss, policy=policy)
        res = saved_residuals(replay, *(x[n] for n in names))
        computed = [(a, src) for a, src in res if "argument" not in src and "constant" not in src]
        # the shards' residuals leave shard_map stacked, in shard order
        saved = sorted((a.size, str(a.dtype)) for a, _ in computed)
        want = [(B * T * 2, "float32")] * statistics + [(B * T * slots, "float32")] * target
        assert saved == sorted(want), (statistics, target, res)
        grad = jax.value_and_grad(replay, argnums=(2, 3, 4))
        results[statistics, target] = jax.tree.leaves(jax.jit(grad)(*(x[n] for n in names)))
    for a, b in zip(results[False, False], results[True, False]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for i, (a, b) in enumerate(zip(results[False, False], results[True, True])):
        tol = dict(rtol=0, atol=0) if i == 0 else dict(rtol=1e-5, atol=1e-6)  # the loss first
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def check_poisoned_rows():
    """NaN k_idx rows are never selected, so NaN or inf in the k and v rows at those positions
    reaches no output or gradient of the sharded op (2x2 mesh; xla, and the reference impl's
    key-prefix path). In the sharded indexer loss, neither do key rows (k, k_idx) that idx does
    not name, nor the inputs (q, q_idx, w) of a row with no valid entry. Poisoned and clean
    runs agree exactly."""
    rows = jnp.asarray([0, 17])
    mesh = mesh_of(2, 2)
    ct = jnp.asarray(np.random.default_rng(8).normal(size=(B, T, H, D)), jnp.float32)
    clean = inputs(8)
    unselectable = {**clean, "k_idx": clean["k_idx"].at[:, rows].set(jnp.nan)}
    sel = (unselectable["q_idx"], unselectable["k_idx"], unselectable["w"])
    idx = hs.hytopk(*sel, k=TOPK, impl="xla").at[:, 3].set(-1)  # names neither row; row 3 empty

    # One compiled value-and-gradient per function, run on the clean and the poisoned inputs.
    attention_results = {
        impl: jax.jit(
            jax.value_and_grad(
                functools.partial(
                    _loss,
                    functools.partial(parallel.hyscale_attention, topk=TOPK, mesh=mesh, impl=impl),
                    ct,
                )
            )
        )
        for impl in ("xla", "reference")
    }

    def loss(x):
        args = (x["q"], x["k"], x["q_idx"], x["k_idx"], x["w"], idx)
        return parallel.indexer_kl_loss(*args, mesh=mesh, impl="xla")

    loss_results = jax.jit(jax.value_and_grad(loss))

    def assert_same(got, want, what):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)

    want = {impl: f(unselectable) for impl, f in attention_results.items()}
    want_loss = loss_results(clean)
    for poison in (np.nan, np.inf):
        bad = {**unselectable, **{n: unselectable[n].at[:, rows].set(poison) for n in ("k", "v")}}
        for impl, f in attention_results.items():
            assert_same(f(bad), want[impl], f"attention {impl} {poison}")
        bad = {**clean, **{n: clean[n].at[:, rows].set(poison) for n in ("k", "k_idx")}}
        bad.update({n: clean[n].at[:, 3].set(poison) for n in ("q", "q_idx", "w")})
        assert_same(loss_results(bad), want_loss, f"indexer loss {poison}")


def _raises(match, fn):
    try:
        fn()
    except ValueError as err:
        assert match in str(err), (match, str(err))
        return
    raise AssertionError(f"no ValueError mentioning {match!r}")


def check_bad_meshes():
    x = inputs(7)
    call = lambda mesh, **kw: parallel.hyscale_attention(  # noqa: E731
        **{**x, **kw}, topk=TOPK, mesh=mesh, impl="xla"
    )
    bad_t = inputs(7, t=28, s=28)  # 28 % 4 == 0 but 28 % 8 != 0: zig-zag needs 2 * seq
    _raises("must be divisible by 8", lambda: call(mesh_of(1, 4), **bad_t))
    _raises("must be divisible by 3", lambda: call(mesh_of(1, 3), causal=False))  # T=32 over 3
    _raises("batch B=2 must be divisible", lambda: call(mesh_of(4, 2)))
    devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
    _raises("missing ('seq',)", lambda: call(Mesh(devices, ("data", "model"))))
    _raises("data * seq == the number of devices", lambda: parallel.make_mesh(data=3, seq=2))
    _raises("do not factor", lambda: parallel.make_mesh(seq=3))
    assert dict(parallel.make_mesh(seq=4).shape) == {"data": 2, "seq": 4}


CHECKS = {f"attention_{d}x{s}": _attention_check(d, s) for d, s in MESHES}
CHECKS.update({f"indexer_loss_{d}x{s}": _indexer_loss_check(d, s) for d, s in MESHES})
CHECKS.update(indexer_loss_interpret_2x4=_indexer_loss_check(2, 4, impl="interpret"))
CHECKS.update(
    contiguous_and_end_aligned=check_contiguous_and_end_aligned,
    noncausal=check_noncausal,
    prefix_switch_path=check_prefix_switch_path,
    zigzag_layout=check_zigzag_layout,
    replay_per_shard=check_replay_per_shard,
    train_step=check_train_step,
    bad_meshes=check_bad_meshes,
    poisoned_rows=check_poisoned_rows,
    attention_lse=check_attention_lse,
    indexer_statistics_per_shard=check_indexer_statistics_per_shard,
    selection_order=check_selection_order,
)


def run_checks(names=None):
    """Runs the named checks (default all); yields {"name", "ok", "seconds", "error"}."""
    for name in names or CHECKS:
        t0 = time.perf_counter()
        try:
            CHECKS[name]()
            error = None
        except Exception:
            error = traceback.format_exc()
        yield {
            "name": name,
            "ok": error is None,
            "seconds": round(time.perf_counter() - t0, 2),
            "error": error,
        }


if __name__ == "__main__":
    if jax.device_count() < 8:
        sys.exit(
            f"needs 8 devices; got {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})"
        )
    for record in run_checks(sys.argv[1:]):
        print(json.dumps(record), flush=True)
