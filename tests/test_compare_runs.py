"""experiments/compare_runs.py on synthetic run folders (config.json + metrics.jsonl)."""

import json
from pathlib import Path

import pytest

from tests.helpers import load_script


def _cli():
    return load_script("compare_runs")


CONFIG = {
    "model": {"attention": "hyscale", "remat": "replay", "topk": 8, "impl": "auto"},
    "train": {"seed": 0, "steps": 6, "ckpt_every": 2, "data": {"seed": 0, "n_pairs": 1}},
}


def _run(folder: Path, ce: list[float], **model) -> Path:
    folder.mkdir(parents=True)
    config = json.loads(json.dumps(CONFIG))
    for key, value in model.items():
        section, name = key.split("__")
        config[section][name] = value
    (folder / "config.json").write_text(json.dumps(config))
    rows = [
        {"step": i + 1, "ce": c, "loss": c + 0.5, "retrieval_acc": 1.0, "step_time_s": 0.25}
        for i, c in enumerate(ce)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_divergence_and_comparability(tmp_path, capsys):
    base = _run(tmp_path / "a", [4.0, 3.0, 2.0, 1.5, 1.25, 1.0])
    # The materialized twin: equal for two steps, then 0.25 apart at step 4 (its largest), and
    # it logged only five steps.
    twin = _run(
        tmp_path / "b",
        [4.0, 3.0, 2.125, 1.75, 1.25],
        model__attention="materialized",
        model__remat="full",
        train__ckpt_every=5,
    )
    other = _run(tmp_path / "c", [4.0, 3.0, 2.0, 1.5, 1.25, 1.0], train__seed=1)
    # A run saved before a model field existed: the field takes its default, not a difference.
    older = _run(tmp_path / "d", [4.0, 3.0, 2.0, 1.5, 1.25, 1.0])
    config = json.loads((older / "config.json").read_text())
    del config["model"]["impl"]
    (older / "config.json").write_text(json.dumps(config))
    _cli().main([str(p) for p in (base, twin, other, older)] + ["--out", str(tmp_path / "out")])
    record = json.loads((tmp_path / "out" / "compare_runs.json").read_text())
    first, b, c, d = record["runs"]
    assert "vs_first" not in first and first["label"] == "hyscale/replay #1"
    assert d["label"] == "hyscale/replay #4" and d["comparable"] and not d["config_differences"]
    assert b["label"] == "materialized/full" and b["comparable"]
    assert b["vs_first"]["common_steps"] == 5
    assert b["vs_first"]["ce"] == {
        "max_abs_diff": 0.25,
        "max_rel_diff": 0.25 / 1.5,
        "at_step": 4,
        "first_differing_step": 3,
    }
    assert b["vs_first"]["loss"]["max_abs_diff"] == 0.25
    assert not c["comparable"] and c["config_differences"] == ["train.seed: 0 -> 1"]
    assert c["vs_first"]["ce"]["first_differing_step"] is None
    assert first["retrieval_acc"] == 1.0 and first["step_time_s"] == 0.25
    assert (tmp_path / "out" / "compare_runs.png").stat().st_size > 0
    assert "not comparable, differs in: train.seed: 0 -> 1" in capsys.readouterr().out


def test_record_prefix(tmp_path):
    """A run saved as a record (PREFIX_config.json, PREFIX_metrics.jsonl) loads as its folder."""
    folder = _run(tmp_path / "run", [4.0, 3.0], model__topk=4)
    records = tmp_path / "records"
    records.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (records / f"h200_run_{name}").write_text((folder / name).read_text())
    cli = _cli()
    assert cli.load_run(records / "h200_run") == cli.load_run(folder)
    assert cli.load_run(records / "h200_run")[0]["model"]["topk"] == 4


def test_bad_arguments(tmp_path):
    cli = _cli()
    with pytest.raises(SystemExit, match="no .*config.json"):
        cli.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="no .*missing_config.json"):
        cli.main([str(tmp_path / "missing")])
    base = _run(tmp_path / "a", [1.0])
    with pytest.raises(SystemExit, match="--labels: 2 given for 1 runs"):
        cli.main([str(base), "--labels", "x", "y", "--out", str(tmp_path / "o")])
