"""Reproduce HyScale's speedups, one layer and one training step, across context length T.

    PYTHONPATH=. python experiments/reproduce.py                       # CPU preset, a few minutes
    PYTHONPATH=. python experiments/reproduce.py --preset h200 [--only layer|e2e]
    PYTHONPATH=. python experiments/reproduce.py --preset glm-5.1 --only layer   # the paper's model

Presets: cpu (tiny), h200 (a DSA-like GQA model: MQA, 16 x 128 heads, 32 x 64 indexer), and the
paper's models (MLA, absorbed sparse attention, k = 2048): glm-5.1 (64 heads, 32 x 128 indexer)
and deepseek-v3.2 (128 heads, 64 x 128 indexer), whose layer level is one attention layer of
that model and whose end to end is two GLM-5.1-shaped layers (hyscale_jax.nn.MLA_LAYER_PRESETS).
Dense attention runs MLA in its per-head (non-absorbed) form.

Modes (attention/remat):
  materialized/full   the DSA baseline: the T x S score table + lax.top_k, plain jax.checkpoint
                      (the selection runs again in the backward pass)
  hyscale/replay      HyTopK + selection replay (saved: the indices, the indexer loss's statistics)
  dense/full          jax.nn.dot_product_attention (cuDNN on GPU), plain jax.checkpoint
  --ablations adds hyscale/full and materialized/replay: what each half buys alone.
  --modes runs the modes it names, in its order (e.g. hyscale/replay dense/full from 64K on,
  where the baseline's table cannot exist); a remat may carry options after "+": offload (the
  saved indices in host memory), target (the indexer loss's target saved, so its backward reads
  no main keys) and index (the selection in key-index order, no ordering sort), e.g.
  hyscale/replay+target+index.
  --offload-indices runs hyscale/replay and hyscale/replay+offload only (the saved indices kept
  in pinned host memory between the forward and the backward pass): the longest T each trains.

Layer: one transformer block's forward+backward (with the sparse-stage indexer KL, as in
training), in this process. Before timing, HyTopK is checked against topk_reference and the sparse
attention against its dense reference on the block's own inputs at the shortest T (halved until
the reference's score table can exist: 32K for a run of 128K alone).
End to end: one training step (model, indexer KL, AdamW) of experiments/train.py's model at
batch --batch, each point in its own subprocess so that its peak memory is its own and an out of
memory error cannot poison the next point; T grows until each mode fails.

Timing: compile, one warm-up run, then the median of --reps runs, each synchronized with
block_until_ready, alternating two input buffers (--no-warmup: end to end, the first step after
compiling is the one timed, for lengths whose steps take minutes). Speedups are against
materialized/full at the same T in the same run; absolute times mean something only on a GPU.

Output: <out>/reproduce_<preset>_<layer|e2e>.{json,png}, by default under runs/reproduce/.
--merge joins records of separate runs (each T from the run that measured most of it). What bounds
each part: docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs"  # default output of the experiment scripts (ignored by git)
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import hyscale_jax as hs  # noqa: E402
from hyscale_jax import reference  # noqa: E402
from hyscale_jax.data import DataConfig, Dataset  # noqa: E402
from hyscale_jax.nn import MLA_LAYER_PRESETS, Block, ModelConfig, remat_block  # noqa: E402
from hyscale_jax.train import TrainConfig, create_train_state, make_train_step  # noqa: E402

BASELINE = ("materialized", "full")
MODES = (BASELINE, ("hyscale", "replay"), ("dense", "full"))
ABLATIONS = (("hyscale", "full"), ("materialized", "replay"))
OFFLOAD = (("hyscale", "replay"), ("hyscale", "replay+offload"))
# What an option after "+" in a mode's remat changes in the model: "replay+offload" is replay
# with the saved indices in pinned host memory, "+target" also saves the indexer loss's target,
# "+index" selects in key-index order (e.g. hyscale/replay+target+index).
MODE_OPTIONS = {
    "offload": dict(offload_indices=True),
    "target": dict(save_indexer_target=True),
    "index": dict(selection_order="index"),
}


def mode_config(base: ModelConfig, attention: str, remat: str) -> ModelConfig:
    """The model of mode attention/remat[+option...] (MODE_OPTIONS)."""
    remat, *options = remat.split("+")
    changes = {}
    for option in options:
        changes.update(MODE_OPTIONS[option])
    return dataclasses.replace(base, attention=attention, remat=remat, **changes)


def parse_mode(mode: str) -> tuple[str, str] | None:
    """("attention", "remat[+option...]") of a mode named on the command line, its options in
    MODE_OPTIONS' order, or None where it names no model (an unknown attention, remat or
    option, a repeated option, or a config the model refuses)."""
    attention, _, remat = mode.partition("/")
    base, *options = remat.split("+")
    if len(set(options)) < len(options):
        return None
    try:
        mode_config(ModelConfig(), attention, remat)
    except (KeyError, ValueError, TypeError):
        return None
    return attention, "+".join([base] + [o for o in MODE_OPTIONS if o in options])


PRESETS = {
    # Tiny shapes: checks the pipeline end to end on CPU; its ratios say little about a GPU.
    "cpu": dict(
        layer_model=ModelConfig(topk=64),  # ModelConfig's defaults: the CPU-sized model
        layer_T=[256, 512, 1024],
        e2e_model=ModelConfig(topk=64),
        e2e_T=[256, 512, 1024],
        reps=3,
        point_timeout_s=300,
    ),
    # One H200. DSA-like selection (MQA, 32 x 64 indexer, k = 2048); powers of two up to OOM.
    "h200": dict(
        layer_model=ModelConfig(
            d_model=2048,
            n_heads=16,
            n_kv_heads=1,
            head_dim=128,
            index_heads=32,
            index_dim=64,
            topk=2048,
            rope_base=1e6,
        ),
        layer_T=[4096, 8192, 16384, 32768, 65536, 131072, 262144],
        e2e_model=ModelConfig(
            d_model=1024,
            n_layers=4,
            n_heads=16,
            n_kv_heads=1,
            head_dim=64,
            index_heads=32,
            index_dim=64,
            topk=2048,
            rope_base=1e6,
        ),
        e2e_T=[8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576],
        reps=5,
        point_timeout_s=570,
    ),
    # The paper's models on one H200: one GLM-5.1 / DeepSeek-V3.2 attention layer (MLA, absorbed
    # sparse attention, 32 x 128 / 64 x 128 indexer, k = 2048) for the layer level; end to end,
    # two GLM-5.1-shaped layers with one expert-sized MLP (2048 wide) and a byte vocabulary.
    **{
        name: dict(
            layer_model=dataclasses.replace(MLA_LAYER_PRESETS[name], rope_base=1e6),
            layer_T=[8192, 16384, 32768, 65536, 131072],
            e2e_model=dataclasses.replace(
                MLA_LAYER_PRESETS["glm-5.1"], n_layers=2, mlp_dim=2048, rope_base=1e6
            ),
            e2e_T=[8192, 16384, 32768, 65536, 131072, 262144],
            reps=3,
            point_timeout_s=570,
        )
        for name in MLA_LAYER_PRESETS
    },
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the module docstring's layout and appends each flag's default to its help line,
    except where the default is None or a switch (their help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Progress:
    """One line per point: its label when it starts, its result when it ends, and the time since
    the run began."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, label: str) -> None:
        print(f"[{self.elapsed():8.1f} s] {label} ...", end="", flush=True)

    def done(self, text: str) -> None:
        print(f" {text}", flush=True)


def add_budget_and_out(p: argparse.ArgumentParser, script: str) -> None:
    """The --budget-s and --out flags that every point-by-point script shares."""
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new point after this many seconds (default: no limit)",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"folder for the JSON and PNG (default: runs/{script}/ in the repository)",
    )


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def command_line() -> str:
    """The command that ran this process, for the record: the XLA_* environment variables set
    (they change what compiles and how much memory JAX may take), then the script's path
    relative to the repository when it lies inside it."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("XLA_")]
    return " ".join(env + [shlex.join([Path(sys.executable).name, str(script)] + sys.argv[1:])])


def is_oom(err: BaseException) -> bool:
    """Out of device memory. A kernel asking for more shared memory than a program has is also
    RESOURCE_EXHAUSTED, but it is an error of that kernel's tiles, reported as such."""
    text = str(err)
    if "Shared memory size limit exceeded" in text:
        return False
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def result_line(stdout, tag: str = "RESULT") -> dict | None:
    """The last `{tag} {json}` line a worker process printed (str or bytes), or None."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    lines = [ln for ln in (stdout or "").splitlines() if ln.startswith(tag + " ")]
    return json.loads(lines[-1][len(tag) + 1 :]) if lines else None


def e2e_train_config(T: int, B: int) -> TrainConfig:
    """The training setup of an end-to-end point: batch B of length T, retrieval data."""
    data = DataConfig(n_pairs=16, n_queries=16, corpus_bytes=4 * 2**20)
    return TrainConfig(seq_len=T, batch_size=B, steps=10_000, data=data)


def _compiled_sizes(compiled) -> dict:
    """What XLA's buffer assignment reserves for the program, in bytes: on the device
    ("compiled_bytes": arguments + temporaries + outputs, less aliased) and in host memory
    ("compiled_host_bytes": the same for buffers placed there, e.g. offloaded residuals).
    None where the backend does not say."""
    try:
        m = compiled.memory_analysis()
        device = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        host = (
            m.host_argument_size_in_bytes
            + m.host_output_size_in_bytes
            + m.host_temp_size_in_bytes
            - m.host_alias_size_in_bytes
        )
        return {"compiled_bytes": int(device), "compiled_host_bytes": int(host)}
    except Exception:
        return {"compiled_bytes": None, "compiled_host_bytes": None}


def _peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


# XLA's GPU kernels index a tensor with int32: a [T, S] score table of 2**31 entries or more
# dies with an illegal memory access (H200, jax 0.11.2) and takes the process with it, so
# those points are skipped, not attempted (the baseline's limit on this stack, before memory
# is). topk_reference builds one batch element's table at a time, so B does not count.
def _table_too_big(attention: str, T: int) -> bool:
    return (
        attention == "materialized"
        and jax.default_backend() == "gpu"
        and T * T >= reference.TABLE_ENTRIES_LIMIT
    )


def check_length(sizes) -> int:
    """The T of the layer check: the shortest timed T, halved until topk_reference's [T, T]
    score table has fewer than 2**31 entries (at 128K alone the reference cannot run)."""
    T = min(sizes)
    while T * T >= reference.TABLE_ENTRIES_LIMIT:
        T //= 2
    return T


def median_ms(fn, reps: int, warmups: int = 1) -> float:
    """Median wall time in ms of `reps` synchronized calls of fn(), after `warmups` calls."""
    for _ in range(warmups):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _median_ms(fn, args_cycle, reps: int) -> float:
    times = []
    for i in range(reps):
        args = args_cycle[i % len(args_cycle)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _visible_pairs(T: int) -> int:
    return T * (T + 1) // 2


def _attention_flops(cfg: ModelConfig, B: int, T: int) -> float:
    """FLOPs of one layer's attention, forward+backward: the selection once,
    2 * HI * DI * B * T(T+1)/2, plus 3.5 times the attention forward (backward = 2.5x forward),
    2 * B * T * H * k_eff * (D + Dv), where k_eff is the mean number of keys a query selects,
    min(t + 1, k). Dense attention: 3.5 * 2 * B * H * T(T+1)/2 * (D + Dv). D, Dv: head_dim twice;
    MLA: D = kv_lora + rope and Dv = kv_lora (the absorbed form) for sparse attention, D =
    qk_nope + rope and Dv = v_head (the per-head form) for dense."""
    if cfg.attention_kind == "mla":
        R = cfg.qk_rope_dim
        if cfg.attention == "dense":
            D, Dv = cfg.qk_nope_dim + R, cfg.v_head_dim
        else:
            D, Dv = cfg.kv_lora_rank + R, cfg.kv_lora_rank
    else:
        D = Dv = cfg.head_dim
    if cfg.attention == "dense":
        return 3.5 * 2 * B * cfg.n_heads * _visible_pairs(T) * (D + Dv)
    k_eff = sum(min(t + 1, cfg.topk) for t in range(T)) / T
    selection = 2 * cfg.index_heads * cfg.index_dim * B * _visible_pairs(T)
    return selection + 3.5 * 2 * B * T * cfg.n_heads * k_eff * (D + Dv)


# ----------------------------------------------------------------------------- layer level


def _layer_fn(cfg: ModelConfig, T: int):
    block = Block(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(block)
    positions = jnp.arange(T, dtype=jnp.int32)

    def loss(state, x, r):
        y, aux = remat_block(nnx.merge(graphdef, state), cfg)(
            x, positions, indexer_stage="sparse" if cfg.attention != "dense" else "none"
        )
        return jnp.sum(y.astype(jnp.float32) * r) + aux["indexer_loss"]

    return state, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _layer_inputs(cfg: ModelConfig, B: int, T: int):
    keys = jax.random.split(jax.random.key(1), 3)
    xs = [
        jax.random.normal(k, (B, T, cfg.d_model), jnp.float32).astype(cfg.compute_dtype)
        for k in keys[:2]
    ]
    r = jax.random.normal(keys[2], (B, T, cfg.d_model), jnp.float32) * cfg.d_model**-0.5
    return xs, r


def check_layer(base: ModelConfig, B: int, T: int) -> dict:
    """HyTopK (at the configured impl) against topk_reference on the same indexer outputs of a
    block, and the sparse attention on those indices against the dense-masked reference."""
    cfg = dataclasses.replace(base, attention="hyscale", remat="none")
    block = Block(cfg, rngs=nnx.Rngs(0))
    xs, _ = _layer_inputs(cfg, B, T)
    positions = jnp.arange(T, dtype=jnp.int32)
    # The block and the arrays are arguments: a jitted closure would compile its parameters in
    # as constants (hundreds of MB at the paper's shapes).
    if cfg.attention_kind == "mla":  # the selection only (tests cover MLA's attention kernels)
        indexer = nnx.jit(lambda block, x, pos: block.attn.indexer(block.attn_norm(x), pos))
        q_idx, k_idx, w = indexer(block, xs[0], positions)
        fast = hs.hytopk(q_idx, k_idx, w, k=cfg.topk, impl=cfg.impl)
        ref = hs.topk_reference(q_idx, k_idx, w, k=cfg.topk)
        return {"T": T, "indices_equal_frac": float(jnp.mean(fast == ref))}

    @nnx.jit
    def inputs(block, x, pos):
        h = block.attn_norm(x)
        a = block.attn
        q = a.q_proj(h).reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = a.k_proj(h).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = a.v_proj(h).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        return (q, k, v), a.indexer(h, pos)

    (q, k, v), (q_idx, k_idx, w) = inputs(block, xs[0], positions)
    fast = hs.hytopk(q_idx, k_idx, w, k=cfg.topk, impl=cfg.impl)
    ref = hs.topk_reference(q_idx, k_idx, w, k=cfg.topk)
    out = hs.sparse_attention(q, k, v, ref, impl=cfg.impl)
    out_ref = hs.sparse_attention_reference(q, k, v, ref)
    return {
        "T": T,
        "indices_equal_frac": float(jnp.mean(fast == ref)),
        "max_abs_attention_diff": float(
            jnp.max(jnp.abs(out.astype(jnp.float32) - out_ref.astype(jnp.float32)))
        ),
    }


def layer_point(cfg: ModelConfig, B: int, T: int, reps: int) -> dict:
    state, fn = _layer_fn(cfg, T)
    xs, r = _layer_inputs(cfg, B, T)
    t0 = time.perf_counter()
    compiled = fn.lower(state, xs[0], r).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(state, xs[0], r))
    ms = _median_ms(compiled, [(state, x, r) for x in xs], reps)
    return {
        "status": "ok",
        "median_ms": ms,
        "compile_s": compile_s,
        **_compiled_sizes(compiled),
        "attn_tflops_per_s": _attention_flops(cfg, B, T) / (ms * 1e-3) / 1e12,
    }


def run_layer(
    preset: dict, modes, B: int, reps: int, budget_end: float, progress: Progress, save
) -> dict:
    base = preset["layer_model"]
    save({"points": []})  # replaces a record an earlier run left at this path
    check_T = check_length(preset["layer_T"])
    progress.start(f"layer check at T={check_T}")
    record = {"check": check_layer(dataclasses.replace(base), B, check_T), "points": []}
    check = record["check"]
    attention_diff = check.get("max_abs_attention_diff")
    progress.done(
        f"hytopk == topk_reference on {check['indices_equal_frac']:.4f} of entries"
        + (
            ""
            if attention_diff is None
            else f"; sparse attention vs reference max |diff| {attention_diff:.3g}"
        )
    )
    if check["indices_equal_frac"] < 0.999:
        print(
            "WARNING: HyTopK disagrees with topk_reference beyond near-ties; timings below "
            "compare different selections"
        )
    save(record)
    dead = set()
    grid = [(T, mode) for T in preset["layer_T"] for mode in modes]
    for i, (T, (attention, remat)) in enumerate(grid, 1):
        progress.start(f"layer {i}/{len(grid)} T={T} {attention}/{remat}")
        cfg = mode_config(base, attention, remat)
        point = {"attention": attention, "remat": remat, "T": T, "B": B}
        if (attention, remat) in dead:
            point["status"] = "skipped (failed at a shorter T)"
        elif _table_too_big(attention, T):
            point["status"] = "skipped (score table >= 2**31 entries: XLA crashes)"
        elif time.time() > budget_end:
            point["status"] = "skipped (time budget)"
        else:
            try:
                point.update(layer_point(cfg, B, T, reps))
            except Exception as err:
                point["status"] = "oom" if is_oom(err) else f"error: {str(err)[:300]}"
                dead.add((attention, remat))
            jax.clear_caches()
            gc.collect()
        record["points"].append(point)
        progress.done(_point_text(point))
        save(record)
    _add_speedups(record["points"])
    return record


# ----------------------------------------------------------------------------- end to end


def e2e_point(cfg: ModelConfig, B: int, T: int, reps: int, warmup: bool = True) -> dict:
    """One training step of the full model; run in a fresh process."""
    tcfg = e2e_train_config(T, B)
    graphdef, state, tx = create_train_state(cfg, tcfg)
    step = make_train_step(graphdef, tx, tcfg)
    dataset = Dataset(tcfg.data)
    batches = [dataset.batch(i, B, T) for i in range(2)]
    stage = "none" if cfg.attention == "dense" else "sparse"
    timed = time_steps(step, state, batches, stage, reps, warmup)
    ms = timed["median_ms"]
    return {
        "status": "ok",
        "median_ms": ms,
        "tokens_per_s": B * T / (ms * 1e-3),
        "compile_s": timed["compile_s"],
        "peak_bytes": _peak_bytes(),
        "loss": timed["loss"],
    }


def time_steps(step, state, batches, stage: str, reps: int, warmup: bool = True) -> dict:
    """Compiles the jitted train step, prints `COMPILED {"compiled_bytes": ...}` (what the
    record keeps of the compiled size, read by run_e2e even when the step then fails), runs one
    warm-up step (unless not `warmup`), then times `reps` steps alternating `batches`. Returns
    median_ms, times_ms, compile_s, the compiled step and the last step's loss."""
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0], stage).compile()
    compile_s = time.perf_counter() - t0
    # Printed before running, so that a step that then runs out of memory still reports what
    # XLA's buffer assignment reserved for it.
    print("COMPILED " + json.dumps(_compiled_sizes(compiled)), flush=True)
    if warmup:
        state, metrics = compiled(state, batches[0])
        jax.block_until_ready(metrics)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "times_ms": times,
        "compile_s": compile_s,
        "compiled": compiled,
        "loss": float(metrics["loss"]),
    }


def _worker(spec: str) -> None:
    args = json.loads(spec)
    cfg = ModelConfig.from_dict(args["model"])
    try:
        result = e2e_point(cfg, args["B"], args["T"], args["reps"], args["warmup"])
    except Exception as err:
        result = {"status": "oom" if is_oom(err) else f"error: {str(err)[:300]}"}
        if result["status"] == "oom":
            # XLA's out-of-memory message names the request and, when the buffer assignment
            # failed, its largest live buffers: the memory profile of the step that did not fit.
            result["oom_message"] = str(err)[:6000]
    print("RESULT " + json.dumps(result), flush=True)


def run_e2e(
    preset: dict,
    modes,
    B: int,
    reps: int,
    budget_end: float,
    progress: Progress,
    save,
    warmup: bool = True,
) -> dict:
    base = preset["e2e_model"]
    record = {"points": []}
    save(record)
    dead = set()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    grid = [(T, mode) for T in preset["e2e_T"] for mode in modes]
    for i, (T, (attention, remat)) in enumerate(grid, 1):
        progress.start(f"e2e {i}/{len(grid)} T={T} {attention}/{remat}")
        cfg = mode_config(base, attention, remat)
        point = {"attention": attention, "remat": remat, "T": T, "B": B}
        left = budget_end - time.time()
        if (attention, remat) in dead:
            point["status"] = "skipped (failed at a shorter T)"
        elif _table_too_big(attention, T):
            point["status"] = "skipped (score table >= 2**31 entries: XLA crashes)"
        elif left < 30:
            point["status"] = "skipped (time budget)"
        else:
            spec = json.dumps(
                {"model": cfg.to_dict(), "B": B, "T": T, "reps": reps, "warmup": warmup}
            )
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", spec],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=min(preset["point_timeout_s"], left),
                )
                point.update(result_line(proc.stdout, "COMPILED") or {})
                result = result_line(proc.stdout)
                if result is not None:
                    point.update(result)
                else:
                    point["status"] = f"error: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
            except subprocess.TimeoutExpired as err:
                point.update(result_line(err.stdout, "COMPILED") or {})
                point["status"] = "timeout"
            if point["status"] != "ok":
                dead.add((attention, remat))
        record["points"].append(point)
        progress.done(_point_text(point))
        save(record)
    _add_speedups(record["points"])
    return record


# ----------------------------------------------------------------------------- reporting


def _add_speedups(points) -> None:
    base = {
        p["T"]: p["median_ms"]
        for p in points
        if (p["attention"], p["remat"]) == BASELINE and p.get("status") == "ok"
    }
    for p in points:
        if p.get("status") == "ok" and p["T"] in base:
            p["speedup_vs_baseline"] = base[p["T"]] / p["median_ms"]


def _point_text(p: dict) -> str:
    if p.get("status") != "ok":
        return p["status"]
    mem = p.get("peak_bytes") or p.get("compiled_bytes")
    extra = f", {p['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in p else ""
    mem = f"{mem / 2**30:.2f} GiB" if mem else "n/a"
    return f"{p['median_ms']:.2f} ms{extra}, memory {mem}"


def print_table(title: str, points) -> None:
    modes = list(dict.fromkeys((p["attention"], p["remat"]) for p in points))
    Ts = sorted({p["T"] for p in points})
    print(f"\n{title}: median ms (speedup over {BASELINE[0]}/{BASELINE[1]})")
    print(f"{'T':>9} | " + " | ".join(f"{a + '/' + r:>24}" for a, r in modes))
    for T in Ts:
        cells = []
        for mode in modes:
            p = next(
                (q for q in points if q["T"] == T and (q["attention"], q["remat"]) == mode), None
            )
            if p is None or p.get("status") != "ok":
                cells.append(f"{(p or {}).get('status', '-')[:24]:>24}")
            else:
                s = p.get("speedup_vs_baseline")
                cell = f"{p['median_ms']:.2f} ({s:.2f}x)" if s else f"{p['median_ms']:.2f}"
                cells.append(f"{cell:>24}")
        print(f"{T:>9} | " + " | ".join(cells))


def plot(record: dict, kind: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in record["points"] if p.get("status") == "ok"]
    if not points:
        return
    modes = list(dict.fromkeys((p["attention"], p["remat"]) for p in record["points"]))
    panels = ["median_ms", "speedup_vs_baseline"] + (["tokens_per_s"] if kind == "e2e" else [])
    if not any("speedup_vs_baseline" in p for p in points):  # --offload-indices: no baseline
        panels.remove("speedup_vs_baseline")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    titles = {
        "median_ms": f"{kind}: fwd+bwd time (ms)"
        if kind == "layer"
        else "e2e: training step time (ms)",
        "speedup_vs_baseline": f"speedup over {BASELINE[0]}/{BASELINE[1]}",
        "tokens_per_s": "e2e: tokens / s",
    }
    for ax, key in zip(axes[0], panels):
        for mode in modes:
            pts = [
                (p["T"], p[key])
                for p in points
                if (p["attention"], p["remat"]) == mode and p.get(key) is not None
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{mode[0]}/{mode[1]}")
        ax.set_xscale("log", base=2)
        if key != "speedup_vs_baseline":
            ax.set_yscale("log")
        ax.set_xlabel("context length T")
        ax.set_title(titles[key])
        ax.legend()
    fig.suptitle(f"{record['device']}, jax {record['jax']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, record: dict) -> None:
    """Writes the record whole or not at all: a run killed mid-write keeps its last record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def merge_records(paths, out: Path) -> Path:
    """One record from several runs of the same kind and preset: each T's points from the one
    run that measured most of its modes at that T (a run stopped by its time budget leaves
    skipped points behind; two runs that measured equally many at one T are an error), speedups
    recomputed per T, each run's file, command, reps and warm-up kept. Writes
    <out>/reproduce_<preset>_<kind>_merged.{json,png} and returns the JSON's path."""
    records = [json.loads(p.read_text()) for p in paths]
    kinds = {(r["kind"], r["preset"]) for r in records}
    if len(kinds) != 1:
        raise SystemExit(f"--merge needs records of one kind and preset; got {sorted(kinds)}")
    points, unused = [], [[] for _ in records]
    for T in sorted({p["T"] for r in records for p in r["points"]}):
        by_run = [[p for p in r["points"] if p["T"] == T] for r in records]
        measured = [sum(p.get("status") == "ok" for p in pts) if pts else -1 for pts in by_run]
        best = max(measured)
        if best > 0 and measured.count(best) > 1:
            raise SystemExit(f"--merge: {measured.count(best)} records measured T={T} equally")
        chosen = measured.index(best)
        points += by_run[chosen]
        for i, pts in enumerate(by_run):
            if i != chosen:
                unused[i] += [p for p in pts if p.get("status") == "ok"]
    merged = dict(records[0], command=None, merged_by=command_line())
    for key in ("check", "finished"):  # per run, in merged_from
        merged.pop(key, None)
    merged["wall_s"] = sum(r.get("wall_s", 0) for r in records)
    for key in ("reps", "warmup"):  # the runs' common setting; None where they differ
        if not any(key in r for r in records):
            continue
        values = {r.get(key) for r in records}
        merged[key] = values.pop() if len(values) == 1 else None
    merged["merged_from"] = [
        {
            "file": str(p),
            "command": r.get("command"),
            "reps": r.get("reps"),
            "warmup": r.get("warmup"),
            "finished": r.get("finished", True),
            "check": r.get("check"),
            # measured points of this run at lengths taken from another run
            "points_not_used": left,
        }
        for p, r, left in zip(paths, records, unused)
    ]
    merged["points"] = points
    _add_speedups(merged["points"])
    kind, name = kinds.pop()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"reproduce_{name}_{kind}_merged.json"
    write_json(path, merged)
    plot(merged, kind, path.with_suffix(".png"))
    print_table(f"{kind} ({name}, merged)", merged["points"])
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shapes, lengths and repetitions (default: h200 on a GPU, cpu elsewhere)",
    )
    p.add_argument(
        "--only",
        choices=("layer", "e2e"),
        default=None,
        help="run one level only (default: both, layer first)",
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also time hyscale/full and materialized/replay (what each half buys alone)",
    )
    p.add_argument(
        "--offload-indices",
        action="store_true",
        help="time only hyscale/replay and hyscale/replay+offload (indices saved in pinned "
        "host memory): how long a T each trains",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help="time only these attention/remat modes, in this order (default: "
        + ", ".join("/".join(m) for m in MODES)
        + "; any attention/remat, the remat optionally with +offload, +target or +index, e.g. "
        "--modes hyscale/replay dense/full where the baseline's table cannot exist)",
    )
    p.add_argument(
        "--impl",
        default=None,
        help="kernel implementation for every mode: auto, pallas, interpret, xla, reference "
        "(default: the preset's, auto)",
    )
    p.add_argument(
        "--mlp-chunk",
        type=int,
        default=None,
        metavar="N",
        help="run every model's SwiGLU over the sequence in chunks of N tokens, recomputed one "
        "at a time in the backward pass (ModelConfig.mlp_chunk; default: the whole sequence)",
    )
    p.add_argument(
        "--max-T", type=int, default=None, help="drop lengths above this T (default: none dropped)"
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated lengths T replacing the preset's, e.g. 32768,131072 (default: "
        "cpu 256,512,1024; h200 powers of two, 4K-256K for the layer, 8K-1M end to end)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed runs per point, median reported (default: the preset's, cpu 3, h200 5)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size B of every point")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="end to end: time the first step after compiling, with no warm-up step (for "
        "lengths whose steps take minutes; that step carries the first run's one-time costs)",
    )
    add_budget_and_out(p, "reproduce")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="join records of one kind and preset from separate runs (each T from the run "
        "that measured most of its modes) into <out>/reproduce_<preset>_<kind>_merged."
        "{json,png}; runs nothing",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    out = Path(args.out) if args.out else RUNS / "reproduce"
    if args.merge:
        return merge_records([Path(m) for m in args.merge], out)

    name = args.preset or ("h200" if jax.default_backend() == "gpu" else "cpu")
    preset = dict(PRESETS[name])
    if args.mlp_chunk is not None and args.mlp_chunk < 1:
        p.error(f"--mlp-chunk must be a positive number of tokens; got {args.mlp_chunk}")
    for key in ("layer_model", "e2e_model"):
        if args.impl:
            preset[key] = dataclasses.replace(preset[key], impl=args.impl)
        if args.mlp_chunk is not None:
            preset[key] = dataclasses.replace(preset[key], mlp_chunk=args.mlp_chunk)
    if args.sizes:
        try:
            sizes = sorted({int(v) for v in args.sizes.split(",") if v.strip()})
        except ValueError:
            p.error(f"--sizes must be comma-separated integers; got {args.sizes!r}")
        if not sizes or min(sizes) < 1:
            p.error(f"--sizes needs positive integers; got {args.sizes!r}")
        preset["layer_T"] = preset["e2e_T"] = sizes
    if args.max_T:
        preset["layer_T"] = [T for T in preset["layer_T"] if T <= args.max_T]
        preset["e2e_T"] = [T for T in preset["e2e_T"] if T <= args.max_T]
    reps = args.reps or preset["reps"]
    if args.no_warmup and args.only == "layer":
        p.error("--no-warmup applies to the end-to-end level; leave it out with --only layer")
    if args.offload_indices and args.ablations:
        p.error("--offload-indices runs its two modes only; leave out --ablations")
    modes = OFFLOAD if args.offload_indices else MODES + (ABLATIONS if args.ablations else ())
    if args.modes:
        if args.offload_indices or args.ablations:
            p.error("--modes names every mode to run; leave out --ablations and --offload-indices")
        known = ", ".join("/".join(m) for m in MODES + ABLATIONS + OFFLOAD)
        parsed = [parse_mode(m) for m in args.modes]
        if None in parsed or len(set(parsed)) < len(parsed):
            p.error(
                f"--modes takes distinct modes such as {known}, a remat optionally with "
                f"+{'/+'.join(MODE_OPTIONS)}; got {' '.join(args.modes)}"
            )
        modes = tuple(parsed)
    budget_end = time.time() + (args.budget_s or 1e9)
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "preset": name,
        "jax": jax.__version__,
        "device": device_name(),
        "B": args.batch,
        "reps": reps,
        "baseline": "/".join(BASELINE),
        "command": command_line(),
    }
    print(f"jax {jax.__version__} on {device_name()}; preset {name}; writing to {out}")
    progress = Progress()
    for kind in ("layer", "e2e"):
        if args.only and args.only != kind:
            continue
        t0 = time.time()
        path = out / f"reproduce_{name}_{kind}.json"
        head = dict(header, kind=kind, model=preset[f"{kind}_model"].to_dict())
        runner = run_layer  # the layer level always warms up
        if kind == "e2e":
            runner = functools.partial(run_e2e, warmup=not args.no_warmup)
            head["warmup"] = not args.no_warmup

        def save(partial: dict, head=head, path=path, t0=t0) -> None:
            # The record so far, rewritten after every point, so that a run stopped by a time
            # limit keeps what it measured ("finished": false until the last point).
            record = dict(head, **partial, finished=False, wall_s=time.time() - t0)
            record["points"] = [dict(p) for p in partial["points"]]
            _add_speedups(record["points"])
            write_json(path, record)

        record = dict(head, **runner(preset, modes, args.batch, reps, budget_end, progress, save))
        record["finished"] = True
        record["wall_s"] = time.time() - t0
        write_json(path, record)
        plot(record, kind, path.with_suffix(".png"))
        print_table(f"{kind} ({name})", record["points"])
        print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
