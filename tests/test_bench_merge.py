"""--merge of experiments/reproduce.py: how records of separate runs combine into one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hyscale_jax.nn import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def _reproduce():
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce

    return reproduce


def _reproduce_record(path, points, *, kind="e2e", command="run", wall_s=10.0):
    """A reproduce.py record at path holding the given (T, attention, remat, median_ms) points."""
    rows = [
        dict(attention=a, remat=r, T=T, B=1, status="ok" if ms else "oom")
        | ({"median_ms": ms, "tokens_per_s": T / (ms * 1e-3)} if ms else {})
        for T, a, r, ms in points
    ]
    record = dict(
        preset="h200",
        kind=kind,
        jax="0.11.2",
        device="gpu:NVIDIA H200",
        command=command,
        wall_s=wall_s,
        points=rows,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def test_reproduce_merge_joins_disjoint_lengths_and_recomputes_speedups(tmp_path):
    """Points of runs over disjoint T are joined in T order; each T's speedup is recomputed
    against that T's baseline (a stale value in an input is replaced), failed points keep their
    status and get no speedup, and each input's file and command are kept."""
    reproduce = _reproduce()
    short = _reproduce_record(
        tmp_path / "short.json",
        [
            (8192, "materialized", "full", 260.0),
            (8192, "hyscale", "replay", 170.0),
            (8192, "dense", "full", None),
        ],
        command="short run",
        wall_s=30.0,
    )
    stale = json.loads(short.read_text())
    stale["points"][1]["speedup_vs_baseline"] = 9.9
    short.write_text(json.dumps(stale))
    long = _reproduce_record(
        tmp_path / "long.json",
        [(32768, "materialized", "full", 2000.0), (32768, "hyscale", "replay", 520.0)],
        command="long run",
        wall_s=40.0,
    )
    path = reproduce.merge_records([long, short], tmp_path / "merged")
    assert path == tmp_path / "merged" / "reproduce_h200_e2e_merged.json"
    merged = json.loads(path.read_text())
    got = [
        (p["T"], p["attention"], p["status"], p.get("speedup_vs_baseline"))
        for p in merged["points"]
    ]
    assert got == [
        (8192, "materialized", "ok", 1.0),
        (8192, "hyscale", "ok", 260.0 / 170.0),
        (8192, "dense", "oom", None),
        (32768, "materialized", "ok", 1.0),
        (32768, "hyscale", "ok", 2000.0 / 520.0),
    ]
    assert merged["merged_from"] == [
        {
            "file": str(long),
            "command": "long run",
            "reps": None,  # records without these fields
            "warmup": None,
            "finished": True,
            "check": None,
            "points_not_used": [],
        },
        {
            "file": str(short),
            "command": "short run",
            "reps": None,  # records without these fields
            "warmup": None,
            "finished": True,
            "check": None,
            "points_not_used": [],
        },
    ]
    assert merged["wall_s"] == 70.0 and merged["command"] is None
    assert path.with_suffix(".png").exists()


def test_reproduce_merge_refuses_shared_lengths_and_mixed_kinds(tmp_path):
    reproduce = _reproduce()
    a = _reproduce_record(tmp_path / "a.json", [(8192, "materialized", "full", 260.0)])
    b = _reproduce_record(tmp_path / "b.json", [(8192, "hyscale", "replay", 170.0)])
    c = _reproduce_record(tmp_path / "c.json", [(16384, "hyscale", "replay", 1.0)], kind="layer")
    with pytest.raises(SystemExit, match="2 records measured T=8192 equally"):
        reproduce.merge_records([a, b], tmp_path / "out")
    with pytest.raises(SystemExit, match="one kind and preset"):
        reproduce.merge_records([a, c], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reproduce_merge_takes_each_length_from_the_run_that_measured_it(tmp_path):
    """A run stopped by its time budget leaves skipped points at its last lengths; a second run
    over those lengths supplies them: each T comes whole from the run with most measured points
    there (its own baseline included), and T that no run measured keeps its skipped points."""
    reproduce = _reproduce()
    stopped = _reproduce_record(
        tmp_path / "stopped.json",
        [
            (8192, "materialized", "full", 300.0),
            (8192, "hyscale", "replay", 200.0),
            (32768, "materialized", "full", 2200.0),
            (65536, "hyscale", "replay", None),
        ],
        kind="layer",
    )
    skipped = json.loads(stopped.read_text())
    skipped["points"][3]["status"] = "skipped (time budget)"
    stopped.write_text(json.dumps(skipped))
    rest = _reproduce_record(
        tmp_path / "rest.json",
        [(32768, "materialized", "full", 2000.0), (32768, "hyscale", "replay", 1000.0)],
        kind="layer",
    )
    merged = json.loads(reproduce.merge_records([stopped, rest], tmp_path / "m").read_text())
    got = [(p["T"], p["median_ms"] if "median_ms" in p else p["status"]) for p in merged["points"]]
    assert got == [
        (8192, 300.0),
        (8192, 200.0),
        (32768, 2000.0),
        (32768, 1000.0),
        (65536, "skipped (time budget)"),
    ]
    assert merged["points"][3]["speedup_vs_baseline"] == 2.0
    # the stopped run's own 32K point stays on the record, beside its run
    unused = [[p["median_ms"] for p in m["points_not_used"]] for m in merged["merged_from"]]
    assert unused == [[2200.0], []]


def test_reproduce_writes_its_record_after_every_point(tmp_path, monkeypatch):
    """A run stopped part-way (a time limit, a crash) leaves a record of the points it measured,
    marked unfinished; a run that ends marks its record finished."""
    reproduce = _reproduce()

    def stopped_runner(preset, modes, B, reps, budget_end, progress, save):
        point = dict(attention="hyscale", remat="replay", T=256, B=B, status="ok", median_ms=5.0)
        save({"points": [point]})
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "run_layer", stopped_runner)
    with pytest.raises(KeyboardInterrupt):
        reproduce.main(["--preset", "cpu", "--only", "layer", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "reproduce_cpu_layer.json").read_text())
    assert record["finished"] is False and record["kind"] == "layer"
    assert [p["median_ms"] for p in record["points"]] == [5.0]

    def runner(preset, modes, B, reps, budget_end, progress, save):
        return {"points": []}

    monkeypatch.setattr(reproduce, "run_layer", runner)
    reproduce.main(["--preset", "cpu", "--only", "layer", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "reproduce_cpu_layer.json").read_text())["finished"] is True


def test_reproduce_tells_out_of_memory_from_a_kernels_shared_memory_limit():
    """Both are RESOURCE_EXHAUSTED; only device memory is an "oom" point (a lengths sweep stops
    there), a kernel's shared-memory request is an error of its tiles."""
    is_oom = _reproduce().is_oom
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.0GiB"))
    assert is_oom(RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    smem = (
        "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 242304, available: 232448"
    )
    assert not is_oom(RuntimeError(smem))
    assert not is_oom(ValueError("q has 3 dimensions; expected 4"))


def test_result_line_reads_the_last_line_of_its_tag():
    """A worker's stdout: progress text, the compiled size printed before running, then the
    result; a worker killed mid-step leaves only the first."""
    reproduce = _reproduce()
    out = 'noise\nCOMPILED {"compiled_bytes": 7}\nRESULT {"status": "x"}\nRESULT {"status": "ok"}\n'
    assert reproduce.result_line(out) == {"status": "ok"}
    assert reproduce.result_line(out.encode(), "COMPILED") == {"compiled_bytes": 7}
    assert reproduce.result_line('COMPILED {"compiled_bytes": 7}\n') is None
    assert reproduce.result_line(None, "COMPILED") is None


@pytest.mark.parametrize("warmup, steps_run", [(True, 3), (False, 2)])
def test_time_steps_warms_up_unless_told_not_to(warmup, steps_run, capsys):
    """reproduce.py's end-to-end timing: one warm-up step, then `reps` timed ones; with
    --no-warmup (warmup=False) the first step after compiling is a timed one."""
    reproduce = _reproduce()

    class Step:  # stands for the jitted step, its lowering and its compiled program
        calls = 0

        def lower(self, *args):
            return self

        def compile(self):
            return self

        def __call__(self, state, batch):
            Step.calls += 1
            return state + 1, {"loss": float(state)}

    timed = reproduce.time_steps(Step(), 0, [0, 1], "sparse", reps=2, warmup=warmup)
    assert Step.calls == steps_run and len(timed["times_ms"]) == 2
    assert timed["loss"] == steps_run - 1  # the last step's loss, from the state it was given
    assert capsys.readouterr().out.startswith("COMPILED ")


def test_merge_keeps_each_runs_reps_and_warmup(tmp_path):
    """Runs timed differently merge into a record that says so: each run's reps and warm-up in
    merged_from, the top-level values None where the runs differ."""
    reproduce = _reproduce()
    paths = []
    for name, T, reps, warmup in (("a", 8192, 2, True), ("b", 16384, 1, False)):
        path = _reproduce_record(tmp_path / f"{name}.json", [(T, "hyscale", "replay", 100.0)])
        record = json.loads(path.read_text()) | {"reps": reps, "warmup": warmup}
        path.write_text(json.dumps(record))
        paths.append(path)
    merged = json.loads(reproduce.merge_records(paths, tmp_path / "m").read_text())
    assert merged["reps"] is None and merged["warmup"] is None
    assert [(m["reps"], m["warmup"]) for m in merged["merged_from"]] == [(2, True), (1, False)]


def test_no_warmup_reaches_the_end_to_end_worker(monkeypatch, tmp_path, capsys):
    """--no-warmup travels from run_e2e's worker spec to e2e_point; --only layer refuses it."""
    reproduce = _reproduce()
    specs = []

    def fake_run(cmd, **kwargs):
        specs.append(json.loads(cmd[cmd.index("--worker") + 1]))
        out = 'RESULT {"status": "ok", "median_ms": 1.0}\n'
        return reproduce.subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(reproduce.subprocess, "run", fake_run)
    preset = dict(reproduce.PRESETS["cpu"], e2e_T=[64])
    progress = reproduce.Progress()
    record = reproduce.run_e2e(
        preset, reproduce.MODES[:1], 1, 1, 1e18, progress, lambda r: None, warmup=False
    )
    assert specs and all(spec["warmup"] is False for spec in specs)
    assert record["points"][0]["status"] == "ok"

    seen = []
    monkeypatch.setattr(
        reproduce, "e2e_point", lambda cfg, B, T, reps, warmup: seen.append(warmup) or {}
    )
    reproduce._worker(json.dumps(specs[0]))
    assert seen == [False]
    with pytest.raises(SystemExit):
        reproduce.main(["--only", "layer", "--no-warmup", "--out", str(tmp_path)])
    assert "--no-warmup applies to the end-to-end level" in capsys.readouterr().err


def test_layer_check_runs_where_the_reference_can():
    """The layer check (HyTopK against topk_reference) runs at the shortest timed T, halved
    until the reference's [T, T] table has fewer than 2**31 entries: a run of 128K alone
    checks at 32K instead of failing before its first point."""
    reproduce = _reproduce()
    assert reproduce.check_length([131072]) == 32768
    assert reproduce.check_length([65536, 8192]) == 8192
    assert reproduce.check_length([256]) == 256


def test_modes_picks_and_orders_the_modes_run(tmp_path, monkeypatch, capsys):
    """--modes runs the named modes in its order, a remat with +options; unknown attention,
    remat or option, a config the model refuses, repeated, or combined with --ablations /
    --offload-indices, it is refused."""
    reproduce = _reproduce()
    asked = []

    def runner(preset, modes, B, reps, budget_end, progress, save):
        asked.append(modes)
        return {"points": []}

    monkeypatch.setattr(reproduce, "run_layer", runner)
    base = ["--preset", "cpu", "--only", "layer", "--out", str(tmp_path)]
    reproduce.main(base + ["--modes", "dense/full", "hyscale/replay+offload"])
    reproduce.main(base + ["--modes", "hyscale/replay+index+target"])  # options in one order
    assert asked == [
        (("dense", "full"), ("hyscale", "replay+offload")),
        (("hyscale", "replay+target+index"),),
    ]
    cfg = reproduce.mode_config(ModelConfig(), "hyscale", "replay+target+index")
    assert (cfg.remat, cfg.save_indexer_target, cfg.selection_order) == ("replay", True, "index")
    assert not cfg.offload_indices
    for bad in (
        ["--modes", "hyscale/never"],
        ["--modes", "sparse/full"],
        ["--modes", "hyscale/replay+fast"],
        ["--modes", "dense/full+offload"],  # offloading is replay's
        ["--modes", "dense/full", "dense/full"],
        ["--modes", "hyscale/replay+target+index", "hyscale/replay+index+target"],
        ["--modes", "hyscale/replay+index+index"],
        ["--modes", "dense/full", "--ablations"],
    ):
        with pytest.raises(SystemExit):
            reproduce.main(base + bad)
        assert "--modes" in capsys.readouterr().err
