"""experiments/bench_selection.py: its --sizes columns run the kernel at other BlockSizes and its
--index-order column the kernel without the ordering sort, each checked against the reference like
the default, and a bad spec stops the run before anything runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_selection

    return bench_selection


def test_extra_columns_are_checked_and_timed(tmp_path, monkeypatch):
    bench = _bench()
    argv = "--impls reference pallas --interpret --seq 96 --index-heads 2 --index-dim 16 "
    argv += f"--topk 24 --reps 1 --index-order --sizes block_k=32,chunk=32 --out {tmp_path}"
    monkeypatch.setattr(sys, "argv", ["bench_selection.py", *argv.split()])
    bench.main()
    records = json.loads((tmp_path / "bench_selection.json").read_text())["records"]
    by_impl = {r["impl"]: r for r in records}
    columns = ("pallas", "pallas/index", "pallas:block_k=32,chunk=32")
    assert set(by_impl) == {"reference", *columns}
    for name in columns:
        assert by_impl[name]["status"] == "ok"
        assert by_impl[name]["verified"] == "all rows == reference"


@pytest.mark.parametrize("spec", ["no_such_field=1", "block_k=x"])
def test_bad_sizes_spec_stops_with_its_text(spec):
    bench = _bench()
    with pytest.raises(SystemExit, match=spec):
        bench.parse_sizes(spec)
