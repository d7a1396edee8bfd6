"""CPU tests of data, training and checkpoints: determinism, loss falls, exact resume."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from hyscale_jax.data import QUERY_MARK, DataConfig, Dataset
from hyscale_jax.nn import ModelConfig
from hyscale_jax.train import TrainConfig, read_metrics, stage_for_step, train
from tests.helpers import TINY_TRAIN_MODEL, load_script

MODEL = ModelConfig(**TINY_TRAIN_MODEL)
DATA = DataConfig(n_pairs=4, n_queries=4, corpus_bytes=2**20)


@pytest.fixture(scope="module")
def dataset():
    return Dataset(DATA)


def test_batches_are_a_pure_function_of_the_step(dataset):
    a, b = dataset.batch(5, 3, 64), dataset.batch(5, 3, 64)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(dataset.batch(6, 3, 64)["tokens"], a["tokens"])
    # a fresh Dataset (a resumed process) sees the same data
    np.testing.assert_array_equal(Dataset(DATA).batch(5, 3, 64)["tokens"], a["tokens"])
    it = dataset.batches(5, 3, 64)
    np.testing.assert_array_equal(next(it)["tokens"], a["tokens"])


def test_retrieval_structure(dataset):
    batch = dataset.batch(0, 4, 96)
    tokens, qpos, npos = batch["tokens"], batch["query_pos"], batch["needle_pos"]
    assert tokens.shape == (4, 97) and batch["loss_mask"].shape == (4, 96)
    assert qpos.shape == npos.shape == (4, DATA.n_queries)
    for row in range(4):
        assert tokens[row, qpos[row, 0] - 1] == QUERY_MARK
        keys = tokens[row, qpos[row]]
        # the query key is the needle's key, its target is the needle's value
        np.testing.assert_array_equal(tokens[row, npos[row]], keys)
        np.testing.assert_array_equal(tokens[row, qpos[row] + 1], tokens[row, npos[row] + 1])
        assert (npos[row] < qpos[row, 0]).all()
        assert len(np.flatnonzero(np.isin(tokens[row, : qpos[row, 0]], keys))) == DATA.n_queries


def test_text_batches(dataset):
    text = Dataset(DataConfig(kind="text", corpus_bytes=2**20), corpus=dataset.corpus)
    batch = text.batch(0, 2, 128)
    assert batch["tokens"].shape == (2, 129) and batch["query_pos"].shape == (2, 0)
    assert batch["tokens"].dtype == np.int32
    assert ((batch["tokens"] >= 0) & (batch["tokens"] < 256)).all()


def test_data_config_validation():
    with pytest.raises(ValueError, match="n_queries"):
        DataConfig(n_pairs=2, n_queries=3)
    with pytest.raises(ValueError, match="too short"):
        Dataset(DATA).batch(0, 1, 8)
    with pytest.raises(ValueError, match="too short"):
        TrainConfig(seq_len=16, data=DATA)


def test_stage_schedule():
    cfg = TrainConfig(seq_len=256, indexer_warmup_steps=3, indexer_warmup_seq_len=64)
    assert stage_for_step(MODEL, cfg, 2) == ("dense", 64)
    assert stage_for_step(MODEL, cfg, 3) == ("sparse", 256)
    dense = ModelConfig(attention="dense")
    assert stage_for_step(dense, cfg, 0) == ("none", 64)


def test_loss_falls(tmp_path, dataset):
    cfg = TrainConfig(
        seq_len=48, batch_size=8, steps=40, lr=1e-2, warmup_steps=5, ckpt_every=1000, data=DATA
    )
    result = train(MODEL, cfg, tmp_path / "run", progress=False, plot=True, dataset=dataset)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = np.mean([r["ce"] for r in rows[:3]])
    last = np.mean([r["ce"] for r in rows[-3:]])
    assert last < first - 1.5, (first, last)
    assert all(r["indexer_loss"] >= 0 for r in rows)
    assert all(0 <= r["needle_recall"] <= 1 and 0 <= r["retrieval_acc"] <= 1 for r in rows)
    # 4 needles with distinct values, all 4 asked: the key-blind guess is right on average
    # (1/4 + 1/3 + 1/2 + 1) / 4 of the time; chance is one value in 64
    assert all(r["retrieval_blind"] == pytest.approx(25 / 48) for r in rows)
    assert all(r["retrieval_chance"] == 1 / 64 and r["answer_ce"] > 0 for r in rows)
    assert (tmp_path / "run" / "metrics.png").exists()
    assert result["step"] == 40


def _strip_timing(rows):
    return [
        {k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s", "elapsed_s")}
        for r in rows
    ]


RESUME_CFG = TrainConfig(
    seq_len=40,
    batch_size=2,
    steps=6,
    lr=1e-2,
    warmup_steps=2,
    indexer_warmup_steps=2,
    indexer_warmup_seq_len=32,
    ckpt_every=2,
    data=DATA,
)


def test_resume_is_exact(tmp_path, dataset):
    """Stop after step 3 (a killed run), resume to 6 == 6 steps straight: bit for bit,
    across the switch from the dense warm-up stage to the sparse stage."""
    cfg = RESUME_CFG
    straight = train(MODEL, cfg, tmp_path / "a", progress=False, plot=False, dataset=dataset)
    part = train(
        MODEL, cfg, tmp_path / "b", progress=False, plot=False, dataset=dataset, stop_after=3
    )
    assert part["step"] == 3
    # a record past the checkpoint, as a killed run leaves behind, is dropped on resume
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "ce": -1.0}) + "\n")
    resumed = train(
        MODEL, cfg, tmp_path / "b", resume=True, progress=False, plot=False, dataset=dataset
    )
    assert resumed["step"] == straight["step"] == 6
    for a, b in zip(
        jax.tree.leaves((straight["state"].params, straight["state"].opt_state)),
        jax.tree.leaves((resumed["state"].params, resumed["state"].opt_state)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _strip_timing(read_metrics(tmp_path / "a" / "metrics.jsonl")) == _strip_timing(
        read_metrics(tmp_path / "b" / "metrics.jsonl")
    )
    stages = [r["stage"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    assert stages == ["dense", "dense", "sparse", "sparse", "sparse", "sparse"]


def test_resume_rejects_a_changed_config(tmp_path, dataset):
    train(
        MODEL, RESUME_CFG, tmp_path / "c", progress=False, plot=False, dataset=dataset, stop_after=1
    )
    saved = (tmp_path / "c" / "config.json").read_text()
    changed = dataclasses.replace(RESUME_CFG, lr=0.5)
    with pytest.raises(ValueError, match="lr"):
        train(
            MODEL, changed, tmp_path / "c", resume=True, progress=False, plot=False, dataset=dataset
        )
    # The refused resume left the run's saved configuration as it was, so a plain --resume
    # (which reloads it) still works.
    assert (tmp_path / "c" / "config.json").read_text() == saved


def test_resume_accepts_a_run_saved_before_a_model_field_existed():
    """A checkpoint whose model config lacks a field added since (its default applies) is
    the same run; one whose saved value differs from this run's is not."""
    from hyscale_jax.train import _resume_problems

    meta = {"model": MODEL.to_dict(), "train": RESUME_CFG.to_dict()}
    older = {"model": dict(meta["model"]), "train": meta["train"]}
    del older["model"]["index_dtype"]
    assert _resume_problems(older, meta) == []
    fp8 = {"model": {**meta["model"], "index_dtype": "float8_e4m3fn"}, "train": meta["train"]}
    assert any("index_dtype" in p for p in _resume_problems(fp8, meta))


def test_resume_without_a_checkpoint_says_it_starts_fresh(tmp_path, dataset, capsys):
    result = train(
        MODEL,
        RESUME_CFG,
        tmp_path / "d",
        resume=True,
        progress=False,
        plot=False,
        dataset=dataset,
        stop_after=1,
    )
    assert "no checkpoint" in capsys.readouterr().out and result["step"] == 1


def test_cli_presets_build():
    cli = _cli()
    for preset in cli.PRESETS:
        model_cfg, train_cfg, out = cli.build_configs(cli.parse_args(["--preset", preset]))
        assert out == Path("runs") / "train" / preset
    model_cfg, train_cfg, _ = cli.build_configs(
        cli.parse_args(["--attention", "dense", "--steps", "7", "--data", "text", "--topk", "4"])
    )
    assert (model_cfg.attention, train_cfg.steps, train_cfg.data.kind, model_cfg.topk) == (
        "dense",
        7,
        "text",
        4,
    )
    _, train_cfg, _ = cli.build_configs(
        cli.parse_args(["--filler", "random", "--n-pairs", "3", "--n-keys", "5", "--n-values", "9"])
    )
    data = train_cfg.data
    assert (data.filler, data.n_pairs, data.n_keys, data.n_values) == ("random", 3, 5, 9)


def test_cli_refuses_a_materialized_table_past_int32_on_gpu(tmp_path, monkeypatch, capsys):
    """--attention materialized at T * T >= 2**31 on a GPU stops with a message before any
    step (XLA's GPU kernels would crash the process); off a GPU the limit does not apply."""
    cli = _cli()
    argv = ["--attention", "materialized", "--seq-len", "46341", "--out", str(tmp_path / "m")]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cli, "train", lambda *a, **kw: pytest.fail("training started"))
    with pytest.raises(SystemExit, match=r"2\*\*31.*T < 46341"):
        cli.main(argv)
    assert not (tmp_path / "m").exists()  # refused before the run folder was made

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(cli, "train", started)
    with pytest.raises(Started):  # off a GPU the same command reaches training
        cli.main(argv)


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, dataset):
    """RESUME_CFG run from start to end without interruption: (result, metrics rows)."""
    out = tmp_path_factory.mktemp("straight")
    result = train(MODEL, RESUME_CFG, out, progress=False, plot=False, dataset=dataset)
    return result, read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_resume_falls_back_past_a_damaged_checkpoint(
    tmp_path, dataset, straight_run, manifest, capsys
):
    """A truncated file in the newest checkpoint: resume restores the previous one, says which
    one it skipped and why in one line, keeps the damaged one aside, and continues to the end
    with the same result as an undamaged run. The damage is found by the checkpoint's file
    manifest, or (for a checkpoint without one) by Orbax failing to read it."""
    cfg = RESUME_CFG
    straight, straight_rows = straight_run
    run = tmp_path / "b"
    train(MODEL, cfg, run, progress=False, plot=False, dataset=dataset, stop_after=4)
    if not manifest:
        (run / "ckpt" / "4" / "hyscale_manifest.json").unlink()
    victim = _largest_file(run / "ckpt" / "4")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    capsys.readouterr()
    resumed = train(MODEL, cfg, run, resume=True, progress=False, plot=False, dataset=dataset)
    out, err = capsys.readouterr()
    skipped = [line for line in out.splitlines() if "step 4" in line and "damaged" in line]
    assert len(skipped) == 1, out
    assert "Traceback" not in out + err and len(skipped[0]) < 500, (skipped[0], err[:2000])
    assert victim.name in skipped[0] if manifest else "Error" in skipped[0]
    assert "ckpt_damaged" in skipped[0]
    kept = run / "ckpt_damaged" / "4"
    assert kept.is_dir() and (kept / victim.relative_to(run / "ckpt" / "4")).exists()
    # restored step 2, metrics cut back to it, then recomputed up to 6: as if never damaged
    assert resumed["step"] == 6
    for a, b in zip(
        jax.tree.leaves(straight["state"].params), jax.tree.leaves(resumed["state"].params)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _strip_timing(straight_rows) == _strip_timing(read_metrics(run / "metrics.jsonl"))


def test_resume_with_no_intact_checkpoint_is_a_clear_error(tmp_path, dataset):
    run = tmp_path / "run"
    train(MODEL, RESUME_CFG, run, progress=False, plot=False, dataset=dataset, stop_after=4)
    for step in ("2", "4"):
        victim = _largest_file(run / "ckpt" / step)
        victim.write_bytes(b"")
    with pytest.raises(RuntimeError, match="no checkpoint .* restores") as err:
        train(MODEL, RESUME_CFG, run, resume=True, progress=False, plot=False, dataset=dataset)
    message = str(err.value)
    assert "step 4" in message and "step 2" in message and len(message) < 1000, message
    # nothing moved or deleted: the user decides
    assert (run / "ckpt" / "2").is_dir() and (run / "ckpt" / "4").is_dir()


def test_resume_drops_a_half_written_metrics_line(tmp_path, dataset, straight_run, capsys):
    cfg = RESUME_CFG
    run = tmp_path / "b"
    train(MODEL, cfg, run, progress=False, plot=False, dataset=dataset, stop_after=4)
    metrics = run / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text + text.splitlines()[-1][:25])  # a fifth record, cut short
    capsys.readouterr()
    resumed = train(MODEL, cfg, run, resume=True, progress=False, plot=False, dataset=dataset)
    out = capsys.readouterr().out
    assert "warning" in out and "metrics.jsonl line 5" in out, out
    assert resumed["step"] == 6
    assert _strip_timing(straight_run[1]) == _strip_timing(read_metrics(metrics))


def test_a_damaged_metrics_line_before_the_last_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "ce\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_a_new_run_says_it_replaces_the_previous_one(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    train(MODEL, RESUME_CFG, run, progress=False, plot=False, dataset=dataset, stop_after=2)
    assert "holds a run" not in capsys.readouterr().out
    train(MODEL, RESUME_CFG, run, progress=False, plot=False, dataset=dataset, stop_after=1)
    out = capsys.readouterr().out
    assert f"out dir {run} holds a run at step 2; starting over" in out and "--resume" in out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def _cli():
    return load_script("train", "train_cli")


def test_cli_help_gives_every_flag_a_line_and_its_default(capsys):
    cli = _cli()
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    parser_flags = [a for a in re.findall(r"\n  (--[a-z-]+)", text) if a != "--help"]
    assert len(parser_flags) > 30, parser_flags
    # each flag's help (up to the next flag) names its default or its presets' values
    chunks = re.split(r"\n  (?=--[a-z])", text.split("options:")[1])
    for chunk in chunks[1:]:
        flag = chunk.split()[0]
        assert re.search(r"default|presets?:|cpu: ", chunk), (flag, chunk)
    assert "replaced" in text and "--resume" in text
