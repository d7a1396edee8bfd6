"""experiments/quickstart.py: default output folder, record, checks line (tiny sizes, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def quickstart():
    return load_script("quickstart")


def test_default_output_is_an_untracked_run_folder(quickstart):
    assert quickstart.parse_args([]).out == Path("runs/quickstart")


def test_help_gives_every_flag_its_default(quickstart, capsys):
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--help"])
    text = capsys.readouterr().out.split("options:")[1]
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert len(flags) == 8, flags
    assert text.count("(default:") == len(flags)


def test_run_writes_record_and_says_all_checks_passed(quickstart, tmp_path, capsys):
    quickstart.main(["--seq", "64", "96", "--repeats", "1", "--topk", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "all checks passed" in out and "stay flat" in out
    record = json.loads((tmp_path / "quickstart.json").read_text())
    assert [r["T"] for r in record["rows"]] == [64, 96]
    assert all(
        r["index_agreement"] == 1.0 and r["xla_block"] == [r["T"]] * 2 for r in record["rows"]
    )
    assert record["command"] and (tmp_path / "quickstart.png").stat().st_size > 0
